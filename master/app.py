"""Assembling and running the master: resources as ``cleanup_ctx``, torn down in reverse.

Start-up order: database (migrated) → bus → CA → HTTP app → background loops
(ingestion, heartbeat monitor, command resender, revocation publisher, telemetry
roll-up and retention, alerts, host scoring). Shutdown runs the same list
backwards: loops are cancelled (safe: each leaves unfinished bus messages pending),
then the bus and the database close.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from aiohttp import web

from billing import jobs as billing_jobs
from console.routes import add_console_routes
from master.api.keys import MASTER
from master.api.middleware import MIDDLEWARES
from master.api.router import add_api
from master.context import Master
from master.db import Database, check_schema, sqlite_url
from master.scheduler import get_placer
from master.services import alerts, reliability, rentals
from master.telemetry import rollups
from master.telemetry.ingest import Ingestor, command_resender, heartbeat_monitor, revocation_publisher
from shared.bus import Bus, open_bus
from shared.clock import Clock, SystemClock
from shared.crypto import CertificateAuthority
from shared.errors import ConfigError
from shared.registry import Registry, open_registry
from shared.settings import MasterSettings

log = logging.getLogger(__name__)


async def open_master(
    settings: MasterSettings, *, bus: Bus | None = None, clock: Clock | None = None, registry: Registry | None = None
) -> Master:
    """Open the database (and migrate it), the bus and the CA. Close with ``close_master``."""
    placer = get_placer(settings.placer)  # an unknown name fails here, before anything opens
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    url = settings.database_url or sqlite_url(settings.data_dir / "gpumarket.db")
    db = Database(url)
    try:
        if settings.migrate_on_start:
            await db.migrate()
        else:
            await check_schema(db, who="masters with migrate_on_start=false")
    except ConfigError:
        await db.close()
        raise
    except Exception as exc:
        await db.close()
        raise ConfigError(f"cannot open the database at {db.engine.url!r}: {exc}; check GPUMARKET_DATABASE_URL") from exc
    if bus is None:
        if settings.redis_url is None:
            await db.close()
            raise ConfigError("a standalone master needs the bus: set GPUMARKET_REDIS_URL (or use `gpumarket up`)")
        bus = await open_bus(settings.redis_url, prefix=settings.bus_prefix)
    ca = CertificateAuthority.load_or_create(settings.data_dir / "ca")
    instance = settings.instance_id or f"{socket.gethostname()}-{os.getpid()}"
    if registry is None:
        registry = await open_registry(settings.redis_url, prefix=settings.bus_prefix)
    return Master(
        settings=settings, db=db, bus=bus, ca=ca, clock=clock or SystemClock(), instance_id=instance, registry=registry,
        placer=placer,
    )  # fmt: skip


async def close_master(master: Master, *, close_bus: bool = True) -> None:
    if close_bus:
        await master.bus.close()
        await master.registry.close()
    await master.db.close()


def _background(name: str, factory: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(factory(), name=name)
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return ctx


def create_app(master: Master, *, background: bool = True) -> web.Application:
    """The aiohttp app of one master process (REST API, console, and its background loops)."""
    app = web.Application(middlewares=MIDDLEWARES, client_max_size=master.settings.max_request_bytes)
    app[MASTER] = master
    add_api(app)
    add_console_routes(app)
    if background:
        ingestor = Ingestor(master)
        app.cleanup_ctx.append(_background("ingest", ingestor.run))
        app.cleanup_ctx.append(_background("heartbeat-monitor", lambda: heartbeat_monitor(master)))
        app.cleanup_ctx.append(_background("command-resender", lambda: command_resender(master)))
        app.cleanup_ctx.append(_background("revocation-publisher", lambda: revocation_publisher(master)))
        app.cleanup_ctx.append(_background("telemetry-maintenance", lambda: rollups.maintenance_loop(master)))
        app.cleanup_ctx.append(_background("alerts", lambda: alerts.alert_loop(master)))
        app.cleanup_ctx.append(_background("host-scoring", lambda: reliability.scoring_loop(master)))
        app.cleanup_ctx.append(_background("rental-queue", lambda: rentals.queue_loop(master)))
        if master.settings.billing_in_process:
            for job in billing_jobs.JOBS.values():
                app.cleanup_ctx.append(_background(f"billing-{job.name}", functools.partial(billing_jobs.billing_loop, master, job)))
    return app


async def serve_master(settings: MasterSettings, *, stop: asyncio.Event) -> None:
    """Run a standalone master until ``stop`` is set."""
    master = await open_master(settings)
    runner = web.AppRunner(create_app(master), shutdown_timeout=3.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.http_host, settings.http_port)
        await site.start()
        log.info("master %s listening on http://%s:%d", master.instance_id, settings.http_host, _port(site))
        await stop.wait()
    finally:
        await runner.cleanup()
        await close_master(master)


def _port(site: web.TCPSite) -> int:
    server = site._server
    assert isinstance(server, asyncio.base_events.Server)
    port: int = server.sockets[0].getsockname()[1]
    return port


bound_port = _port
