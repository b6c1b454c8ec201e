"""OpenAPI 3.1 document built from the route table (``master/api/table.py``, handed in) and its pydantic models.

This module reads ``Route`` records only; it imports no route module, so the table can be
documented without a cycle.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel

from master.api.base import API, VERSION, RateClass, Route
from master.api.schemas import ErrorBody

_REASONS = {400: "Bad request", 401: "Missing or invalid API key", 403: "Not allowed for this account", 404: "Not found",
            409: "Conflict", 422: "Invalid body", 429: "Too many requests; retry after Retry-After seconds",
            503: "Not ready: the database or Redis is unavailable; retry after Retry-After seconds"}
# Every amount of money the API writes (prices, bids, charges, balances, earnings): a decimal string, never a JSON
# number, so no client reads it through a binary float. The console and the CLI show it with shared.money.format_usd.
MONEY_SCHEMA: dict[str, Any] = {
    "type": "string", "pattern": r"^-?[0-9]+(\.[0-9]+)?$", "examples": ["0.450000", "1234.500000"],
    "description": "US dollars as a decimal string: ASCII digits, an optional leading '-', at most one dot, no exponent "
                   "or separators; ledger amounts carry six decimals (a millionth of a dollar). Read it as a decimal, not "
                   "a float. Prices are per GPU-hour; usage is billed per second after a 60-second minimum.",
}  # fmt: skip
_RETRY_AFTER = {"Retry-After": {"description": "Whole seconds to wait before retrying (at least 1).",
                                "schema": {"type": "integer", "minimum": 1}}}


def _component(components: dict[str, Any], model: type[BaseModel]) -> dict[str, str]:
    """Add ``model`` (and the models it nests) to the components; a reference to it."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in schema.pop("$defs", {}).items():
        components[name] = sub
    components[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _success_schema(components: dict[str, Any], route: Route, media_type: str) -> dict[str, Any]:
    if media_type != "application/json":
        return {"type": "string"}
    if route.response is not None:
        return _component(components, route.response)
    return {"type": "object"}


def build_openapi(routes: tuple[Route, ...]) -> dict[str, Any]:
    """The document of ``routes`` (the ``/api/v1`` part of the table)."""
    components: dict[str, Any] = {"Error": ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}"),
                                  "Money": MONEY_SCHEMA}
    paths: dict[str, Any] = {}
    for route in routes:
        success = {
            "description": "Success",
            "content": {
                media_type: {"schema": _success_schema(components, route, media_type)} for media_type in route.media_types
            },
        }
        op: dict[str, Any] = {
            "summary": route.summary,
            "operationId": route.handler.__name__,
            "responses": {str(status): success for status in (route.success, *route.also_success)},
        }
        params: list[dict[str, Any]] = []
        for name in re.findall(r"\{(\w+)\}", route.path):
            params.append({"name": name, "in": "path", "required": True, "schema": {"type": "string"}})
        for q in route.query:
            schema: dict[str, Any] = {"type": q.type}
            if q.minimum is not None:
                schema["minimum"] = q.minimum
            if q.maximum is not None:
                schema["maximum"] = q.maximum
            if q.choices:
                schema["enum"] = list(q.choices)
            # Every query parameter sent empty (?limit=) counts as left out (master/api/base.py): a required one is 400.
            params.append({"name": q.name, "in": "query", "required": q.required, "allowEmptyValue": not q.required,
                           "description": q.description, "schema": schema})
        for h in route.headers:
            params.append({"name": h, "in": "header", "required": False, "schema": {"type": "string", "minLength": 1, "maxLength": 255}})
        if params:
            op["parameters"] = params
        if route.body is not None:
            reference = _component(components, route.body)
            op["requestBody"] = {
                # A body whose every field has a default may be left out, unless it must name at least one (minProperties).
                "required": bool(components[route.body.__name__].get("required") or components[route.body.__name__].get("minProperties")),
                "content": {"application/json": {"schema": reference}},
            }
        statuses = set(route.errors) | {400}
        if not route.public:
            op["security"] = [{"bearer": []}]
            op["x-api-key-scope"] = route.needs  # what a scoped API key must have (master/services/accounts/keys.py)
            statuses |= {401, 403}
        if route.limit is not RateClass.NONE:
            statuses.add(429)  # rate limits (master/api/ratelimits.py), when enabled
            statuses.add(503)  # the database or Redis unreachable for a moment (master/api/middleware.py)
        for status in sorted(statuses):
            op["responses"][str(status)] = {
                "description": _REASONS.get(status, "Error"),
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
            }
            if status in (429, 503):
                op["responses"][str(status)]["headers"] = _RETRY_AFTER
        paths.setdefault(API + route.path, {})[route.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "gpumarket API", "version": VERSION,
                 "description": "Every money field (price_*, bid_*, charged, balance, earned, amount, total_*, ...) is "
                                "a decimal string as #/components/schemas/Money describes. A call acts for a team "
                                "(its rentals, credit, SSH keys) with the header Gpumarket-Team: <team id> (GET "
                                "/api/v1/teams lists yours; 404 team_not_found for one you are not in, 403 "
                                "team_role_forbids where your role there does not allow the call)."},
        "servers": [{"url": "/"}],
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
