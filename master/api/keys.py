"""Typed application state keys (``web.AppKey``) shared by the master's handlers."""

from __future__ import annotations

from aiohttp import web

from master.context import Master

MASTER = web.AppKey("master", Master)
