"""Elastic services (``/services``): replicas of one workload behind one endpoint, scaled by load.

Handlers parse and authorize; the rules live in ``master/services/endpoints/core.py`` (creating, reading,
scaling, deleting), ``autoscale.py`` and ``scaling.py`` (the autoscaler) and ``gateway/`` (the
endpoint, ``/svc/<id>/``). Another renter's service is 404 ``service_not_found``, as one that does
not exist. The service token is in the answer of ``POST /services`` and ``POST /services/{id}/token``
only.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from aiohttp import web

from billing import ledger
from billing.summaries import charged_by_rental
from master.api.base import (
    BOOLEAN,
    PAGING,
    QueryParam,
    Route,
    choice_query,
    idempotency_key,
    int_query,
    listing,
    page,
    parse_body,
)
from master.api.keys import MASTER
from master.api.middleware import principal
from master.api.schemas import ServiceCreate, ServiceScale
from master.models import Service
from master.scheduler.price import optional_tolerance
from master.services import endpoints
from master.services.endpoints import ServiceRequest
from shared.errors import BadRequest, ValidationFailed

DEFAULT_SCALING = {"metric": "inflight", "target": 4}


def endpoint_url(request: web.Request, service_id: str) -> str:
    base = request.app[MASTER].settings.public_url or f"{request.scheme}://{request.host}"
    return base.rstrip("/") + endpoints.endpoint_path(service_id)


async def _detail(request: web.Request, service_id: str, *, failed: bool = False) -> dict[str, Any]:
    async with request.app[MASTER].db.session() as session:
        view = await endpoints.service_detail(session, principal(request), service_id, failed=failed)
        replicas = await endpoints.replica_ids(session, [service_id])
        charged = await charged_by_rental(session, replicas[service_id])
    view["endpoint_url"] = endpoint_url(request, service_id)
    view["cost_so_far"] = ledger.money(sum(charged.values(), Decimal(0)))
    return view


async def create_service(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    body = await parse_body(request, ServiceCreate)
    if (body.template is None) == (body.workload is None):
        raise ValidationFailed("give either template (a name from GET /api/v1/templates) or workload (a container), one of them",
                               code="template_or_workload",
                               details={"problems": [{"field": "template", "problem": "exactly one of template and workload"}]})  # fmt: skip
    key = idempotency_key(request)
    query = body.requirements or ""
    if body.max_price_per_gpu_hour is not None:
        query = f"{query} price<={body.max_price_per_gpu_hour}".strip()
    scaling = body.scaling.model_dump(exclude_none=True) if body.scaling is not None else dict(DEFAULT_SCALING)
    wanted = ServiceRequest(
        name=body.name, port=body.port, min_replicas=body.min_replicas, max_replicas=body.max_replicas, scaling=scaling,
        workload=body.workload.model_dump(mode="json") if body.workload is not None else {}, template=body.template,
        health_path=body.health_path, gpu_count=body.gpu_count, gpu_model=body.gpu_model, query=query, kind=body.kind,
        bid=body.bid, volumes=tuple(v.ask() for v in body.volumes or ()), price_tolerance=optional_tolerance(body.price_tolerance),
    )  # fmt: skip
    service, token = await endpoints.create_service(master, principal(request), wanted, idempotency_key=key)
    view = await _detail(request, service.id)
    view["token"] = token
    return web.json_response(view, status=201 if token is not None else 200)


async def list_services(request: web.Request) -> web.Response:
    limit, offset = page(request)
    include_deleted = choice_query(request, "deleted", BOOLEAN) == "true"
    async with request.app[MASTER].db.session() as session:
        items, total = await endpoints.list_services(session, principal(request), limit=limit, offset=offset,
                                                   include_deleted=include_deleted)  # fmt: skip
        replicas = await endpoints.replica_ids(session, [item["id"] for item in items])
        charged = await charged_by_rental(session, [rid for ids in replicas.values() for rid in ids])
    for item in items:
        item["endpoint_url"] = endpoint_url(request, item["id"])
        item["cost_so_far"] = ledger.money(sum((charged.get(rid, Decimal(0)) for rid in replicas[item["id"]]), Decimal(0)))
    return listing(items, total, limit, offset)


async def get_service(request: web.Request) -> web.Response:
    failed = choice_query(request, "failed", BOOLEAN) == "true"
    return web.json_response(await _detail(request, request.match_info["service_id"], failed=failed))


async def scale_service(request: web.Request) -> web.Response:
    body = await parse_body(request, ServiceScale)
    if body.min_replicas is None and body.max_replicas is None:
        raise BadRequest("give min_replicas, max_replicas or both", code="invalid_replica_bounds")
    service = await endpoints.scale_service(request.app[MASTER], principal(request), request.match_info["service_id"],
                                          min_replicas=body.min_replicas, max_replicas=body.max_replicas)  # fmt: skip
    return web.json_response(await _detail(request, service.id))


async def new_token(request: web.Request) -> web.Response:
    service, token = await endpoints.rotate_token(request.app[MASTER], principal(request), request.match_info["service_id"])
    return web.json_response({"service_id": service.id, "token": token, "token_prefix": service.token_prefix})


async def delete_service(request: web.Request) -> web.Response:
    service = await endpoints.delete_service(request.app[MASTER], principal(request), request.match_info["service_id"])
    return web.json_response(await _detail(request, service.id), status=202)


async def service_stats(request: web.Request) -> web.Response:
    minutes = int_query(request, "minutes", 60, minimum=1, maximum=7 * 24 * 60)
    master = request.app[MASTER]
    async with master.db.session() as session:
        service: Service = await endpoints.get_service(session, principal(request), request.match_info["service_id"])
        series = await endpoints.series(session, service, now=master.clock.now(), minutes=minutes,
                                              bucket_s=master.settings.service_stats_bucket_s)
    return web.json_response(series)


ROUTES: tuple[Route, ...] = (
    Route("POST", "/services", create_service, "Make a service: replicas of a template's or an image's container behind one "
          "endpoint (endpoint_url), scaled between min_replicas and max_replicas by its rule. The answer carries the "
          "service token, once (200: a repeat of an Idempotency-Key, without the token).",
          verified=True, roles=("renter",), body=ServiceCreate, success=201, also_success=(200,), headers=("Idempotency-Key",),
          errors=(400, 402, 404, 409, 422)),
    Route("GET", "/services", list_services, "Your services, newest first (deleted ones with ?deleted=true).",
          query=(*PAGING, QueryParam("deleted", "string", "true: deleted services too.", choices=BOOLEAN))),
    Route("GET", "/services/{service_id}", get_service, "One service: its replicas, scaling history, endpoint and cost so far; "
          "its failure (state failing: replicas failed to start) and next attempt. Failed replicas are counted "
          "(replicas.failed), listed with ?failed=true.",
          query=(QueryParam("failed", "string", "true: list the failed replicas too.", choices=BOOLEAN),), errors=(404,)),
    Route("PUT", "/services/{service_id}/replicas", scale_service, "Set a service's replica bounds; the autoscaler "
          "moves into them on its next pass. A failing service (or one waiting between start failures) is resumed: "
          "replicas are rented again at once.", body=ServiceScale, errors=(400, 404, 409, 422)),
    Route("POST", "/services/{service_id}/token", new_token, "Replace the service token (the old one stops working at once).",
          errors=(404, 409)),
    Route("GET", "/services/{service_id}/stats", service_stats, "The service over time: replicas, requests/s, errors, "
          "latency p50/p99 and requests in flight, per bucket.", query=(QueryParam("minutes", "integer", "How far back.", 1, 10080),),
          errors=(404,)),
    Route("DELETE", "/services/{service_id}", delete_service, "Delete a service: its replicas stop, its endpoint closes.",
          success=202, errors=(404,)),
)
