"""``/api/v1/alerts``: open and resolved alerts (see ``master/services/alerts/``).

Admins see every alert; providers see the alerts on their own hosts; renters are refused.
"""

from __future__ import annotations

from typing import Literal, cast

from aiohttp import web

from master.api.base import PAGING, QueryParam, Route, choice_query, listing, page, str_query
from master.api.keys import MASTER
from master.api.middleware import principal
from master.services import alerts

_STATES = ("firing", "resolved", "all")


def alert_filter(request: web.Request) -> alerts.AlertFilter:
    """The filter of ``GET /alerts`` from its query string; 400 on a value it does not know."""
    state = choice_query(request, "state", _STATES) or "firing"
    return alerts.AlertFilter(
        state=cast(Literal["firing", "resolved", "all"], state),
        severity=choice_query(request, "severity", alerts.SEVERITIES),
        rule=choice_query(request, "rule", alerts.RULES),
        host_id=str_query(request, "host_id"),
    )


async def list_alerts(request: web.Request) -> web.Response:
    wanted = alert_filter(request)
    limit, offset = page(request)
    async with request.app[MASTER].db.session() as session:
        items, total = await alerts.list_alerts(session, principal(request), wanted, limit=limit, offset=offset)
    return listing(items, total, limit, offset)


async def get_alert(request: web.Request) -> web.Response:
    async with request.app[MASTER].db.session() as session:
        return web.json_response(await alerts.get_alert(session, principal(request), request.match_info["alert_id"]))


ROUTES: tuple[Route, ...] = (
    Route(
        "GET",
        "/alerts",
        list_alerts,
        "Alerts, newest first: all of them for admins, those on their own hosts for providers.",
        roles=("admin", "provider"),
        query=(
            QueryParam("state", "string", "firing (default), resolved or all."),
            QueryParam("severity", "string", "critical, warning or info."),
            QueryParam("rule", "string", f"One of {', '.join(alerts.RULES)}."),
            QueryParam("host_id", "string", "Only alerts on this host."),
            *PAGING,
        ),
    ),
    Route(
        "GET",
        "/alerts/{alert_id}",
        get_alert,
        "One alert with its details.",
        roles=("admin", "provider"),
        errors=(404,),
    ),
)
