"""What every route module shares: the ``Route`` record (one row of the route table), its rate-limit
class, and query and body parsing, paging.

A route module (``routes*.py``) declares its handlers and exports them as ``ROUTES`` (under
``/api/v1``) or ``UNVERSIONED`` (outside it); ``master/api/table.py`` concatenates them, and
the router, the middlewares and the OpenAPI builder all read that one table.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from master.api.jsonbody import decode_json_body
from shared.errors import BadRequest, ValidationFailed

API = "/api/v1"
VERSION = "0.1.0"
"""The API's version, in the OpenAPI document and the health probes."""

Body = TypeVar("Body", bound=BaseModel)
HandlerFn = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class QueryParam:
    name: str
    type: str  # "string" | "integer" | "number"
    description: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()  # the only values accepted (an enum in the document)
    required: bool = False  # left out or empty is 400 (the handler checks: ``required_int_query``)


class RateClass(StrEnum):
    """The token buckets a route's requests take from (``master/api/ratelimits.py``)."""

    NONE = "none"  # never limited: the health probes, and everything outside /api/v1
    DEFAULT = "default"  # the client address's and the credential's buckets
    ENROLL = "enroll"  # and the address's enrollment bucket
    ENROLL_CHECK = "enroll-check"  # and the address's bucket of enrollment token checks (the enrollment settings)
    ENROLLMENT_TOKENS = "enrollment-tokens"  # and the address's and (after authentication) the account's
    SIGN_IN = "sign-in"  # and the address's sign-in bucket; a failed sign-in costs more


@dataclass(frozen=True)
class Route:
    """One route, declared once: the router registers it, the middlewares enforce it, OpenAPI documents it."""

    method: str
    path: str  # under /api/v1 for ``ROUTES``; the whole path for ``UNVERSIONED``
    handler: HandlerFn
    summary: str
    roles: tuple[str, ...] = ()  # empty + public=False: any signed-in account; admins pass every role check
    public: bool = False  # no API key or session needed
    verified: bool = False  # the account's email address must be verified (self-service accounts: signup.py)
    scope: str | None = None  # the API key scope it needs; None: derived (``needs``)
    limit: RateClass = RateClass.DEFAULT
    body: type[BaseModel] | None = None
    response: type[BaseModel] | None = None  # the success body's model, where one is declared (else: any object)
    query: tuple[QueryParam, ...] = ()
    success: int = 200
    also_success: tuple[int, ...] = ()  # e.g. 200 for a repeat that changed nothing, where a first call is 201
    headers: tuple[str, ...] = ()
    errors: tuple[int, ...] = field(default=())
    media_types: tuple[str, ...] = ("application/json",)  # of the success response; JSON is an object, others text


    @property
    def needs(self) -> str:
        """The API key scope a call needs (master/services/accounts/keys.py): ``scope`` where the route says; else
        ``read`` for a GET, ``admin``, ``provider`` or ``rent`` after the role a change needs, ``rent`` for a change
        any account may make (its rentals, clusters, services, SSH keys, connections)."""
        if self.scope is not None:
            return self.scope
        if self.method in ("GET", "HEAD"):
            return "read"
        for role, scope in (("admin", "admin"), ("provider", "provider")):
            if self.roles == (role,):
                return scope
        return "rent"


@dataclass(frozen=True)
class RouteIndex:
    """The table as the middlewares consult it (one per app, built by the router): which ``Route`` a request matched."""

    by_route: Mapping[web.AbstractRoute, Route]
    never_limited: frozenset[str]  # /api/v1 paths whose every route is RateClass.NONE

    def route_of(self, request: web.Request) -> Route | None:
        """The declared route, or ``None`` for a request no route matched (404/405) or one outside the table (static files)."""
        return self.by_route.get(request.match_info.route)

    def rate_class(self, request: web.Request) -> RateClass:
        """The matched route's class; a request that matched none counts as ``DEFAULT`` under /api/v1 (unless its
        path is a probe's), ``NONE`` elsewhere."""
        route = self.route_of(request)
        if route is not None:
            return route.limit
        if not request.path.startswith(f"{API}/") or request.path in self.never_limited:
            return RateClass.NONE
        return RateClass.DEFAULT


async def parse_body(request: web.Request, model: type[Body]) -> Body:
    """The request's body as ``model``: the one place a body is read (the API, the console's routes, enrollment).

    Its size is bounded as it is read (413 past the app's ``client_max_size``); JSON that is not, or
    is a parser bomb, is 400 ``invalid_json`` (``master.api.jsonbody``); a value the model refuses
    is 422 ``validation_failed`` with every problem."""
    raw: Any = decode_json_body(await request.read()) if request.can_read_body else {}
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        problems = [{"field": ".".join(str(p) for p in e["loc"]), "problem": e["msg"]} for e in exc.errors()]
        first = problems[0]
        raise ValidationFailed(
            f"{first['field'] or 'body'}: {first['problem']}", details={"problems": problems}
        ) from None


def int_query(request: web.Request, name: str, default: int, *, minimum: int, maximum: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"query parameter {name!r} must be an integer, got {raw!r}", code="invalid_query") from None
    if not minimum <= value <= maximum:
        raise BadRequest(f"query parameter {name!r} must be between {minimum} and {maximum}", code="invalid_query")
    return value


def float_query(request: web.Request, name: str, *, minimum: float, maximum: float, exclusive_minimum: bool = False) -> float | None:
    """A number parameter (absent or empty: None); a finite decimal within the bounds, else 400 ``invalid_query``."""
    raw = request.query.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or len(raw) > 32:
        raise BadRequest(f"query parameter {name!r} must be a number, got {raw[:40]!r}", code="invalid_query")
    if value < minimum or value > maximum or (exclusive_minimum and value == minimum):
        low = f"above {minimum:g}" if exclusive_minimum else f"at least {minimum:g}"
        raise BadRequest(f"query parameter {name!r} must be {low} and at most {maximum:g}", code="invalid_query")
    return value


def required_int_query(request: web.Request, name: str, *, minimum: int, maximum: int) -> int:
    """An integer parameter the route cannot do without: left out or empty is 400 ``invalid_query`` saying so."""
    if request.query.get(name, "") == "":
        raise BadRequest(f"query parameter {name!r} is required: an integer from {minimum} to {maximum}", code="invalid_query")
    return int_query(request, name, minimum, minimum=minimum, maximum=maximum)


def str_query(request: web.Request, name: str, *, max_length: int = 128) -> str | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return None
    if len(raw) > max_length:
        raise BadRequest(f"query parameter {name!r} is longer than {max_length} characters", code="invalid_query")
    return raw


BOOLEAN = ("true", "false")


def choice_query(request: web.Request, name: str, allowed: tuple[str, ...]) -> str | None:
    """A query parameter that must be one of ``allowed`` (absent or empty: None); 400 ``invalid_query`` otherwise."""
    raw = str_query(request, name)
    if raw is not None and raw not in allowed:
        raise BadRequest(f"query parameter {name!r} must be one of {', '.join(allowed)}; got {raw[:40]!r}", code="invalid_query")
    return raw


def idempotency_key(request: web.Request) -> str | None:
    """The request's ``Idempotency-Key`` header (None: none sent) for a create that must happen once; 400
    ``invalid_idempotency_key`` unless it is 1 to 255 characters."""
    key = request.headers.get("Idempotency-Key")
    if key is not None and not 1 <= len(key) <= 255:
        raise BadRequest("Idempotency-Key must be 1 to 255 characters", code="invalid_idempotency_key")
    return key


def refuse_template_with_workload(template: str | None, given: set[str]) -> None:
    """422 ``template_and_workload`` when a create names a ``template`` and also sent a ``workload`` (``given``: the
    body's fields that were sent)."""
    if template is not None and "workload" in given:
        raise ValidationFailed(
            "give either template (a name from GET /api/v1/templates) or workload, not both",
            code="template_and_workload", details={"problems": [{"field": "template", "problem": "excludes workload"}]},
        )


def page(request: web.Request) -> tuple[int, int]:
    return int_query(request, "limit", 50, minimum=1, maximum=500), int_query(request, "offset", 0, minimum=0, maximum=10**9)


def listing(items: list[dict[str, Any]], total: int, limit: int, offset: int) -> web.Response:
    return web.json_response({"items": items, "total": total, "limit": limit, "offset": offset})


PAGING = (
    QueryParam("limit", "integer", "Page size.", 1, 500),
    QueryParam("offset", "integer", "Items to skip.", 0, 10**9),
)
