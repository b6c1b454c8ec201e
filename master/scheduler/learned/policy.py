"""A trained scorer as shipped: a small MLP in an ``.npz`` file, loaded by name and run in numpy.

The file holds the layers (``w0``, ``b0``, ``w1``, … : ``w_i`` of shape (out, in)), the feature
normalisation (``mean``, ``std``: the scorer reads ``(features − mean) / std``) and ``meta``, a JSON
string: ``format`` (1), ``algorithm`` (``ppo``/``ddpg``), ``setting`` (``hetero``/``trace``), the
``features`` it was trained on (they must be ``FEATURES``), ``activation`` (``tanh``/``relu``) of the
hidden layers, ``output`` (``identity``, or ``tanh`` for DDPG's squashed actor), and the training
``config``, ``seed``, ``steps`` and ``seconds``. Higher scores are better; one shared MLP scores every
candidate node (``Policy.score``; ``Policy.scores`` for many at once).

``load_policy(name)`` reads ``master/scheduler/policies/NAME.npz`` (or a given folder); a missing or
damaged file is a :class:`PolicyError` whose one line says what to do. Numpy only.
"""

from __future__ import annotations

import json
import math
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from master.scheduler.learned.features import FEATURES, FloatArray
from shared.errors import ConfigError

POLICY_DIR = Path(__file__).resolve().parent.parent / "policies"
FORMAT = 1
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_ACTIVATIONS = ("tanh", "relu")
_OUTPUTS = ("identity", "tanh")


class PolicyError(ConfigError):
    """A learned placer's policy file is missing, unreadable or not a policy."""

    code = "bad_policy"


@dataclass(frozen=True, eq=False)
class Policy:
    """The per-candidate scorer: ``score(features)`` → one float, higher better."""

    name: str
    weights: tuple[FloatArray, ...]
    biases: tuple[FloatArray, ...]
    mean: FloatArray
    std: FloatArray
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The normalisation folded into the first layer: W·((x − mean)/std) + b = (W/std)·x + (b − W·(mean/std)).
        first, bias = self.weights[0], self.biases[0]
        folded = [(np.ascontiguousarray(first / self.std), bias - first @ (self.mean / self.std))]
        folded += [(np.ascontiguousarray(w), b) for w, b in zip(self.weights[1:], self.biases[1:], strict=True)]
        object.__setattr__(self, "_hidden", folded[:-1])
        object.__setattr__(self, "_last", (np.ascontiguousarray(folded[-1][0][0]), float(folded[-1][1][0])))
        object.__setattr__(self, "_relu", self.meta.get("activation", "tanh") == "relu")
        object.__setattr__(self, "_squash", self.meta.get("output", "identity") == "tanh")

    @property
    def activation(self) -> str:
        return str(self.meta.get("activation", "tanh"))

    @property
    def output(self) -> str:
        return str(self.meta.get("output", "identity"))

    def scores(self, features: FloatArray) -> FloatArray:
        """Scores of the rows of ``features`` (shape (N, F))."""
        hidden = (features - self.mean) / self.std
        last = len(self.weights) - 1
        relu = self.activation == "relu"
        for layer, (weight, bias) in enumerate(zip(self.weights, self.biases, strict=True)):
            hidden = hidden @ weight.T + bias
            if layer < last:
                hidden = np.maximum(hidden, 0.0) if relu else np.tanh(hidden)
        out = hidden[:, 0]
        return np.tanh(out) if self.output == "tanh" else out

    def score(self, features: FloatArray) -> float:
        """The score of one candidate's features (shape (F,)): ``scores`` for one row, in a few µs."""
        hidden = features
        relu: bool = self._relu  # type: ignore[attr-defined]
        for weight, bias in self._hidden:  # type: ignore[attr-defined]
            hidden = weight @ hidden + bias
            hidden = np.maximum(hidden, 0.0) if relu else np.tanh(hidden)
        last, offset = self._last  # type: ignore[attr-defined]
        out = float(last @ hidden) + offset
        return math.tanh(out) if self._squash else out  # type: ignore[attr-defined]

    def save(self, path: Path) -> None:
        arrays: dict[str, Any] = {"mean": self.mean, "std": self.std, "meta": np.array(json.dumps(self.meta))}
        for layer, (weight, bias) in enumerate(zip(self.weights, self.biases, strict=True)):
            arrays[f"w{layer}"], arrays[f"b{layer}"] = weight, bias
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as handle:
            np.savez(handle, **arrays)


def policy_path(name: str, directory: Path | None = None) -> Path:
    if not _NAME.fullmatch(name):
        raise PolicyError(f"policy name {name!r} is not valid: use lowercase letters, digits, '_', '-' and '.'")
    return (directory or POLICY_DIR) / f"{name}.npz"


_loaded: dict[tuple[Path, float], Policy] = {}


def load_policy(name: str, *, directory: Path | None = None) -> Policy:
    """The policy ``name`` from ``directory`` (default: the shipped ones), read once per process and file version."""
    path = policy_path(name, directory)
    hint = f"train it with `gpumarket train-placer --out {name}` (needs pip install 'gpumarket[learn]')"
    try:
        mtime = path.stat().st_mtime
    except OSError:
        raise PolicyError(f"learned placer policy {name!r}: {path} does not exist; {hint}") from None
    found = _loaded.get((path, mtime))
    if found is not None:
        return found
    try:
        policy = _read(name, path)
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise PolicyError(f"learned placer policy {name!r}: {path} is not a usable policy ({reason}); {hint}") from None
    if len(_loaded) >= 16:
        _loaded.clear()
    _loaded[(path, mtime)] = policy
    return policy


def _read(name: str, path: Path) -> Policy:
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(str(data["meta"]))
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format') if isinstance(meta, dict) else None!r}, expected {FORMAT}")
        if tuple(meta.get("features", ())) != FEATURES:
            raise ValueError("it was trained on other features than this version computes")
        if meta.get("activation", "tanh") not in _ACTIVATIONS or meta.get("output", "identity") not in _OUTPUTS:
            raise ValueError("unknown activation or output")
        weights: list[FloatArray] = []
        biases: list[FloatArray] = []
        while f"w{len(weights)}" in data:
            layer = len(weights)
            weights.append(np.asarray(data[f"w{layer}"], dtype=np.float64))
            biases.append(np.asarray(data[f"b{layer}"], dtype=np.float64))
        mean = np.asarray(data["mean"], dtype=np.float64)
        std = np.asarray(data["std"], dtype=np.float64)
    width = len(FEATURES)
    if not weights or mean.shape != (width,) or std.shape != (width,) or np.any(std <= 0):
        raise ValueError("no layers, or a normalisation of the wrong shape")
    for weight, bias in zip(weights, biases, strict=True):
        if weight.ndim != 2 or weight.shape[1] != width or bias.shape != (weight.shape[0],):
            raise ValueError(f"a layer of shape {weight.shape} does not follow one of width {width}")
        if not (np.all(np.isfinite(weight)) and np.all(np.isfinite(bias))):
            raise ValueError("a layer holds NaN or infinite weights")
        width = weight.shape[0]
    if width != 1:
        raise ValueError(f"the last layer gives {width} outputs, not 1")
    return Policy(name, tuple(weights), tuple(biases), mean, std, meta)


__all__ = ["FORMAT", "POLICY_DIR", "Policy", "PolicyError", "load_policy", "policy_path"]
