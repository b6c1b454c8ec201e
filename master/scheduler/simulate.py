"""Replaying a cluster trace through the placers, as the FGD paper's simulator does.

The protocol (Weng et al., USENIX ATC 2023, and their kubernetes-scheduler-simulator):

1. **Workload.** Start from the trace's pods. While their GPU demand is below
   ``inflate`` × the cluster's GPU capacity, append a copy of a random trace pod; then
   shuffle them all with the seed. (A trace whose demand already exceeds the target is
   shuffled and cut where the demand reaches it.)
2. **Place one pod at a time** with the chosen placer, the same ``Placer`` code the
   master uses. A pod nothing can take fails and is dropped; nothing is ever released.
3. **Measure** after each whole percent of *arrived* GPU demand (placed or not, as a
   share of capacity): ``allocated_pct`` = GPU milli in use / total GPU milli, and
   ``fragmented_pct`` = Σ over nodes of FGD's expected fragmentation against the
   target workload / total GPU milli (the paper's *fragmentation amount*; as in the
   artifact, CPU-only task types count a node's whole idle GPU as fragment to them).
   ``power_w`` = the datacenter's power draw under ``master.scheduler.power`` (every host on, each GPU linear
   from idle to its board power in its allocated share, CPUs likewise per vCPU).

The target workload is the trace's own pods: their most popular shapes covering
95 % (``Workload.from_requests``) — what FGD optimises against and what the
fragmentation metric measures against, for every algorithm alike.

Deterministic: the same trace, algorithm and seed give the same result.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from master.scheduler.fleet import MILLI, Fleet, Gpu, Node, Request
from master.scheduler.fragmentation import FragModel, Workload
from master.scheduler.placers.fgd import Fgd
from master.scheduler.power import TRACE_POWER, PowerModel
from master.scheduler.registry import get_placer
from master.scheduler.trace import TraceNode
from shared.errors import ValidationFailed

Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class CurvePoint:
    arrived_pct: int
    allocated_pct: float
    fragmented_pct: float
    power_w: float = 0.0


@dataclass(slots=True)
class SimulationResult:
    algorithm: str
    seed: int
    nodes: int
    gpus: int
    pods: int  # arriving pods in the inflated workload
    placed: int = 0
    failed: int = 0
    curve: list[CurvePoint] = field(default_factory=list)

    def allocated_at(self, arrived_pct: int) -> float | None:
        """GPU allocation % when arrived demand first reached ``arrived_pct`` % (None if it never did)."""
        for point in self.curve:
            if point.arrived_pct == arrived_pct:
                return point.allocated_pct
        return None

    def fragmented_at(self, arrived_pct: int) -> float | None:
        for point in self.curve:
            if point.arrived_pct == arrived_pct:
                return point.fragmented_pct
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm,
            "seed": self.seed,
            "nodes": self.nodes,
            "gpus": self.gpus,
            "pods": self.pods,
            "placed": self.placed,
            "failed": self.failed,
            "curve": [
                {
                    "arrived_pct": p.arrived_pct,
                    "allocated_pct": p.allocated_pct,
                    "fragmented_pct": p.fragmented_pct,
                    "power_w": p.power_w,
                }
                for p in self.curve
            ],
        }

    def power_at(self, arrived_pct: int) -> float | None:
        """The datacenter's watts when arrived demand first reached ``arrived_pct`` % (None if it never did)."""
        for point in self.curve:
            if point.arrived_pct == arrived_pct:
                return point.power_w
        return None


def arrivals(pods: Sequence[Request], capacity_milli: int, *, inflate: float, seed: int) -> list[Request]:
    """The workload of step 1: the trace's pods topped up (or cut) to ``inflate`` × capacity, shuffled."""
    if inflate <= 0:
        raise ValidationFailed(f"inflate must be above 0, not {inflate}")
    if not pods:
        raise ValidationFailed("there are no pods to replay")
    rng = random.Random(seed)
    target = inflate * capacity_milli
    demand = sum(pod.gpu_milli_total for pod in pods)
    workload = list(pods)
    if demand < target:
        if not any(pod.gpu_milli_total for pod in pods):
            raise ValidationFailed("no pod asks for a GPU, so the demand can never reach the target")
        while demand < target:
            pod = rng.choice(pods)
            workload.append(pod)
            demand += pod.gpu_milli_total
        rng.shuffle(workload)
        return workload
    rng.shuffle(workload)
    if demand > target:
        cumulative = 0
        for cut, pod in enumerate(workload, start=1):
            cumulative += pod.gpu_milli_total
            if cumulative >= target:
                return workload[:cut]
    return workload


def simulate(
    nodes: Sequence[TraceNode | Node],
    pods: Sequence[Request],
    *,
    algorithm: str,
    inflate: float = 1.3,
    seed: int = 42,
    stop_at_pct: float | None = None,
    workload: Workload | None = None,
    power: PowerModel = TRACE_POWER,
    progress: Progress | None = None,
    progress_every: int = 200,
) -> SimulationResult:
    """Run the protocol of the module docstring; ``stop_at_pct`` ends it once that much demand has arrived.

    ``nodes`` are copied (``TraceNode``s become fresh nodes), so one list serves many runs.
    ``power`` is the model ``power_w`` is measured with (``PowerModel.capped()``: idle GPUs capped off-peak).
    ``progress(done, total)`` is called every ``progress_every`` pods and at the end.
    """
    fleet = Fleet(fresh_node(node) for node in nodes)
    capacity = sum(node.gpu_milli_capacity for node in fleet)
    if capacity == 0:
        raise ValidationFailed("the nodes have no GPUs")
    workload = workload if workload is not None else Workload.from_requests(pods)
    placer = get_placer(algorithm, seed=seed, workload=workload)
    # The metric is against the trace's workload for every placer (fgd_plus measures against its own).
    frag_model = FragModel.shared(workload)
    if isinstance(placer, Fgd) and placer.frag_model.workload is workload:
        frag_model = placer.frag_model
    queue = arrivals(pods, capacity, inflate=inflate, seed=seed)
    result = SimulationResult(algorithm, seed, len(fleet), capacity // MILLI, len(queue))

    node_frag = [frag_model.node_frag(node) for node in fleet]
    frag_total = sum(node_frag)
    power_by_state: dict[str, float] = {}  # node states recur: their watts once each
    node_power = [_node_w(power, node, power_by_state) for node in fleet]
    power_total = sum(node_power)
    used = arrived = 0
    next_pct = 1
    stop = None if stop_at_pct is None else stop_at_pct * capacity / 100
    total = len(queue)
    for done, request in enumerate(queue, start=1):
        placement = placer.place(request, fleet)
        if placement is None:
            result.failed += 1
        else:
            fleet.apply(placement)
            result.placed += 1
            used += placement.gpu_milli * len(placement.gpu_indices)
            position = placement.node_index
            after = frag_model.node_frag(fleet[position])
            frag_total += after - node_frag[position]
            node_frag[position] = after
            watts = _node_w(power, fleet[position], power_by_state)
            power_total += watts - node_power[position]
            node_power[position] = watts
        arrived += request.gpu_milli_total
        while arrived * 100 >= next_pct * capacity:
            result.curve.append(
                CurvePoint(
                    next_pct,
                    round(100 * used / capacity, 4),
                    round(100 * frag_total / capacity, 4),
                    round(power_total, 1),
                )
            )
            next_pct += 1
        if progress is not None and (done % progress_every == 0 or done == total):
            progress(done, total)
        if stop is not None and arrived >= stop:
            if progress is not None:
                progress(total, total)
            break
    return result


def _node_w(power: PowerModel, node: Node, by_state: dict[str, float]) -> float:
    state = node.state  # model, CPU, free CPU and free GPU milli: all the power model reads (None: MIG or memory)
    if state is None:
        return power.node_w(node)
    watts = by_state.get(state)
    if watts is None:
        watts = by_state[state] = power.node_w(node)
    return watts


def fresh_node(node: TraceNode | Node) -> Node:
    """A copy of ``node`` to change freely (a ``TraceNode``: a fresh, empty node)."""
    if isinstance(node, TraceNode):
        return node.to_node()
    return Node(
        node.node_id, node.model, [_copy_gpu(gpu) for gpu in node.gpus], cpu_milli=node.cpu_milli,
        memory_mib=node.memory_mib, cpu_milli_free=node.cpu_milli_free, memory_mib_free=node.memory_mib_free,
        links=node.links, affinity=node.affinity, region=node.region,
    )  # fmt: skip


def _copy_gpu(gpu: Gpu) -> Gpu:
    mig = None if gpu.mig is None else [replace(slot) for slot in gpu.mig]
    return replace(gpu, mig=mig)


class ProgressBar:
    """A one-line progress bar on a stream (stderr): redrawn in place on a terminal, a line per 10 % otherwise."""

    def __init__(self, label: str, *, stream: TextIO | None = None, width: int = 30) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.started = time.monotonic()
        self.tty = self.stream.isatty()
        self._last_tenth = -1

    def __call__(self, done: int, total: int) -> None:
        share = done / total if total else 1.0
        filled = int(self.width * share)
        line = (
            f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {100 * share:3.0f}% "
            f"{done:,}/{total:,} pods {time.monotonic() - self.started:.1f}s"
        )
        if self.tty:
            self.stream.write(f"\r{line}\033[K" + ("\n" if done >= total else ""))
        else:
            tenth = int(10 * share)
            if tenth == self._last_tenth:
                return
            self._last_tenth = tenth
            self.stream.write(line + "\n")
        self.stream.flush()
