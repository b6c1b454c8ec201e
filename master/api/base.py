"""What every ``/api/v1`` route module shares: the ``Route`` record, query and body parsing, paging."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from shared.errors import BadRequest, ValidationFailed

API = "/api/v1"

Body = TypeVar("Body", bound=BaseModel)
HandlerFn = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class QueryParam:
    name: str
    type: str  # "string" | "integer"
    description: str
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[str, ...] = ()  # the only values accepted (an enum in the document)


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: HandlerFn
    summary: str
    roles: tuple[str, ...] = ()  # empty + public=False: any signed-in account
    public: bool = False
    body: type[BaseModel] | None = None
    query: tuple[QueryParam, ...] = ()
    success: int = 200
    also_success: tuple[int, ...] = ()  # e.g. 200 for a repeat that changed nothing, where a first call is 201
    headers: tuple[str, ...] = ()
    errors: tuple[int, ...] = field(default=())
    media_types: tuple[str, ...] = ("application/json",)  # of the success response; JSON is an object, others text


async def parse_body(request: web.Request, model: type[Body]) -> Body:
    if not request.can_read_body:
        raw: Any = {}
    else:
        try:
            raw = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON", code="invalid_json") from None
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


def str_query(request: web.Request, name: str, *, max_length: int = 128) -> str | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return None
    if len(raw) > max_length:
        raise BadRequest(f"query parameter {name!r} is longer than {max_length} characters", code="invalid_query")
    return raw


def page(request: web.Request) -> tuple[int, int]:
    return int_query(request, "limit", 50, minimum=1, maximum=500), int_query(request, "offset", 0, minimum=0, maximum=10**9)


def listing(items: list[dict[str, Any]], total: int, limit: int, offset: int) -> web.Response:
    return web.json_response({"items": items, "total": total, "limit": limit, "offset": offset})


PAGING = (
    QueryParam("limit", "integer", "Page size.", 1, 500),
    QueryParam("offset", "integer", "Items to skip.", 0, 10**9),
)
