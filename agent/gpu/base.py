"""What a GPU backend reports, and the ``GpuBackend`` seam every backend implements.

``None`` in any field always means "not supported or not available on this GPU"
(a GeForce card has no ECC counters, a passively cooled card has no fan), never
"zero by default": a zero is a reading.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

MIB = 1024 * 1024


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
    power_limit_w: float | None
    max_sm_clock_mhz: int | None
    max_mem_clock_mhz: int | None
    pcie_gen_max: int | None
    pcie_width_max: int | None
    mig_mode: bool | None

    def to_wire(self) -> dict[str, Any]:
        """A JSON-ready dict whose keys are exactly this class's fields."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


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
    pcie_tx_kbps: int | None
    pcie_rx_kbps: int | None
    ecc_volatile_uncorrected: int | None
    ecc_aggregate_uncorrected: int | None
    processes: tuple[GpuProcess, ...]

    def to_wire(self) -> dict[str, Any]:
        """A JSON-ready dict whose keys are exactly this class's fields (processes as a list of dicts)."""
        wire: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            wire[field.name] = getattr(self, field.name)
        wire["processes"] = [process.to_wire() for process in self.processes]
        return wire


class GpuBackend(Protocol):
    """Where the agent's GPU readings come from: real NVML, or an explicitly chosen simulation.

    ``gpus()`` and ``sample()`` list GPUs in the same order, by ascending ``index``.
    ``close()`` releases the backend; calling it twice is harmless.
    """

    name: str  # "nvml" | "sim"

    def gpus(self) -> list[GpuInfo]: ...

    def sample(self) -> list[GpuSample]: ...

    def close(self) -> None: ...
