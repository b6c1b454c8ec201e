"""The ``Placer`` protocol and the machinery every algorithm shares.

``IndexedPlacer`` does the work common to all of them: the hard constraints (``fits``), the
tie-break, the GPU choice within the chosen node, MIG slots, and the speed-up below; an
algorithm supplies only ``score`` (and, where it differs, ``choose_gpus``).

Equal scores go to the fullest node — the smallest share of its CPU and GPU free
(``Node.free_share``) — which keeps empty hosts whole for gang requests, then to a
pseudo-random one, deterministic in ``(seed, position, version)``. Within the chosen
node a share takes the best-fitting GPU (the least free milli that fits; ``first_fit``:
the lowest index; ``fgd``: the GPU FGD scored best), whole GPUs the lowest-index idle
ones, and a MIG request the GPU with the fewest free slots that has one of its profile.

Speed
=====

A :class:`Fleet` (a ``Sequence[Node]``) logs which nodes changed. A placer keeps,
per distinct request shape, a heap of the feasible nodes' scores for the fleet it
last saw and rescores only the nodes changed since — so one decision costs the
changes since that shape was last placed, not the fleet size. Given a plain list,
``place`` wraps it in a fresh ``Fleet`` and scores every node once. FGD also caches
scores by node state, which recur.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import ClassVar, Protocol

from master.scheduler.fleet import MILLI, Fleet, Gpu, MigSlot, Node, Placement, Request, fits_shape
from master.scheduler.fragmentation import Workload


class Placer(Protocol):
    """Chooses a node and GPUs for a request, or ``None`` when nothing feasible is left."""

    @property
    def name(self) -> str: ...

    def place(self, request: Request, nodes: Sequence[Node]) -> Placement | None: ...


class PlacerFactory(Protocol):
    def __call__(self, *, seed: int = 0, workload: Workload | None = None) -> Placer: ...


# A score (higher is better) and the GPU choice it was computed for (algorithm-specific; None = default).
Scored = tuple[float, object]
_Entry = tuple[float, float, int, int, int]  # (-score, free share, tie-break, position, node version)


class _Heap:
    __slots__ = ("entries", "seen")

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.seen = 0


class IndexedPlacer:
    """The shared machinery: per request shape, the feasible nodes' scores for the last fleet seen."""

    name: ClassVar[str] = ""
    # How many request shapes keep an index; past that the least recently used go.
    max_indexes: ClassVar[int] = 4096

    def __init__(self, *, seed: int = 0, workload: Workload | None = None) -> None:
        self.seed = seed
        self._fleet: Fleet | None = None
        self._heaps: dict[tuple[object, ...], _Heap] = {}

    # -- what subclasses provide --

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        """How much this algorithm likes placing ``request`` on the feasible ``node`` (None: not at all)."""
        raise NotImplementedError

    def choose_gpus(self, node: Node, request: Request, choice: object) -> list[Gpu]:
        """The GPUs of ``node`` that ``request`` gets (default: best fit for shares, lowest index for whole)."""
        return best_fit_gpus(node, request)

    # -- the machinery --

    def _bind(self, fleet: Fleet) -> None:
        if self._fleet is not fleet:
            self._fleet = fleet
            self._heaps.clear()

    def _score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        if not fits_shape(node, request):
            return None
        if request.mig_profile is not None:
            return _mig_score(node, position, request, first=self.name == "first_fit")
        return self.score(node, position, request, fleet)

    def _entries(self, positions: Iterable[int], request: Request, fleet: Fleet) -> list[_Entry]:
        """Heap entries for the nodes at ``positions`` that can take ``request``."""
        nodes, seed, score, entries = fleet.nodes, self.seed, self._score, []
        models = request.gpu_models
        cpu = request.cpu_milli
        gpu = 0 if request.mig_profile is not None else request.gpu_milli_total
        for position in positions:
            node = nodes[position]
            # The cheap part of ``fits_shape`` first: most nodes a busy fleet has fail it.
            if node.free_total < gpu or node.cpu_milli_free < cpu or (models and node.model not in models):
                continue
            scored = score(node, position, request, fleet)
            if scored is not None:
                version = node.version
                entries.append((-scored[0], node.free_share, hash((seed, position, version)), position, version))
        return entries

    def _refresh(self, request: Request, fleet: Fleet) -> list[_Entry]:
        """The heap for the request's shape (host memory aside), brought up to date with the fleet."""
        key = request.shape_key
        index = self._heaps.get(key)
        nodes = fleet.nodes
        count = fleet.change_count
        changed = None if index is None else fleet.changed_since(index.seen)
        if index is None or changed is None or len(changed) > len(nodes):
            if index is None and len(self._heaps) >= self.max_indexes:
                del self._heaps[next(iter(self._heaps))]
            index = self._heaps[key] = _Heap()
            index.seen = count
            index.entries = self._entries(fleet.candidates(request), request, fleet)
            heapq.heapify(index.entries)
            return index.entries
        if changed:
            heap = index.entries
            for entry in self._entries(dict.fromkeys(changed), request, fleet):
                heapq.heappush(heap, entry)
            index.seen = count
            if len(heap) > 4 * len(nodes) + 64:  # drop stale entries before they pile up
                heap[:] = [entry for entry in heap if nodes[entry[3]].version == entry[4]]
                heapq.heapify(heap)
        # Keep recently used shapes at the end of the dict (the LRU order).
        self._heaps[key] = self._heaps.pop(key)
        return index.entries

    def best_position(self, request: Request, fleet: Fleet) -> int | None:
        heap = self._refresh(request, fleet)
        nodes = fleet.nodes
        memory = request.memory_mib
        short_of_memory: list[_Entry] = []  # current, but not for this request: put back afterwards
        found = None
        while heap:
            _, _, _, position, version = heap[0]
            node = nodes[position]
            if node.version != version:
                heapq.heappop(heap)
            elif node.memory_mib_free < memory:
                short_of_memory.append(heapq.heappop(heap))
            else:
                found = position
                break
        for entry in short_of_memory:
            heapq.heappush(heap, entry)
        return found

    def place(self, request: Request, nodes: Sequence[Node]) -> Placement | None:
        fleet = nodes if isinstance(nodes, Fleet) else Fleet(nodes)
        self._bind(fleet)
        position = self.best_position(request, fleet)
        if position is None:
            return None
        node = fleet[position]
        scored = self._score(node, position, request, fleet)  # again, for the winner only: its GPU choice
        return self._placement(node, position, request, None if scored is None else scored[1])

    def _placement(self, node: Node, position: int, request: Request, choice: object) -> Placement:
        if request.mig_profile is not None:
            gpu, slot = _mig_slot(node, request.mig_profile, first=self.name == "first_fit")
            return Placement(request, node.node_id, position, (gpu.index,), (gpu.uuid,), 0, 0, (slot.instance,))
        if request.num_gpu == 0:
            return Placement(request, node.node_id, position, (), (), 0, 0)
        gpus = self.choose_gpus(node, request, choice)
        memory = node.share_memory(request, gpus[0])
        return Placement(
            request, node.node_id, position, tuple(gpu.index for gpu in gpus), tuple(gpu.uuid for gpu in gpus),
            request.gpu_milli, memory,
        )  # fmt: skip


def best_fit_gpus(node: Node, request: Request) -> list[Gpu]:
    usable = [gpu for gpu in node.gpus if node.gpu_takes(request, gpu)]
    if request.gpu_milli < MILLI:
        usable.sort(key=lambda gpu: gpu.milli_free)  # stable: lowest index among equals
    return usable[: request.num_gpu]


def _mig_slot(node: Node, profile: str, *, first: bool) -> tuple[Gpu, MigSlot]:
    """The GPU with a free ``profile`` slot that has the fewest free slots (``first``: the lowest index)."""
    best: tuple[int, Gpu, MigSlot] | None = None
    for gpu in node.gpus:
        slots = gpu.mig or []
        slot = next((s for s in slots if s.free and s.profile == profile), None)
        if slot is None:
            continue
        if first:
            return gpu, slot
        free = sum(1 for s in slots if s.free)
        if best is None or free < best[0]:
            best = (free, gpu, slot)
    if best is None:
        raise LookupError(f"node {node.node_id} has no free {profile} slot")
    return best[1], best[2]


def _mig_score(node: Node, position: int, request: Request, *, first: bool) -> Scored:
    if first:
        return -float(position), None
    # Pack slices: the node with the fewest free MIG slots left.
    return -float(sum(node.mig_free.values())), None


__all__ = ["IndexedPlacer", "Placer", "PlacerFactory", "Scored", "best_fit_gpus"]
