"""Which GPUs a workload may take, and what simulated GPUs show as busy.

A workload sees only its GPUs (or MIG instances) and needs them unheld, or holds a ``GpuShare`` of
exactly one, several shares fitting in one GPU while their thousandths sum to at most 1000 and their
memory to at most the GPU's. The manager (``agent.runtimes.manager``) asks ``check_gpus`` before a
start, with every workload that runs, stops or is still starting as a holder.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from agent.gpu.base import GpuBackend
from agent.gpu.sim import SimulatedBackend
from agent.runtimes.base import Workload
from shared.errors import BadRequest, Conflict
from shared.protocol import MILLI_PER_GPU, GpuShare

_MIG_RE = re.compile(r"^MIG-(?:GPU-[0-9a-f-]{36}/\d+/\d+|[0-9a-f-]{36})$", re.IGNORECASE)


def check_gpus(backend: GpuBackend, held: Iterable[Workload], gpu_uuids: Sequence[str], share: GpuShare | None) -> list[str]:
    """The GPUs, checked to be on this host and free of the ``held`` workloads' (whole, or room for ``share``)."""
    if not isinstance(gpu_uuids, list | tuple) or not all(isinstance(u, str) for u in gpu_uuids):
        raise BadRequest("gpu_uuids must be a list of GPU UUIDs", code="bad_gpu_uuids")
    if len(set(gpu_uuids)) != len(gpu_uuids):
        raise BadRequest("gpu_uuids names a GPU twice", code="bad_gpu_uuids")
    if share is not None and len(gpu_uuids) != 1:
        raise BadRequest(f"a GPU share is a fraction of exactly one GPU, but gpu_uuids names {len(gpu_uuids)}", code="bad_gpu_share")
    infos = backend.gpus()
    memory: dict[str, int | None] = {g.uuid: g.memory_total_mib for g in infos}
    memory.update({m.uuid: m.memory_total_mib for g in infos for m in g.mig_instances})
    # The backend lists physical GPUs only; MIG instances are taken on a MIG-enabled host by their form.
    mig = any(g.mig_mode for g in infos)
    unknown = [u for u in gpu_uuids if u not in memory and not (mig and _MIG_RE.fullmatch(u))]
    if unknown:
        raise BadRequest(f"GPU(s) {', '.join(unknown)} are not on this host", code="gpu_not_found")
    holders: dict[str, list[Workload]] = {}
    for workload in held:
        for gpu_uuid in workload.gpu_uuids:
            holders.setdefault(gpu_uuid, []).append(workload)
    if share is None:
        taken = [f"{u} ({holder_names(holders[u])})" for u in gpu_uuids if u in holders]
        if taken:
            raise Conflict(f"GPU(s) {', '.join(taken)} already serve another rental; stop it first", code="gpu_in_use")
        return list(gpu_uuids)
    (gpu_uuid,) = gpu_uuids
    total_mib = memory.get(gpu_uuid)
    if total_mib is not None and share.memory_mib > total_mib:
        raise BadRequest(f"the share asks for {share.memory_mib} MiB, but GPU {gpu_uuid} has {total_mib} MiB", code="bad_gpu_share")
    sharing = holders.get(gpu_uuid, [])
    if any(w.share is None for w in sharing):
        raise Conflict(f"GPU {gpu_uuid} serves {holder_names(sharing)} whole; a share cannot join it", code="gpu_in_use")
    milli = sum(w.share.milli for w in sharing if w.share is not None) + share.milli
    memory_mib = sum(w.share.memory_mib for w in sharing if w.share is not None) + share.memory_mib
    if milli > MILLI_PER_GPU:
        raise Conflict(
            f"GPU {gpu_uuid} has {MILLI_PER_GPU + share.milli - milli}/{MILLI_PER_GPU} left, not the {share.milli} asked for: "
            f"{holder_names(sharing)} hold the rest",
            code="gpu_in_use",
        )
    if total_mib is not None and memory_mib > total_mib:
        raise Conflict(
            f"GPU {gpu_uuid} has {total_mib + share.memory_mib - memory_mib} MiB left, not the {share.memory_mib} MiB asked for: "
            f"{holder_names(sharing)} hold the rest",
            code="gpu_in_use",
        )
    return [gpu_uuid]


def holder_names(workloads: Sequence[Workload]) -> str:
    """``rental r-1 (250/1000)`` for each holder of a GPU: who to stop, and how much each holds."""
    return ", ".join(
        f"rental {w.rental_id}" + ("" if w.share is None else f" ({w.share.milli}/{MILLI_PER_GPU})")
        for w in sorted(workloads, key=lambda w: w.rental_id)
    )


def show_load(backend: GpuBackend, running: Iterable[Workload]) -> None:
    """Show on simulated GPUs what runs now: each running workload's GPUs or MIG instances, wholly or by its
    share's milli. A hold runs nothing, and a workload still starting (an image pulling) nothing yet."""
    if not isinstance(backend, SimulatedBackend):
        return
    infos = backend.gpus()
    known = {g.uuid for g in infos} | {m.uuid for g in infos for m in g.mig_instances}
    loads: dict[str, list[float]] = {}
    for workload in running:
        if workload.kind == "hold":
            continue
        fraction = 1.0 if workload.share is None else workload.share.milli / MILLI_PER_GPU
        for gpu_uuid in workload.gpu_uuids:
            if gpu_uuid in known:
                loads.setdefault(gpu_uuid, []).append(fraction)
    backend.set_loads(loads)
