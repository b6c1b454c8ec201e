"""Gang placement: a cluster's nodes, each on a different host, placed together or not at all.

A cluster is ``count`` members of one request of whole GPUs (``gpu_milli == MILLI``), each on a
distinct host, all of one GPU model unless the renter allows mixing. :func:`place_gang` returns
``count`` placements or ``None``; like every placer it never changes the nodes, and the caller applies
the placements it has claimed (``Fleet.apply``), all of them or none.

Which set, in this order of preference:

1. **One region.** A set whose hosts all sit in one region (``Node.region``; a host of unknown region
   is in none) beats any set that spans regions, whatever it costs the fleet.
2. **Smallest worst RTT.** With ``rtt_ms(node_a, node_b)`` (None: unknown), the set whose worst pairwise
   round trip is smallest; ``max_rtt_ms`` is a hard limit, and an unknown RTT never keeps it (as with
   ``NetworkLimits``: unknown is not good enough). Without a limit an unknown RTT ranks as the worst.
3. **The placer's preference.** Among the sets left, the configured placer chooses one member at a time
   among the hosts not used yet (and, with RTTs, only among hosts that still complete a set as good as
   the best), so FGD's fragmentation preference applies to each member.

Because every member has a host of its own, and hosts are independent, a set exists exactly when some
group of hosts (a region and model, then a model, or everything when mixing) holds ``count`` hosts
that each fit the request and, with RTTs, are pairwise within the limit (a ``count``-clique of the
"RTT ≤ t" graph, found by an exact search). The search is bounded by ``max_search_steps``; past it a
group counts as having no set (never reached by the tests' fleets; a region holds tens of hosts a model).

Cost: one ``fits`` per host, then ``count`` calls of the placer on the chosen group's hosts (each
scores that group once); with ``rtt_ms``, ``n²/2`` RTT look-ups per group of ``n`` eligible hosts.
Hand ``place_gang`` a placer instance of its own when another instance serves single placements on a
long-lived ``Fleet``: a placer keeps its scores for the last fleet it saw, and ``place_gang`` shows it
other (smaller) ones.

Imports ``shared.errors`` only; no database, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from master.scheduler.fleet import MILLI, Node, Placement, Request, fits
from master.scheduler.placers.base import Placer
from shared.errors import ValidationFailed

Rtt = Callable[[str, str], float | None]


class _SearchTooLong(Exception):
    """The clique search spent its ``max_search_steps``."""


class _Pool:
    """Eligible hosts that may form a set together (one region and model, one model, or all)."""

    __slots__ = ("_weights", "positions")

    def __init__(self, positions: list[int]) -> None:
        self.positions = positions
        self._weights: dict[tuple[int, int], float] | None = None

    def weights(
        self, nodes: Sequence[Node], rtt_ms: Rtt, max_rtt_ms: float | None
    ) -> dict[tuple[int, int], float]:
        """RTT of every pair of the pool's hosts that may be in one set (unknown: inf, only without a limit)."""
        if self._weights is None:
            weights: dict[tuple[int, int], float] = {}
            positions = self.positions
            for i, a in enumerate(positions):
                id_a = nodes[a].node_id
                for b in positions[i + 1 :]:
                    measured = rtt_ms(id_a, nodes[b].node_id)
                    weight = math.inf if measured is None else float(measured)
                    if max_rtt_ms is None or weight <= max_rtt_ms:
                        weights[(a, b)] = weights[(b, a)] = weight
            self._weights = weights
        return self._weights


def place_gang(
    request: Request,
    count: int,
    nodes: Sequence[Node],
    *,
    placer: Placer,
    same_model: bool = True,
    rtt_ms: Rtt | None = None,
    max_rtt_ms: float | None = None,
    # Limits
    max_search_steps: int = 100_000,
) -> list[Placement] | None:
    """``count`` placements of ``request``, each on a distinct host, or ``None`` (see the module docstring)."""
    if request.num_gpu < 1 or request.gpu_milli != MILLI or request.mig_profile is not None:
        raise ValidationFailed("a cluster's nodes ask for whole GPUs (num_gpu ≥ 1, gpu_milli = 1000, no MIG)")
    if count < 1:
        raise ValidationFailed(f"a cluster has at least one node, not {count}")
    if max_rtt_ms is not None and rtt_ms is None:
        raise ValidationFailed("max_rtt_ms needs rtt_ms: without RTTs no set can be shown to keep the limit")
    wanted = request.num_gpu
    eligible = [p for p, node in enumerate(nodes) if node.full >= wanted and fits(node, request)]
    if len(eligible) < count:
        return None
    for tier in _tiers(nodes, eligible, count, same_model=same_model):
        solved: list[tuple[float, _Pool]] = []
        for pool in tier:
            bottleneck = _bottleneck(pool, count, nodes, rtt_ms, max_rtt_ms, max_search_steps)
            if bottleneck is not None:
                solved.append((bottleneck, pool))
        if solved:
            best = min(bottleneck for bottleneck, _ in solved)
            tied = [pool for bottleneck, pool in solved if bottleneck == best]
            return _choose(request, count, nodes, tied, best, placer, rtt_ms, max_rtt_ms, max_search_steps)
    return None


def _tiers(nodes: Sequence[Node], eligible: list[int], count: int, *, same_model: bool) -> list[list[_Pool]]:
    """The groups a set may come from, best tier first: one region (and model), then across regions."""
    in_region: dict[tuple[str, str], list[int]] = {}
    anywhere: dict[str, list[int]] = {}
    for position in eligible:
        node = nodes[position]
        model = node.model if same_model else ""
        if node.region is not None:
            in_region.setdefault((node.region, model), []).append(position)
        anywhere.setdefault(model, []).append(position)
    return [
        [_Pool(positions) for positions in in_region.values() if len(positions) >= count],
        [_Pool(positions) for positions in anywhere.values() if len(positions) >= count],
    ]


def _bottleneck(
    pool: _Pool,
    count: int,
    nodes: Sequence[Node],
    rtt_ms: Rtt | None,
    max_rtt_ms: float | None,
    max_steps: int,
) -> float | None:
    """The smallest worst pairwise RTT of a set of ``count`` of the pool's hosts (0 without RTTs), or
    ``None`` when no set keeps ``max_rtt_ms``."""
    if rtt_ms is None or count == 1:
        return 0.0
    weights = pool.weights(nodes, rtt_ms, max_rtt_ms)
    thresholds = sorted(set(weights.values()))
    low, high = 0, len(thresholds) - 1
    found: float | None = None
    # The smallest threshold whose graph has a count-clique (having one is monotone in the threshold).
    while low <= high:
        middle = (low + high) // 2
        adjacency = _adjacency(pool.positions, weights, thresholds[middle])
        if _clique(adjacency, pool.positions, count, max_steps) is not None:
            found = thresholds[middle]
            high = middle - 1
        else:
            low = middle + 1
    return found


def _adjacency(
    positions: list[int], weights: dict[tuple[int, int], float], threshold: float
) -> dict[int, set[int]]:
    adjacency: dict[int, set[int]] = {position: set() for position in positions}
    for (a, b), weight in weights.items():
        if weight <= threshold:
            adjacency[a].add(b)
    return adjacency


def _clique(
    adjacency: dict[int, set[int]], candidates: Sequence[int], size: int, max_steps: int
) -> list[int] | None:
    """``size`` of ``candidates`` pairwise adjacent, or ``None`` (also when the search runs past ``max_steps``)."""
    steps = 0

    def extend(chosen: list[int], left: list[int]) -> list[int] | None:
        nonlocal steps
        if len(chosen) == size:
            return chosen
        for i, position in enumerate(left):
            if len(chosen) + len(left) - i < size:
                return None
            steps += 1
            if steps > max_steps:
                raise _SearchTooLong
            neighbours = adjacency[position]
            found = extend([*chosen, position], [other for other in left[i + 1 :] if other in neighbours])
            if found is not None:
                return found
        return None

    # Hosts with the most neighbours first: a clique, when there is one, tends to be found among them early.
    ordered = sorted(candidates, key=lambda position: -len(adjacency[position]))
    try:
        return extend([], [position for position in ordered if len(adjacency[position]) >= size - 1])
    except _SearchTooLong:
        return None


def _choose(
    request: Request,
    count: int,
    nodes: Sequence[Node],
    tied: list[_Pool],
    bottleneck: float,
    placer: Placer,
    rtt_ms: Rtt | None,
    max_rtt_ms: float | None,
    max_steps: int,
) -> list[Placement] | None:
    """The placer's choice, one member at a time, among the tied pools' hosts that still complete a set
    whose worst RTT is ``bottleneck``; the first member decides the pool."""
    adjacency: dict[int, set[int]] = {}
    if rtt_ms is not None:
        for pool in tied:
            adjacency.update(_adjacency(pool.positions, pool.weights(nodes, rtt_ms, max_rtt_ms), bottleneck))
    pool_of = {position: pool for pool in tied for position in pool.positions}
    chosen: list[Placement] = []
    used: list[int] = []
    candidates = [position for pool in tied for position in pool.positions]
    while len(chosen) < count:
        while True:
            if not candidates:
                return None  # not reached: the pool holds a set as good as ``bottleneck``
            placement = placer.place(request, [nodes[position] for position in candidates])
            if placement is None:
                return None  # a placer that refuses a host ``fits`` accepts
            position = candidates[placement.node_index]
            if rtt_ms is None or _completes(adjacency, used, position, count, max_steps):
                break
            candidates.remove(position)
        chosen.append(replace(placement, node_index=position))
        used.append(position)
        members = pool_of[position].positions
        if rtt_ms is None:
            candidates = [other for other in members if other not in used]
        else:
            still = set(candidates)
            candidates = [other for other in members if other in adjacency[position] and other in still]
    return chosen


def _completes(
    adjacency: dict[int, set[int]], used: list[int], position: int, count: int, max_steps: int
) -> bool:
    """Whether ``used`` and ``position`` extend to ``count`` hosts pairwise adjacent."""
    members = [*used, position]
    common = set.intersection(*(adjacency[member] for member in members)) - set(members)
    return _clique(adjacency, sorted(common), count - len(members), max_steps) is not None


__all__ = ["Rtt", "place_gang"]
