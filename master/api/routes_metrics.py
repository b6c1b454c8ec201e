"""Operator metrics: ``GET /metrics`` (Prometheus) and ``GET /api/v1/metrics`` (JSON).

Both serve the one cached snapshot of ``master.telemetry.metrics.MetricsExporter`` (one per app).
``/metrics`` lives outside ``/api/v1``, so API keys do not apply to it: it takes the
``metrics_token`` setting as a bearer token, and without one set it refuses every scrape (401
``metrics_token_unset``), unless the operator opened it on purpose (``metrics_open``, for a listener
only a private network reaches): the figures name hosts, services and rentals. ``gpumarket up`` makes
a token of its own. ``/api/v1/metrics`` is for admins.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from master.api.base import RateClass, Route
from master.api.keys import MASTER
from master.telemetry.metrics import MetricsExporter
from shared.errors import Unauthorized

METRICS_EXPORTER = web.AppKey("metrics_exporter", MetricsExporter)


async def scrape(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    if master.settings.metrics_token is not None:
        _check_token(request, master.settings.metrics_token)
    elif not master.settings.metrics_open:
        raise Unauthorized("GET /metrics needs a scrape token and this master has none: set its metrics_token (Prometheus "
                           "sends it as 'Authorization: Bearer <token>'), or metrics_open = true for a listener only a "
                           "private network reaches", code="metrics_token_unset")  # fmt: skip
    gzipped = accepts_gzip(request.headers.get("Accept-Encoding", ""))
    body = await request.app[METRICS_EXPORTER].exposition(master, gzipped=gzipped)
    headers = {"Content-Type": CONTENT_TYPE_LATEST, "Vary": "Accept-Encoding"}
    if gzipped:
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=body, headers=headers)


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an ``Accept-Encoding`` header allows gzip (Prometheus always sends ``gzip``)."""
    qualities: dict[str, float] = {}
    for part in accept_encoding.split(","):
        coding, _, params = part.partition(";")
        quality = params.strip().lower().removeprefix("q=")
        try:
            qualities[coding.strip().lower()] = float(quality) if quality else 1.0
        except ValueError:
            qualities[coding.strip().lower()] = 0.0
    return qualities.get("gzip", qualities.get("*", 0.0)) > 0


def _check_token(request: web.Request, token: str) -> None:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise Unauthorized("send the metrics token as 'Authorization: Bearer <token>'", code="missing_metrics_token")
    # Constant time, so the token cannot be guessed a byte at a time from response timings.
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise Unauthorized("the metrics token is wrong; it is the master's metrics_token setting",
                           code="invalid_metrics_token")


async def get_metrics(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    snapshot = await request.app[METRICS_EXPORTER].snapshot(master)
    # Tens of thousands of GPUs make a large document: serialize it off the event loop.
    body = await asyncio.to_thread(lambda: json.dumps(snapshot.to_json()))
    return web.Response(text=body, content_type="application/json")


async def exporter_ctx(app: web.Application) -> AsyncIterator[None]:
    """The app's own exporter (its own Prometheus registry and snapshot cache)."""
    app[METRICS_EXPORTER] = MetricsExporter()
    yield


ROUTES: tuple[Route, ...] = (
    Route(
        "GET", "/metrics", get_metrics,
        "Fleet, GPU, relay, ingestion, rental and alert figures as JSON (the data of the Prometheus /metrics).",
        roles=("admin",),
    ),
)

UNVERSIONED: tuple[Route, ...] = (
    Route("GET", "/metrics", scrape, "Prometheus exposition (the metrics_token setting as a bearer token; closed without one).", public=True,
          limit=RateClass.NONE, media_types=(CONTENT_TYPE_LATEST,)),
)  # fmt: skip
