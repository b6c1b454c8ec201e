"""``random``: a uniformly random feasible node (seeded), kept as a set of feasible nodes per request shape."""

from __future__ import annotations

import random

from master.scheduler.fleet import Fleet, Node, Request, fits
from master.scheduler.fragmentation import Workload
from master.scheduler.placers.base import IndexedPlacer, Scored


class _Members:
    __slots__ = ("members", "seen", "where")

    def __init__(self) -> None:
        self.members: list[int] = []
        self.where: dict[int, int] = {}
        self.seen = 0


class RandomFit(IndexedPlacer):
    """A uniformly random feasible node (seeded); shares best-fit within it."""

    name = "random"

    def __init__(self, *, seed: int = 0, workload: Workload | None = None) -> None:
        super().__init__(seed=seed, workload=workload)
        self._rng = random.Random(seed)
        self._sets: dict[tuple[object, int], _Members] = {}

    def _bind(self, fleet: Fleet) -> None:
        if self._fleet is not fleet:
            self._sets.clear()
        super()._bind(fleet)

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        return 0.0, None  # only the chosen node is ever scored: for its GPU choice

    def best_position(self, request: Request, fleet: Fleet) -> int | None:
        key = (request.shape_key, request.memory_mib)
        index = self._sets.get(key)
        nodes = fleet.nodes
        count = fleet.change_count
        changed = None if index is None else fleet.changed_since(index.seen)
        if index is None or changed is None:
            if index is None and len(self._sets) >= self.max_indexes:
                del self._sets[next(iter(self._sets))]
            index = self._sets[key] = _Members()
            index.members = [position for position in fleet.candidates(request) if fits(nodes[position], request)]
            index.where = {position: slot for slot, position in enumerate(index.members)}
            index.seen = count
        elif changed:
            members, where = index.members, index.where
            for position in dict.fromkeys(changed):
                ok = fits(nodes[position], request)
                if ok and position not in where:
                    where[position] = len(members)
                    members.append(position)
                elif not ok and position in where:
                    slot = where.pop(position)
                    last = members.pop()
                    if last != position:
                        members[slot] = last
                        where[last] = slot
            index.seen = count
        if not index.members:
            return None
        return index.members[self._rng.randrange(len(index.members))]


__all__ = ["RandomFit"]
