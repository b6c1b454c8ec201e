"""The renter's price first (issue 43, point 3): the cheapest feasible offers, then the placer among them.

Without a model or an offer named, a rental (a service's replica, a cluster's members) goes to the cheapest
offers that meet its constraints, and the placer (FGD, ``fgd_net``, …) chooses only among those within
``price_tolerance`` of the cheapest: a node is in the **band** when its price ≤ cheapest × (1 + tolerance).

"Cheapest" is taken over the nodes that can take the request (``fits``: model, CPU, memory, GPU room, MIG slot,
network limits), never over the whole fleet: a full $0.15 host does not make a free $0.40 one "too dear". The band
then holds every node up to that price, feasible or not, and the placer filters and chooses as it always does.
Should the placer find nothing in the band (a placer stricter than ``fits``), the next band is tried: the cheapest
feasible price above the band's limit, and so on, up to the whole fleet — so the rule never refuses a request
the plain placer would place. Prices are ``Decimal`` (USD per GPU-hour) and the tolerance a ``Decimal`` fraction
(0.05 = 5 %); ``None`` as the tolerance means "no rule": the plain placer on every node.

For a gang (a cluster, ``gang_band``) the band is taken from the least price ``p`` such that the nodes priced at
most ``p`` hold a whole set (the cheapest its dearest member can be), found by a binary search over the distinct
prices; the gang search then runs on the nodes priced at most ``p × (1 + tolerance)``.

Pure computation over ``master.scheduler.fleet``: the master hands it the candidates' charged prices
(``rentals/placement.py::try_place``), the simulator a price per trace node (``price_simulate.py``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from decimal import Decimal, InvalidOperation
from typing import TypeVar

from master.scheduler.fleet import Fleet, Node, Placement, Request, fits
from master.scheduler.placers.base import Placer
from shared.errors import BadRequest

MAX_TOLERANCE = Decimal(10)  # 1000 % above the cheapest: beyond it the rule would mean nothing
TOLERANCE_PLACES = 4  # 0.0001 = a hundredth of a percent
_MAX_TEXT = 16

T = TypeVar("T")


def parse_tolerance(value: object, *, field: str = "price_tolerance") -> Decimal:
    """A tolerance a renter sent: a plain decimal string ("0.05") or a JSON number (0.05, 1), 0 ≤ t ≤ 10, at most 4
    decimals; anything else (a sign, an exponent, NaN, ∞, spaces, control characters, a bool) is 400
    ``invalid_price_tolerance`` saying what to write. A JSON number is read by its shortest decimal form (``repr``),
    the digits the client wrote."""
    rule = (f"{field} must be a fraction of the cheapest price from 0 to {MAX_TOLERANCE} with at most {TOLERANCE_PLACES} "
            'decimals, e.g. "0.05" (5 %)')  # fmt: skip
    if isinstance(value, bool) or value is None:
        raise BadRequest(rule, code="invalid_price_tolerance", details={"problems": [{"field": field, "problem": rule}]})
    if isinstance(value, float):
        text = repr(value) if math.isfinite(value) else "nan"
    elif isinstance(value, int):
        text = str(value) if 0 <= value <= MAX_TOLERANCE else "-"
    elif isinstance(value, Decimal):
        text = format(value, "f") if value.is_finite() and value.adjusted() < _MAX_TEXT else "-"
    elif isinstance(value, str):
        text = value
    else:
        text = "-"
    ok = len(text) <= _MAX_TEXT and text.isascii() and all(c.isdigit() or c == "." for c in text) and text.count(".") <= 1
    amount: Decimal | None = None
    if ok and text.strip(".") != "":
        try:
            amount = Decimal(text)
        except InvalidOperation:
            amount = None
    if amount is None or not 0 <= amount <= MAX_TOLERANCE or amount != amount.quantize(Decimal(1).scaleb(-TOLERANCE_PLACES)):
        shown = f", got {text[:20]!r}" if isinstance(value, str) and text.isprintable() else ""
        raise BadRequest(rule + shown, code="invalid_price_tolerance", details={"problems": [{"field": field, "problem": rule}]})
    return amount


def optional_tolerance(value: object, *, field: str = "price_tolerance") -> Decimal | None:
    """``parse_tolerance`` of a field that may be left out (None, or JSON null: not given)."""
    return None if value is None else parse_tolerance(value, field=field)


def tolerance_text(value: Decimal) -> str:
    """A tolerance as the API writes and fingerprints it: "0.05", "0", "10" — one text per value, whatever its scale
    (a column's ``0.0500`` is "0.05")."""
    return format(value.normalize(), "f")


def band_limit(cheapest: Decimal, tolerance: Decimal) -> Decimal:
    """The dearest price within ``tolerance`` of ``cheapest`` (exact: Decimal arithmetic)."""
    return cheapest * (1 + tolerance)


class PriceFirst:
    """A placer that keeps the renter's price first: ``placer`` chooses only among the band (see the module).

    ``price_of(node)`` is each node's price (``place``; or give the prices to ``place_priced``); ``tolerance`` None
    places exactly as ``placer`` does. Placements it returns index the nodes it was given (``node_index``), as every
    placer's do.
    """

    def __init__(self, placer: Placer, tolerance: Decimal | None, price_of: Callable[[Node], Decimal] | None = None) -> None:
        self.placer = placer
        self.tolerance = tolerance
        self.price_of = price_of

    @property
    def name(self) -> str:
        return f"{self.placer.name}+price" if self.tolerance is not None else self.placer.name

    def place(self, request: Request, nodes: Sequence[Node]) -> Placement | None:
        if self.tolerance is None:
            return self.placer.place(request, nodes)
        if self.price_of is None:
            raise TypeError("PriceFirst.place needs price_of; or call place_priced with the prices")
        prices = [self.price_of(node) for node in nodes]
        return self.place_priced(request, nodes, prices)

    def place_priced(self, request: Request, nodes: Sequence[Node], prices: Sequence[Decimal],
                     order: Sequence[int] | None = None) -> Placement | None:  # fmt: skip
        """``place`` with the prices given (``prices[i]`` of ``nodes[i]``); ``order``: the positions sorted by price
        (cheapest first), when the caller keeps them (the simulator), else sorted here."""
        tolerance = self.tolerance
        if tolerance is None:
            return self.placer.place(request, nodes)
        if order is None:
            order = sorted(range(len(nodes)), key=prices.__getitem__)
        sorted_prices = [prices[p] for p in order]
        start, count = 0, len(order)
        while start < count:
            first = next((i for i in range(start, count) if fits(nodes[order[i]], request)), None)
            if first is None:
                return None
            cheapest = sorted_prices[first]
            end = bisect.bisect_right(sorted_prices, band_limit(cheapest, tolerance))
            if end == len(order):  # the band is every node: the plain placer, on the nodes as given
                return self.placer.place(request, nodes)
            positions = sorted(order[:end])  # the band in the nodes' own order (placers break ties by position)
            band = _sub_fleet(nodes, positions)
            placement = self.placer.place(request, band)
            if placement is not None:
                return replace(placement, node_index=positions[placement.node_index])
            start = end  # a placer stricter than fits: the next band up
        return None


def _sub_fleet(nodes: Sequence[Node], positions: Sequence[int]) -> Fleet:
    """The band as a fleet of its own that still sees the whole fleet's capacity (``fgd_net``'s model pressure,
    the scales ``utilization`` normalises by): the band changes which nodes a placer may choose, not how it scores."""
    band = Fleet(nodes[p] for p in positions)
    whole = nodes if isinstance(nodes, Fleet) else Fleet(nodes)  # a plain list: as the placer would see it
    band.capacity_by_model = whole.capacity_by_model
    band.max_cpu_milli, band.max_gpu_milli = whole.max_cpu_milli, whole.max_gpu_milli
    return band


def gang_band(nodes: Sequence[Node], prices: Sequence[Decimal], tolerance: Decimal | None,
              solve: Callable[[Sequence[Node]], T | None]) -> tuple[list[int], T] | None:  # fmt: skip
    """The cheapest band a gang fits in, and ``solve``'s answer on it: ``solve(band)`` is the gang search (``place_gang``
    on the nodes given). ``None`` when no set exists at all. ``tolerance`` None: ``solve`` on every node.

    The band's limit is ``p × (1 + tolerance)`` for the least ``p`` whose nodes priced ≤ ``p`` hold a set; more nodes
    never take a set away, so ``p`` is found by a binary search over the distinct prices."""
    everything = list(range(len(nodes)))
    if tolerance is None:
        found = solve(list(nodes))
        return None if found is None else (everything, found)
    levels = sorted(set(prices))
    low, high = 0, len(levels) - 1
    if not levels or solve([n for n, price in zip(nodes, prices, strict=True) if price <= levels[high]]) is None:
        return None
    while low < high:
        middle = (low + high) // 2
        if solve([n for n, price in zip(nodes, prices, strict=True) if price <= levels[middle]]) is not None:
            high = middle
        else:
            low = middle + 1
    limit = band_limit(levels[low], tolerance)
    positions = [p for p in everything if prices[p] <= limit]
    found = solve([nodes[p] for p in positions])
    assert found is not None  # a superset of a band that holds a set
    return positions, found


def effective_tolerance(asked: Decimal | None, default: Decimal | None, *, names_model: bool, names_offer: bool) -> Decimal | None:
    """The tolerance a placement uses: none for an offer (one node); the renter's own when given; else the platform's
    ``default`` when the request names no model (a named model keeps the placer's choice among its offers)."""
    if names_offer:
        return None
    if asked is not None:
        return asked
    return None if names_model else default


def prices_by_node(prices: Mapping[str, Decimal]) -> Callable[[Node], Decimal]:
    """``price_of`` from node id → price."""
    return lambda node: prices[node.node_id]


__all__ = [
    "MAX_TOLERANCE", "TOLERANCE_PLACES", "PriceFirst", "band_limit", "effective_tolerance", "gang_band", "optional_tolerance",
    "parse_tolerance",
    "prices_by_node", "tolerance_text",
]  # fmt: skip
