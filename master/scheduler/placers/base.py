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
import math
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
_UNSCORED = float("nan")  # a state not scored yet (``_entries``); never a score


class _Heap:
    __slots__ = ("entries", "memory_ceiling", "seen")

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.seen = 0
        # At least the most host memory free on a node with a current entry (inf: not known yet).
        self.memory_ceiling: float = math.inf


class IndexedPlacer:
    """The shared machinery: per request shape, the feasible nodes' scores for the last fleet seen."""

    name: ClassVar[str] = ""
    # How many request shapes keep an index; past that the least recently used go.
    max_indexes: ClassVar[int] = 4096
    # True where ``score`` reads nothing of a node but its ``Node.state`` (and the request and fleet).
    scores_by_state: ClassVar[bool] = False
    # True where the score reads host memory — the node's (which ``Node.state`` leaves out; ``memory_key`` says
    # what of it) and the request's (which ``Request.shape_key`` leaves out): states and heaps are told apart by them.
    scores_memory: ClassVar[bool] = False
    # Entries one decision may pop (stale, or short of host memory) however small the heap, before it looks
    # at the whole heap at once.
    min_pops: ClassVar[int] = 256

    def __init__(self, *, seed: int = 0, workload: Workload | None = None) -> None:
        self.seed = seed
        self._fleet: Fleet | None = None
        self._heaps: dict[tuple[object, ...], _Heap] = {}
        # Per fleet position, the tie-break of the node's version in ``_tiebreak_version`` (see ``_entries``).
        self._tiebreak: list[int] = []
        self._tiebreak_version: list[int] = []

    # -- what subclasses provide --

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        """How much this algorithm likes placing ``request`` on the feasible ``node`` (None: not at all)."""
        raise NotImplementedError

    def memory_key(self, node: Node, request: Request) -> object:
        """What of the node's host memory the score of ``request`` reads (``scores_memory`` placers)."""
        return (node.memory_mib, node.memory_mib_free)

    def choose_gpus(self, node: Node, request: Request, choice: object) -> list[Gpu]:
        """The GPUs of ``node`` that ``request`` gets (default: best fit for shares, lowest index for whole)."""
        return best_fit_gpus(node, request)

    # -- the machinery --

    def _bind(self, fleet: Fleet) -> None:
        if self._fleet is not fleet:
            self._fleet = fleet
            self._heaps.clear()
            self._tiebreak = [0] * len(fleet)
            self._tiebreak_version = [-1] * len(fleet)

    def _score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        if not fits_shape(node, request):
            return None
        if request.mig_profile is not None:
            return _mig_score(node, position, request, first=self.name == "first_fit")
        return self.score(node, position, request, fleet)

    def _entries(self, positions: Iterable[int], request: Request, fleet: Fleet) -> list[_Entry]:
        """Heap entries for the nodes at ``positions`` that can take ``request``."""
        nodes, score = fleet.nodes, self._score
        entries: list[_Entry] = []
        append = entries.append
        tiebreak, tiebreak_version, seed = self._tiebreak, self._tiebreak_version, self.seed
        models = request.gpu_models
        cpu = request.cpu_milli
        gpu = 0 if request.mig_profile is not None else request.gpu_milli_total
        # Nodes in equal states score alike (``Node.state``): score each state once per call — a new
        # shape's first heap scores every node, and most of a fleet's nodes share a few states.
        by_state: dict[object, float | None] | None = None
        memory_key = self.memory_key if self.scores_memory else None
        if self.scores_by_state and request.network is None and request.mig_profile is None:
            by_state = {}
        for position in positions:
            node = nodes[position]
            # The cheap part of ``fits_shape`` first: most nodes a busy fleet has fail it.
            if node.free_total < gpu or node.cpu_milli_free < cpu or (models and node.model not in models):
                continue
            state: object = node.state
            if memory_key is not None and state is not None:
                state = (state, memory_key(node, request))
            if by_state is not None and state is not None:
                negated = by_state.get(state, _UNSCORED)
                if negated is _UNSCORED:
                    scored = score(node, position, request, fleet)
                    negated = by_state[state] = None if scored is None else -scored[0]
            else:
                scored = score(node, position, request, fleet)
                negated = None if scored is None else -scored[0]
            if negated is None:
                continue
            version = node.version
            if tiebreak_version[position] != version:
                tiebreak_version[position] = version
                tiebreak[position] = hash((seed, position, version))
            append((negated, node.free_share, tiebreak[position], position, version))
        return entries

    def _refresh(self, request: Request, fleet: Fleet) -> _Heap:
        """The heap for the request's shape (host memory aside), brought up to date with the fleet."""
        key = (request.shape_key, request.memory_mib) if self.scores_memory else request.shape_key
        index = self._heaps.get(key)
        nodes = fleet.nodes
        count = fleet.change_count
        changed = None if index is None else fleet.changed_since(index.seen)
        # Past a quarter of the fleet, rescoring the changed nodes one push at a time costs more than a new heap.
        positions = None if changed is None else dict.fromkeys(changed)
        if index is None or positions is None or len(positions) > len(nodes) // 4:
            if index is None and len(self._heaps) >= self.max_indexes:
                del self._heaps[next(iter(self._heaps))]
            index = self._heaps[key] = _Heap()
            index.seen = count
            index.entries = self._entries(fleet.candidates(request), request, fleet)
            heapq.heapify(index.entries)
            return index
        if positions:
            heap = index.entries
            for entry in self._entries(positions, request, fleet):
                heapq.heappush(heap, entry)
                index.memory_ceiling = max(index.memory_ceiling, nodes[entry[3]].memory_mib_free)
            index.seen = count
            if len(heap) > 2 * len(nodes) + 64:  # drop stale entries before they pile up
                self._compact(index, nodes, 0)
        # Keep recently used shapes at the end of the dict (the LRU order).
        self._heaps[key] = self._heaps.pop(key)
        return index

    def best_position(self, request: Request, fleet: Fleet) -> int | None:
        index = self._refresh(request, fleet)
        heap, nodes, memory = index.entries, fleet.nodes, request.memory_mib
        if memory > index.memory_ceiling:
            return None  # no node in the heap has that much memory free: do not pop them all to find out
        short_of_memory: list[_Entry] = []  # current, but not for this request: put back afterwards
        found = None
        pops = 0
        # A pop (and the push back of an entry short of memory) costs some ten times what looking at an entry in a
        # pass does: past a sixteenth of the heap, one pass over it all (which also drops its stale entries).
        max_pops = max(self.min_pops, len(heap) // 16)
        while heap:
            if pops == max_pops:
                for entry in short_of_memory:
                    heapq.heappush(heap, entry)
                return self._compact(index, nodes, memory)
            pops += 1
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
        if found is None:
            index.memory_ceiling = max((nodes[entry[3]].memory_mib_free for entry in short_of_memory), default=-1)
        return found

    @staticmethod
    def _compact(index: _Heap, nodes: Sequence[Node], memory: int) -> int | None:
        """Drop the heap's stale entries; return what popping it would: the position of the least current
        entry whose node has ``memory`` free (None: none has), and note the most memory any has free."""
        kept: list[_Entry] = []
        best: _Entry | None = None
        ceiling = -1
        for entry in index.entries:
            node = nodes[entry[3]]
            if node.version != entry[4]:
                continue
            kept.append(entry)
            free = node.memory_mib_free
            if free > ceiling:
                ceiling = free
            if free >= memory and (best is None or entry < best):
                best = entry
        heapq.heapify(kept)
        index.entries, index.memory_ceiling = kept, ceiling
        return None if best is None else best[3]

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
