"""The marketplace: offer search (``/offers``), cluster offers (``/offers/clusters``), host listings and the tier
price bounds.

Handlers parse and authorize; the rules live in ``master/services/market/offers.py``, ``master/services/market/cluster_offers.py``,
``master/services/market/listings.py`` and the query language in ``master/services/market/query.py``.
"""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel, Field

from master.api.base import (
    BOOLEAN,
    PAGING,
    QueryParam,
    Route,
    choice_query,
    float_query,
    int_query,
    page,
    parse_body,
    required_int_query,
    str_query,
)
from master.api.keys import MASTER
from master.api.middleware import principal
from master.api.schemas_market import ListingPut
from master.services import market
from master.services.clusters import MAX_NODES
from master.services.host_links import NetworkBounds
from master.services.market import (
    MAX_QUERY_LENGTH,
    Condition,
    OfferSearch,
    Op,
    Order,
    Sort,
    format_query,
    parse,
    parse_value,
)

# Each filter as its own query parameter: name → (field of the query language, operator, type, description).
FILTER_PARAMS: dict[str, tuple[str, Op, str, str]] = {
    "gpu_model": ("gpu_name", Op.EQ, "string", "Model words, e.g. 'RTX 4090' or 'A100 80GB' (every word must be in the name)."),
    "min_vram_gib": ("vram", Op.GE, "number", "At least this much GPU memory, GiB (rounded: a 24564 MiB card has 24)."),
    "min_compute_capability": ("compute_capability", Op.GE, "string", "At least this CUDA compute capability, e.g. 8.0."),
    "min_cuda_driver_version": ("cuda_driver_version", Op.GE, "string", "The driver supports at least this CUDA version, e.g. 12.2."),
    "min_price": ("price", Op.GE, "string", "At least this price, USD per GPU-hour."),
    "max_price": ("price", Op.LE, "string", "At most this price, USD per GPU-hour."),
    "max_price_per_score": ("price_per_score", Op.LE, "number", "At most this price per performance-score point."),
    "region": ("region", Op.EQ, "string", "Exact region."),
    "tier": ("tier", Op.EQ, "string", "One tier: flagship, datacenter, prosumer, consumer or entry."),
    "min_score": ("score", Op.GE, "number", "At least this performance score (H100 SXM = 100)."),
    "min_reliability": ("reliability", Op.GE, "number", "At least this host reliability (0 to 1)."),
    "min_download_mbps": ("download_mbps", Op.GE, "number", "At least this measured download speed, Mbit/s."),
    "min_upload_mbps": ("upload_mbps", Op.GE, "number", "At least this measured upload speed, Mbit/s."),
    "verified": ("verified", Op.EQ, "boolean", "true: hosts proven by the GPU challenge only (every GPU passed within "
                 "the last 7 days: docs/verification.md); false: the others."),
    "isolated": ("isolated", Op.EQ, "boolean", "true: hosts that isolate renters' workloads (containers or per-rental "
                 "users) only; false: hosts that say they do not. Hosts of older agents, which do not say, match neither."),
}


def offer_conditions(request: web.Request) -> list[Condition]:
    """The filters of a GET /offers request: ``q`` first, then each filter parameter, all ANDed."""
    conditions = parse(str_query(request, "q", max_length=MAX_QUERY_LENGTH) or "")
    num_gpus = int_query(request, "num_gpus", 0, minimum=1, maximum=64)
    if num_gpus:
        conditions.append(Condition("num_gpus", Op.GE, (num_gpus,)))
    for name, (field, op, _, _) in FILTER_PARAMS.items():
        raw = str_query(request, name)
        if raw is not None:
            conditions.append(parse_value(field, op, raw, parameter=name))
    return conditions


async def list_offers(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    limit, offset = page(request)
    conditions = offer_conditions(request)
    sort = Sort(choice_query(request, "sort", tuple(Sort)) or Sort.SCORE)
    chosen = choice_query(request, "order", tuple(Order))
    order = Order(chosen) if chosen is not None else market.DEFAULT_ORDER[sort]
    search = OfferSearch(conditions, sort=sort, order=order, limit=limit, offset=offset, now=master.clock.now())
    async with master.db.session() as session:
        items, total = await market.search_offers(session, search)
    return web.json_response(
        {
            "items": items,
            "total": total,
            "limit": limit,
            "offset": offset,
            "sort": sort.value,
            "order": order.value,
            "query": format_query(conditions),
        }
    )


MAX_GPUS_PER_NODE = 64

_MONEY = "USD, a decimal string (#/components/schemas/Money)."


class ClusterOfferHost(BaseModel):
    host_id: str
    gpu_name: str
    price_per_gpu_hour: str = Field(description="The host's cheapest matching offer, USD per GPU-hour.")
    region: str | None
    reliability: float | None


class ClusterOfferItem(BaseModel):
    gpu_name: str | None = Field(description="Every node's GPU model; null when models are mixed.")
    region: str | None = Field(description="Every host's region; null: a group across regions (see regions).")
    regions: list[str] = Field(description="The known regions of the group's hosts.")
    hosts_available: int = Field(description="Distinct hosts of the group with room for one node.")
    price_per_hour: str = Field(description="The whole cluster on the group's cheapest set of hosts, per hour. " + _MONEY)
    price_per_hour_max: str = Field(description="The whole cluster on the group's dearest set of hosts, per hour. " + _MONEY)
    price_per_gpu_hour_min: str = Field(description="The group's cheapest host, per GPU-hour. " + _MONEY)
    price_per_gpu_hour_max: str = Field(description="The group's dearest host, per GPU-hour. " + _MONEY)
    hosts: list[ClusterOfferHost] = Field(description="The cheapest set of hosts, cheapest first.")


class ClusterOffersPage(BaseModel):
    items: list[ClusterOfferItem] = Field(description="Cheapest first (price_per_hour).")
    total: int
    limit: int
    offset: int
    nodes: int
    gpus_per_node: int
    allow_mixed: bool
    query: str = Field(description="Every filter applied, in the query language, the per-host num_gpus>= included.")
    max_nodes: int = Field(description="The most nodes a cluster of these GPUs per node and filters could have now.")
    offers_considered: int = Field(description=f"Offers read, the cheapest first (at most {market.MAX_OFFERS_CONSIDERED:,}).")
    offers_matching: int = Field(description="Offers matching in all.")
    truncated: bool = Field(description="More offers matched than were read: the dearest prices may be understated.")
    network: dict[str, float] | None = Field(description="The network bounds applied (max_latency_ms, max_loss_pct, "
                                             "min_mbit_s, those given); null without any.")


# A cluster's network bounds as query parameters (ClusterNetworkBody's ranges): name, maximum, above 0 (not at
# least 0), description.
NETWORK_BOUNDS = (
    ("max_latency_ms", 10_000, True, "Network bound, as a cluster's: no two nodes on hosts measured further apart "
     "(round trip, ms, above 0); hosts never measured may be together."),
    ("max_loss_pct", 100, False, "Network bound: no two nodes on hosts measured losing more (%)."),
    ("min_mbit_s", 400_000, True, "Network bound: no two nodes on hosts measured slower (Mbit/s, above 0)."),
)


async def list_cluster_offers(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    nodes = required_int_query(request, "nodes", minimum=2, maximum=MAX_NODES)
    gpus_per_node = int_query(request, "gpus_per_node", 1, minimum=1, maximum=MAX_GPUS_PER_NODE)
    allow_mixed = choice_query(request, "allow_mixed", BOOLEAN) == "true"
    limit, offset = page(request)
    conditions = offer_conditions(request)
    network = NetworkBounds(**{
        name: float_query(request, name, minimum=0, maximum=maximum, exclusive_minimum=above_zero)
        for name, maximum, above_zero, _ in NETWORK_BOUNDS
    })  # fmt: skip
    async with master.db.session() as session:
        found = await market.find_cluster_offers(
            session, conditions, nodes=nodes, gpus_per_node=gpus_per_node, allow_mixed=allow_mixed, now=master.clock.now(),
            network=network or None, links_max_age_s=master.settings.host_link_max_age_s,
        )  # fmt: skip
    return web.json_response(
        {
            "items": [item.view() for item in found.items[offset : offset + limit]],
            "total": len(found.items),
            "limit": limit,
            "offset": offset,
            "nodes": nodes,
            "gpus_per_node": gpus_per_node,
            "allow_mixed": allow_mixed,
            "query": format_query([*conditions, market.node_condition(gpus_per_node)]),
            "max_nodes": found.max_nodes,
            "offers_considered": found.offers_considered,
            "offers_matching": found.offers_matching,
            "truncated": found.truncated,
            "network": {k: v for k, v in vars(network).items() if v is not None} or None,
        }
    )


async def put_listing(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    body = await parse_body(request, ListingPut)
    terms = market.ListingTerms(
        price_per_gpu_hour=market.price_of(body.price_per_gpu_hour, field="price_per_gpu_hour", code="invalid_price"),
        min_bid_per_gpu_hour=None if body.min_bid_per_gpu_hour is None
        else market.price_of(body.min_bid_per_gpu_hour, field="min_bid_per_gpu_hour", code="invalid_min_bid"),
        smallest_unit=body.smallest_unit,
        available_until=body.available_until,
        maintenance_windows=[market.MaintenanceWindow(w.start, w.end) for w in body.maintenance_windows],
        verified=body.verified,
        storage_price_per_gib_hour=None if body.storage_price_per_gib_hour is None
        else market.price_of(body.storage_price_per_gib_hour, field="storage_price_per_gib_hour", code="invalid_storage_price"),
        volume_gib=body.volume_gib,
    )
    now = master.clock.now()
    async with master.db.session() as session:
        listing, created, tier = await market.put_listing(session, principal(request), request.match_info["host_id"], terms, now=now)
        view = market.listing_view(listing, tier=tier, now=now)
    return web.json_response(view, status=201 if created else 200)


async def get_listing(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    async with master.db.session() as session:
        listing, tier = await market.get_listing(session, principal(request), request.match_info["host_id"])
        view = market.listing_view(listing, tier=tier, now=master.clock.now())
    return web.json_response(view)


async def get_price_bounds(request: web.Request) -> web.Response:
    return web.json_response({"currency": "USD", "unit": "GPU-hour", "items": market.load_price_bounds().view()})


ROUTES: tuple[Route, ...] = (
    Route(
        "GET",
        "/offers",
        list_offers,
        "GPUs that can be rented now, grouped per host and model, with price, tier, performance score, "
        "reliability and what the GPU challenge proved (verified: every GPU of the host passed within 7 days; "
        "verification: the measured TFLOP/s min and median beside the model's expectation); filter with parameters or "
        "the query language in q (docs/marketplace.md).",
        query=(
            QueryParam("q", "string", "Query language: space-separated 'field op value' terms, e.g. "
                       "'gpu_name=RTX_4090 num_gpus>=2 reliability>0.98 price<=0.5'."),
            QueryParam("num_gpus", "integer", "At least this many free GPUs on one host.", 1, 64),
            *(QueryParam(name, kind, description) for name, (_, _, kind, description) in FILTER_PARAMS.items()),
            QueryParam("sort", "string", "score (default, best first), price (cheapest first), "
                       "price_per_performance (price per score point, lowest first) or reliability (highest first)."),
            QueryParam("order", "string", "asc or desc; the default is the sort's best-first direction."),
            *PAGING,
        ),
        errors=(400,),
    ),
    Route(
        "GET",
        "/offers/clusters",
        list_cluster_offers,
        "Which groups of hosts could hold a cluster now, and at what price: per GPU model and region (across regions "
        "only where no region has room; per region when models may mix), the whole cluster's price per hour on the "
        "cheapest and the dearest set of hosts, cheapest first; filters as for GET /offers (docs/clusters.md).",
        response=ClusterOffersPage,
        query=(
            QueryParam("nodes", "integer", "Nodes, each on a host of its own (required).", 2, MAX_NODES, required=True),
            QueryParam("gpus_per_node", "integer", "Whole GPUs of one model on each node (default 1).", 1, MAX_GPUS_PER_NODE),
            QueryParam("allow_mixed", "string", "true: nodes may have different GPU models (default false).", choices=BOOLEAN),
            QueryParam("q", "string", "Query language, as for GET /offers: requirements every node's host meets."),
            *(QueryParam(name, kind, description) for name, (_, _, kind, description) in FILTER_PARAMS.items()),
            *(QueryParam(name, "number", description, 0, maximum) for name, maximum, _, description in NETWORK_BOUNDS),
            *PAGING,
        ),
        errors=(400,),
    ),
    Route(
        "PUT",
        "/hosts/{host_id}/listing",
        put_listing,
        "List a host: price per GPU-hour within its tier's bounds, minimum bid, smallest unit, end date, "
        "maintenance windows, the storage it lends to volumes and its price per GiB-hour. Replaces the whole listing; repeating it changes nothing.",
        roles=("provider",),
        body=ListingPut,
        also_success=(201,),  # the first listing of the host
        errors=(404, 409, 422),
    ),
    Route("GET", "/hosts/{host_id}/listing", get_listing, "A host's listing with its tier's price bounds.", errors=(404,)),
    Route("GET", "/price-bounds", get_price_bounds, "The lowest, default and highest price per GPU-hour of each tier."),
)
