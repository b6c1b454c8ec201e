"""Errors as JSON with a stable code, and API-key authentication."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from master.api.keys import MASTER
from master.services.accounts import Principal, authenticate
from shared.errors import GpumarketError, Unauthorized

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

PUBLIC_PATHS = frozenset({"/api/v1/health", "/api/v1/openapi.json", "/api/v1/enroll"})
PRINCIPAL = web.RequestKey("principal", Principal)

_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
}


def error_response(status: int, code: str, message: str, **extra: object) -> web.Response:
    return web.json_response({"code": code, "message": message, **extra}, status=status)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except GpumarketError as exc:
        if exc.http_status >= 500:
            log.error("%s %s failed: %s", request.method, request.path, exc)
        return web.json_response(exc.to_json(), status=exc.http_status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = _HTTP_CODES.get(exc.status, "http_error")
        message = exc.reason
        if exc.status == 404:
            message = f"no such endpoint: {request.method} {request.path}; see /api/v1/openapi.json"
        elif exc.status == 413:
            message = "request body too large"
        return error_response(exc.status, code, message)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, "internal_error", "internal error; it has been logged")


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.match_info.http_exception is not None:
        raise request.match_info.http_exception  # unknown path or method: 404/405 before any auth
    if request.path.startswith("/api/") and request.path not in PUBLIC_PATHS:
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("send your API key as 'Authorization: Bearer <key>'", code="missing_api_key")
        master = request.app[MASTER]
        async with master.db.session() as session:
            request[PRINCIPAL] = await authenticate(session, key.strip())
    return await handler(request)


def principal(request: web.Request) -> Principal:
    return request[PRINCIPAL]
