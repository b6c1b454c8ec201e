"""Every rental's ceilings on memory, CPU, pids and disk: the rental's share of its host, and the most it may ask for.

Pure arithmetic, shared by the agent (which applies the ceilings and refuses what its host cannot give,
``limits_exceed_host``) and the master (which places a workload only on hosts whose reported size can
hold it). A rental of ``g`` GPUs on a host of ``G`` gets ``g / G`` of what the host has less what its
provider reserves for the host itself (``HostSize``); a share (``gpu_milli``) or a MIG slice counts as
its fraction; a host that reports no GPU gives every rental ``NO_GPU_FRACTION`` of it. Never more than
the host has, never less than a floor that still starts a shell (``DEFAULT_FLOORS``), when the host has
that much.

Refusals (``exceeded``): a ``pids_limit`` above the rental's share of the host's ``pid_max`` less the
reserve (its neighbours' process slots), CPU or memory above the host's size, or disk above the largest
quota the host gives one rental.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal

DEFAULT_RESERVED_CPU_CORES: Final = 0.5
DEFAULT_RESERVED_MEMORY_MIB: Final = 1024
DEFAULT_RESERVED_PIDS: Final = 2048
DEFAULT_RESERVED_DISK_GIB: Final = 20
DEFAULT_RENTAL_DISK_GIB: Final = 10
NO_GPU_FRACTION: Final = 0.125  # a host with no GPU (or a rental of none): an eighth of it
MIG_SLICES: Final = 7  # compute slices of a MIG-capable GPU ("1g.10gb" is one of seven)
KERNEL_PID_MAX: Final = 1 << 22  # the most /proc/sys/kernel/pid_max can be on 64-bit Linux

CeilingField = Literal["cpu_cores", "memory_mib", "pids_limit", "disk_gib"]


@dataclass(frozen=True, slots=True)
class Floors:
    """The least a derived ceiling is (when the host has that much): enough to start a shell and a few tools."""

    cpu_cores: float = 1.0
    memory_mib: int = 256
    pids_limit: int = 256
    disk_gib: int = 1


DEFAULT_FLOORS: Final = Floors()


@dataclass(frozen=True, slots=True)
class HostSize:
    """What a host has and what its provider keeps for the host itself (never given to a rental).

    ``max_disk_gib`` is the largest disk quota one rental may have (``None``: this host sets no disk
    quota, so it refuses none either); ``disk_gib`` is the per-rental default where the renter names none.
    """

    cpu_cores: float
    memory_mib: int
    pid_max: int
    reserved_cpu_cores: float = 0.0
    reserved_memory_mib: int = 0
    reserved_pids: int = 0
    max_disk_gib: int | None = None
    disk_gib: int = DEFAULT_RENTAL_DISK_GIB

    @property
    def usable_cpu_cores(self) -> float:
        return max(0.01, self.cpu_cores - self.reserved_cpu_cores)

    @property
    def usable_memory_mib(self) -> int:
        return max(16, self.memory_mib - self.reserved_memory_mib)

    @property
    def usable_pids(self) -> int:
        return max(16, self.pid_max - self.reserved_pids)


@dataclass(frozen=True, slots=True)
class Ceilings:
    """One rental's limits, every one set (``disk_gib`` is ``None`` only where the host sets no disk quota)."""

    cpu_cores: float
    memory_mib: int
    pids_limit: int
    disk_gib: int | None


def rental_fraction(gpus: float, host_gpus: int) -> float:
    """The rental's part of its host: ``gpus`` (whole GPUs, or a share's or MIG slice's fraction) of ``host_gpus``."""
    if host_gpus <= 0 or gpus <= 0:
        return NO_GPU_FRACTION
    return min(1.0, gpus / host_gpus)


def share_of(host: HostSize, fraction: float, *, floors: Floors = DEFAULT_FLOORS) -> Ceilings:
    """The ceilings of a rental that names none: ``fraction`` of what the host gives rentals, at least the floors."""
    cpu = min(host.usable_cpu_cores, max(floors.cpu_cores, math.floor(fraction * host.usable_cpu_cores * 100) / 100))
    memory = min(host.usable_memory_mib, max(floors.memory_mib, int(fraction * host.usable_memory_mib)))
    disk = None if host.max_disk_gib is None else min(host.max_disk_gib, max(floors.disk_gib, host.disk_gib))
    return Ceilings(cpu_cores=cpu, memory_mib=memory, pids_limit=pids_allowed(host, fraction, floors=floors), disk_gib=disk)


def pids_allowed(host: HostSize, fraction: float, *, floors: Floors = DEFAULT_FLOORS) -> int:
    """The most processes a rental of ``fraction`` may run: its share of ``pid_max`` less the host's reserve."""
    return min(host.usable_pids, max(floors.pids_limit, int(fraction * host.usable_pids)))


def allowed(host: HostSize, fraction: float, name: CeilingField) -> float | int | None:
    """The most a rental of ``fraction`` may ask for of ``name`` here (``None``: no bound this host can say)."""
    if name == "cpu_cores":
        return host.cpu_cores  # the reserve shapes the defaults; a renter who asks may have the whole host
    if name == "memory_mib":
        return host.memory_mib
    if name == "pids_limit":
        return pids_allowed(host, fraction)
    return host.max_disk_gib


UNITS: Final[dict[CeilingField, str]] = {"cpu_cores": "CPU cores", "memory_mib": "MiB of memory", "pids_limit": "processes", "disk_gib": "GiB of disk"}


def exceeded(
    host: HostSize, fraction: float, *, cpu_cores: float | None = None, memory_mib: int | None = None,
    pids_limit: int | None = None, disk_gib: int | None = None,
) -> tuple[CeilingField, float, float] | None:
    """The first limit asked for that the host cannot give a rental of ``fraction``: (field, asked, the most allowed); None: all fit."""
    asked: dict[CeilingField, float | None] = {
        "cpu_cores": cpu_cores, "memory_mib": memory_mib, "pids_limit": pids_limit, "disk_gib": disk_gib,
    }
    for name, value in asked.items():
        most = allowed(host, fraction, name)
        if value is not None and most is not None and value > most:
            return name, value, most
    return None


def describe(name: CeilingField, asked: float, most: float) -> str:
    """``workload.pids_limit 4194304 is more than this host allows (at most 4064 processes)``."""
    return f"workload.{name} {asked:g} is more than the host allows a rental of this size (at most {most:g} {UNITS[name]})"
