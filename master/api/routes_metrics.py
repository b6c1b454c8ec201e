"""Operator metrics: ``GET /metrics`` (Prometheus) and ``GET /api/v1/metrics`` (JSON)."""

from __future__ import annotations

from aiohttp import web

from master.api.base import Route

ROUTES: tuple[Route, ...] = ()


def add_unversioned_routes(app: web.Application) -> None:
    """Routes outside ``/api/v1`` (the Prometheus scrape endpoint)."""
