"""The core ``/api/v1`` routes: health, the OpenAPI document, the account, enrollment, hosts, rentals, relays.

Handlers parse, call one service function and respond; who may call them is their row's
``roles`` / ``public``, enforced by the middlewares (``master/api/middleware.py``).
"""

from __future__ import annotations

import shlex

from aiohttp import web

from billing import views as money
from master.api.base import (
    PAGING,
    VERSION,
    QueryParam,
    RateClass,
    Route,
    idempotency_key,
    int_query,
    listing,
    page,
    parse_body,
    refuse_template_with_workload,
    str_query,
)
from master.api.keys import MASTER, OPENAPI_DOCUMENT
from master.api.middleware import principal
from master.api.responses import (
    CommandAccepted,
    Enrollment,
    EnrollmentCheck,
    EnrollmentToken,
    Liveness,
    Readiness,
)
from master.api.schemas import EnrollCheckRequest, EnrollRequest, FairSharePut, QuotaPut, RentalCreate
from master.api.times import time_query
from master.scheduler.price import optional_tolerance
from master.services import hosts, market, platform, rentals
from master.services.rentals import RentalRequest, set_fair_share, set_quota
from master.telemetry import series
from master.telemetry import store as telemetry
from shared.errors import ValidationFailed

# ---- handlers -------------------------------------------------------------------------

# What a POST /rentals must name, at least one of: which GPUs, how many, or what runs on them.
RENTAL_TARGETS = frozenset({"offer_id", "gpu_model", "requirements", "gpu_count", "gpu_milli", "mig_profile", "template", "workload"})


async def health(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    checks = await platform.dependency_checks(master)
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
    return web.json_response(await money.account_view(request.app[MASTER], principal(request)))


async def put_account_quota(request: web.Request) -> web.Response:
    body = await parse_body(request, QuotaPut)
    account_id = request.match_info["account_id"]
    view = await set_quota(
        request.app[MASTER], account_id, max_gpus=body.max_gpus, max_spend_per_hour=body.max_spend_per_hour
    )
    return web.json_response({"account_id": account_id, "quota": view})


async def put_account_fair_share(request: web.Request) -> web.Response:
    body = await parse_body(request, FairSharePut)
    account_id = request.match_info["account_id"]
    weight = await set_fair_share(request.app[MASTER], account_id, weight=body.weight)
    return web.json_response({"account_id": account_id, "fair_share_weight": weight})


async def create_enrollment_token(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    who = principal(request)
    token, expires_at = await hosts.create_token(master, who.account_id)
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
    result = await hosts.enroll(request.app[MASTER], body.token, body.csr, hostname=body.hostname)
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


async def check_enrollment_token(request: web.Request) -> web.Response:
    """Whether a token can enroll a host, without using it (the installer asks before it installs anything)."""
    body = await parse_body(request, EnrollCheckRequest)
    expires_at = await hosts.check_token(request.app[MASTER], body.token)
    return web.json_response({"usable": True, "expires_at": expires_at.isoformat()})


async def list_hosts(request: web.Request) -> web.Response:
    limit, offset = page(request)
    items, total = await money.host_page(request.app[MASTER], principal(request), limit=limit, offset=offset)
    return listing(items, total, limit, offset)


async def get_host(request: web.Request) -> web.Response:
    return web.json_response(await money.host_detail(request.app[MASTER], principal(request), request.match_info["host_id"]))


async def get_host_metrics(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    limit = int_query(request, "limit", 360, minimum=1, maximum=5000)
    since, until = time_query(request, "since"), time_query(request, "until")
    resolution = telemetry.pick_resolution(str_query(request, "resolution"), since, until, master.clock.now())
    async with master.db.session() as session:
        items = await series.host_metrics(
            session, principal(request), request.match_info["host_id"], since=since, until=until, limit=limit,
            resolution=resolution,
        )
    return web.json_response({"host_id": request.match_info["host_id"], "resolution": resolution, "items": items})


async def get_host_events(request: web.Request) -> web.Response:
    limit, offset = page(request)
    async with request.app[MASTER].db.session() as session:
        items, total = await hosts.host_events(session, principal(request), request.match_info["host_id"], limit=limit, offset=offset)
    return listing(items, total, limit, offset)


async def get_host_network(request: web.Request) -> web.Response:
    limit = int_query(request, "limit", 50, minimum=1, maximum=1000)
    async with request.app[MASTER].db.session() as session:
        items = await hosts.host_network(session, principal(request), request.match_info["host_id"], limit=limit)
    return web.json_response({"host_id": request.match_info["host_id"], "items": items})


async def start_network_test(request: web.Request) -> web.Response:
    command_id = await hosts.request_network_test(request.app[MASTER], principal(request), request.match_info["host_id"])
    return web.json_response({"command_id": command_id, "host_id": request.match_info["host_id"]}, status=202)


async def revoke_host(request: web.Request) -> web.Response:
    host = await hosts.revoke_host(request.app[MASTER], principal(request), request.match_info["host_id"])
    return web.json_response({"id": host.id, "state": host.state, "revoked_at": host.revoked_at.isoformat() if host.revoked_at else None})


async def list_relays(request: web.Request) -> web.Response:
    items = await platform.relay_list(request.app[MASTER])
    return web.json_response({"items": items, "total": len(items)})


async def get_rental_logs(request: web.Request) -> web.Response:
    offset = int_query(request, "offset", 0, minimum=0, maximum=1 << 62)
    limit = int_query(request, "limit", 64 << 10, minimum=1, maximum=1 << 20)
    async with request.app[MASTER].db.session() as session:
        body = await rentals.rental_logs(session, principal(request), request.match_info["rental_id"], offset=offset, limit=limit)
    return web.json_response(body)


async def start_health_check(request: web.Request) -> web.Response:
    host_id = request.match_info["host_id"]
    command_id = await market.request_health_check(request.app[MASTER], principal(request), host_id)
    return web.json_response({"command_id": command_id, "host_id": host_id}, status=202)


async def create_rental(request: web.Request) -> web.Response:
    body = await parse_body(request, RentalCreate)
    if not any(getattr(body, name) is not None for name in RENTAL_TARGETS & body.model_fields_set):
        # Regression: an empty body (or none) rented a GPU of the placer's choosing, running nothing, at its price.
        raise ValidationFailed(
            f"say what to rent: give at least one of {', '.join(sorted(RENTAL_TARGETS))} "
            "(e.g. {\"gpu_count\": 1, \"gpu_model\": \"RTX 4090\"} or {\"offer_id\": ...} from GET /api/v1/offers)",
            code="rental_target_missing", details={"problems": [{"field": "body", "problem": "names no GPUs or workload"}]},
        )
    refuse_template_with_workload(body.template, body.model_fields_set)
    key = idempotency_key(request)
    request_ = RentalRequest(
        gpu_count=body.gpu_count, gpu_model=body.gpu_model, template=body.template,
        workload={} if body.template is not None else body.workload.model_dump(mode="json"),
        restart_on_failure=body.restart_on_failure, gpu_milli=body.gpu_milli, gpu_memory_mib=body.gpu_memory_mib,
        mig_profile=body.mig_profile, offer_id=body.offer_id, query=body.requirements or "", kind=body.kind, bid=body.bid,
        network=body.network.model_dump() if body.network is not None else None, queue=body.queue,
        queue_timeout_s=body.queue_timeout_s, volumes=tuple(v.ask() for v in body.volumes or ()),
        price_tolerance=optional_tolerance(body.price_tolerance),
        failover_after_s=body.failover_after_s,
    )  # fmt: skip
    view, created = await money.create_rental(request.app[MASTER], principal(request), request_, idempotency_key=key)
    return web.json_response(view, status=201 if created else 200)


async def list_rentals(request: web.Request) -> web.Response:
    limit, offset = page(request)
    items, total = await money.rental_page(request.app[MASTER], principal(request), limit=limit, offset=offset)
    return listing(items, total, limit, offset)


async def get_rental(request: web.Request) -> web.Response:
    return web.json_response(await money.rental_detail(request.app[MASTER], principal(request), request.match_info["rental_id"]))


async def delete_rental(request: web.Request) -> web.Response:
    view = await money.stop_rental(request.app[MASTER], principal(request), request.match_info["rental_id"])
    return web.json_response(view, status=202)


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI_DOCUMENT])


ROUTES: tuple[Route, ...] = (
    Route("GET", "/health", health, "Readiness of this master process: 200 when its database and Redis answer, "
          "503 (and which failed) otherwise.", public=True, limit=RateClass.NONE, response=Readiness, errors=(503,)),
    Route("GET", "/health/live", health_live, "Liveness of this master process: 200 whenever it serves requests.",
          public=True, limit=RateClass.NONE, response=Liveness),
    Route("GET", "/openapi.json", openapi, "This document.", public=True),
    Route("GET", "/account", get_account, "The calling account, with its quotas and what it uses of them."),
    Route("PUT", "/accounts/{account_id}/quota", put_account_quota, "Set an account's quotas (GPUs at once, USD per hour).",
          roles=("admin",), body=QuotaPut, errors=(404, 422)),
    Route("PUT", "/accounts/{account_id}/fair-share", put_account_fair_share, "Set an account's weight in the queue's fair "
          "share (docs/placement.md, \"Fair queues\").", roles=("admin",), body=FairSharePut, errors=(404, 422)),
    Route("POST", "/enrollment-tokens", create_enrollment_token, "Create a one-time host enrollment token.", verified=True, roles=("provider",),
          limit=RateClass.ENROLLMENT_TOKENS, response=EnrollmentToken, success=201),
    Route("POST", "/enroll", enroll, "Exchange an enrollment token and a CSR for a host certificate.", public=True, limit=RateClass.ENROLL, body=EnrollRequest, response=Enrollment, success=201, errors=(400, 403, 422)),
    Route("POST", "/enroll/check", check_enrollment_token, "Whether an enrollment token can enroll a host now, without "
          "using it: 200, or 403 with POST /enroll's code (token_unknown, token_used, token_expired).", public=True,
          limit=RateClass.ENROLL_CHECK, body=EnrollCheckRequest, response=EnrollmentCheck, errors=(400, 403, 422)),
    Route("GET", "/hosts", list_hosts, "Hosts you can see (providers: their own).", query=PAGING),
    Route("GET", "/hosts/{host_id}", get_host, "One host with its GPUs (each with what the GPU challenge proved: "
          "verification), latest telemetry and recent state changes (docs/marketplace.md).", errors=(404,)),
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
          roles=("provider",), response=CommandAccepted, success=202, errors=(404, 409)),
    Route("POST", "/hosts/{host_id}/network-test", start_network_test, "Ask the host's agent to measure its network now.",
          roles=("provider",), response=CommandAccepted, success=202, errors=(404,)),
    Route("POST", "/rentals", create_rental, "Rent GPUs (200: a repeat of an Idempotency-Key, answered with the rental it made).",
          verified=True, roles=("renter",), body=RentalCreate, success=201, also_success=(200,), headers=("Idempotency-Key",), errors=(404, 409, 422)),
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
