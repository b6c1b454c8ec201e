"""The ``/api/v1`` handlers and the one table that registers them and documents them in OpenAPI."""

from __future__ import annotations

import shlex
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime
from decimal import Decimal
from typing import Any

from aiohttp import web
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from billing import credits, ledger, rating, summaries
from master.api import (
    routes_alerts,
    routes_billing,
    routes_console,
    routes_downloads,
    routes_invoices,
    routes_market,
    routes_metrics,
)
from master.api.base import (
    API,
    PAGING,
    HandlerFn,
    QueryParam,
    Route,
    int_query,
    listing,
    page,
    parse_body,
    str_query,
)
from master.api.keys import MASTER
from master.api.middleware import principal
from master.api.schemas import EnrollRequest, ErrorBody, QuotaPut, RentalCreate
from master.models import Account, Rental, RentalEvent
from master.services import (
    commands,
    enrollment,
    faults,
    host_views,
    rental_placement,
    rental_request,
    rentals,
)
from master.services.accounts import Principal
from master.telemetry import store as telemetry
from shared import protocol
from shared.errors import BadRequest, NotFound

VERSION = "0.1.0"

# ---- handlers -------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    checks: dict[str, str] = {}
    try:
        async with master.db.session() as session:
            await session.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        await master.bus.ping()
        checks["bus"] = "ok"
    except Exception as exc:
        checks["bus"] = f"error: {type(exc).__name__}"
    ok = all(v == "ok" for v in checks.values())
    return web.json_response(
        {"status": "ok" if ok else "degraded", "version": VERSION, "instance": master.instance_id, "checks": checks},
        status=200 if ok else 503,
    )


async def health_live(request: web.Request) -> web.Response:
    """Liveness: this process serves requests. Touches neither the database nor Redis, so an outage of those
    makes masters unready (``/health``), never restarted."""
    master = request.app[MASTER]
    return web.json_response({"status": "ok", "version": VERSION, "instance": master.instance_id})


async def get_account(request: web.Request) -> web.Response:
    who = principal(request)
    async with request.app[MASTER].db.session() as session:
        account = await session.get(Account, who.account_id)
        assert account is not None
        view = {
            "id": account.id, "name": account.name, "role": account.role, "created_at": account.created_at.isoformat(),
            "quota": (quota := await rental_placement.quota_view(request.app[MASTER], session, account)),
            "credit": await credits.credit_view(session, account, burn_per_hour=Decimal(quota["spend_per_hour"]),
                                                now=request.app[MASTER].clock.now()),
        }  # fmt: skip
        if account.role != "renter":
            view["earnings"] = await summaries.provider_earnings(session, account.id)
        return web.json_response(view)


async def put_account_quota(request: web.Request) -> web.Response:
    principal(request).require("admin")
    body = await parse_body(request, QuotaPut)
    account_id = request.match_info["account_id"]
    async with request.app[MASTER].db.session() as session:
        account = await session.get(Account, account_id, with_for_update=True)
        if account is None:
            raise NotFound(f"no account {account_id!r}", code="account_not_found")
        account.max_gpus, account.max_spend_per_hour = body.max_gpus, body.max_spend_per_hour
        view = await rental_placement.quota_view(request.app[MASTER], session, account)
    return web.json_response({"account_id": account_id, "quota": view})


async def create_enrollment_token(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    who = principal(request)
    token, expires_at = await enrollment.create_token(master, who.account_id)
    public = shlex.quote((master.settings.public_url or f"http://{request.host}").rstrip("/"))
    return web.json_response(
        {
            "token": token,
            "expires_at": expires_at.isoformat(),
            # The installer (deploy/install-agent.sh, served by this master) installs, enrolls and starts the agent.
            "enroll_command": f"curl -fsSL {public}/downloads/install-agent.sh | sh -s -- --master {public} --token {token}",
            # For an agent installed by other means.
            "enroll_command_manual": f"gpumarket agent enroll --master {public} --token {token}",
        },
        status=201,
    )


async def enroll(request: web.Request) -> web.Response:
    body = await parse_body(request, EnrollRequest)
    result = await enrollment.enroll(request.app[MASTER], body.token, body.csr, hostname=body.hostname)
    return web.json_response(
        {
            "host_id": result.host_id,
            "certificate": result.certificate_pem,
            "ca_certificate": result.ca_certificate_pem,
            "relay_urls": result.relay_urls,
            "not_after": result.not_after.isoformat(),
        },
        status=201,
    )


async def _with_earnings(session: AsyncSession, who: Principal, views: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each host's earnings for its provider (and admins); renters see null."""
    earned = await summaries.earned_by_host(session, [v["id"] for v in views]) if who.role != "renter" else {}
    for view in views:
        view["earned"] = ledger.money(earned.get(view["id"], Decimal(0))) if who.role != "renter" else None
    return views


async def list_hosts(request: web.Request) -> web.Response:
    limit, offset = page(request)
    who = principal(request)
    async with request.app[MASTER].db.session() as session:
        items, total = await host_views.list_hosts(session, who, limit=limit, offset=offset)
        items = await _with_earnings(session, who, items)
    return listing(items, total, limit, offset)


async def get_host(request: web.Request) -> web.Response:
    who = principal(request)
    async with request.app[MASTER].db.session() as session:
        view = await host_views.get_host(session, who, request.match_info["host_id"])
        return web.json_response((await _with_earnings(session, who, [view]))[0])


def time_query(request: web.Request, name: str) -> datetime | None:
    raw = request.query.get(name)
    if not raw:
        return None
    try:
        value = datetime.fromisoformat(raw)
    except ValueError:
        raise BadRequest(f"query parameter {name!r} must be an ISO 8601 time, got {raw!r}", code="invalid_query") from None
    if value.tzinfo is None:
        raise BadRequest(f"query parameter {name!r} needs a timezone (e.g. 2026-01-01T00:00:00Z)", code="invalid_query")
    return value


async def get_host_metrics(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    limit = int_query(request, "limit", 360, minimum=1, maximum=5000)
    since, until = time_query(request, "since"), time_query(request, "until")
    resolution = telemetry.pick_resolution(str_query(request, "resolution"), since, until, master.clock.now())
    async with master.db.session() as session:
        items = await host_views.host_metrics(
            session, principal(request), request.match_info["host_id"], since=since, until=until, limit=limit,
            resolution=resolution,
        )
    return web.json_response({"host_id": request.match_info["host_id"], "resolution": resolution, "items": items})


async def get_host_events(request: web.Request) -> web.Response:
    limit, offset = page(request)
    async with request.app[MASTER].db.session() as session:
        items, total = await host_views.host_events(session, principal(request), request.match_info["host_id"], limit=limit, offset=offset)
    return listing(items, total, limit, offset)


async def get_host_network(request: web.Request) -> web.Response:
    limit = int_query(request, "limit", 50, minimum=1, maximum=1000)
    async with request.app[MASTER].db.session() as session:
        items = await host_views.host_network(session, principal(request), request.match_info["host_id"], limit=limit)
    return web.json_response({"host_id": request.match_info["host_id"], "items": items})


async def start_network_test(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    async with master.db.session() as session:
        host = await host_views.owned_host(session, principal(request), request.match_info["host_id"])
        command = commands.new_command(session, host_id=host.id, command=protocol.MeasureNetwork(), rental_id=None)
        command_id = command.id
    await commands.publish(master, [command_id])
    return web.json_response({"command_id": command_id, "host_id": request.match_info["host_id"]}, status=202)


async def revoke_host(request: web.Request) -> web.Response:
    host = await enrollment.revoke_host(request.app[MASTER], principal(request), request.match_info["host_id"])
    return web.json_response({"id": host.id, "state": host.state, "revoked_at": host.revoked_at.isoformat() if host.revoked_at else None})


async def list_relays(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    now = time.time()
    items = [
        {**asdict(r), "spare": r.spare, "age_s": round(now - r.updated_at, 3), "status": "draining" if r.draining else "ok"}
        for r in await master.registry.relays()
    ]
    return web.json_response({"items": items, "total": len(items)})


async def get_rental_logs(request: web.Request) -> web.Response:
    offset = int_query(request, "offset", 0, minimum=0, maximum=1 << 62)
    limit = int_query(request, "limit", 64 << 10, minimum=1, maximum=1 << 20)
    async with request.app[MASTER].db.session() as session:
        body = await rentals.rental_logs(session, principal(request), request.match_info["rental_id"], offset=offset, limit=limit)
    return web.json_response(body)


async def start_health_check(request: web.Request) -> web.Response:
    host_id = request.match_info["host_id"]
    command_id = await faults.request_health_check(request.app[MASTER], principal(request), host_id)
    return web.json_response({"command_id": command_id, "host_id": host_id}, status=202)


async def create_rental(request: web.Request) -> web.Response:
    who = principal(request)
    who.require("renter")
    body = await parse_body(request, RentalCreate)
    key = request.headers.get("Idempotency-Key")
    if key is not None and not 1 <= len(key) <= 255:
        raise BadRequest("Idempotency-Key must be 1 to 255 characters", code="invalid_idempotency_key")
    request_ = rental_request.RentalRequest(
        gpu_count=body.gpu_count, gpu_model=body.gpu_model, workload=body.workload.model_dump(mode="json"),
        restart_on_failure=body.restart_on_failure, gpu_milli=body.gpu_milli, gpu_memory_mib=body.gpu_memory_mib,
        mig_profile=body.mig_profile, offer_id=body.offer_id, query=body.requirements or "", kind=body.kind, bid=body.bid,
        network=body.network.model_dump() if body.network is not None else None, queue=body.queue,
        queue_timeout_s=body.queue_timeout_s,
    )  # fmt: skip
    rental, created = await rentals.create_rental(request.app[MASTER], who, request_, idempotency_key=key)
    async with request.app[MASTER].db.session() as session:
        views = await _rental_views(session, [rental])
    return web.json_response(views[0], status=201 if created else 200)


async def _rental_views(
    session: AsyncSession, rows: Sequence[Rental], events: Sequence[RentalEvent] | None = None
) -> list[dict[str, Any]]:
    """Rental views with their money: what the whole rental costs per hour and what it has charged so far."""
    charged = await summaries.charged_by_rental(session, [r.id for r in rows])
    views = []
    for rental in rows:
        view = rentals.rental_view(rental, events)
        view["price_per_hour"] = ledger.money(rating.per_hour(rental)) if rental.price_per_gpu_hour is not None else None
        view["charged"] = ledger.money(charged.get(rental.id, Decimal(0)))
        views.append(view)
    return views


async def list_rentals(request: web.Request) -> web.Response:
    limit, offset = page(request)
    async with request.app[MASTER].db.session() as session:
        rows, total = await rentals.list_rentals(session, principal(request), limit=limit, offset=offset)
        items = await _rental_views(session, rows)
    return listing(items, total, limit, offset)


async def get_rental(request: web.Request) -> web.Response:
    async with request.app[MASTER].db.session() as session:
        rental = await rentals.get_rental(session, principal(request), request.match_info["rental_id"])
        events = await rentals.rental_events(session, rental.id)
        return web.json_response((await _rental_views(session, [rental], events))[0])


async def delete_rental(request: web.Request) -> web.Response:
    rental = await rentals.stop_rental(request.app[MASTER], principal(request), request.match_info["rental_id"])
    async with request.app[MASTER].db.session() as session:
        views = await _rental_views(session, [rental])
    return web.json_response(views[0], status=202)


async def openapi(request: web.Request) -> web.Response:
    from master.api.openapi import build_openapi

    return web.json_response(build_openapi(ROUTES))


CORE_ROUTES: tuple[Route, ...] = (
    Route("GET", "/health", health, "Readiness of this master process: 200 when its database and Redis answer, "
          "503 (and which failed) otherwise.", public=True, errors=(503,)),
    Route("GET", "/health/live", health_live, "Liveness of this master process: 200 whenever it serves requests.",
          public=True),
    Route("GET", "/openapi.json", openapi, "This document.", public=True),
    Route("GET", "/account", get_account, "The calling account, with its quotas and what it uses of them."),
    Route("PUT", "/accounts/{account_id}/quota", put_account_quota, "Set an account's quotas (GPUs at once, USD per hour).",
          roles=("admin",), body=QuotaPut, errors=(404, 422)),
    Route("POST", "/enrollment-tokens", create_enrollment_token, "Create a one-time host enrollment token.", roles=("provider",), success=201),
    Route("POST", "/enroll", enroll, "Exchange an enrollment token and a CSR for a host certificate.", public=True, body=EnrollRequest, success=201, errors=(400, 403, 422)),
    Route("GET", "/hosts", list_hosts, "Hosts you can see (providers: their own).", query=PAGING),
    Route("GET", "/hosts/{host_id}", get_host, "One host with its GPUs, latest telemetry and recent state changes.", errors=(404,)),
    Route(
        "GET", "/hosts/{host_id}/metrics", get_host_metrics, "Telemetry of a host, oldest first: raw samples with sequence numbers, or 1-minute / 1-hour roll-ups.",
        query=(
            QueryParam("since", "string", "ISO 8601 time with timezone (inclusive)."),
            QueryParam("until", "string", "ISO 8601 time with timezone (exclusive)."),
            QueryParam("limit", "integer", "The newest this many samples (or buckets).", 1, 5000),
            QueryParam("resolution", "string", "raw (every sample), 1m or 1h (per-GPU buckets: average and maximum), "
                       "or auto (the default: raw up to 6 h, 1m up to 3 days, then 1h)."),
        ),
        errors=(404,),
    ),
    Route("GET", "/hosts/{host_id}/events", get_host_events, "The host's state changes, newest first, with cause and actor (renters: without them).",
          query=PAGING, errors=(404,)),
    Route("GET", "/hosts/{host_id}/network", get_host_network, "Network measurements of a host, newest first.",
          query=(QueryParam("limit", "integer", "How many.", 1, 1000),), errors=(404,)),
    Route("POST", "/hosts/{host_id}/health-check", start_health_check,
          "Ask the host's agent to check its GPUs; passing is the only way out of faulty.",
          roles=("provider",), success=202, errors=(404, 409)),
    Route("POST", "/hosts/{host_id}/network-test", start_network_test, "Ask the host's agent to measure its network now.",
          roles=("provider",), success=202, errors=(404,)),
    Route("POST", "/rentals", create_rental, "Rent GPUs (200: a repeat of an Idempotency-Key, answered with the rental it made).",
          roles=("renter",), body=RentalCreate, success=201, also_success=(200,), headers=("Idempotency-Key",), errors=(404, 409, 422)),
    Route("GET", "/rentals", list_rentals, "Your rentals, newest first.", query=PAGING),
    Route("GET", "/rentals/{rental_id}", get_rental, "One rental with its state history.", errors=(404,)),
    Route("POST", "/hosts/{host_id}/revoke", revoke_host, "Revoke a host: refuse its certificate and close its connections.",
          roles=("provider",), errors=(404,)),
    Route("GET", "/relays", list_relays, "Live relays with their region, load and draining flag.", roles=("admin",)),
    Route("GET", "/rentals/{rental_id}/logs", get_rental_logs, "The workload's output from a byte offset.",
          query=(QueryParam("offset", "integer", "Byte offset to read from.", 0, 1 << 62), QueryParam("limit", "integer", "Bytes at most.", 1, 1 << 20)),
          errors=(404,)),
    Route("DELETE", "/rentals/{rental_id}", delete_rental, "Stop a rental; the GPUs are freed when the agent confirms.", success=202, errors=(404,)),
)

ROUTES: tuple[Route, ...] = (
    CORE_ROUTES + routes_market.ROUTES + routes_alerts.ROUTES + routes_metrics.ROUTES + routes_billing.ROUTES
    + routes_invoices.ROUTES + routes_console.ROUTES
)

ERROR_SCHEMA = ErrorBody


def add_routes(app: web.Application) -> None:
    routes_metrics.add_unversioned_routes(app)
    routes_downloads.add_routes(app)
    routes_console.add_stream_lifecycle(app)
    for route in ROUTES:
        handler = route.handler
        if route.roles:
            handler = _requiring(route.roles, handler)
        app.router.add_route(route.method, API + route.path, handler)


def _requiring(roles: tuple[str, ...], handler: HandlerFn) -> HandlerFn:
    async def guarded(request: web.Request) -> web.StreamResponse:
        principal(request).require(*roles)
        return await handler(request)

    return guarded
