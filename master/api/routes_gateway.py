"""The elastic services' endpoint: ``{public_url}/svc/{service}/{tail}``, any method, websockets too.

Not part of the REST API: outside ``/api/v1``, not in the route table nor the OpenAPI document, so the API's
middlewares leave it alone (no API-key authentication, rate limits or JSON parsing; their lookups find no
route and pass it on). Its one rate limit is on refused tokens (``ApiRateLimits.gateway_refused``): every
token is judged first (the service's token by the service's route, an API key by the gateway's key cache,
read from the database when unknown), and only a refused one costs its address one token of
``gateway_auth_failure_burst``; once the address is in debt its refused requests are answered 429 instead
of 401/404. A valid token is never answered 429, whatever its address sent before. It authenticates by its
own rules, reads bodies as streams with its own bound (``gateway_max_body_mib``) and answers errors in the
API's JSON shape. The rules live in
``master/services/gateway/``; this module parses the request and delegates.

``add_gateway_routes`` registers the routes and the gateway's ``cleanup_ctx`` (its pools closed and its last
figures written at shutdown).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

from aiohttp import web

from master.api.keys import MASTER
from master.api.ratelimits import RATE_LIMITS
from master.services.gateway import close_gateway, error_response, forward, gateway_of
from shared.errors import GpumarketError, NotFound, RateLimited, Unauthorized

PREFIX = "/svc"
SERVICE_ID = re.compile(r"[A-Za-z0-9_-]{1,40}")


def bearer_of(request: web.Request) -> str:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("send the service's token or your API key as 'Authorization: Bearer <token>'",
                           code="missing_token")  # fmt: skip
    return token.strip()


async def serve(request: web.Request) -> web.StreamResponse:
    """Any request to a service's endpoint."""
    service_id = request.match_info["service_id"]
    limits = request.app.get(RATE_LIMITS)
    address = limits.address_of(request) if limits is not None else ""
    try:
        token = bearer_of(request)
        if not SERVICE_ID.fullmatch(service_id):
            raise NotFound(f"no service {service_id!r}; check the URL", code="service_not_found")
        gateway = gateway_of(request.app[MASTER])
        route = await gateway.authorize(service_id, token)
    except (Unauthorized, NotFound) as exc:
        if limits is not None:
            try:
                await limits.gateway_refused(address)
            except RateLimited as limited:
                return error_response(limited)
        return error_response(exc)
    except GpumarketError as exc:
        return error_response(exc)
    return await forward(gateway, request, route, prefix_len=len(f"{PREFIX}/{service_id}"))


async def gateway_ctx(app: web.Application) -> AsyncIterator[None]:
    """Nothing to open (the gateway is built on first use); at shutdown its pools close and its figures are written."""
    yield
    await close_gateway(app[MASTER])


def add_gateway_routes(app: web.Application) -> None:
    app.router.add_route("*", PREFIX + "/{service_id}", serve)
    app.router.add_route("*", PREFIX + "/{service_id}/{tail:.*}", serve)
    app.cleanup_ctx.append(gateway_ctx)
