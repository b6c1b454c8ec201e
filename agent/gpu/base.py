"""What a GPU backend reports, and the seams every backend implements.

``None`` in any field always means "not supported or not available on this GPU"
(a GeForce card has no ECC counters, a passively cooled card has no fan), never
"zero by default": a zero is a reading.

``GpuBackend`` is the seam the agent reads GPUs through. ``GpuEventSource`` is an
optional second seam: a backend that can report XID and ECC events offers
``poll_events()``; ``poll_events(backend)`` asks any backend and answers ``[]`` for
one that cannot. Power limits (``set_power_limit``, ``restore_power_limit``) are part of
``GpuBackend``: every backend checks a limit against the board's range with
``check_power_limit`` before it changes anything. Nothing here imports NVML.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Protocol, runtime_checkable

from shared.errors import PowerLimitError

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class GpuMigInstance:
    """One MIG device (a GPU instance with a compute instance) carved out of a MIG-enabled GPU."""

    uuid: str  # "MIG-..."
    gpu_instance_id: int | None
    compute_instance_id: int | None
    memory_total_mib: int | None
    name: str | None  # what NVML names the MIG device: "NVIDIA A100-SXM4-40GB MIG 1g.5gb"
    profile: str | None  # the profile part of the name: "1g.5gb"
    multiprocessor_count: int | None

    def to_wire(self) -> dict[str, Any]:
        """A JSON-ready dict whose keys are exactly this class's fields."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """A GPU's identity: read once when the backend opens, fixed until the agent restarts."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str | None
    serial: str | None
    memory_total_mib: int
    compute_capability: str | None  # "8.9"
    driver_version: str | None  # "550.54.15"
    cuda_driver_version: str | None  # "12.4"
    power_limit_w: float | None  # the limit the GPU enforces now
    power_limit_default_w: float | None  # the board's default limit
    power_limit_min_w: float | None  # the range an administrator may set the limit within
    power_limit_max_w: float | None
    max_sm_clock_mhz: int | None
    max_mem_clock_mhz: int | None
    pcie_gen_max: int | None
    pcie_width_max: int | None
    mig_mode: bool | None
    # Empty unless MIG mode is enabled; as configured when the backend opened.
    mig_instances: tuple[GpuMigInstance, ...]

    def to_wire(self) -> dict[str, Any]:
        """A JSON-ready dict whose keys are exactly this class's fields (MIG instances as dicts)."""
        wire = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        wire["mig_instances"] = [instance.to_wire() for instance in self.mig_instances]
        return wire


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A compute process running on a GPU."""

    pid: int
    used_memory_mib: int | None

    def to_wire(self) -> dict[str, Any]:
        return {"pid": self.pid, "used_memory_mib": self.used_memory_mib}


@dataclass(frozen=True, slots=True)
class GpuSample:
    """A GPU's live state, read every telemetry interval."""

    index: int
    uuid: str
    gpu_util_pct: float | None
    mem_util_pct: float | None
    memory_used_mib: int | None
    memory_free_mib: int | None
    temperature_c: float | None
    power_draw_w: float | None
    sm_clock_mhz: int | None
    mem_clock_mhz: int | None
    fan_pct: float | None
    # The PCIe link trains down when the GPU idles, so its current state is live, not identity.
    pcie_gen_current: int | None
    pcie_width_current: int | None
    pcie_tx_kbps: int | None
    pcie_rx_kbps: int | None
    # Why the clocks are below their maximum ("gpu_idle", "sw_power_cap", "hw_thermal", ...);
    # empty when nothing holds them back, None when the GPU cannot say.
    throttle_reasons: tuple[str, ...] | None
    ecc_volatile_uncorrected: int | None
    ecc_aggregate_uncorrected: int | None
    # Page retirement (GPUs before Ampere) ...
    retired_pages_single_bit: int | None
    retired_pages_double_bit: int | None
    retired_pages_pending: bool | None
    # ... or row remapping (Ampere and later data-centre GPUs).
    remapped_rows_correctable: int | None
    remapped_rows_uncorrectable: int | None
    remapped_rows_pending: bool | None
    remapped_rows_failure: bool | None
    processes: tuple[GpuProcess, ...]
    # The power limit the GPU enforces now: ``GpuInfo.power_limit_w`` is the one found at start-up.
    power_limit_w: float | None = None

    def to_wire(self) -> dict[str, Any]:
        """A JSON-ready dict whose keys are exactly this class's fields (tuples as lists)."""
        wire = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        wire["throttle_reasons"] = None if self.throttle_reasons is None else list(self.throttle_reasons)
        wire["processes"] = [process.to_wire() for process in self.processes]
        return wire


GpuEventKind = Literal["xid", "double_bit_ecc", "single_bit_ecc", "other"]


@dataclass(frozen=True, slots=True)
class GpuEvent:
    """Something a GPU reported once: an XID error or an ECC error event.

    ``code`` is the XID number for ``"xid"`` events (79: fallen off the bus, 48: double-bit
    ECC, ...), the NVML event type for ``"other"``, and ``None`` otherwise. ``at`` is when
    the agent saw the event (NVML does not timestamp them), timezone-aware.
    """

    uuid: str
    kind: GpuEventKind
    code: int | None
    at: datetime
    # On a MIG-enabled GPU: the instance the event belongs to, where NVML can tell.
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None

    def to_wire(self) -> dict[str, Any]:
        """A JSON-ready dict whose keys are exactly this class's fields (``at`` in ISO 8601)."""
        wire = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        wire["at"] = self.at.isoformat()
        return wire


def check_power_limit(info: GpuInfo, watts: float) -> float:
    """``watts`` as a limit GPU ``info`` accepts (within ``power_limit_min_w..power_limit_max_w``);
    ``PowerLimitError`` saying the range otherwise, or when the GPU reports no adjustable range."""
    low, high = info.power_limit_min_w, info.power_limit_max_w
    if low is None or high is None:
        raise PowerLimitError(
            f"GPU {info.index} ({info.name}) reports no adjustable power-limit range: its limit cannot be set",
            code="power_limit_unsupported", details={"gpu_uuid": info.uuid},
        )
    if not math.isfinite(watts) or not low <= watts <= high:
        raise PowerLimitError(
            f"{watts:g} W is outside GPU {info.index}'s ({info.name}) allowed power-limit range {low:g}-{high:g} W; nothing changed",
            code="power_limit_out_of_range", details={"gpu_uuid": info.uuid, "min_w": low, "max_w": high},
        )
    return float(watts)


def default_power_limit(info: GpuInfo) -> float:
    """The board's default limit, which a restore sets; ``PowerLimitError`` where the GPU reports none."""
    if info.power_limit_default_w is None:
        raise PowerLimitError(
            f"GPU {info.index} ({info.name}) reports no default power limit to restore", code="power_limit_unsupported",
            details={"gpu_uuid": info.uuid},
        )
    return check_power_limit(info, info.power_limit_default_w)


class GpuBackend(Protocol):
    """Where the agent's GPU readings come from: real NVML, a recording of it, or an explicit simulation.

    ``gpus()`` and ``sample()`` list GPUs in the same order, by ascending ``index``.
    ``close()`` releases the backend; calling it twice is harmless.
    """

    name: str  # "nvml" | "replay" | "sim"

    def gpus(self) -> list[GpuInfo]: ...

    def sample(self) -> list[GpuSample]: ...

    def set_power_limit(self, index: int, watts: float) -> float:
        """Set GPU ``index``'s power limit to ``watts`` (``check_power_limit``: within the board's range) and
        return the limit now in force; ``PowerLimitError`` (and nothing changed) where it cannot be set."""
        ...

    def restore_power_limit(self, index: int) -> float:
        """Set GPU ``index``'s power limit back to the board's default; returns it. ``PowerLimitError`` as above."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class GpuEventSource(Protocol):
    """A backend that reports GPU events.

    ``poll_events()`` never blocks: it returns the events seen since the previous call,
    each exactly once, oldest first, and ``[]`` when there are none.
    """

    def poll_events(self) -> list[GpuEvent]: ...


def poll_events(backend: object) -> list[GpuEvent]:
    """The events ``backend`` saw since it was last asked; ``[]`` for a backend that reports none."""
    if isinstance(backend, GpuEventSource):
        return backend.poll_events()
    return []
