"""What every runtime shares: the ``Workload`` record, the ``Runtime`` interface, rental ids.

A runtime starts one kind of workload (``hold``, ``process``, ``container``); the manager
(``agent.runtimes.manager``) owns everything after the start — watching, stopping, the
registry — through the ``Workload`` the runtime returned.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from agent.runtimes.cgroups import Placement
from shared.errors import BadRequest
from shared.protocol import RENTAL_ID_PATTERN, GpuShare

WorkloadKind = Literal["hold", "process", "container"]

ExitCallback = Callable[[str, int | None], Awaitable[None]]
"""``on_exit(rental_id, exit_code)``; ``exit_code`` is ``-N`` when signal N ended it, ``None`` when unknown."""

_RENTAL_ID_RE = re.compile(RENTAL_ID_PATTERN)

SpecT_contra = TypeVar("SpecT_contra", contravariant=True)


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


def host_capacity() -> tuple[float, int]:
    """This host's logical CPUs and RAM (MiB): the most one workload may ask for."""
    return float(os.cpu_count() or 1), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)


def check_rental_id(rental_id: str) -> None:
    # The id names a folder, a cgroup, a unit and a container: keep it to safe characters.
    if not isinstance(rental_id, str) or not _RENTAL_ID_RE.fullmatch(rental_id):
        raise BadRequest(f"rental id {rental_id!r} must be 1-64 letters, digits, '.', '_' or '-'", code="bad_rental_id")



class WorkloadHandle(Protocol):
    """What the manager watches a workload through: ``pids.ProcessHandle`` (a process) or
    ``container.ContainerHandle`` (a container, through the engine)."""

    @property
    def exited(self) -> bool: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self, timeout: float | None) -> bool: ...

    def close(self) -> None: ...


@dataclass(eq=False)
class Workload:
    """One rental's workload as the manager tracks it (and records in ``workloads.json``)."""

    rental_id: str
    kind: WorkloadKind
    gpu_uuids: list[str]
    started_at: str
    pid: int | None = None  # also the process group and session id
    start_time: int | None = None
    placement: Placement = field(default_factory=Placement)
    container: tuple[str, str] | None = None  # (engine's container id, container name)
    share: GpuShare | None = None  # a fraction of its one GPU; None: its GPUs whole
    disk_gib: int | None = None  # its disk quota (a container's writable layer is watched against it)
    handle: WorkloadHandle | None = None
    watcher: asyncio.Task[None] | None = None
    stop_task: asyncio.Task[dict[str, Any]] | None = None

    def to_record(self) -> dict[str, Any]:
        return {
            "rental_id": self.rental_id,
            "kind": self.kind,
            "gpu_uuids": self.gpu_uuids,
            "started_at": self.started_at,
            "pid": self.pid,
            "start_time": self.start_time,
            "cgroup_dirs": [str(d) for d in self.placement.cgroup_dirs],
            "systemd_unit": self.placement.unit,
            "container": None if self.container is None else {"id": self.container[0], "name": self.container[1]},
            "share": None if self.share is None else self.share.model_dump(),
            "disk_gib": self.disk_gib,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Workload:
        rental_id, kind, pid, start_time = record["rental_id"], record["kind"], record["pid"], record["start_time"]
        check_rental_id(rental_id)
        if kind not in ("hold", "process", "container"):
            raise ValueError(f"unknown kind {kind!r}")
        container = record.get("container")
        # A process has a pid; a hold has none; a container is watched through the engine (no pid).
        if (kind == "process") != (pid is not None) or not isinstance(pid, int | None) or not isinstance(start_time, int | None):
            raise ValueError("pid and start_time do not fit the kind")
        if kind == "container" and not container:
            raise ValueError("a container workload names its container")
        gpu_uuids = [str(u) for u in record["gpu_uuids"]]
        raw_share = record.get("share")  # absent in records written before shares
        share = None if raw_share is None else GpuShare.model_validate(raw_share)
        if share is not None and len(gpu_uuids) != 1:
            raise ValueError("a GPU share names exactly one GPU")
        return cls(
            rental_id=rental_id,
            kind=kind,
            gpu_uuids=gpu_uuids,
            started_at=str(record.get("started_at", "")),
            pid=pid,
            start_time=start_time,
            placement=Placement(cgroup_dirs=tuple(Path(d) for d in record.get("cgroup_dirs") or ()), unit=record.get("systemd_unit")),
            container=None if not container else (str(container.get("id") or ""), str(container["name"])),
            share=share,
            disk_gib=record.get("disk_gib") if isinstance(record.get("disk_gib"), int) else None,
        )


@dataclass(frozen=True, slots=True)
class RentalAccess:
    """What a login into a running workload reaches (``WorkloadManager.access``): its kind and where it runs.

    ``running`` is ``False`` once its stop began or its process ended: only its files remain.
    ``uid``/``gid``/``home``: a process rental's own user (``None`` when it runs as the agent's).
    """

    rental_id: str
    kind: WorkloadKind
    running: bool
    gpu_uuids: tuple[str, ...] = ()
    container_id: str | None = None
    uid: int | None = None
    gid: int | None = None
    home: Path | None = None
    cgroup_dirs: tuple[Path, ...] = ()

    @classmethod
    def of(cls, workload: Workload, user: tuple[int, int, Path] | None) -> RentalAccess:
        """The access of ``workload``, a process rental's ``user`` its (uid, gid, home)."""
        ended = workload.stop_task is not None or (workload.handle is not None and workload.handle.exited)
        uid, gid, home = (None, None, None) if user is None else user
        return cls(
            workload.rental_id, workload.kind, running=not ended, gpu_uuids=tuple(workload.gpu_uuids),
            container_id=workload.container[0] if workload.container else None, uid=uid, gid=gid, home=home,
            cgroup_dirs=workload.placement.cgroup_dirs,
        )


class Runtime(Protocol[SpecT_contra]):
    """Starts one kind of workload on the host itself (``hold``, ``process``).

    The container runtime (``agent.runtimes.container.ContainerRuntime``) has the same
    ``remove`` but its own ``prepare(rental_id, spec)`` and an ``async start``: it waits on the
    engine, and the manager reserves the rental's GPUs meanwhile.

    ``prepare`` may wait (asking docker whether it runs) and must be safe to cancel; ``start``
    does not wait, so a start is all-or-nothing under the manager's checks; ``remove`` takes
    away what the runtime made beyond the workload's process group and cgroup.
    """

    async def prepare(self, spec: SpecT_contra) -> None: ...

    def start(
        self, rental_id: str, gpus: list[str], spec: SpecT_contra, share: GpuShare | None
    ) -> tuple[Workload, dict[str, Any]]: ...

    async def remove(self, workload: Workload) -> None: ...
