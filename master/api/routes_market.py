"""The marketplace: ``/api/v1/offers`` (and, with the marketplace issue, listings and search)."""

from __future__ import annotations

from aiohttp import web

from master.api.base import PAGING, QueryParam, Route, int_query, listing, page, str_query
from master.api.keys import MASTER
from master.services import hosts
from master.tiers import Tier
from shared.errors import BadRequest


async def list_offers(request: web.Request) -> web.Response:
    limit, offset = page(request)
    async with request.app[MASTER].db.session() as session:
        items, total = await hosts.list_offers(
            session,
            gpu_model=str_query(request, "gpu_model"),
            min_gpus=int_query(request, "num_gpus", 1, minimum=1, maximum=64),
            region=str_query(request, "region"),
            limit=limit,
            offset=offset,
            tier=_tier_query(request),
        )
    return listing(items, total, limit, offset)


def _tier_query(request: web.Request) -> str | None:
    tier = str_query(request, "tier")
    known = [t.value for t in Tier]
    if tier is not None and tier not in known:
        raise BadRequest(f"tier must be one of {', '.join(known)}; got {tier!r}", code="invalid_query")
    return tier


ROUTES: tuple[Route, ...] = (
    Route(
        "GET",
        "/offers",
        list_offers,
        "GPUs that can be rented now, best first, with tier, performance score and host reliability.",
        query=(
            QueryParam("gpu_model", "string", "Model words, e.g. 'RTX 4090'."),
            QueryParam("num_gpus", "integer", "At least this many GPUs on one host.", 1, 64),
            QueryParam("region", "string", "Exact region."),
            QueryParam("tier", "string", "One tier: flagship, datacenter, prosumer, consumer or entry."),
            *PAGING,
        ),
    ),
)
