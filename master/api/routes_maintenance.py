"""Maintenance windows one at a time (``/hosts/{host_id}/maintenance-windows``), beside the listing's PUT.

A provider (or an admin) adds a window to a listed host or clears one, the listing's other terms
unchanged; both answer the whole listing, as ``GET /hosts/{host_id}/listing``. The rules live in
``master/services/market/listings.py`` (``add_window``, ``clear_window``).
"""

from __future__ import annotations

from datetime import datetime

from aiohttp import web

from master.api.base import Route, parse_body
from master.api.keys import MASTER
from master.api.middleware import principal
from master.api.schemas_market import MaintenanceWindowBody
from master.api.times import parse_time
from master.services import market
from shared.errors import BadRequest


def _start(raw: str) -> datetime:
    """The ``{start}`` of the path: an RFC 3339 time with a timezone (as the listing shows it); 400 otherwise."""
    try:
        return parse_time(raw)
    except ValueError:
        raise BadRequest(
            f"the window's start must be an RFC 3339 time with a timezone, as the listing shows it "
            f"(e.g. 2027-01-01T00:00:00Z); got {raw[:64]!r}",
            code="invalid_maintenance_window",
        ) from None


async def add_maintenance_window(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    body = await parse_body(request, MaintenanceWindowBody)
    now = master.clock.now()
    async with master.db.session() as session:
        listing, tier = await market.add_window(
            session, principal(request), request.match_info["host_id"], market.MaintenanceWindow(body.start, body.end), now=now
        )
        view = market.listing_view(listing, tier=tier, now=now)
    return web.json_response(view, status=201)


async def clear_maintenance_window(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    start = _start(request.match_info["start"])
    now = master.clock.now()
    async with master.db.session() as session:
        listing, tier = await market.clear_window(session, principal(request), request.match_info["host_id"], start, now=now)
        view = market.listing_view(listing, tier=tier, now=now)
    return web.json_response(view)


ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        "/hosts/{host_id}/maintenance-windows",
        add_maintenance_window,
        "Add a maintenance window to a listed host (the host is not offered during it); answers the listing. "
        "422 invalid_maintenance_window when it ends before it starts, is already over, overlaps another window "
        "or would be one more than 32; 404 listing_not_found before the host's first listing.",
        roles=("provider",),
        body=MaintenanceWindowBody,
        success=201,
        errors=(404, 409, 422),
    ),
    Route(
        "DELETE",
        "/hosts/{host_id}/maintenance-windows/{start}",
        clear_maintenance_window,
        "Clear the host's upcoming maintenance window that starts at {start} (as the listing shows it, e.g. "
        "2027-01-01T00:00:00Z), even one open now; answers the listing. 404 maintenance_window_not_found when none starts then.",
        roles=("provider",),
        errors=(400, 404, 409),
    ),
)
