"""GPU tiers: which shelf of the marketplace a GPU is listed on, and why.

Pure functions over the model table in ``master/data/gpu_models.toml`` (loaded once);
no database, no network. Imports ``shared.errors`` only.

Rules
=====

1. **Match the model.** ``match_model`` normalises the NVML name (case, the
   NVIDIA/GeForce/Tesla/Quadro words, hyphens vs spaces, ``RTX4090`` vs ``RTX 4090``)
   and looks for an exact alias. Otherwise it compares the *family* — the name
   without form-factor words (``PCIE``, ``SXM4``, ``HBM3``, ``80GB``) — which must be
   equal token for token, so ``A10`` never matches ``A100`` and ``RTX 4080`` never
   matches ``RTX 4080 SUPER``. Among a family's variants it prefers the one sharing
   the most form-factor words with the name, then the one whose memory is closest
   to the reported memory (A100 40 vs 80 GB, V100 16 vs 32 GB), then the first in
   the table (the cheaper variant, so an ambiguous name never scores high).

2. **Score from specs**, normalised so an H100 SXM is 100 (other cards can pass 100)::

       score = 100 * (0.40 * tensor_fp16 / 989      # dense FP16 tensor TFLOPS
                    + 0.15 * fp32 / 66.9            # FP32 TFLOPS
                    + 0.30 * bandwidth / 3350       # memory bandwidth, GB/s
                    + 0.15 * memory / 80)           # memory, GiB

   Tensor throughput and bandwidth carry most weight because renters run ML; a card
   without tensor cores (Pascal) forgoes that share.

   **Unknown models** are never refused: their score is estimated as
   ``1.0 per GiB of reported memory`` times a clock factor
   ``max_sm_clock_mhz / 1800`` (clamped to 0.5–1.25; 1 when unknown), capped at 40,
   and they are treated as consumer cards (so never flagship or datacenter) and
   flagged ``needs_review``. A known model whose reported memory differs from its
   spec by more than 15 % is flagged ``needs_review`` too.

3. **Adjust for the host**, each multiplying the score once:

   ======================================  ======
   PCIe link slower than gen3 x8           × 0.80
   network download below 100 Mbps          × 0.75
   reliability below 0.9                    × 0.70
   ======================================  ======

   A link counts by bandwidth, so gen4 x4 equals gen3 x8; it is judged only when
   both generation and width are known.

4. **Tier from the adjusted score** (rounded to 0.1), first rule that holds:

   ===========  =======================================================================
   flagship     datacenter segment and score ≥ 70 (H100, H200, B200)
   datacenter   score ≥ 8 and datacenter segment, or workstation with ≥ 24 GiB
                (A100, A40, L40S, T4, RTX A6000, RTX 6000 Ada)
   prosumer     score ≥ 25 and ≥ 16 GiB (RTX 3090, 4080, 4090, 5090)
   consumer     score ≥ 8 and ≥ 8 GiB (RTX 3060, 3080, 4070, GTX 1080 Ti, RTX A4000)
   entry        everything else (under 8 GiB, or too slow: GTX 1060–1080, RTX 2060)
   ===========  =======================================================================
"""

from __future__ import annotations

import functools
import importlib.resources
import re
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from shared.errors import ConfigError, ValidationFailed

__all__ = [
    "Architecture",
    "Classification",
    "GpuModel",
    "ModelTable",
    "Segment",
    "Tier",
    "classify",
    "load_models",
    "match_model",
    "parse_models",
    "spec_score",
    "tier_for",
]


class Tier(StrEnum):
    FLAGSHIP = "flagship"
    DATACENTER = "datacenter"
    PROSUMER = "prosumer"
    CONSUMER = "consumer"
    ENTRY = "entry"


class Segment(StrEnum):
    CONSUMER = "consumer"
    WORKSTATION = "workstation"
    DATACENTER = "datacenter"


class Architecture(StrEnum):
    PASCAL = "Pascal"
    VOLTA = "Volta"
    TURING = "Turing"
    AMPERE = "Ampere"
    ADA_LOVELACE = "Ada Lovelace"
    HOPPER = "Hopper"
    BLACKWELL = "Blackwell"


# Score reference: H100 SXM (NVIDIA datasheet), which scores 100.
REFERENCE_TENSOR_FP16_TFLOPS = 989.0
REFERENCE_FP32_TFLOPS = 66.9
REFERENCE_BANDWIDTH_GBS = 3350.0
REFERENCE_MEMORY_GIB = 80.0
WEIGHT_TENSOR = 0.40
WEIGHT_FP32 = 0.15
WEIGHT_BANDWIDTH = 0.30
WEIGHT_MEMORY = 0.15

# Unknown models.
FALLBACK_SCORE_PER_GIB = 1.0
FALLBACK_REFERENCE_CLOCK_MHZ = 1800.0
FALLBACK_CLOCK_FACTOR_MIN = 0.5
FALLBACK_CLOCK_FACTOR_MAX = 1.25
FALLBACK_SCORE_CAP = 40.0
MEMORY_MISMATCH_TOLERANCE = 0.15

# Host adjustments.
PCIE_MIN_LINK_GBS = 0.985 * 8  # gen3 x8
PCIE_PENALTY = 0.80
NETWORK_MIN_DOWN_MBPS = 100.0
NETWORK_PENALTY = 0.75
RELIABILITY_MIN = 0.9
RELIABILITY_PENALTY = 0.70

# Tier boundaries.
FLAGSHIP_MIN_SCORE = 70.0
DATACENTER_MIN_SCORE = 8.0
WORKSTATION_DATACENTER_MIN_GIB = 24.0
PROSUMER_MIN_SCORE = 25.0
PROSUMER_MIN_GIB = 16.0
CONSUMER_MIN_SCORE = 8.0
CONSUMER_MIN_GIB = 8.0

REQUIRED_FIELDS = (
    "key",
    "names",
    "architecture",
    "segment",
    "memory_gib",
    "memory_bandwidth_gbs",
    "fp32_tflops",
    "tensor_fp16_tflops",
    "launch_year",
)


@dataclass(frozen=True, slots=True)
class GpuModel:
    key: str
    names: tuple[str, ...]
    architecture: Architecture
    segment: Segment
    memory_gib: float
    memory_bandwidth_gbs: float
    fp32_tflops: float
    tensor_fp16_tflops: float
    launch_year: int


@dataclass(frozen=True, slots=True)
class Classification:
    tier: Tier
    score: float
    model_key: str | None
    needs_review: bool
    reasons: list[str] = field(default_factory=list)


# --- name matching ---------------------------------------------------------------------

_VENDOR_WORDS = frozenset({"nvidia", "geforce", "tesla", "quadro"})
# Words that name a variant of a model rather than the model itself.
_VARIANT_WORD = re.compile(r"^(pcie|sxm\d?|hbm\d?e?|\d+gb)$")
_GLUED_BRAND = re.compile(r"\b(rtx|gtx)(?=\d)")


def _tokens(name: str) -> tuple[str, ...]:
    text = _GLUED_BRAND.sub(r"\1 ", name.lower().replace("-", " ").replace("_", " "))
    return tuple(word for word in text.split() if word not in _VENDOR_WORDS)


def _family(tokens: Sequence[str]) -> tuple[str, ...]:
    return tuple(word for word in tokens if not _VARIANT_WORD.fullmatch(word))


class ModelTable:
    """The known models, indexed for NVML-name matching."""

    def __init__(self, models: Sequence[GpuModel]) -> None:
        self._models = tuple(models)
        self._by_key: dict[str, GpuModel] = {}
        self._by_tokens: dict[tuple[str, ...], GpuModel] = {}
        self._by_family: dict[tuple[str, ...], list[GpuModel]] = {}
        self._variant_words: dict[str, frozenset[str]] = {}
        for model in self._models:
            if model.key in self._by_key:
                raise ConfigError(f"GPU model key {model.key!r} appears twice; keys must be unique")
            self._by_key[model.key] = model
            variant_words: set[str] = set()
            families: set[tuple[str, ...]] = set()
            for name in model.names:
                tokens = _tokens(name)
                other = self._by_tokens.get(tokens)
                if other is not None:
                    raise ConfigError(f"GPU name {name!r} of {model.key!r} already names {other.key!r}")
                self._by_tokens[tokens] = model
                family = _family(tokens)
                families.add(family)
                variant_words.update(set(tokens) - set(family))
            for family in families:
                self._by_family.setdefault(family, []).append(model)
            self._variant_words[model.key] = frozenset(variant_words)

    def __iter__(self) -> Iterator[GpuModel]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)

    def get(self, key: str) -> GpuModel | None:
        return self._by_key.get(key)

    def __getitem__(self, key: str) -> GpuModel:
        return self._by_key[key]

    def match(self, nvml_name: str, memory_mib: int | None = None) -> GpuModel | None:
        """The model ``nvml_name`` names (see rule 1 in the module docstring), or None."""
        tokens = _tokens(nvml_name)
        if not tokens:
            return None
        exact = self._by_tokens.get(tokens)
        if exact is not None:
            return exact
        candidates = self._by_family.get(_family(tokens))
        if not candidates:
            return None
        name_variant_words = set(tokens) - set(_family(tokens))
        reported_gib = memory_mib / 1024 if memory_mib else None

        def rank(indexed: tuple[int, GpuModel]) -> tuple[int, float, int]:
            index, model = indexed
            shared_words = len(name_variant_words & self._variant_words[model.key])
            memory_gap = abs(model.memory_gib - reported_gib) if reported_gib is not None else 0.0
            return (-shared_words, memory_gap, index)

        return min(enumerate(candidates), key=rank)[1]


# --- loading ---------------------------------------------------------------------------


def _number(entry: Mapping[str, object], name: str, where: str) -> float:
    value = entry[name]
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ConfigError(f"{where}: {name} must be a non-negative number, got {value!r}")
    return float(value)


def _parse_model(entry: object, index: int) -> GpuModel:
    if not isinstance(entry, dict):
        raise ConfigError(f"gpu[{index}] must be a table")
    where = f"gpu[{index}] ({entry.get('key', '?')})"
    missing = [name for name in REQUIRED_FIELDS if name not in entry]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {', '.join(missing)}")
    unknown = sorted(set(entry) - set(REQUIRED_FIELDS))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}")
    key, names, year = entry["key"], entry["names"], entry["launch_year"]
    if not isinstance(key, str) or not key:
        raise ConfigError(f"{where}: key must be a non-empty string")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise ConfigError(f"{where}: names must be a non-empty list of non-empty strings")
    if isinstance(year, bool) or not isinstance(year, int):
        raise ConfigError(f"{where}: launch_year must be an integer")
    try:
        architecture = Architecture(entry["architecture"])
        segment = Segment(entry["segment"])
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    memory_gib = _number(entry, "memory_gib", where)
    if memory_gib == 0:
        raise ConfigError(f"{where}: memory_gib must be positive")
    return GpuModel(
        key=key,
        names=tuple(names),
        architecture=architecture,
        segment=segment,
        memory_gib=memory_gib,
        memory_bandwidth_gbs=_number(entry, "memory_bandwidth_gbs", where),
        fp32_tflops=_number(entry, "fp32_tflops", where),
        tensor_fp16_tflops=_number(entry, "tensor_fp16_tflops", where),
        launch_year=year,
    )


def parse_models(document: Mapping[str, object]) -> ModelTable:
    """Build a table from a parsed TOML document with a ``[[gpu]]`` array; ConfigError names the bad entry."""
    entries = document.get("gpu")
    if not isinstance(entries, list) or not entries:
        raise ConfigError("the GPU model table needs a non-empty [[gpu]] array")
    return ModelTable([_parse_model(entry, index) for index, entry in enumerate(entries)])


@functools.cache
def load_models() -> ModelTable:
    """The packaged model table, read from ``master/data/gpu_models.toml`` on first use."""
    resource = importlib.resources.files("master").joinpath("data/gpu_models.toml")
    return parse_models(tomllib.loads(resource.read_text(encoding="utf-8")))


def match_model(
    nvml_name: str, memory_mib: int | None, *, table: ModelTable | None = None
) -> GpuModel | None:
    """The known model ``nvml_name`` names, using ``memory_mib`` to pick among variants; None if unknown."""
    return (table if table is not None else load_models()).match(nvml_name, memory_mib)


# --- scoring and tiers -----------------------------------------------------------------


def spec_score(model: GpuModel) -> float:
    """The unadjusted performance score of ``model`` (H100 SXM = 100), rule 2."""
    return 100 * (
        WEIGHT_TENSOR * model.tensor_fp16_tflops / REFERENCE_TENSOR_FP16_TFLOPS
        + WEIGHT_FP32 * model.fp32_tflops / REFERENCE_FP32_TFLOPS
        + WEIGHT_BANDWIDTH * model.memory_bandwidth_gbs / REFERENCE_BANDWIDTH_GBS
        + WEIGHT_MEMORY * model.memory_gib / REFERENCE_MEMORY_GIB
    )


def _fallback_score(memory_gib: float, max_sm_clock_mhz: float | None) -> float:
    clock_factor = 1.0
    if max_sm_clock_mhz is not None:
        clock_factor = min(
            FALLBACK_CLOCK_FACTOR_MAX,
            max(FALLBACK_CLOCK_FACTOR_MIN, max_sm_clock_mhz / FALLBACK_REFERENCE_CLOCK_MHZ),
        )
    return min(FALLBACK_SCORE_CAP, FALLBACK_SCORE_PER_GIB * memory_gib * clock_factor)


def _pcie_link_gbs(generation: int, width: int) -> float:
    # Per-lane throughput after encoding: gen1 0.25, gen2 0.5, gen3 0.985 GB/s, doubling since.
    per_lane = {1: 0.25, 2: 0.5}.get(generation, 0.985 * 2.0 ** (generation - 3))
    return per_lane * width


def tier_for(score: float, segment: Segment, memory_gib: float) -> tuple[Tier, str]:
    """The tier for an adjusted ``score`` (rule 4), with the rule that placed it."""
    is_datacenter = segment is Segment.DATACENTER
    if is_datacenter and score >= FLAGSHIP_MIN_SCORE:
        return Tier.FLAGSHIP, f"flagship: datacenter GPU with score >= {FLAGSHIP_MIN_SCORE:g}"
    big_workstation = segment is Segment.WORKSTATION and memory_gib >= WORKSTATION_DATACENTER_MIN_GIB
    if (is_datacenter or big_workstation) and score >= DATACENTER_MIN_SCORE:
        return Tier.DATACENTER, (
            f"datacenter: datacenter GPU or workstation GPU with >= {WORKSTATION_DATACENTER_MIN_GIB:g} GiB, "
            f"score >= {DATACENTER_MIN_SCORE:g}"
        )
    if score >= PROSUMER_MIN_SCORE and memory_gib >= PROSUMER_MIN_GIB:
        return Tier.PROSUMER, f"prosumer: score >= {PROSUMER_MIN_SCORE:g} and >= {PROSUMER_MIN_GIB:g} GiB"
    if score >= CONSUMER_MIN_SCORE and memory_gib >= CONSUMER_MIN_GIB:
        return Tier.CONSUMER, f"consumer: score >= {CONSUMER_MIN_SCORE:g} and >= {CONSUMER_MIN_GIB:g} GiB"
    return Tier.ENTRY, (
        f"entry: score < {CONSUMER_MIN_SCORE:g} or < {CONSUMER_MIN_GIB:g} GiB (score {score:g}, {memory_gib:g} GiB)"
    )


def classify(
    gpu_name: str,
    memory_mib: int | None,
    *,
    max_sm_clock_mhz: float | None = None,
    pcie_gen: int | None = None,
    pcie_width: int | None = None,
    network_down_mbps: float | None = None,
    reliability: float | None = None,
    table: ModelTable | None = None,
) -> Classification:
    """Tier, score and reasons for one GPU; unknown models are estimated and flagged, never refused.

    Raises ValidationFailed only for impossible readings (negative memory, reliability
    outside 0..1, a PCIe generation or width below 1, negative bandwidth or clock).
    """
    _check_readings(memory_mib, max_sm_clock_mhz, pcie_gen, pcie_width, network_down_mbps, reliability)
    reasons: list[str] = []
    needs_review = False
    reported_gib = memory_mib / 1024 if memory_mib is not None else None
    model = match_model(gpu_name, memory_mib, table=table)

    if model is not None:
        score = spec_score(model)
        segment = model.segment
        memory_gib = model.memory_gib
        reasons.append(f"matched {model.key} ({model.architecture}, {model.segment}); spec score {score:.1f}")
        if (
            reported_gib is not None
            and abs(reported_gib - memory_gib) > MEMORY_MISMATCH_TOLERANCE * memory_gib
        ):
            needs_review = True
            reasons.append(
                f"reported memory {reported_gib:.1f} GiB differs from the spec's {memory_gib:g} GiB"
            )
    else:
        needs_review = True
        segment = Segment.CONSUMER
        memory_gib = float(round(reported_gib)) if reported_gib is not None else 0.0
        score = _fallback_score(memory_gib, max_sm_clock_mhz)
        clock = f"{max_sm_clock_mhz:g} MHz" if max_sm_clock_mhz is not None else "unknown clock"
        reasons.append(
            f"unknown model {gpu_name!r}: score {score:.1f} estimated from {memory_gib:g} GiB and {clock}; "
            "treated as a consumer card"
        )

    if pcie_gen is not None and pcie_width is not None:
        link_gbs = _pcie_link_gbs(pcie_gen, pcie_width)
        if link_gbs < PCIE_MIN_LINK_GBS:
            score *= PCIE_PENALTY
            reasons.append(f"PCIe gen{pcie_gen} x{pcie_width} is below gen3 x8: score x{PCIE_PENALTY:g}")
    if network_down_mbps is not None and network_down_mbps < NETWORK_MIN_DOWN_MBPS:
        score *= NETWORK_PENALTY
        reasons.append(
            f"network download {network_down_mbps:g} Mbps is below {NETWORK_MIN_DOWN_MBPS:g}: score x{NETWORK_PENALTY:g}"
        )
    if reliability is not None and reliability < RELIABILITY_MIN:
        score *= RELIABILITY_PENALTY
        reasons.append(
            f"reliability {reliability:g} is below {RELIABILITY_MIN:g}: score x{RELIABILITY_PENALTY:g}"
        )

    score = round(score, 1)
    tier, rule = tier_for(score, segment, memory_gib)
    reasons.append(rule)
    return Classification(
        tier=tier,
        score=score,
        model_key=model.key if model is not None else None,
        needs_review=needs_review,
        reasons=reasons,
    )


def _check_readings(
    memory_mib: int | None,
    max_sm_clock_mhz: float | None,
    pcie_gen: int | None,
    pcie_width: int | None,
    network_down_mbps: float | None,
    reliability: float | None,
) -> None:
    problems: list[str] = []
    if memory_mib is not None and memory_mib < 0:
        problems.append(f"memory_mib must be >= 0, got {memory_mib}")
    if max_sm_clock_mhz is not None and max_sm_clock_mhz < 0:
        problems.append(f"max_sm_clock_mhz must be >= 0, got {max_sm_clock_mhz}")
    if pcie_gen is not None and pcie_gen < 1:
        problems.append(f"pcie_gen must be >= 1, got {pcie_gen}")
    if pcie_width is not None and pcie_width < 1:
        problems.append(f"pcie_width must be >= 1, got {pcie_width}")
    if network_down_mbps is not None and network_down_mbps < 0:
        problems.append(f"network_down_mbps must be >= 0, got {network_down_mbps}")
    if reliability is not None and not 0 <= reliability <= 1:
        problems.append(f"reliability must be within 0..1, got {reliability}")
    if problems:
        raise ValidationFailed("; ".join(problems))
