"""Recording a host's NVML answers, for replay where there is no GPU (``gpumarket agent record-nvml``).

``record_nvml`` opens an ``NvmlBackend`` whose NVML is a pass-through stand-in,
``RecordingNvml``: every call the agent's collection code makes reaches the real
``pynvml`` and its answer (value or ``NVMLError``) is written down, per device and
per function, for the open phase and for each sampling pass. Because the recording
is made by running the very code the agent runs, it holds exactly the calls that
code makes, and ``agent.gpu.replay.ReplayBackend`` plays it back through that code.
The format is described in ``agent.gpu.replay``.

What is not recorded: serial numbers (written as ``"REDACTED"``), host names (the
collection code never asks NVML for one), and process names (it never asks either).
PCI bus ids, GPU UUIDs and process ids are kept. Imports ``agent.gpu`` and ``shared``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import time
from collections.abc import Callable, Hashable, Mapping
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import pynvml

from agent.gpu.nvml import NvmlApi, handle_key
from agent.gpu.nvmlbackend import NvmlBackend
from agent.gpu.replay import (
    EVENT_SET,
    LIFECYCLE_CALLS,
    RECORDING_FORMAT,
    RECORDING_VERSION,
    REDACTED,
    SYSTEM_SCOPE,
    ReplayHandle,
    ReplayOpaque,
    args_key,
    takes_handle,
)
from shared.clock import utcnow
from shared.errors import ConfigError

# An hour at one pass a second; a longer recording is a mistake, not a fixture.
MAX_RECORD_TICKS = 3600
MIN_RECORD_INTERVAL_S = 0.01
# Calls whose answers identify the physical board and are withheld.
REDACTED_CALLS = frozenset({"nvmlDeviceGetSerial"})
# Fields holding a device handle, by the call that answers them: nvmlEventData_t.device. Not by
# field name alone: nvmlPciInfo_t.device is the PCI device number.
_HANDLE_FIELDS = {"nvmlEventSetWait": frozenset({"device"}), "nvmlEventSetWait_v2": frozenset({"device"})}
_HOW = "recorded through NVML by gpumarket (agent.record.record_nvml)"


def _hashable_key(value: Any) -> Hashable | None:
    try:
        key = handle_key(value)
        hash(key)
    except TypeError:
        return None
    return key


class RecordingNvml:
    """Passes every call to ``nvml`` and writes down what it answered.

    Calls made before the first ``begin_tick`` belong to the open phase; each
    ``begin_tick`` starts a sampling pass. A function ``nvml`` lacks stays missing
    (``AttributeError``), as it would be on that host.
    """

    def __init__(self, nvml: NvmlApi) -> None:
        self._nvml = nvml
        self.open_calls: dict[str, Any] = {}
        self.ticks: list[dict[str, Any]] = []
        self._calls = self.open_calls
        self._scopes: dict[Hashable, str] = {}
        self._opaque: dict[Hashable, str] = {}

    def begin_tick(self, at: datetime) -> None:
        """Record the following calls as one more sampling pass, taken at ``at``."""
        tick: dict[str, Any] = {"at": at.isoformat(), "calls": {}}
        self.ticks.append(tick)
        self._calls = tick["calls"]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        target = getattr(self._nvml, name)
        if not name.startswith("nvml") or not callable(target) or name in LIFECYCLE_CALLS:
            return target

        def record(*args: Any) -> Any:
            return self._record(name, target, args)

        record.__name__ = name
        return record

    def _opaque_name(self, value: Any) -> str | None:
        key = _hashable_key(value)
        return None if key is None else self._opaque.get(key)

    def _record(self, function: str, target: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        scope, rest = SYSTEM_SCOPE, args
        if takes_handle(function):
            key = _hashable_key(args[0]) if args else None
            handle_scope = None if key is None else self._scopes.get(key)
            if handle_scope is None:
                raise ValueError(
                    f"{function} was called on a device handle NVML did not hand out while recording"
                )
            scope, rest = handle_scope, args[1:]
        arguments = args_key(rest, opaque_name=self._opaque_name)
        try:
            value = target(*args)
        except pynvml.NVMLError as err:
            self._store(scope, function, arguments, {"error": type(err).__name__, "code": int(err.value)})
            raise
        self._store(scope, function, arguments, self._answer(function, scope, args, value))
        return value

    def _answer(self, function: str, scope: str, args: tuple[Any, ...], value: Any) -> dict[str, Any]:
        if function.startswith("nvmlDeviceGetHandleBy"):
            return {"value": self._register(value, f"gpu{args_key(args, opaque_name=lambda _: None)}")}
        if function == "nvmlDeviceGetMigDeviceHandleByIndex":
            return {"value": self._register(value, f"{scope}/mig{args[1]}")}
        if function == "nvmlEventSetCreate":
            key = _hashable_key(value)
            if key is None:
                raise TypeError("NVML's event set cannot be told apart from other values")
            self._opaque[key] = EVENT_SET
            return {"value": {"$opaque": EVENT_SET}}
        if function in REDACTED_CALLS:
            return {"value": REDACTED, "redacted": True}
        return {"value": self._encode(value, _HANDLE_FIELDS.get(function, frozenset()))}

    def _register(self, handle: Any, scope: str) -> dict[str, str]:
        key = _hashable_key(handle)
        if key is None:
            raise TypeError(f"NVML handle of type {type(handle).__name__} cannot be recorded")
        self._scopes[key] = scope
        return {"$handle": scope}

    def _store(self, scope: str, function: str, arguments: str, answer: dict[str, Any]) -> None:
        by_args = self._calls.setdefault(scope, {}).setdefault(function, {})
        if arguments not in by_args:
            by_args[arguments] = answer
        elif isinstance(by_args[arguments], list):
            by_args[arguments].append(answer)
        else:
            by_args[arguments] = [by_args[arguments], answer]

    def _encode_handle(self, value: Any) -> dict[str, str] | None:
        key = _hashable_key(value)
        if key is None:
            return None
        if key in self._scopes:
            return {"$handle": self._scopes[key]}
        if key in self._opaque:
            return {"$opaque": self._opaque[key]}
        return None

    def _encode(self, value: Any, handle_fields: frozenset[str] = frozenset()) -> Any:
        """``value`` as JSON; attributes named in ``handle_fields`` are handles whatever their type.

        (A stand-in's handles may be plain ints, which only their place tells from numbers.)
        """
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, bytes):
            return value.decode("utf-8", errors="replace")
        if isinstance(value, list | tuple | ctypes.Array):
            return [self._encode(item) for item in value]
        if isinstance(value, ctypes._Pointer | ReplayHandle | ReplayOpaque):
            handle = self._encode_handle(value)
            if handle is None:
                raise TypeError("NVML answered with a handle the recorder never saw handed out")
            return handle
        if isinstance(value, ctypes.Structure):
            fields = {entry[0]: getattr(value, entry[0]) for entry in value._fields_}
        elif hasattr(value, "__dict__"):
            fields = {name: item for name, item in vars(value).items() if not name.startswith("_")}
        else:
            raise TypeError(f"an NVML answer of type {type(value).__name__} cannot be recorded")
        encoded: dict[str, Any] = {}
        for name, item in fields.items():
            if name in handle_fields:
                encoded[name] = self._encode_handle(item) or {"$handle": "unknown"}
            else:
                encoded[name] = self._encode(item)
        return encoded


def _nvidia_ml_py_version() -> str | None:
    try:
        return metadata.version("nvidia-ml-py")
    except metadata.PackageNotFoundError:
        return None


def _write_atomically(out: Path, text: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # Created with open() rather than mkstemp so that the file gets the umask's usual mode.
    temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, out)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise


def record_nvml(
    out: Path,
    *,
    seconds: float = 5.0,
    interval: float = 1.0,
    nvml: NvmlApi = pynvml,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], datetime] = utcnow,
    source: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Record this host's GPUs through NVML for ``seconds``, one sampling pass every ``interval``.

    Takes ``seconds / interval`` passes (at least one), each the agent's own
    ``sample()`` plus an event poll, and writes the recording to ``out`` (atomically)
    and returns it. ``source`` entries are added to (and override) the recording's
    ``source``; ``sleep`` waits between passes and ``clock`` stamps them. Raises
    ``GpuBackendUnavailable``, exactly as the agent would, where NVML cannot start
    (no driver), and ``ConfigError`` for a duration or interval out of range.
    """
    if not interval >= MIN_RECORD_INTERVAL_S:
        raise ConfigError(
            f"the recording interval must be at least {MIN_RECORD_INTERVAL_S} s, not {interval}"
        )
    ticks = max(1, int(seconds / interval + 1e-9))
    if not seconds > 0 or ticks > MAX_RECORD_TICKS:
        raise ConfigError(
            f"record between one pass and {MAX_RECORD_TICKS} passes: {seconds} s at one pass every "
            f"{interval} s is {ticks}",
            details={"seconds": seconds, "interval": interval},
        )
    recorder = RecordingNvml(nvml)
    recorded_at = clock()
    backend = NvmlBackend(nvml=recorder, clock=clock)
    try:
        started = time.monotonic()
        for tick in range(ticks):
            if tick:
                sleep(max(0.0, started + tick * interval - time.monotonic()))
            recorder.begin_tick(clock())
            backend.sample()
            backend.poll_events()
        gpus = backend.gpus()
    finally:
        backend.close()
    document: dict[str, Any] = {
        "format": RECORDING_FORMAT,
        "version": RECORDING_VERSION,
        "source": {
            "gpus": [gpu.name for gpu in gpus],
            "driver_version": gpus[0].driver_version if gpus else None,
            "cuda_driver_version": gpus[0].cuda_driver_version if gpus else None,
            "recorded_at": recorded_at.isoformat(),
            "how": _HOW,
            "nvidia_ml_py": _nvidia_ml_py_version(),
            "ticks": ticks,
            "interval_s": interval,
            "redacted": sorted(REDACTED_CALLS),
            **(source or {}),
        },
        "calls": {"open": recorder.open_calls, "ticks": recorder.ticks},
    }
    _write_atomically(Path(out), json.dumps(document, indent=1, ensure_ascii=False) + "\n")
    return document


def main(out: Path | str, seconds: float = 5.0) -> str:
    """``gpumarket agent record-nvml``: record this host's GPUs to ``out``; says what it recorded.

    Raises ``GpuBackendUnavailable`` on a host without a usable NVIDIA driver.
    """
    path = Path(out)
    source = record_nvml(path, seconds=seconds)["source"]
    names = ", ".join(source["gpus"]) or "no GPUs"
    return (
        f"recorded {source['ticks']} sampling passes of {len(source['gpus'])} GPU(s) ({names}; driver "
        f"{source['driver_version']}, CUDA {source['cuda_driver_version']}) to {path}; serial numbers "
        "are redacted. Replay it with --gpus replay:" + str(path)
    )
