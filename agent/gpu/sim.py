"""The simulated GPU backend, for demos and tests, used only when chosen explicitly.

``--gpus sim:4xRTX4090`` (or ``gpus = "sim:2xA100-80GB,1xH100"`` in the config)
makes an agent report made-up GPUs of real models; ``1xA100-80GB:mig`` is one in MIG mode,
carved into instances of several profiles (``MIG_LAYOUTS``). Nothing ever falls back to it:
a host without an NVIDIA driver fails loudly in ``agent.gpu.nvml`` instead, so a
provider can never list simulated GPUs by accident.

UUIDs and serials derive from the ``seed`` (the host's identity), the GPU's index
and its model, so a restarted demo agent reports the same GPUs and two demo hosts
with different seeds never report the same UUID.

A GPU shows load only while workloads run on it: the agent's workload manager tells
``set_loads`` what each running workload uses (a hold runs nothing and is not named).

Power limits: ``set_power_limit`` changes a GPU's limit within its model's range (the
``_MODELS`` table). A busy GPU's draw is capped at the limit and its clocks drop, with
``sw_power_cap`` among its throttle reasons; an idle GPU's draw shrinks a little under a
lower limit (``idle_power_w``: a stated modelling assumption, see docs/power.md).
"""

from __future__ import annotations

import random
import re
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from types import MappingProxyType
from typing import Literal

from agent.gpu.base import (
    GpuEvent,
    GpuInfo,
    GpuMigInstance,
    GpuProcess,
    GpuSample,
    check_power_limit,
    default_power_limit,
)
from shared.clock import utcnow
from shared.errors import ConfigError, NotFound

SIM_PREFIX = "sim:"
# A real host rarely has more than 8 GPUs; 16 leaves room for odd demos while keeping
# a typo such as "sim:400xH100" from flooding the master with fake inventory.
MAX_SIM_GPUS = 16
# Longer than any sensible spec; bounds the parsing work on a hostile config value.
MAX_SIM_SPEC_CHARS = 256

# Blackwell (RTX 5090) needs the R570 driver branch, so the simulated host reports one.
SIM_DRIVER_VERSION = "570.124.06"
SIM_CUDA_DRIVER_VERSION = "12.8"

# Fixed namespace of simulated GPU UUIDs; changing it changes every demo GPU's identity.
_SIM_UUID_NAMESPACE = uuid.UUID("5b0c8a3e-6f1d-4e0b-9a57-2d9c4f1e7a10")

# Events injected but not yet polled; a demo that injects more loses the oldest.
MAX_PENDING_SIM_EVENTS = 256

_IDLE_SM_CLOCK_MHZ = 210  # P8 idle clock of recent NVIDIA GPUs
_IDLE_GDDR_CLOCK_MHZ = 405  # GDDR drops to this at idle; HBM stays at its fixed clock
_COUNT_RE = re.compile(r"^(?:([+-]?\d+)\s*[xX]\s*)?(.*)$")
_MIG_SUFFIX = ":mig"
MIG_SLICES = 7  # compute slices of a MIG-capable GPU (A100, H100, H200)


@dataclass(frozen=True, slots=True)
class MigSlot:
    """One MIG instance of a layout: its profile, compute slices (of 7) and memory eighths (of 8)."""

    profile: str
    compute_slices: int
    memory_eighths: int


def _layout(*slots: tuple[str, int, int]) -> tuple[MigSlot, ...]:
    layout = tuple(MigSlot(*slot) for slot in slots)
    assert sum(s.compute_slices for s in layout) <= MIG_SLICES and sum(s.memory_eighths for s in layout) <= 8
    return layout


# How a MIG-enabled simulated GPU is carved: one valid NVIDIA layout mixing three profiles, so a demo
# can rent each size. Real providers choose theirs with nvidia-smi mig; the agent reports what it finds.
MIG_LAYOUTS: Mapping[str, tuple[MigSlot, ...]] = MappingProxyType({
    "A100-40GB": _layout(("3g.20gb", 3, 4), ("2g.10gb", 2, 2), ("1g.5gb", 1, 1), ("1g.5gb", 1, 1)),
    "A100-80GB": _layout(("3g.40gb", 3, 4), ("2g.20gb", 2, 2), ("1g.10gb", 1, 1), ("1g.10gb", 1, 1)),
    "H100": _layout(("3g.40gb", 3, 4), ("2g.20gb", 2, 2), ("1g.10gb", 1, 1), ("1g.10gb", 1, 1)),
    "H200": _layout(("3g.71gb", 3, 4), ("2g.35gb", 2, 2), ("1g.18gb", 1, 1), ("1g.18gb", 1, 1)),
})  # fmt: skip
_SMS_PER_SLICE = {"A100-40GB": 14, "A100-80GB": 14, "H100": 16, "H200": 16}


@dataclass(frozen=True, slots=True)
class SimModel:
    """A real GPU model, as NVML reports it."""

    key: str
    name: str  # what nvmlDeviceGetName returns
    memory_total_mib: int  # what nvmlDeviceGetMemoryInfo().total reports, in MiB
    compute_capability: str
    power_limit_w: float
    idle_power_w: float
    max_sm_clock_mhz: int
    max_mem_clock_mhz: int
    pcie_gen_max: int
    pcie_width_max: int
    has_fan: bool  # passively cooled data-centre cards report no fan speed
    ecc: bool  # ECC enabled by default (data-centre cards)
    serial: bool  # GeForce cards report no serial number
    mig_capable: bool
    hbm: bool
    power_limit_min_w: float
    power_limit_max_w: float

    @property
    def remaps_rows(self) -> bool:
        """ECC GPUs from Ampere on remap rows; older ones (Turing's T4) retire pages instead."""
        return self.ecc and float(self.compute_capability) >= 8.0


# Which kind of card a model is decides the features NVML reports for it.
_Kind = Literal["geforce", "workstation", "datacenter", "datacenter-hbm"]


def _model(
    key: str,
    name: str,
    memory_total_mib: int,
    compute_capability: str,
    power_limit_w: float,
    idle_power_w: float,
    max_sm_clock_mhz: int,
    max_mem_clock_mhz: int,
    pcie_gen_max: int,
    kind: _Kind,
    power_limit_min_w: float,
    power_limit_max_w: float,
) -> SimModel:
    geforce = kind == "geforce"
    hbm = kind == "datacenter-hbm"
    return SimModel(
        key=key,
        name=name,
        memory_total_mib=memory_total_mib,
        compute_capability=compute_capability,
        power_limit_w=power_limit_w,
        idle_power_w=idle_power_w,
        max_sm_clock_mhz=max_sm_clock_mhz,
        max_mem_clock_mhz=max_mem_clock_mhz,
        pcie_gen_max=pcie_gen_max,
        pcie_width_max=16,
        has_fan=kind in ("geforce", "workstation"),
        ecc=kind in ("datacenter", "datacenter-hbm"),
        serial=not geforce,
        mig_capable=hbm,
        hbm=hbm,
        power_limit_min_w=power_limit_min_w,
        power_limit_max_w=power_limit_max_w,
    )


# fmt: off
# min W / max W: the range `nvidia-smi -q -d POWER` shows for the reference board (approximate: a partner
# board's own range may differ); the simulated power policy is checked against it.
_MODELS = (
    #      key           NVML name                          MiB       CC      limit W  idle W  max SM  max mem  PCIe  kind              min W  max W
    _model("RTX3060",     "NVIDIA GeForce RTX 3060",         12288,    "8.6",  170.0,   13.0,   2100,   7501,    4,    "geforce",        100.0, 170.0),
    _model("RTX3090",     "NVIDIA GeForce RTX 3090",         24576,    "8.6",  350.0,   25.0,   2100,   9751,    4,    "geforce",        100.0, 350.0),
    _model("RTX4090",     "NVIDIA GeForce RTX 4090",         24564,    "8.9",  450.0,   22.0,   3120,   10501,   4,    "geforce",        150.0, 600.0),
    _model("RTX5090",     "NVIDIA GeForce RTX 5090",         32607,    "12.0", 575.0,   30.0,   3090,   14001,   5,    "geforce",        400.0, 600.0),
    _model("RTXA4000",    "NVIDIA RTX A4000",                16376,    "8.6",  140.0,   10.0,   2100,   7001,    4,    "workstation",    100.0, 140.0),
    _model("RTX6000ADA",  "NVIDIA RTX 6000 Ada Generation",  49140,    "8.9",  300.0,   20.0,   3105,   10001,   4,    "workstation",    100.0, 300.0),
    _model("L4",          "NVIDIA L4",                       23034,    "8.9",  72.0,    16.0,   2040,   6251,    4,    "datacenter",     40.0,  72.0),
    _model("L40S",        "NVIDIA L40S",                     46068,    "8.9",  350.0,   35.0,   2520,   9001,    4,    "datacenter",     100.0, 350.0),
    _model("T4",          "Tesla T4",                        15360,    "7.5",  70.0,    10.0,   1590,   5001,    3,    "datacenter",     60.0,  70.0),
    _model("A10",         "NVIDIA A10",                      23028,    "8.6",  150.0,   18.0,   1695,   6251,    4,    "datacenter",     100.0, 150.0),
    _model("A100-40GB",   "NVIDIA A100-SXM4-40GB",           40960,    "8.0",  400.0,   55.0,   1410,   1215,    4,    "datacenter-hbm", 100.0, 400.0),
    _model("A100-80GB",   "NVIDIA A100-SXM4-80GB",           81920,    "8.0",  400.0,   60.0,   1410,   1593,    4,    "datacenter-hbm", 100.0, 400.0),
    _model("H100",        "NVIDIA H100 80GB HBM3",           81559,    "9.0",  700.0,   70.0,   1980,   2619,    5,    "datacenter-hbm", 200.0, 700.0),
    _model("H200",        "NVIDIA H200",                     143771,   "9.0",  700.0,   75.0,   1980,   3201,    5,    "datacenter-hbm", 200.0, 700.0),
)
# fmt: on

SIM_MODELS: Mapping[str, SimModel] = MappingProxyType({model.key: model for model in _MODELS})
"""The simulated models by canonical key ("RTX4090", "A100-80GB", ...)."""


def _normalize_key(text: str) -> str:
    # "rtx-4090", "RTX_4090" and "rtx 4090" all name the RTX4090.
    return re.sub(r"[\s_-]", "", text).upper()


_MODELS_BY_NORMALIZED_KEY = {_normalize_key(key): key for key in SIM_MODELS}
assert len(_MODELS_BY_NORMALIZED_KEY) == len(SIM_MODELS), "two model keys normalize alike"


assert {key for key, model in SIM_MODELS.items() if model.mig_capable} == set(MIG_LAYOUTS), "a MIG model without a layout"


def _spec_error(spec: str, problem: str) -> ConfigError:
    valid = ", ".join(SIM_MODELS)
    return ConfigError(
        f"invalid simulated GPU spec {spec!r}: {problem}. "
        f"Write it as 'sim:[COUNTx]MODEL[:mig][,[COUNTx]MODEL[:mig]...]', e.g. 'sim:4xRTX4090' or "
        f"'sim:2xA100-80GB,1xH100:mig', with at most {MAX_SIM_GPUS} GPUs in all. Valid models: {valid}; "
        f"':mig' (MIG mode) on {', '.join(MIG_LAYOUTS)}.",
        details={"setting": "gpus", "valid_models": list(SIM_MODELS)},
    )


@dataclass(frozen=True, slots=True)
class SimItem:
    """One entry of a spec: ``count`` GPUs of ``key``, in MIG mode when ``mig``."""

    key: str
    count: int
    mig: bool = False


def parse_sim_spec(spec: str, *, max_gpus: int = MAX_SIM_GPUS) -> list[tuple[str, int]]:
    """Parse ``sim:4xRTX4090`` or ``sim:2xA100-80GB,1xH100`` into ``[(model_key, count), ...]``.

    The count defaults to 1 and model keys are case-insensitive (``-``, ``_`` and spaces
    are ignored); the returned keys are the canonical ``SIM_MODELS`` keys, in spec order.
    Raises ``ConfigError``, listing the valid model keys, for anything else.
    ``parse_sim_items`` says which entries are in MIG mode too.
    """
    return [(item.key, item.count) for item in parse_sim_items(spec, max_gpus=max_gpus)]


def parse_sim_items(spec: str, *, max_gpus: int = MAX_SIM_GPUS) -> list[SimItem]:
    """Parse a spec as ``parse_sim_spec`` does; an entry ending in ``:mig`` is in MIG mode (MIG-capable models only)."""
    if len(spec) > MAX_SIM_SPEC_CHARS:
        raise _spec_error(spec[:40] + "...", f"longer than {MAX_SIM_SPEC_CHARS} characters")
    text = spec.strip()
    if not text.lower().startswith(SIM_PREFIX):
        raise _spec_error(spec, f"it must start with {SIM_PREFIX!r}")
    body = text[len(SIM_PREFIX) :].strip()
    if not body:
        raise _spec_error(spec, "no GPU model given")
    parsed: list[SimItem] = []
    total = 0
    for item in body.split(","):
        item = item.strip()
        if not item:
            raise _spec_error(spec, "empty entry between commas")
        match = _COUNT_RE.fullmatch(item)
        assert match is not None  # the pattern matches every string
        count_text, model_text = match.group(1), match.group(2).strip()
        mig = model_text.lower().endswith(_MIG_SUFFIX)
        if mig:
            model_text = model_text[: -len(_MIG_SUFFIX)].strip()
        count = 1 if count_text is None else int(count_text)
        if count < 1:
            raise _spec_error(spec, f"count {count} in {item!r} must be at least 1")
        if not model_text:
            raise _spec_error(spec, f"no GPU model in {item!r}")
        key = _MODELS_BY_NORMALIZED_KEY.get(_normalize_key(model_text))
        if key is None:
            raise _spec_error(spec, f"unknown GPU model {model_text!r}")
        if mig and key not in MIG_LAYOUTS:
            raise _spec_error(spec, f"{key} has no MIG mode")
        total += count
        if total > max_gpus:
            raise _spec_error(spec, f"more than {max_gpus} simulated GPUs on one host")
        parsed.append(SimItem(key, count, mig))
    return parsed


@dataclass(slots=True)
class _SimGpu:
    info: GpuInfo
    model: SimModel
    # What each running workload on it uses (1.0: the whole GPU), and its process's pid; empty: idle.
    loads: list[float] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    mig_slices: Mapping[str, int] = field(default_factory=dict)  # MIG instance UUID -> its compute slices

    @property
    def limit_w(self) -> float:
        """The power limit in force (``set_power_limit`` changes it; the model's default until then)."""
        return self.info.power_limit_w if self.info.power_limit_w is not None else self.model.power_limit_w

    @property
    def load(self) -> float:
        return min(1.0, sum(self.loads))


class SimulatedBackend:
    """Made-up GPUs of real models, with plausible live readings.

    A GPU no workload runs on idles: low utilization, idle power, about 35 °C, no process.
    ``set_loads`` says what running workloads use (``set_busy``: whole GPUs), and the
    readings follow: utilization, memory, power, temperature and clocks scale with the
    load, one compute process per workload. Readings jitter within fixed bounds using
    ``rng`` (by default a ``random.Random`` seeded from ``seed``, so runs repeat).
    The simulated GPUs never fail on their own: ``inject_xid`` queues an XID event
    for ``poll_events`` to report, stamped with ``clock()``.
    """

    name: str = "sim"

    def __init__(
        self,
        spec: str,
        *,
        seed: str,
        rng: random.Random | None = None,
        max_gpus: int = MAX_SIM_GPUS,
        clock: Callable[[], datetime] = utcnow,
        max_pending_events: int = MAX_PENDING_SIM_EVENTS,
    ) -> None:
        if not seed:
            # Every simulated host would otherwise report the same UUIDs, and the
            # master would see one GPU on several hosts.
            raise ConfigError(
                "the simulated GPU backend needs a non-empty seed (the host's identity) "
                "so that its GPU UUIDs are unique per host",
                details={"setting": "gpus"},
            )
        self.spec = spec
        self._rng = rng if rng is not None else random.Random(f"gpumarket-sim:{seed}")
        self._gpus: list[_SimGpu] = []
        for item in parse_sim_items(spec, max_gpus=max_gpus):
            for _ in range(item.count):
                index = len(self._gpus)
                model = SIM_MODELS[item.key]
                info = _sim_info(model, seed=seed, index=index, mig=item.mig)
                slices = {m.uuid: int((m.profile or "1g").split("g", 1)[0]) for m in info.mig_instances}
                self._gpus.append(_SimGpu(info=info, model=model, mig_slices=slices))
        self._by_uuid = {gpu.info.uuid: gpu for gpu in self._gpus}
        self._by_mig_uuid = {mig_uuid: gpu for gpu in self._gpus for mig_uuid in gpu.mig_slices}
        self._clock = clock
        self._events: deque[GpuEvent] = deque(maxlen=max_pending_events)

    def gpus(self) -> list[GpuInfo]:
        return [gpu.info for gpu in self._gpus]

    def sample(self) -> list[GpuSample]:
        return [self._sample(gpu) for gpu in self._gpus]

    def set_loads(self, loads: Mapping[str, Sequence[float]]) -> None:
        """Show what the running workloads use, replacing what was shown before.

        ``loads`` maps a GPU's UUID, or a MIG instance's, to the part of it each workload
        running there uses (1.0: all of it; a share of 250 milli: 0.25). A MIG instance's load
        counts on its GPU in proportion to its compute slices of 7. GPUs not named idle.
        Raises ``NotFound`` and changes nothing if a UUID is none of this backend's GPUs or
        MIG instances, or ``ValueError`` for a load outside (0, 1].
        """
        unknown = [u for u in loads if u not in self._by_uuid and u not in self._by_mig_uuid]
        if unknown:
            raise NotFound(f"no simulated GPU or MIG instance with UUID {', '.join(unknown)}", code="gpu_not_found")
        if any(not 0.0 < fraction <= 1.0 for fractions in loads.values() for fraction in fractions):
            raise ValueError("a workload's load is a fraction of the GPU in (0, 1]")
        per_gpu: dict[str, list[float]] = {gpu.info.uuid: [] for gpu in self._gpus}
        for gpu_uuid, fractions in loads.items():
            gpu = self._by_uuid.get(gpu_uuid)
            scale = 1.0
            if gpu is None:
                gpu = self._by_mig_uuid[gpu_uuid]
                scale = gpu.mig_slices[gpu_uuid] / MIG_SLICES
            per_gpu[gpu.info.uuid].extend(fraction * scale for fraction in fractions)
        for gpu in self._gpus:
            gpu.loads = per_gpu[gpu.info.uuid]
            # Each workload keeps its pid while it runs; Linux's default pid_max is 4194304.
            del gpu.pids[len(gpu.loads) :]
            gpu.pids.extend(self._rng.randint(1000, 4_194_303) for _ in range(len(gpu.loads) - len(gpu.pids)))

    def set_busy(self, uuids: Iterable[str], busy: bool) -> None:
        """Make the GPUs with these UUIDs look wholly used by one workload each, or idle; others stay as they are.

        Raises ``NotFound`` and changes nothing if any UUID is not one of this backend's GPUs.
        """
        wanted = list(uuids)
        unknown = [gpu_uuid for gpu_uuid in wanted if gpu_uuid not in self._by_uuid]
        if unknown:
            raise NotFound(f"no simulated GPU with UUID {', '.join(unknown)}", code="gpu_not_found")
        loads = {gpu.info.uuid: list(gpu.loads) for gpu in self._gpus if gpu.loads}
        for gpu_uuid in wanted:
            if busy:
                loads[gpu_uuid] = loads.get(gpu_uuid) or [1.0]
            else:
                loads.pop(gpu_uuid, None)
        self.set_loads(loads)  # a GPU that stays busy keeps its pid

    def set_power_limit(self, index: int, watts: float) -> float:
        """Lower (or raise) GPU ``index``'s limit within its model's range; its readings follow (see ``_sample``)."""
        gpu = self._gpu_at(index)
        limit = check_power_limit(gpu.info, watts)
        gpu.info = replace(gpu.info, power_limit_w=limit)
        return limit

    def restore_power_limit(self, index: int) -> float:
        gpu = self._gpu_at(index)
        return self.set_power_limit(index, default_power_limit(gpu.info))

    def _gpu_at(self, index: int) -> _SimGpu:
        if not 0 <= index < len(self._gpus):
            raise NotFound(f"no simulated GPU at index {index}", code="gpu_not_found")
        return self._gpus[index]

    def inject_xid(self, gpu_uuid: str, code: int) -> None:
        """Make the GPU with this UUID report XID ``code`` (79: fallen off the bus, ...) once.

        Raises ``NotFound`` if the UUID is not one of this backend's GPUs.
        """
        if gpu_uuid not in self._by_uuid:
            raise NotFound(f"no simulated GPU with UUID {gpu_uuid}", code="gpu_not_found")
        self._events.append(GpuEvent(uuid=gpu_uuid, kind="xid", code=code, at=self._clock()))

    def poll_events(self) -> list[GpuEvent]:
        """The injected events not yet polled, oldest first; each is reported once."""
        events = list(self._events)
        self._events.clear()
        return events

    def close(self) -> None:
        """Nothing to release; present for the ``GpuBackend`` seam."""

    def _sample(self, gpu: _SimGpu) -> GpuSample:
        model, rng = gpu.model, self._rng
        limit = gpu.limit_w
        idle_memory_mib = max(1, round(model.memory_total_mib * 0.004))
        processes: tuple[GpuProcess, ...] = ()
        load = gpu.load
        if load > 0:
            # Busy readings scale with the part of the GPU its workloads use; idle ones are the floor.
            gpu_util = max(rng.uniform(0.0, 3.0), load * rng.uniform(92.0, 100.0))
            mem_util = max(rng.uniform(0.0, 2.0), load * rng.uniform(45.0, 85.0))
            memory_used = max(idle_memory_mib + 1, round(model.memory_total_mib * load * rng.uniform(0.70, 0.92)))
            temperature = rng.uniform(32.0, 38.0) + load * rng.uniform(32.0, 41.0)
            busy_power = model.power_limit_w * rng.uniform(0.85, 0.99)
            wanted = model.idle_power_w + load * max(0.0, busy_power - model.idle_power_w)
            power = min(wanted, limit)
            # Under a lower limit the clocks drop until the draw fits it (power grows roughly with the clock here).
            sm_clock = round(model.max_sm_clock_mhz * rng.uniform(0.85, 0.97) * min(1.0, limit / wanted))
            mem_clock = model.max_mem_clock_mhz
            fan = rng.uniform(27.0, 33.0) + load * rng.uniform(28.0, 47.0)
            pcie_tx = round(load * rng.randint(50_000, 2_000_000))
            pcie_rx = round(load * rng.randint(50_000, 2_000_000))
            pcie_gen = model.pcie_gen_max
            # A card drawing its whole budget is held back by the power cap.
            throttle: tuple[str, ...] = ("sw_power_cap",) if power >= 0.97 * limit else ()
            total = sum(gpu.loads)
            processes = tuple(
                GpuProcess(pid=pid, used_memory_mib=max(1, round((memory_used - idle_memory_mib) * fraction / total)))
                for pid, fraction in zip(gpu.pids, gpu.loads, strict=True)
            )
        else:
            gpu_util = rng.uniform(0.0, 3.0)
            mem_util = rng.uniform(0.0, 2.0)
            memory_used = idle_memory_mib + rng.randint(0, 8)
            temperature = rng.uniform(32.0, 38.0)
            power = idle_power_w(model, limit) * rng.uniform(0.9, 1.1)
            sm_clock = _IDLE_SM_CLOCK_MHZ
            mem_clock = model.max_mem_clock_mhz if model.hbm else _IDLE_GDDR_CLOCK_MHZ
            fan = rng.uniform(27.0, 33.0)
            pcie_tx, pcie_rx = rng.randint(0, 500), rng.randint(0, 500)
            # Idle GDDR cards train their link down to Gen1; HBM data-centre cards stay at P0.
            pcie_gen = model.pcie_gen_max if model.hbm else 1
            throttle = ("gpu_idle",)
        return GpuSample(
            index=gpu.info.index,
            uuid=gpu.info.uuid,
            gpu_util_pct=round(min(gpu_util, 100.0), 1),
            mem_util_pct=round(min(mem_util, 100.0), 1),
            memory_used_mib=min(memory_used, model.memory_total_mib),
            memory_free_mib=model.memory_total_mib - min(memory_used, model.memory_total_mib),
            temperature_c=round(temperature, 1),
            power_draw_w=round(min(power, limit), 1),
            sm_clock_mhz=sm_clock,
            mem_clock_mhz=mem_clock,
            fan_pct=round(min(fan, 100.0), 1) if model.has_fan else None,
            pcie_gen_current=pcie_gen,
            pcie_width_current=model.pcie_width_max,
            pcie_tx_kbps=pcie_tx,
            pcie_rx_kbps=pcie_rx,
            throttle_reasons=throttle,
            ecc_volatile_uncorrected=0 if model.ecc else None,
            ecc_aggregate_uncorrected=0 if model.ecc else None,
            retired_pages_single_bit=0 if model.ecc and not model.remaps_rows else None,
            retired_pages_double_bit=0 if model.ecc and not model.remaps_rows else None,
            retired_pages_pending=False if model.ecc and not model.remaps_rows else None,
            remapped_rows_correctable=0 if model.remaps_rows else None,
            remapped_rows_uncorrectable=0 if model.remaps_rows else None,
            remapped_rows_pending=False if model.remaps_rows else None,
            remapped_rows_failure=False if model.remaps_rows else None,
            processes=processes,
            power_limit_w=limit,
        )


# A modelling assumption, not a measurement: most of an idle GPU's draw is fixed (memory, fans, leakage at the
# idle clock); the rest (boost excursions between idle periods) is taken to shrink in proportion to the limit.
# Real boards differ; docs/power.md says what this means for the energy-saved figures the demo shows.
IDLE_FIXED_SHARE = 0.7


def idle_power_w(model: SimModel, limit_w: float) -> float:
    """The simulated idle draw (before jitter) of ``model`` under ``limit_w``: the model's idle draw at its default limit."""
    scale = min(1.0, limit_w / model.power_limit_w)
    return model.idle_power_w * (IDLE_FIXED_SHARE + (1 - IDLE_FIXED_SHARE) * scale)


def sim_gpu_uuid(*, seed: str, index: int, model_key: str) -> str:
    """The UUID a simulated GPU reports, in NVML's ``GPU-xxxxxxxx-...`` form."""
    return f"GPU-{uuid.uuid5(_SIM_UUID_NAMESPACE, f'{seed}:{index}:{model_key}')}"


def sim_mig_uuid(*, seed: str, index: int, model_key: str, slot: int) -> str:
    """The UUID of a simulated MIG instance, in NVML's ``MIG-xxxxxxxx-...`` form."""
    return f"MIG-{uuid.uuid5(_SIM_UUID_NAMESPACE, f'{seed}:{index}:{model_key}:mig:{slot}')}"


def _mig_instances(model: SimModel, *, seed: str, index: int) -> tuple[GpuMigInstance, ...]:
    return tuple(
        GpuMigInstance(
            uuid=sim_mig_uuid(seed=seed, index=index, model_key=model.key, slot=slot),
            gpu_instance_id=slot + 1,
            compute_instance_id=0,
            memory_total_mib=model.memory_total_mib * layout.memory_eighths // 8,
            name=f"{model.name} MIG {layout.profile}",
            profile=layout.profile,
            multiprocessor_count=_SMS_PER_SLICE[model.key] * layout.compute_slices,
        )
        for slot, layout in enumerate(MIG_LAYOUTS[model.key])
    )


def _sim_info(model: SimModel, *, seed: str, index: int, mig: bool = False) -> GpuInfo:
    gpu_uuid = sim_gpu_uuid(seed=seed, index=index, model_key=model.key)
    serial = None
    if model.serial:
        serial = f"1{int(gpu_uuid.replace('-', '')[-12:], 16) % 10**12:012d}"
    return GpuInfo(
        index=index,
        uuid=gpu_uuid,
        name=model.name,
        pci_bus_id=f"{index // 16:08X}:{0x01 + 0x10 * (index % 16):02X}:00.0",
        serial=serial,
        memory_total_mib=model.memory_total_mib,
        compute_capability=model.compute_capability,
        driver_version=SIM_DRIVER_VERSION,
        cuda_driver_version=SIM_CUDA_DRIVER_VERSION,
        power_limit_w=model.power_limit_w,
        power_limit_default_w=model.power_limit_w,
        power_limit_min_w=model.power_limit_min_w,
        power_limit_max_w=model.power_limit_max_w,
        max_sm_clock_mhz=model.max_sm_clock_mhz,
        max_mem_clock_mhz=model.max_mem_clock_mhz,
        pcie_gen_max=model.pcie_gen_max,
        pcie_width_max=model.pcie_width_max,
        mig_mode=mig if model.mig_capable else None,
        mig_instances=_mig_instances(model, seed=seed, index=index) if mig else (),
    )
