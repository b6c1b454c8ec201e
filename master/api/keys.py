"""Typed application state keys (``web.AppKey``) shared by the master's handlers and middlewares."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from master.api.base import RouteIndex
from master.context import Master

MASTER = web.AppKey("master", Master)
ROUTE_INDEX = web.AppKey("route_index", RouteIndex)
"""The route table of this app, as the middlewares look a request up in it (``master/api/router.py``)."""
OPENAPI_DOCUMENT: web.AppKey[dict[str, Any]] = web.AppKey("openapi_document")
"""The OpenAPI document of this app's route table, built once when the routes are added."""
