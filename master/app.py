"""Assembling and running the master: every resource a context, torn down in reverse.

What a master process holds, in the order it opens (it closes in the reverse order):

1. **The master's resources** (``open_master``): the database (migrated, or its schema
   checked), the bus, the CA (files: nothing to close), the relay registry. Each is pushed on
   an ``AsyncExitStack`` as it opens, so one that fails closes those opened before it.
   ``close_master`` closes them in reverse: registry, bus, database.
2. **The app's** ``cleanup_ctx`` (``create_app``), in order: the master's resources when the
   app owns them (``owns_master``: closing them is its first context, so they close last), the
   API's own (``master.api.router.add_api``: the rate-limit store, the metrics exporter, the
   agent package finder, the live streams' closing event), the services' gateway
   (``master.api.routes_gateway``: nothing opens, its replica pools close and its last figures
   are written at cleanup), the alert webhook's HTTP client session and the background
   supervisor (both with ``background``). The supervisor's module
   docstring (``master.background.supervisor``) is the loops' written start, crash and stop
   policy.

The master's resources open before the app is built, not in its first ``cleanup_ctx``, because
the app is built over an opened ``Master``: routes read its settings as they are added, and an
embedder (``gpumarket up``, the tests, the benchmarks) shares that ``Master`` with its relay and
agents, opens it with ``open_master``, hands it to ``create_app`` and closes it with
``close_master`` after the app. A standalone master (``serve_master``) hands it to the app to
own instead.

A failed start leaks nothing: a resource that fails to open closes those opened before it;
when ``runner.setup()`` fails, ``runner.cleanup()`` unwinds the contexts already entered (the
owned master's included); and ``serve_master`` closes the master itself if the app cannot be
built. Shutdown: the loops stop in reverse start order (each cancel is safe: whatever they had
not acknowledged stays pending on the bus), the webhook session, the gateway and the rate-limit
store close, then the registry, the bus and the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from billing.enforce import PrepaidCreditGate
from console.routes import add_console_routes
from master.api.keys import MASTER
from master.api.middleware import MIDDLEWARES
from master.api.router import add_api
from master.api.routes_gateway import add_gateway_routes
from master.background.alerts import webhook_session
from master.background.supervisor import Supervisor, master_loops
from master.context import Master
from master.db import Database, open_database, sqlite_url
from master.scheduler import get_placer
from master.services import accounts
from shared.bus import Bus, open_bus
from shared.clock import Clock, SystemClock
from shared.crypto import CertificateAuthority
from shared.errors import ConfigError
from shared.registry import Registry, open_registry
from shared.settings import MasterSettings

log = logging.getLogger(__name__)

WEBHOOK_HTTP = web.AppKey("alert_webhook_http", aiohttp.ClientSession)
"""The alert webhook's HTTP client session (set while the app runs with ``background``)."""
SUPERVISOR = web.AppKey("supervisor", Supervisor)
"""The background loops' supervisor (set while the app runs with ``background``)."""


async def _open_database(settings: MasterSettings) -> Database:
    """The database, migrated (or its schema checked); closed again if that fails."""
    url = settings.database_url or sqlite_url(settings.data_dir / "gpumarket.db")
    return await open_database(url, migrate=settings.migrate_on_start, who="masters with migrate_on_start=false")


async def open_master(
    settings: MasterSettings, *, bus: Bus | None = None, clock: Clock | None = None, registry: Registry | None = None
) -> Master:
    """Open the database (and migrate it), the bus, the CA and the registry. Close with ``close_master``.

    A ``bus`` or ``registry`` handed in is used as is (and closed by ``close_master`` all the
    same). If any step fails, what this call opened before it is closed again.
    """
    placer = get_placer(settings.placer)  # an unknown name fails here, before anything opens
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    async with contextlib.AsyncExitStack() as opened:
        db = await _open_database(settings)
        opened.push_async_callback(db.close)
        if bus is None:
            if settings.redis_url is None:
                raise ConfigError("a standalone master needs the bus: set GPUMARKET_REDIS_URL (or use `gpumarket up`)")
            bus = await open_bus(settings.redis_url, prefix=settings.bus_prefix)
            opened.push_async_callback(bus.close)
        ca = CertificateAuthority.load_or_create(settings.data_dir / "ca")
        instance = settings.instance_id or f"{socket.gethostname()}-{os.getpid()}"
        if registry is None:
            registry = await open_registry(settings.redis_url, prefix=settings.bus_prefix)
            opened.push_async_callback(registry.close)
        opened.pop_all()  # all open: from here on they are close_master's
    return Master(
        settings=settings, db=db, bus=bus, ca=ca, credit_gate=PrepaidCreditGate(), clock=clock or SystemClock(), instance_id=instance, registry=registry,
        placer=placer, command_secrets=accounts.RegistryLogins(settings),
    )  # fmt: skip


async def close_master(master: Master, *, close_bus: bool = True) -> None:
    """Close what ``open_master`` opened, in reverse: the registry and the bus (unless not ``close_bus``), the database.

    Each is closed even when closing one before it failed.
    """
    async with contextlib.AsyncExitStack() as closing:
        closing.push_async_callback(master.db.close)
        if close_bus:
            closing.push_async_callback(master.bus.close)
            closing.push_async_callback(master.registry.close)


async def _owned_master(app: web.Application) -> AsyncIterator[None]:
    """The master's resources, when the app owns them: nothing to open, ``close_master`` at cleanup."""
    try:
        yield
    finally:
        await close_master(app[MASTER])


async def _webhook_http(app: web.Application) -> AsyncIterator[None]:
    """The alert webhook's HTTP client session, for the alert loop's whole life."""
    async with webhook_session() as http:
        app[WEBHOOK_HTTP] = http
        yield


async def _supervisor(app: web.Application) -> AsyncIterator[None]:
    """Every background loop, started after the resources they use and stopped before those close."""
    async with Supervisor(master_loops(app[MASTER], webhook_http=app[WEBHOOK_HTTP])) as supervisor:
        app[SUPERVISOR] = supervisor
        yield


def create_app(master: Master, *, background: bool = True, owns_master: bool = False) -> web.Application:
    """The aiohttp app of one master process (REST API, console, and its background loops).

    The caller keeps ``master`` and closes it after the app (``close_master``), unless
    ``owns_master``: then the app closes it, last, when it is cleaned up.
    """
    app = web.Application(middlewares=MIDDLEWARES, client_max_size=master.settings.max_request_bytes)
    app[MASTER] = master
    if owns_master:
        app.cleanup_ctx.append(_owned_master)
    add_api(app)
    add_gateway_routes(app)
    add_console_routes(app)
    if background:
        app.cleanup_ctx.append(_webhook_http)
        app.cleanup_ctx.append(_supervisor)
    return app


async def serve_master(settings: MasterSettings, *, stop: asyncio.Event) -> None:
    """Run a standalone master until ``stop`` is set; its app owns (and closes) the master's resources."""
    master = await open_master(settings)
    try:
        app = create_app(master, owns_master=True)
    except BaseException:
        await close_master(master)
        raise
    runner = web.AppRunner(app, shutdown_timeout=3.0)
    try:
        await runner.setup()
        site = web.TCPSite(runner, settings.http_host, settings.http_port)
        await site.start()
        log.info("master %s listening on http://%s:%d", master.instance_id, settings.http_host, _port(site))
        await stop.wait()
    finally:
        await runner.cleanup()  # the app's contexts in reverse, the master's resources last


def _port(site: web.TCPSite) -> int:
    server = site._server
    assert isinstance(server, asyncio.base_events.Server)
    port: int = server.sockets[0].getsockname()[1]
    return port


bound_port = _port
