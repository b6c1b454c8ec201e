"""``GET /api/v1/regions``: the regions hosts may name, public (the agent installer checks ``--region``
against it before it installs anything)."""

from __future__ import annotations

from aiohttp import web

from master.api.base import Route
from master.api.keys import MASTER
from master.services import hosts


async def list_regions(request: web.Request) -> web.Response:
    regions = await hosts.known_regions(request.app[MASTER])
    return web.json_response({"regions": regions})


ROUTES: tuple[Route, ...] = (
    Route("GET", "/regions", list_regions, "Regions served by live relays: the ones a host may name at install "
          "(install-agent.sh --region).", public=True),
)  # fmt: skip
