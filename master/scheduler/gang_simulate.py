"""Replaying a trace with clusters in it: gang placement against placing a cluster's nodes one at a time.

The trace has no clusters, so some of its tasks become ones: every task asking for an even number
``N ≥ 2`` of whole GPUs becomes, with probability ``share`` (seeded), a cluster of **2 nodes of N/2
GPUs each** (the 8-GPU tasks become 2 × 4 GPUs, the 4-GPU ones 2 × 2, the 2-GPU ones 2 × 1), each node
with half the task's CPU and memory and the task's GPU models; the demand is unchanged. The trace's
hosts have no region either: each is given one of ``regions`` regions (``r0`` …), drawn with the seed.

The workload is step 1 of ``master.scheduler.simulate`` (the trace topped up to ``inflate`` × the
capacity and shuffled, with the same seed); tasks are placed in that order, nothing is released, and
the replay stops when arrived GPU demand reaches ``stop_at_pct`` % of the capacity. Plain tasks go
through the placer as in ``simulate``; a cluster, by ``mode``:

* ``gang`` — :func:`master.scheduler.gang.place_gang` (one model, one region when any has room);
* ``one_at_a_time`` — the plain placer places node 1 anywhere, then each next node on a host not used
  yet with the first one's model (regions ignored); when one does not fit, the nodes already placed
  are released (rolled back) and the cluster fails.

Both modes share the algorithm, seed, regions and workload, so their results differ only by how
clusters are placed. Deterministic.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from master.scheduler.fleet import MILLI, Fleet, Node, Placement, Request
from master.scheduler.fragmentation import FragModel, Workload
from master.scheduler.gang import place_gang
from master.scheduler.placers.base import Placer
from master.scheduler.placers.fgd import Fgd
from master.scheduler.registry import get_placer
from master.scheduler.simulate import arrivals, fresh_node
from master.scheduler.trace import TraceNode
from shared.errors import ValidationFailed

Mode = Literal["gang", "one_at_a_time"]
MODES: tuple[Mode, ...] = ("gang", "one_at_a_time")
CLUSTER_NODES = 2  # every cluster made from a trace task has two nodes


@dataclass(frozen=True, slots=True)
class Cluster:
    """``count`` nodes of ``member`` each, on distinct hosts."""

    member: Request
    count: int

    @property
    def gpu_milli_total(self) -> int:
        return self.count * self.member.gpu_milli_total


Task = Request | Cluster


@dataclass(slots=True)
class ClusterResult:
    mode: str
    algorithm: str
    seed: int
    nodes: int
    gpus: int
    regions: int
    tasks: int = 0  # plain tasks arrived
    tasks_placed: int = 0
    clusters: int = 0  # clusters arrived
    clusters_placed: int = 0
    clusters_split: int = 0  # placed across more than one region
    allocated_pct: float = 0.0  # GPU milli in use / capacity when the replay stopped
    fragmented_pct: float = 0.0  # FGD's fragmentation amount / capacity then
    cluster_gpus: int = 0  # GPUs the placed clusters hold

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def with_clusters(queue: Sequence[Request], *, share: float, seed: int) -> list[Task]:
    """``queue`` with the tasks the module docstring says turned into clusters (``share`` of them, seeded)."""
    if not 0 <= share <= 1:
        raise ValidationFailed(f"share must be 0..1, not {share}")
    rng = random.Random(seed)
    tasks: list[Task] = []
    for request in queue:
        whole = request.gpu_milli == MILLI and request.mig_profile is None
        if whole and request.num_gpu >= 2 and request.num_gpu % 2 == 0 and rng.random() < share:
            member = replace(
                request,
                num_gpu=request.num_gpu // CLUSTER_NODES,
                cpu_milli=request.cpu_milli // CLUSTER_NODES,
                memory_mib=request.memory_mib // CLUSTER_NODES,
            )
            tasks.append(Cluster(member, CLUSTER_NODES))
        else:
            tasks.append(request)
    return tasks


def simulate_clusters(
    nodes: Sequence[TraceNode | Node],
    pods: Sequence[Request],
    *,
    algorithm: str,
    mode: Mode,
    share: float = 1.0,
    regions: int = 4,
    inflate: float = 1.3,
    seed: int = 42,
    stop_at_pct: float = 100.0,
    workload: Workload | None = None,
) -> ClusterResult:
    """Run the replay of the module docstring in ``mode``."""
    if mode not in MODES:
        raise ValidationFailed(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    if regions < 1:
        raise ValidationFailed(f"regions must be at least 1, not {regions}")
    region_rng = random.Random(seed)
    fresh = []
    for node in nodes:
        copy = fresh_node(node)
        copy.region = f"r{region_rng.randrange(regions)}"
        fresh.append(copy)
    fleet = Fleet(fresh)
    capacity = sum(node.gpu_milli_capacity for node in fleet)
    if capacity == 0:
        raise ValidationFailed("the nodes have no GPUs")
    workload = workload if workload is not None else Workload.from_requests(pods)
    placer = get_placer(algorithm, seed=seed, workload=workload)
    # A second instance for the placements over a part of the fleet, so ``placer`` keeps its scores.
    side_placer = get_placer(algorithm, seed=seed, workload=workload)
    # The metric is against the trace's workload for every placer (fgd_plus measures against its own).
    frag_model = FragModel.shared(workload)
    if isinstance(placer, Fgd) and placer.frag_model.workload is workload:
        frag_model = placer.frag_model
    tasks = with_clusters(arrivals(pods, capacity, inflate=inflate, seed=seed), share=share, seed=seed + 1)
    result = ClusterResult(mode, algorithm, seed, len(fleet), capacity // MILLI, regions)

    node_frag = [frag_model.node_frag(node) for node in fleet]
    state = {"used": 0, "frag": sum(node_frag)}

    def changed(placement: Placement, sign: int) -> None:
        state["used"] += sign * placement.gpu_milli * len(placement.gpu_indices)
        position = placement.node_index
        after = frag_model.node_frag(fleet[position])
        state["frag"] += after - node_frag[position]
        node_frag[position] = after

    arrived = 0
    stop = stop_at_pct * capacity / 100
    for task in tasks:
        if isinstance(task, Cluster):
            result.clusters += 1
            if mode == "gang":
                placements = place_gang(task.member, task.count, fleet, placer=side_placer)
                for member in placements or ():
                    fleet.apply(member)
                    changed(member, +1)
            else:
                placements = place_one_at_a_time(task, fleet, placer, side_placer, changed)
            if placements is not None:
                result.clusters_placed += 1
                result.cluster_gpus += task.count * task.member.num_gpu
                result.clusters_split += int(len({fleet[p.node_index].region for p in placements}) > 1)
        else:
            result.tasks += 1
            single = placer.place(task, fleet)
            if single is not None:
                fleet.apply(single)
                changed(single, +1)
                result.tasks_placed += 1
        arrived += task.gpu_milli_total
        if arrived >= stop:
            break
    result.allocated_pct = round(100 * state["used"] / capacity, 4)
    result.fragmented_pct = round(100 * state["frag"] / capacity, 4)
    return result


def place_one_at_a_time(
    cluster: Cluster,
    fleet: Fleet,
    placer: Placer,
    side_placer: Placer,
    changed: Callable[[Placement, int], None],
) -> list[Placement] | None:
    """The cluster's nodes one at a time with the plain placer, rolled back when one does not fit; applied to
    ``fleet`` (``changed(placement, ±1)`` after each apply and release). ``side_placer``, another instance
    of the algorithm, chooses among the hosts not used yet when ``placer``'s favourite is one of them."""
    placements: list[Placement] = []
    used: set[int] = set()
    member = cluster.member
    for _ in range(cluster.count):
        placement = placer.place(member, fleet)
        if placement is not None and placement.node_index in used:
            # The placer's favourite already holds a node of this cluster: its choice among the other hosts.
            others = [position for position in range(len(fleet)) if position not in used]
            elsewhere = side_placer.place(member, [fleet[position] for position in others])
            placement = (
                None if elsewhere is None else replace(elsewhere, node_index=others[elsewhere.node_index])
            )
        if placement is None:
            for placed in reversed(placements):
                fleet.release(placed)
                changed(placed, -1)
            return None
        fleet.apply(placement)
        changed(placement, +1)
        placements.append(placement)
        used.add(placement.node_index)
        member = replace(cluster.member, gpu_models=frozenset({fleet[placement.node_index].model}))
    return placements


__all__ = [
    "CLUSTER_NODES", "MODES", "Cluster", "ClusterResult", "Mode", "place_one_at_a_time", "simulate_clusters",
    "with_clusters",
]  # fmt: skip
