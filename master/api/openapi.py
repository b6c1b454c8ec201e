"""OpenAPI 3.1 document built from the route table and the pydantic request models."""

from __future__ import annotations

import re
from typing import Any

from master.api.base import API, Route
from master.api.routes import ROUTES, VERSION
from master.api.schemas import ErrorBody

_REASONS = {400: "Bad request", 401: "Missing or invalid API key", 403: "Not allowed for this account", 404: "Not found",
            409: "Conflict", 422: "Invalid body", 503: "Not ready"}


def build_openapi(routes: tuple[Route, ...] = ROUTES) -> dict[str, Any]:
    components: dict[str, Any] = {"Error": ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")}
    paths: dict[str, Any] = {}
    for route in routes:
        op: dict[str, Any] = {
            "summary": route.summary,
            "operationId": route.handler.__name__,
            "responses": {str(route.success): {"description": "Success", "content": {"application/json": {"schema": {"type": "object"}}}}},
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
            params.append({"name": q.name, "in": "query", "required": False, "description": q.description, "schema": schema})
        for h in route.headers:
            params.append({"name": h, "in": "header", "required": False, "schema": {"type": "string", "minLength": 1, "maxLength": 255}})
        if params:
            op["parameters"] = params
        if route.body is not None:
            schema = route.body.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, sub in schema.pop("$defs", {}).items():
                components[name] = sub
            components[route.body.__name__] = schema
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{route.body.__name__}"}}},
            }
        statuses = set(route.errors) | {400}
        if not route.public:
            op["security"] = [{"bearer": []}]
            statuses |= {401, 403}
        for status in sorted(statuses):
            op["responses"][str(status)] = {
                "description": _REASONS.get(status, "Error"),
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
            }
        paths.setdefault(API + route.path, {})[route.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "gpumarket API", "version": VERSION},
        "servers": [{"url": "/"}],
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
