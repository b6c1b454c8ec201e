"""What the renter's price first costs the fleet: the trace replayed with the placer behind ``PriceFirst``.

The FGD paper's protocol (``master.scheduler.simulate``: inflate, shuffle, place one pod at a time, no departures),
with a price per host: each GPU model ("tier") has a price per GPU-hour from ``TIER_PRICES`` and each host its own,
``± jitter`` around it (uniform, seeded, to a ten-thousandth of a dollar), as providers set theirs within a tier's
bounds. A pod that asks for GPUs and names no model (the trace's ``gpu_spec`` empty) is placed by the rule at the
tolerance given, as a rental naming no model is; a pod that names models, and a CPU-only pod, by the plain placer, as
the master does. ``tolerance=None`` is the plain placer for every pod: the baseline.

Measured at each whole percent of arrived GPU demand, as the simulator does: ``allocated_pct`` and
``fragmented_pct``; and ``mean_price``: the mean price per GPU-hour of the GPUs placed so far (Σ price × GPU milli /
Σ GPU milli), what renters pay on average. Deterministic in the trace, placer, tolerance and seed.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from master.scheduler.fleet import MILLI, Fleet, Node, Request
from master.scheduler.fragmentation import FragModel, Workload
from master.scheduler.placers.fgd import Fgd
from master.scheduler.price import PriceFirst
from master.scheduler.registry import get_placer
from master.scheduler.simulate import arrivals, fresh_node
from master.scheduler.trace import TraceNode
from shared.errors import ValidationFailed

# USD per GPU-hour per trace GPU model: a stated table in the spirit of the platform's tiers (price_bounds.toml).
# G2 and G3 are the trace's unnamed models (G2 about a T4's generation, G3 a V100's).
TIER_PRICES: Mapping[str, Decimal] = {
    "T4": Decimal("0.35"), "P100": Decimal("0.40"), "G2": Decimal("0.50"), "A10": Decimal("0.60"),
    "V100M16": Decimal("0.75"), "G3": Decimal("0.85"), "V100M32": Decimal("0.90"),
}  # fmt: skip
DEFAULT_PRICE = Decimal("0.50")  # a model not in the table
DEFAULT_JITTER = Decimal("0.10")  # each host within ±10 % of its model's price
_QUANTUM = Decimal("0.0001")


def host_prices(nodes: Sequence[TraceNode | Node], *, seed: int, jitter: Decimal = DEFAULT_JITTER,
                table: Mapping[str, Decimal] = TIER_PRICES) -> list[Decimal]:  # fmt: skip
    """Each host's price per GPU-hour: its model's from ``table``, times (1 + u), u uniform in ±``jitter``, seeded."""
    rng = random.Random(f"prices-{seed}")
    prices = []
    for node in nodes:
        base = table.get(node.model, DEFAULT_PRICE)
        factor = 1 + jitter * Decimal(2 * rng.random() - 1).quantize(Decimal("0.000001"))
        prices.append((base * factor).quantize(_QUANTUM))
    return prices


@dataclass(frozen=True, slots=True)
class PricePoint:
    arrived_pct: int
    allocated_pct: float
    fragmented_pct: float
    mean_price: float  # USD per GPU-hour, over the GPUs placed so far


@dataclass(slots=True)
class PriceResult:
    algorithm: str
    tolerance: Decimal | None
    seed: int
    nodes: int
    gpus: int
    pods: int
    placed: int = 0
    failed: int = 0
    ruled: int = 0  # pods the price rule placed (GPU pods naming no model)
    curve: list[PricePoint] = field(default_factory=list)

    def at(self, arrived_pct: int) -> PricePoint | None:
        return next((p for p in self.curve if p.arrived_pct == arrived_pct), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm, "tolerance": None if self.tolerance is None else str(self.tolerance),
            "seed": self.seed, "nodes": self.nodes, "gpus": self.gpus, "pods": self.pods, "placed": self.placed,
            "failed": self.failed, "ruled": self.ruled,
            "curve": [{"arrived_pct": p.arrived_pct, "allocated_pct": p.allocated_pct, "fragmented_pct": p.fragmented_pct,
                       "mean_price": p.mean_price} for p in self.curve],
        }  # fmt: skip


def simulate_prices(
    nodes: Sequence[TraceNode | Node],
    pods: Sequence[Request],
    *,
    algorithm: str,
    tolerance: Decimal | None,
    inflate: float = 1.3,
    seed: int = 42,
    stop_at_pct: float | None = None,
    jitter: Decimal = DEFAULT_JITTER,
    table: Mapping[str, Decimal] = TIER_PRICES,
    workload: Workload | None = None,
) -> PriceResult:
    """The simulator's protocol with prices (see the module docstring)."""
    fleet = Fleet(fresh_node(node) for node in nodes)
    capacity = sum(node.gpu_milli_capacity for node in fleet)
    if capacity == 0:
        raise ValidationFailed("the nodes have no GPUs")
    prices = host_prices(nodes, seed=seed, jitter=jitter, table=table)
    order = sorted(range(len(fleet)), key=lambda p: (prices[p], p))
    workload = workload if workload is not None else Workload.from_requests(pods)
    placer = get_placer(algorithm, seed=seed, workload=workload)
    rule = PriceFirst(placer, tolerance)
    frag_model = placer.frag_model if isinstance(placer, Fgd) else FragModel.shared(workload)
    queue = arrivals(pods, capacity, inflate=inflate, seed=seed)
    result = PriceResult(algorithm, tolerance, seed, len(fleet), capacity // MILLI, len(queue))
    node_frag = [frag_model.node_frag(node) for node in fleet]
    frag_total = sum(node_frag)
    used = arrived = 0
    paid = Decimal(0)  # Σ price × milli placed
    next_pct = 1
    stop = None if stop_at_pct is None else stop_at_pct * capacity / 100
    for request in queue:
        if tolerance is not None and request.num_gpu and not request.gpu_models:
            result.ruled += 1
            placement = rule.place_priced(request, fleet, prices, order)
        else:
            placement = placer.place(request, fleet)
        if placement is None:
            result.failed += 1
        else:
            fleet.apply(placement)
            result.placed += 1
            milli = placement.gpu_milli * len(placement.gpu_indices)
            used += milli
            paid += prices[placement.node_index] * milli
            position = placement.node_index
            after = frag_model.node_frag(fleet[position])
            frag_total += after - node_frag[position]
            node_frag[position] = after
        arrived += request.gpu_milli_total
        while arrived * 100 >= next_pct * capacity:
            mean = float(paid / used) if used else 0.0
            result.curve.append(PricePoint(next_pct, round(100 * used / capacity, 4), round(100 * frag_total / capacity, 4),
                                           round(mean, 6)))  # fmt: skip
            next_pct += 1
        if stop is not None and arrived >= stop:
            break
    return result


__all__ = ["DEFAULT_JITTER", "TIER_PRICES", "PricePoint", "PriceResult", "host_prices", "simulate_prices"]
