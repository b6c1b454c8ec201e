"""The agent's side of every rental's ceilings (``shared.ceilings``): this host's size, how it bounds disk,
and each start's limits resolved from what the renter named and the rental's share of the host.

``CeilingPolicy.detect`` reads the host (logical CPUs, RAM, ``/proc/sys/kernel/pid_max``, the free space
under the agent's data dir) and chooses the disk quota: ``loop`` (``agent.runtimes.diskquota``) where the
agent is root with ``mkfs.ext4`` and loop devices, else ``none``; the container runtime upgrades a
container's writable layer to ``storage_opt`` where its engine's storage driver enforces
``--storage-opt size`` (``ContainerRuntime.facts``). ``resolve`` refuses a limit the host cannot give
(``limits_exceed_host``, naming the field) and fills in the rest from the rental's share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from agent.gpu.base import GpuInfo
from agent.runtimes.base import host_capacity
from agent.runtimes.diskquota import LoopDisks, LoopTools, detect_loop_disks, free_gib
from shared.ceilings import (
    DEFAULT_RENTAL_DISK_GIB,
    DEFAULT_RESERVED_CPU_CORES,
    DEFAULT_RESERVED_DISK_GIB,
    DEFAULT_RESERVED_MEMORY_MIB,
    DEFAULT_RESERVED_PIDS,
    KERNEL_PID_MAX,
    MIG_SLICES,
    UNITS,
    Ceilings,
    HostSize,
    exceeded,
    rental_fraction,
    share_of,
)
from shared.errors import BadRequest, ConfigError
from shared.protocol import MILLI_PER_GPU, ContainerWorkload, GpuShare, IsolationFacts, ProcessWorkload

DiskQuota = Literal["storage_opt", "loop", "none"]


def host_pid_max(path: Path = Path("/proc/sys/kernel/pid_max")) -> int:
    """The kernel's ``pid_max`` (the most process ids at once, threads included)."""
    try:
        return max(16, min(KERNEL_PID_MAX, int(path.read_text().strip())))
    except (OSError, ValueError):
        return 32768  # the kernel's default


@dataclass(frozen=True, slots=True)
class CeilingPolicy:
    """This host's size and reserves, how it bounds disk, and the container runtime's caps on derived defaults."""

    host: HostSize
    disk_quota: DiskQuota = "none"
    disks: LoopDisks | None = None  # set when disk_quota is "loop" or "storage_opt" (/workspace and homes)
    disk_reason: str = ""  # why there is no disk quota, when there is none
    reserved_disk_gib: int = 0
    container_pids_limit: int | None = None  # a container's derived pids limit is at most this
    container_memory_mib: int | None = None  # a container's derived memory is at most this

    def __post_init__(self) -> None:
        if (self.disks is None) != (self.disk_quota == "none"):
            raise ConfigError("a disk quota needs its loop disks, and loop disks a disk quota")

    @classmethod
    def detect(
        cls, work_dir: Path, *,
        reserved_cpu_cores: float = DEFAULT_RESERVED_CPU_CORES, reserved_memory_mib: int = DEFAULT_RESERVED_MEMORY_MIB,
        reserved_pids: int = DEFAULT_RESERVED_PIDS, reserved_disk_gib: int = DEFAULT_RESERVED_DISK_GIB,
        rental_disk_gib: int = DEFAULT_RENTAL_DISK_GIB, disk_quota: bool = True,
        container_pids_limit: int | None = None, container_memory_mib: int | None = None,
        loop_tools: LoopTools | str | None = None,
    ) -> CeilingPolicy:
        """The policy for this host, with the provider's reserves; ``disk_quota=False`` turns disk quotas off."""
        cores, memory = host_capacity()
        tools = (detect_loop_disks() if loop_tools is None else loop_tools) if disk_quota else "disk quotas are off (disk_quota = false)"
        max_disk = max(1, free_gib(work_dir) - reserved_disk_gib)
        host = HostSize(
            cpu_cores=cores, memory_mib=memory, pid_max=host_pid_max(), reserved_cpu_cores=min(reserved_cpu_cores, cores / 2),
            reserved_memory_mib=min(reserved_memory_mib, memory // 2), reserved_pids=reserved_pids,
            max_disk_gib=None if isinstance(tools, str) else max_disk, disk_gib=min(rental_disk_gib, max_disk),
        )
        if isinstance(tools, str):
            return cls(host, disk_reason=tools, reserved_disk_gib=reserved_disk_gib,
                       container_pids_limit=container_pids_limit, container_memory_mib=container_memory_mib)  # fmt: skip
        return cls(host, "loop", LoopDisks(work_dir, tools), reserved_disk_gib=reserved_disk_gib,
                   container_pids_limit=container_pids_limit, container_memory_mib=container_memory_mib)  # fmt: skip

    def with_storage_opt(self, supported: bool) -> CeilingPolicy:
        """The same policy once the container engine said whether it enforces ``--storage-opt size``."""
        if self.disks is None:
            return self
        return replace(self, disk_quota="storage_opt" if supported else "loop")

    def fraction(self, gpu_uuids: Sequence[str], share: GpuShare | None, gpus: Sequence[GpuInfo]) -> float:
        """The rental's part of this host: whole GPUs, a share's thousandths, a MIG instance's slices (or memory) of its GPU."""
        rented = 0.0
        mig = {m.uuid: (m, g) for g in gpus for m in g.mig_instances}
        for gpu_uuid in gpu_uuids:
            if share is not None:
                rented += share.milli / MILLI_PER_GPU
            elif gpu_uuid in mig:
                instance, parent = mig[gpu_uuid]
                slices = instance.profile.split("g", 1)[0] if instance.profile else ""
                if slices.isdigit():
                    rented += min(1.0, int(slices) / MIG_SLICES)
                elif instance.memory_total_mib and parent.memory_total_mib:
                    rented += min(1.0, instance.memory_total_mib / parent.memory_total_mib)
                else:
                    rented += 1 / MIG_SLICES
            else:
                rented += 1.0
        return rental_fraction(rented, len(gpus))

    def resolve(self, spec: ContainerWorkload | ProcessWorkload, fraction: float) -> Ceilings:
        """The workload's ceilings: what it named, checked against the host (``limits_exceed_host``), else its share."""
        over = exceeded(self.host, fraction, cpu_cores=spec.cpu_cores, memory_mib=spec.memory_mib, pids_limit=spec.pids_limit,
                        disk_gib=spec.disk_gib)  # fmt: skip
        if over is not None:
            name, asked, most = over
            has = {"cpu_cores": self.host.cpu_cores, "memory_mib": self.host.memory_mib, "pids_limit": self.host.pid_max}.get(name)
            whole = f"this host has {has:g}" if has is not None else "this host's disk allows"
            if name == "pids_limit":
                whole = f"this host's pid_max is {self.host.pid_max}, of which a rental of {fraction:.3g} of its GPUs gets its share"
            raise BadRequest(
                f"workload.{name}: the workload asks for {asked:g} {UNITS[name]}, but {whole}: at most {most:g}; ask for less",
                code="limits_exceed_host", details={"problems": [{"field": f"workload.{name}", "problem": f"at most {most:g}"}]},
            )
        if spec.disk_gib is not None and self.host.max_disk_gib is None:
            raise BadRequest(
                f"workload.disk_gib: this host sets no disk quota ({self.disk_reason}); leave disk_gib out or choose another host",
                code="limits_exceed_host", details={"problems": [{"field": "workload.disk_gib", "problem": "no disk quota on this host"}]},
            )
        derived = share_of(self.host, fraction)
        pids, memory = derived.pids_limit, derived.memory_mib
        if isinstance(spec, ContainerWorkload):
            pids = min(pids, self.container_pids_limit or pids)
            memory = min(memory, self.container_memory_mib or memory)
        return Ceilings(
            cpu_cores=spec.cpu_cores if spec.cpu_cores is not None else derived.cpu_cores,
            memory_mib=spec.memory_mib if spec.memory_mib is not None else memory,
            pids_limit=spec.pids_limit if spec.pids_limit is not None else pids,
            disk_gib=None if derived.disk_gib is None else (spec.disk_gib or derived.disk_gib),
        )


def with_ceilings(facts: IsolationFacts, policy: CeilingPolicy) -> IsolationFacts:
    """``facts`` saying what the master needs to place within ``policy``: the host's size, its reserves, its disk quota."""
    host = policy.host
    return facts.model_copy(update={
        "max_cpu_cores": host.cpu_cores, "max_memory_mib": host.memory_mib, "pid_max": host.pid_max,
        "reserved_cpu_cores": host.reserved_cpu_cores, "reserved_memory_mib": host.reserved_memory_mib,
        "reserved_pids": host.reserved_pids, "reserved_disk_gib": policy.reserved_disk_gib, "disk_quota": policy.disk_quota,
        "max_disk_gib": host.max_disk_gib, "rental_disk_gib": None if host.max_disk_gib is None else host.disk_gib,
    })  # fmt: skip
