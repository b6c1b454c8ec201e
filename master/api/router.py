"""Mounting the API on an app: the route table's routes, its lookup index, its OpenAPI document, and
the API's own resources, each a ``cleanup_ctx``.

``add_api(app)`` needs ``app[MASTER]`` set and the middlewares of ``master.api.middleware.MIDDLEWARES``
installed. Resources, opened in this order when the app starts and closed in reverse: the rate
limiter (its Redis connection), the metrics exporter, the agent package finder, the live streams'
closing event (set at shutdown, before the open streams are waited for).
"""

from __future__ import annotations

import functools
from typing import Any

from aiohttp import web

from master.api import routes_console, routes_downloads, routes_metrics, routes_payments
from master.api.base import API, Route, RouteIndex
from master.api.keys import OPENAPI_DOCUMENT, ROUTE_INDEX
from master.api.openapi import build_openapi
from master.api.ratelimits import rate_limits_ctx
from master.api.table import NEVER_LIMITED, ROUTES, UNVERSIONED


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The route table's OpenAPI document, built once per process (the table is fixed at import; building it takes
    ~70 ms of pydantic's schema generation, which every app, and so every API test, paid)."""
    return build_openapi(ROUTES)


def add_api(app: web.Application) -> None:
    """Register every route of the table on ``app``, with what its middlewares and handlers read."""
    by_route: dict[web.AbstractRoute, Route] = {}
    for route in ROUTES:
        if route.public and route.roles:
            raise ValueError(f"{route.method} {route.path}: a public route cannot require roles")
        by_route[app.router.add_route(route.method, API + route.path, route.handler)] = route
    for route in UNVERSIONED:
        # Outside /api/v1, a GET answers HEAD too (a download's size and checksum without its body).
        resource = app.router.add_resource(route.path)
        methods = (route.method, "HEAD") if route.method == "GET" else (route.method,)
        for method in methods:
            by_route[resource.add_route(method, route.handler)] = route
    app[ROUTE_INDEX] = RouteIndex(by_route=by_route, never_limited=NEVER_LIMITED)
    app[OPENAPI_DOCUMENT] = openapi_document()
    app.cleanup_ctx.extend(
        (rate_limits_ctx, routes_metrics.exporter_ctx, routes_downloads.packages_ctx, routes_console.streams_ctx,
         routes_payments.payments_ctx)
    )
    app.on_shutdown.append(routes_console.close_streams)
