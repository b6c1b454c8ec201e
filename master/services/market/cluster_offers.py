"""Cluster offers, behind ``GET /api/v1/offers/clusters``: which groups of hosts could hold a cluster now, at what price.

A cluster is ``nodes`` nodes of ``gpus_per_node`` whole GPUs, each on a host of its own, all of one GPU model
unless mixing is allowed (``master/services/clusters/request.py``). Placement chooses its hosts by region, round
trip and the placer, never by price (docs/clusters.md, "Gang placement"), so what a renter can know beforehand is
the range: the cheapest and the dearest set of ``nodes`` hosts of each group placement could take them from.

Two halves. ``group_cluster_offers`` is pure: offers in, groups out, so the grouping and the money are tested
without a database (``tests/test_cluster_offers.py`` checks it against brute force). ``find_cluster_offers`` reads
the offers through the offer search (``master.services.market.offers.search_offer_prices``: ``search_offers``' statement
reduced to host, model, price, region and reliability) — the offers' own rules and the query language, nothing
written again here — cheapest first, in pages of ``page_size``, at most ``max_offers`` of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from master.services import host_links
from master.services.market.listings import PriceBounds, money
from master.services.market.offers import OfferPrice, OfferSearch, Order, Sort, search_offer_prices
from master.services.market.query import Condition, Op

__all__ = [
    "MAX_OFFERS_CONSIDERED",
    "ClusterOffer",
    "ClusterOffers",
    "HostOffer",
    "find_cluster_offers",
    "group_cluster_offers",
    "most_nodes",
    "node_condition",
]

MAX_OFFERS_CONSIDERED = 10_000
"""The most offers one request reads (the cheapest ones): past it the answer says ``truncated``."""
OFFERS_PAGE = 5_000
"""Offers read per statement (each sorts every match again: few, large pages)."""


@dataclass(frozen=True)
class HostOffer:
    """One offer as the grouping reads it: a host's free GPUs of one model (enough for one node) and their price."""

    host_id: str
    gpu_name: str
    region: str | None
    price_per_gpu_hour: Decimal
    reliability: float | None = None

    def view(self) -> dict[str, Any]:
        return {
            "host_id": self.host_id,
            "gpu_name": self.gpu_name,
            "price_per_gpu_hour": money(self.price_per_gpu_hour),
            "region": self.region,
            "reliability": self.reliability,
        }


@dataclass(frozen=True)
class ClusterOffer:
    """A group of hosts placement could take the whole cluster from, with the cheapest and the dearest set's price."""

    gpu_name: str | None  # None: models mixed
    region: str | None  # None: across regions
    regions: tuple[str, ...]  # the known regions of the group's hosts
    hosts_available: int  # distinct hosts in the group, each with room for one node
    price_per_hour: Decimal  # the cheapest set of `nodes` hosts, the whole cluster
    price_per_hour_max: Decimal  # the dearest set
    price_per_gpu_hour_min: Decimal  # the cheapest host of the group
    price_per_gpu_hour_max: Decimal  # the dearest host of the group
    hosts: tuple[HostOffer, ...]  # the cheapest set, cheapest first

    def view(self) -> dict[str, Any]:
        return {
            "gpu_name": self.gpu_name,
            "region": self.region,
            "regions": list(self.regions),
            "hosts_available": self.hosts_available,
            "price_per_hour": money(self.price_per_hour),
            "price_per_hour_max": money(self.price_per_hour_max),
            "price_per_gpu_hour_min": money(self.price_per_gpu_hour_min),
            "price_per_gpu_hour_max": money(self.price_per_gpu_hour_max),
            "hosts": [host.view() for host in self.hosts],
        }


def node_condition(gpus_per_node: int) -> Condition:
    """The per-host condition of a cluster's node: an offer of at least ``gpus_per_node`` free GPUs of one model."""
    return Condition("num_gpus", Op.GE, (gpus_per_node,))


# ---- grouping (pure) ---------------------------------------------------------------------------


def _cheapest(offers: Sequence[HostOffer]) -> HostOffer:
    return min(offers, key=lambda o: (o.price_per_gpu_hour, o.gpu_name))


def _dearest(offers: Sequence[HostOffer]) -> HostOffer:
    return max(offers, key=lambda o: (o.price_per_gpu_hour, o.gpu_name))


Apart = Callable[[str, str], bool]
"""Whether two hosts were measured outside a cluster's network bounds (never placed together)."""


SEEDS = 64
"""With network bounds, the greedy passes tried per set: one starting from each of the first ``SEEDS`` hosts."""


def _greedy(ordered: Sequence[str], seed: str, nodes: int, apart: Apart) -> list[str]:
    """``seed``, then each host of ``ordered`` in turn that is measured apart from none taken, up to ``nodes``."""
    taken = [seed]
    for host in ordered:
        if len(taken) == nodes:
            break
        if host != seed and not any(apart(host, other) for other in taken):
            taken.append(host)
    return taken


def _together(ordered: Sequence[str], nodes: int, apart: Apart | None, cost: Callable[[str], Decimal]) -> list[str] | None:
    """``nodes`` of ``ordered`` hosts (best first), no two measured apart, with the least total ``cost``; ``None``: no
    such set found. Without ``apart``, the first ``nodes``. With it, the best of greedy passes (``_greedy``) seeded with
    each of the first ``SEEDS`` hosts: a host measured apart from many is a poor first pick, and is then skipped (as
    the gang search's next node avoids the hosts measured apart from those it took). A heuristic, as that search is."""
    if len(ordered) < nodes:
        return None
    if apart is None:
        return list(ordered[:nodes])
    rank = {host: index for index, host in enumerate(ordered)}
    sets = (taken for seed in ordered[:SEEDS] if len(taken := _greedy(ordered, seed, nodes, apart)) == nodes)
    best = min(sets, key=lambda taken: sum(map(cost, taken)), default=None)  # the first of equal totals
    return None if best is None else sorted(best, key=rank.__getitem__)


def _group(
    hosts: dict[str, list[HostOffer]], *, gpu_name: str | None, region: str | None, nodes: int, gpus_per_node: int,
    apart: Apart | None = None,
) -> ClusterOffer | None:
    """The group's item: its ``nodes`` cheapest hosts (each at its cheapest offer) and its ``nodes`` dearest (each at
    its dearest: with models mixed, placement may give a node either of a host's models), each set keeping the
    network bounds when ``apart`` says which pairs do not; ``None`` when no such set is found."""
    low = {host_id: _cheapest(offers) for host_id, offers in hosts.items()}
    high = {host_id: _dearest(offers).price_per_gpu_hour for host_id, offers in hosts.items()}
    # Cheapest first; among equal prices the most reliable (unknown last), then by id, so the answer is stable.
    by_price = sorted(low, key=lambda h: (low[h].price_per_gpu_hour, low[h].reliability is None, -(low[h].reliability or 0.0), h))
    cheapest_ids = _together(by_price, nodes, apart, lambda h: low[h].price_per_gpu_hour)
    dearest_ids = _together(sorted(high, key=lambda h: (high[h], h), reverse=True), nodes, apart, lambda h: -high[h])
    if cheapest_ids is None or dearest_ids is None:
        return None
    cheapest = [low[h] for h in cheapest_ids]
    dearest = [high[h] for h in dearest_ids]
    # Exact: Decimal sums of the listed prices (6 places), times whole GPUs; no rounding anywhere.
    return ClusterOffer(
        gpu_name=gpu_name,
        region=region,
        regions=tuple(sorted({o.region for offers in hosts.values() for o in offers if o.region is not None})),
        hosts_available=len(hosts),
        price_per_hour=sum((o.price_per_gpu_hour for o in cheapest), Decimal(0)) * gpus_per_node,
        price_per_hour_max=sum(dearest, Decimal(0)) * gpus_per_node,
        price_per_gpu_hour_min=min(o.price_per_gpu_hour for o in low.values()),
        price_per_gpu_hour_max=max(high.values()),
        hosts=tuple(cheapest),
    )


def group_cluster_offers(
    offers: Iterable[HostOffer], *, nodes: int, gpus_per_node: int, allow_mixed: bool, apart: Apart | None = None
) -> list[ClusterOffer]:
    """The groups of hosts that could take a cluster of ``nodes`` nodes now, cheapest first.

    ``offers`` are the offers that can each take one node (the caller filtered them: enough free GPUs of one model,
    every requirement). The groups are those of gang placement (``master.scheduler.gang``): per GPU model (every model
    one key when ``allow_mixed``), one group per region with at least ``nodes`` distinct hosts; and, for a model with
    no such region, one across regions (``region`` None; hosts of unknown region belong only there) when all its hosts
    together are enough. Placement never spans regions while a region has room, so a model's cross-region group is
    shown only then. Sorted by ``price_per_hour``, then the dearest set's price, regions before across regions, model
    and region.

    With ``apart`` (a cluster's network bounds), a group's sets skip hosts measured apart from one already in them,
    and a group where no set of ``nodes`` is found so is not shown (nor counts as a region with room).
    """
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError("nodes and gpus_per_node are at least 1")
    in_region: dict[str | None, dict[str, dict[str, list[HostOffer]]]] = {}  # model → region → host → offers
    anywhere: dict[str | None, dict[str, list[HostOffer]]] = {}  # model → host → offers
    for offer in offers:
        model = None if allow_mixed else offer.gpu_name
        if offer.region is not None:
            in_region.setdefault(model, {}).setdefault(offer.region, {}).setdefault(offer.host_id, []).append(offer)
        anywhere.setdefault(model, {}).setdefault(offer.host_id, []).append(offer)
    items: list[ClusterOffer] = []
    for model, hosts in anywhere.items():
        regional = [
            item
            for region, group in in_region.get(model, {}).items()
            if len(group) >= nodes
            and (item := _group(group, gpu_name=model, region=region, nodes=nodes, gpus_per_node=gpus_per_node, apart=apart))
        ]
        if regional:
            items += regional
        elif len(hosts) >= nodes and (
            across := _group(hosts, gpu_name=model, region=None, nodes=nodes, gpus_per_node=gpus_per_node, apart=apart)
        ):
            items.append(across)
    items.sort(key=lambda i: (i.price_per_hour, i.price_per_hour_max, i.region is None, i.gpu_name or "", i.region or ""))
    return items


def most_nodes(offers: Iterable[HostOffer], *, allow_mixed: bool, apart: Apart | None = None) -> int:
    """The largest cluster the offers could hold now: the most distinct hosts of one model (of any, mixing); with
    ``apart``, the most that greedy passes (``_together``'s) put together keeping the bounds."""
    hosts: dict[str | None, dict[str, Decimal]] = {}
    for offer in offers:
        prices = hosts.setdefault(None if allow_mixed else offer.gpu_name, {})
        prices[offer.host_id] = min(prices.get(offer.host_id, offer.price_per_gpu_hour), offer.price_per_gpu_hour)
    if apart is None:
        return max((len(ids) for ids in hosts.values()), default=0)
    best = 0
    for prices in hosts.values():
        ordered = sorted(prices, key=lambda h: (prices[h], h))
        best = max([best, *(len(_greedy(ordered, seed, len(ordered), apart)) for seed in ordered[:SEEDS])])
    return best


# ---- reading the offers ------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterOffers:
    items: list[ClusterOffer]
    max_nodes: int  # the most nodes a cluster of these GPUs per node and filters could have now
    offers_considered: int  # offers read (the cheapest ones)
    offers_matching: int  # offers matching in all
    truncated: bool  # more offers matched than were read: the dearest prices may be understated


async def find_cluster_offers(
    session: AsyncSession,
    conditions: Sequence[Condition],
    *,
    nodes: int,
    gpus_per_node: int = 1,
    allow_mixed: bool = False,
    now: datetime | None = None,
    bounds: PriceBounds | None = None,
    network: host_links.NetworkBounds | None = None,
    links_max_age_s: float = 7 * 86400.0,
    # Limits
    max_offers: int = MAX_OFFERS_CONSIDERED,
    page_size: int = OFFERS_PAGE,
) -> ClusterOffers:
    """The cluster offers for ``nodes`` nodes of ``gpus_per_node`` GPUs among the offers matching ``conditions``.

    Reads the matching offers with at least ``gpus_per_node`` free GPUs through the offer search, cheapest first
    (ties in the search's stable order), ``page_size`` a statement and at most ``max_offers``: past that, the dearest
    sets are priced from the offers read and ``truncated`` says so. Pages are separate statements, so an offer that
    changes meanwhile may be seen twice (it is counted once) or missed: the answer is a moment's estimate, as any
    offer list is. Read-only: cancelling it is safe.
    """
    wanted = [*conditions, node_condition(gpus_per_node)]
    read: dict[tuple[str, str], HostOffer] = {}
    matching = 0
    offset = 0
    while offset < max_offers:
        search = OfferSearch(wanted, sort=Sort.PRICE, order=Order.ASC, limit=min(page_size, max_offers - offset), offset=offset,
                             now=now, bounds=bounds)  # fmt: skip
        page, matching = await search_offer_prices(session, search)
        for offer in page:
            read.setdefault((offer.host_id, offer.gpu_name), _host_offer(offer))
        offset += len(page)
        if len(page) < search.limit or offset >= matching:
            break
    offers = list(read.values())
    apart = await _apart(session, {o.host_id for o in offers}, network, now=now, max_age_s=links_max_age_s) if network else None
    return ClusterOffers(
        items=group_cluster_offers(offers, nodes=nodes, gpus_per_node=gpus_per_node, allow_mixed=allow_mixed, apart=apart),
        max_nodes=most_nodes(offers, allow_mixed=allow_mixed, apart=apart),
        offers_considered=len(offers),
        offers_matching=max(matching, len(offers)),
        truncated=matching > offset,
    )


async def _apart(
    session: AsyncSession, host_ids: set[str], network: host_links.NetworkBounds, *, now: datetime | None, max_age_s: float
) -> Apart:
    """Which pairs of ``host_ids`` were measured outside ``network`` within ``max_age_s`` (placement's rule: a pair
    never measured may be placed together), from one read of their links."""
    since = (now or datetime.now(UTC)) - timedelta(seconds=max_age_s)
    links = await host_links.among(session, host_ids, since=since)
    breached = {key for key, figures in links.items() if network.breaches(figures)}
    return lambda a, b: host_links.pair(a, b) in breached


def _host_offer(offer: OfferPrice) -> HostOffer:
    return HostOffer(offer.host_id, offer.gpu_name, offer.region, offer.price_per_gpu_hour, offer.reliability)
