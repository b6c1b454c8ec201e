"""Errors as JSON with a stable code, rate limits (master/api/ratelimits.py), authentication and roles.

Every decision about a route is read from its row of the route table (``master/api/table.py``),
looked up per request in the app's ``ROUTE_INDEX``: whether it is public, the roles it needs,
its rate-limit class. Handlers never check roles themselves.

Order in the app (``MIDDLEWARES``): errors → rate limits → unknown query parameters → authentication →
per-account rate limits → the route's roles.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable

import asyncpg
from aiohttp import web
from redis import exceptions as redis_exceptions
from sqlalchemy import exc as sa_exc

from master.api.base import API, RateClass, Route
from master.api.characters import check_line
from master.api.keys import MASTER, ROUTE_INDEX
from master.api.ratelimits import RATE_LIMITS, request_address
from master.services import accounts
from master.services.accounts import Principal, authenticate
from shared.errors import BadRequest, Forbidden, GpumarketError, RateLimited, Unauthorized

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

PRINCIPAL = web.RequestKey("principal", Principal)
SESSION = web.RequestKey("console_session", accounts.SignedIn)
# Methods that change something: a call authenticated by the console's cookie must also carry its CSRF token.
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})

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
        response = web.json_response(exc.to_json(), status=exc.http_status)
        if isinstance(exc, RateLimited):
            response.headers["Retry-After"] = str(exc.retry_after)
        return response
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
    except Exception as exc:
        if not_storable_text(exc):
            # A safety net: the middlewares refuse control characters in paths, queries and bodies before any
            # handler runs, so this is text from elsewhere (a header?) that PostgreSQL cannot hold. The caller's, not ours.
            log.warning("%s %s: text PostgreSQL cannot store: %s", request.method, request.path, exc)
            return error_response(400, "invalid_character", "the request holds a character the database cannot "
                                  "store (NUL, or an escape it cannot translate); remove it")  # fmt: skip
        dependency = unavailable_dependency(exc)
        if dependency is not None:
            # An outage, not a bug: the client may retry (with the same Idempotency-Key) once it is back.
            log.warning("%s %s: the %s is unavailable: %s", request.method, request.path, dependency, exc)
            response = error_response(503, f"{dependency}_unavailable",
                                      f"the {dependency} is unavailable for a moment; retry in a few seconds")  # fmt: skip
            response.headers["Retry-After"] = str(UNAVAILABLE_RETRY_AFTER_S)
            return response
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, "internal_error", "internal error; it has been logged")


UNAVAILABLE_RETRY_AFTER_S = 5
_NOT_STORABLE = (asyncpg.exceptions.CharacterNotInRepertoireError, asyncpg.exceptions.UntranslatableCharacterError)
_NOT_STORABLE_SQLSTATES = frozenset({"22021", "22P05"})  # character_not_in_repertoire, untranslatable_character


def not_storable_text(exc: BaseException) -> bool:
    """Whether ``exc`` is PostgreSQL refusing text it cannot store (NUL; a ``\\u0000`` in JSON), however wrapped: by
    SQLAlchemy (``DBAPIError``, its adapted driver error) or not at all."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, _NOT_STORABLE) or getattr(cause, "sqlstate", None) in _NOT_STORABLE_SQLSTATES:
            return True
        orig = getattr(cause, "orig", None)
        cause = orig if isinstance(orig, BaseException) and id(orig) not in seen else cause.__cause__
    return False


def unavailable_dependency(exc: BaseException) -> str | None:
    """``"database"`` or ``"bus"`` when ``exc`` means that server cannot be reached (or dropped the
    connection) rather than that the request or our code is wrong; ``None`` otherwise."""
    if isinstance(exc, redis_exceptions.ConnectionError | redis_exceptions.TimeoutError):
        return "bus"
    if isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError):
        return "database"
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return "database"
    if isinstance(exc, ConnectionError | asyncpg.exceptions.ConnectionDoesNotExistError | asyncpg.exceptions.CannotConnectNowError):
        return "database"  # the driver's own connect failures, before SQLAlchemy wraps anything
    return None


def declared_route(request: web.Request) -> Route | None:
    """The row of the route table the request matched (``None``: no route, or one outside the table)."""
    index = request.app.get(ROUTE_INDEX)
    return index.route_of(request) if index is not None else None


@web.middleware
async def rate_limit_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Before authentication, so neither a flood nor guessed keys cost a database lookup."""
    limits, index = request.app.get(RATE_LIMITS), request.app.get(ROUTE_INDEX)
    rate_class = index.rate_class(request) if index is not None else RateClass.NONE
    if limits is None or rate_class is RateClass.NONE:
        return await handler(request)
    address = limits.address_of(request)
    await limits.before_auth(request, address, rate_class)
    try:
        return await handler(request)
    except Unauthorized:
        await limits.sign_in_failed(address, rate_class)
        raise


def check_query(route: Route, names: Iterable[str]) -> None:
    """400 ``unknown_parameter`` for the first of ``names`` that ``route`` does not declare: a misspelt filter
    (``?gpu=A100`` for ``?gpu_model=``) must not silently answer an unfiltered list."""
    known = [q.name for q in route.query]
    for name in names:
        if name not in known:
            takes = f"known: {', '.join(known)}" if known else "this route takes none"
            raise BadRequest(f"unknown query parameter {name!r}; {takes}", code="unknown_parameter")


@web.middleware
async def query_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """No path or query parameter of a route of the table holds a control character (400
    ``invalid_character``, ``master.api.characters``), and every ``/api/v1`` route's query parameters
    are the ones its row of the table declares (``Route.query``).

    Before authentication: a malformed call costs no database lookup. Routes outside the table are
    left alone: the console's files, and a service's endpoint (``/svc/…``), whose path and query
    are its renter's server's to judge (the gateway checks the service's id itself)."""
    route = declared_route(request)
    if route is not None:
        for name, value in request.match_info.items():
            check_line(f"path parameter {name!r}", value)
        for name, value in request.query.items():
            check_line(f"query parameter name {name!r}", name)
            check_line(f"query parameter {name!r}", value)
    if route is not None and request.query and request.path.startswith(f"{API}/"):
        check_query(route, request.query.keys())
    return await handler(request)


@web.middleware
async def account_rate_limit_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """After authentication: the buckets of the calling account."""
    limits, route = request.app.get(RATE_LIMITS), declared_route(request)
    if limits is not None and route is not None and PRINCIPAL in request:
        await limits.after_auth(request[PRINCIPAL].account_id, route.limit)
    return await handler(request)


@web.middleware
async def roles_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The roles the route declares (admins pass every role check): 403 ``forbidden`` for any other caller; 403
    ``scope_missing`` for an API key without the scope the route needs (``Route.needs``); 403
    ``email_not_verified`` on a route that needs a verified address (``Route.verified``) for an account without one.

    After the account's rate limits, so a refused call still takes from the account's buckets."""
    route = declared_route(request)
    if route is not None and route.roles:
        principal(request).require(*route.roles)
    if route is not None and not route.public:
        accounts.check_team_role(principal(request), route.needs)
    scopes = principal(request).scopes if route is not None and not route.public else None
    if route is not None and scopes is not None and route.needs not in scopes:
        raise accounts.ScopeMissing(f"this API key may not call {route.method} {API}{route.path}: it needs the "
                                    f"'{route.needs}' scope and has {', '.join(sorted(scopes))}; make a key with it "
                                    f"(gpumarket keys create --scope {route.needs})")  # fmt: skip
    if route is not None and route.verified and not principal(request).email_verified:
        raise EmailNotVerified("verify your email address first: open the link we mailed you, or ask for a new one "
                               "(POST /api/v1/accounts/verify/resend, or the console's banner)")  # fmt: skip
    return await handler(request)


class EmailNotVerified(Forbidden):
    code = "email_not_verified"


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Authenticates every route the table does not declare public, by API key or console session.

    A route outside the table is private under ``/api/`` and left alone elsewhere (the console's
    static files)."""
    if request.match_info.http_exception is not None:
        raise request.match_info.http_exception  # unknown path or method: 404/405 before any auth
    route = declared_route(request)
    public = route.public if route is not None else not request.path.startswith("/api/")
    if not public:
        master = request.app[MASTER]
        header = request.headers.get("Authorization")
        cookie = request.cookies.get(accounts.COOKIE)
        if header is None and cookie:
            # The web console: a session cookie, and for any change the session's CSRF token too.
            async with master.db.session() as session:
                signed_in = await accounts.resolve(session, cookie, settings=master.settings, now=master.clock.now())
                if request.method in UNSAFE_METHODS:
                    signed_in.check_csrf(request.headers.get(accounts.CSRF_HEADER))
                request[PRINCIPAL] = await accounts.act_for(session, signed_in.principal, team_named(request))
            request[SESSION] = signed_in
            return await handler(request)
        scheme, _, key = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            if header is None and request.path.startswith("/api/v1/sessions"):
                raise Unauthorized("you are not signed in; sign in again", code="not_signed_in")
            raise Unauthorized("send your API key as 'Authorization: Bearer <key>'", code="missing_api_key")
        async with master.db.session() as session:
            person = await authenticate(session, key.strip(), address=request_address(request), now=master.clock.now())
            request[PRINCIPAL] = await accounts.act_for(session, person, team_named(request))
    return await handler(request)


def team_named(request: web.Request) -> str | None:
    """The team the request acts for (``Gpumarket-Team``: its id), or ``None`` for the caller's own account."""
    value = request.headers.get(accounts.TEAM_HEADER)
    if value is None and request.method == "GET" and "team" in request.query:
        value = request.query["team"]  # an EventSource (a browser's stream) sends no header; only routes declaring it
    if value is None:
        return None
    if not value.isascii() or not value.isprintable() or not 0 < len(value) <= 40 or value != value.strip():
        raise BadRequest(f"{accounts.TEAM_HEADER}: give a team's id (gpumarket team list shows them)", code="invalid_team")
    return value


def principal(request: web.Request) -> Principal:
    return request[PRINCIPAL]


MIDDLEWARES = (errors_middleware, rate_limit_middleware, query_middleware, auth_middleware, account_rate_limit_middleware, roles_middleware)
"""The API's middlewares, in the order the app must install them."""
