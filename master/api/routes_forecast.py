"""Demand forecasts (``GET /demand-forecast``): GPUs wanted per GPU model and region for the next hours.

For providers (when to have capacity ready) and admins; the rules live in ``master/services/market/forecast.py``.
"""

from __future__ import annotations

from aiohttp import web

from master.api.base import QueryParam, Route, int_query
from master.api.keys import MASTER
from master.services import market


async def demand_forecast(request: web.Request) -> web.Response:
    days = int_query(request, "days", 14, minimum=1, maximum=60)
    hours = int_query(request, "hours", 24, minimum=1, maximum=168)
    master = request.app[MASTER]
    async with master.db.session() as session:
        return web.json_response(await market.demand_forecast(session, now=master.clock.now(), days=days, horizon=hours))


ROUTES: tuple[Route, ...] = (
    Route("GET", "/demand-forecast", demand_forecast, "GPUs wanted per GPU model and region, hour by hour: the last day "
          "and a forecast of the next hours: the same hour's mean over the last 7 days, or a small learned model where it "
          "beat that on the last two (held-out) days; each series says which.",
          roles=("provider",), query=(QueryParam("days", "integer", "Days of history read.", 1, 60),
                                      QueryParam("hours", "integer", "Hours forecast.", 1, 168))),
)
