"""Clusters (``/clusters``): one rental over several hosts, created and deleted as one.

Handlers parse and authorize; the rules live in ``master/services/clusters/core.py`` (creating,
reading, deleting), ``placement.py`` beside it (every node or none) and ``master/services/lifecycle/clusters.py``.
Another renter's cluster is 404 ``cluster_not_found``, as one that does not exist.
"""

from __future__ import annotations

from aiohttp import web

from master.api.base import (
    PAGING,
    Route,
    idempotency_key,
    listing,
    page,
    parse_body,
    refuse_template_with_workload,
)
from master.api.keys import MASTER
from master.api.middleware import principal
from master.api.schemas import ClusterCreate
from master.scheduler.price import optional_tolerance
from master.services import clusters
from master.services.clusters import ClusterRequest


async def create_cluster(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    body = await parse_body(request, ClusterCreate)
    refuse_template_with_workload(body.template, body.model_fields_set)
    key = idempotency_key(request)
    wanted = ClusterRequest(
        node_count=body.node_count, gpus_per_node=body.gpus_per_node, gpu_model=body.gpu_model, allow_mixed=body.allow_mixed,
        workload={} if body.template is not None else body.workload.model_dump(mode="json"), template=body.template,
        query=body.requirements or "", kind=body.kind, bid=body.bid,
        network=body.network.model_dump() if body.network is not None else None, restart_policy=body.restart_policy,
        queue=body.queue, queue_timeout_s=body.queue_timeout_s, volumes=tuple(v.ask() for v in body.volumes or ()),
        price_tolerance=optional_tolerance(body.price_tolerance),
    )  # fmt: skip
    cluster, created = await clusters.create_cluster(master, principal(request), wanted, idempotency_key=key)
    async with master.db.session() as session:
        view = await clusters.cluster_detail(session, principal(request), cluster.id)
    return web.json_response(view, status=201 if created else 200)


async def list_clusters(request: web.Request) -> web.Response:
    limit, offset = page(request)
    async with request.app[MASTER].db.session() as session:
        items, total = await clusters.list_clusters(session, principal(request), limit=limit, offset=offset)
    return listing(items, total, limit, offset)


async def get_cluster(request: web.Request) -> web.Response:
    async with request.app[MASTER].db.session() as session:
        return web.json_response(await clusters.cluster_detail(session, principal(request), request.match_info["cluster_id"]))


async def delete_cluster(request: web.Request) -> web.Response:
    view = await clusters.delete_cluster(request.app[MASTER], principal(request), request.match_info["cluster_id"])
    return web.json_response(view, status=202)


ROUTES: tuple[Route, ...] = (
    Route("POST", "/clusters", create_cluster, "Rent a cluster: node_count nodes of gpus_per_node GPUs, each on its own host, placed "
          "together or not at all (200: a repeat of an Idempotency-Key, answered with the cluster it made).",
          verified=True, roles=("renter",), body=ClusterCreate, success=201, also_success=(200,), headers=("Idempotency-Key",), errors=(404, 409, 422)),
    Route("GET", "/clusters", list_clusters, "Your clusters with their members, newest first.", query=PAGING),
    Route("GET", "/clusters/{cluster_id}", get_cluster, "One cluster with its members (host, state, GPUs) and state history.", errors=(404,)),
    Route("DELETE", "/clusters/{cluster_id}", delete_cluster, "Stop every node of a cluster; it is stopped when every node is.",
          success=202, errors=(404,)),
)
