"""Clusters as a renter sees them: creating one (idempotently), reading, listing, deleting, and its view.

A cluster is ``node_count`` member rentals, one per host (``rentals.cluster_id``). Where they go:
``placement.py``; how the cluster's state follows theirs: ``master/services/lifecycle/clusters.py``. Deleting
a cluster stops each member through the rental's own stop (``rentals.stop_rental``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import Master
from master.models import Cluster, ClusterEvent, Rental
from master.scheduler.price import tolerance_text
from master.services import commands, idempotency, rentals
from master.services.accounts import Principal
from master.services.clusters import placement as cluster_placement
from master.services.clusters import queue as cluster_queue
from master.services.clusters.request import ClusterRequest
from master.services.lifecycle import cluster_network
from master.services.lifecycle.clusters import FINAL_CLUSTER_STATES, ClusterState, transition
from master.services.lifecycle.rentals import RentalState, advance
from master.services.market import money
from master.services.rentals import workload_of
from master.services.volumes import check_asks
from shared.errors import InsufficientCapacity, NotFound
from shared.ids import new_id

log = logging.getLogger(__name__)


async def create_cluster(master: Master, renter: Principal, request: ClusterRequest, *, idempotency_key: str | None) -> tuple[Cluster, bool]:
    """Place and start every node of a cluster, or none (or, with ``queue``, queue it whole); returns ``(cluster, created)``.

    With an ``idempotency_key``, a repeat of the same request returns the first cluster (``created``
    False); the same key with another request is a conflict. Runs to completion once called.
    """
    request = request.check(max_queue_timeout_s=master.settings.max_queue_timeout_s)
    cluster, command_ids = await idempotency.create_once(
        master, Cluster, renter.account_id, idempotency_key, request.fingerprint(), what="cluster",
        create=lambda: _create(master, renter, request, idempotency_key),
    )  # fmt: skip
    if command_ids is None:
        return cluster, False
    await commands.publish(master, command_ids)
    return cluster, True


async def _create(master: Master, renter: Principal, request: ClusterRequest, idempotency_key: str | None) -> tuple[Cluster, list[str]]:
    if request.template is not None and not request.workload:
        async with master.db.session() as session:  # the template as it is now
            request = replace(request, workload=await workload_of(session, request.template))
        check_asks(request.volumes, request.workload, ranked=True)
    now = master.clock.now()
    cluster = Cluster(
        id=new_id("c"), renter_id=renter.account_id, state=ClusterState.PENDING.value, node_count=request.node_count,
        gpus_per_node=request.gpus_per_node, gpu_model=request.gpu_model, allow_mixed=request.allow_mixed,
        workload=request.workload, template=request.template, network=request.network, kind=request.kind,
        bid_per_gpu_hour=request.bid, restart_policy=request.restart_policy, idempotency_key=idempotency_key,
        request_fingerprint=request.fingerprint(), created_at=now, price_tolerance=request.price_tolerance,
    )  # fmt: skip
    cluster_id, renter_id = cluster.id, cluster.renter_id
    # One transaction: the cluster, every member's claim, state and start command commit together, or nothing does
    # (or, queued, the cluster and its queued members).
    async with master.db.serialised_session() as session:
        session.add(cluster)
        what = f"{request.node_count} nodes × {request.gpus_per_node} {request.gpu_model or 'any GPU'}"
        session.add(ClusterEvent(cluster_id=cluster.id, from_state=None, to_state=cluster.state, cause=f"asked for {what}", at=now))
        await session.flush()
        try:
            command_ids = await cluster_placement.place_cluster(master, session, cluster, request, now=now)
            log.info("cluster %s placed: %s", cluster_id, what)
        except InsufficientCapacity as reason:
            if not request.queue or reason.code != InsufficientCapacity.code:  # exceeds_fleet: nothing to wait for
                raise
            await cluster_queue.enqueue(session, cluster_id, renter_id, request, reason, now=now)
            command_ids = []
        await session.refresh(cluster)  # its state followed the members' (and a rolled-back attempt expired it)
    return cluster, command_ids


# ---- reading and ending -----------------------------------------------------------------------


async def get_cluster(session: AsyncSession, principal: Principal, cluster_id: str, *, for_update: bool = False) -> Cluster:
    cluster = await session.get(Cluster, cluster_id, with_for_update=for_update)
    if cluster is None or (principal.role != "admin" and cluster.renter_id != principal.account_id):
        raise NotFound(f"no cluster {cluster_id!r} in your account", code="cluster_not_found")
    return cluster


async def members_of(session: AsyncSession, cluster_ids: Sequence[str]) -> dict[str, list[Rental]]:
    rows = (await session.scalars(select(Rental).where(Rental.cluster_id.in_(list(cluster_ids))).order_by(Rental.node_rank))).all()
    found: dict[str, list[Rental]] = {cid: [] for cid in cluster_ids}
    for row in rows:
        assert row.cluster_id is not None
        found[row.cluster_id].append(row)
    return found


async def list_clusters(session: AsyncSession, principal: Principal, *, limit: int, offset: int) -> tuple[list[dict[str, Any]], int]:
    """A page of clusters (the caller's; an admin's: all), newest first, as ``cluster_view``s with their ``queue``."""
    query = select(Cluster)
    if principal.role != "admin":
        query = query.where(Cluster.renter_id == principal.account_id)
    total = await session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = (await session.scalars(query.order_by(Cluster.created_at.desc(), Cluster.id).limit(limit).offset(offset))).all()
    members = await members_of(session, [c.id for c in rows])
    views = []
    for c in rows:
        views.append(cluster_view(c, members[c.id], queue=await cluster_queue.cluster_standing(session, c, members[c.id])))
    return views, total


async def cluster_detail(session: AsyncSession, principal: Principal, cluster_id: str) -> dict[str, Any]:
    cluster = await get_cluster(session, principal, cluster_id)
    events = (await session.scalars(select(ClusterEvent).where(ClusterEvent.cluster_id == cluster.id).order_by(ClusterEvent.id))).all()
    members = (await members_of(session, [cluster.id]))[cluster.id]
    return cluster_view(cluster, members, events, queue=await cluster_queue.cluster_standing(session, cluster, members))


async def delete_cluster(master: Master, principal: Principal, cluster_id: str) -> dict[str, Any]:
    """Stop every member (each through the rental's stop); idempotent, and a repeat finishes an interrupted one.

    A queued cluster ends at once (``stopped``, its queued members with it, in one transaction): nothing runs anywhere.
    """
    now = master.clock.now()
    async with master.db.session() as session:
        cluster = await get_cluster(session, principal, cluster_id, for_update=True)
        members = (await members_of(session, [cluster.id]))[cluster.id]
        queued = cluster_queue.is_queued(cluster, members)
        if cluster.state not in FINAL_CLUSTER_STATES:
            transition(session.sync_session, cluster, ClusterState.STOPPING, f"stop requested by {principal.name}", at=now)
        if queued:  # the flush moves the cluster on to stopped once every member has ended
            for member in members:
                if advance(session, member, RentalState.STOPPED, f"cancelled while queued, with cluster {cluster.id}, by {principal.name}"):
                    member.stopped_at = now
        member_ids = [m.id for m in members]
    for member_id in member_ids:
        await rentals.stop_rental(master, principal, member_id)  # a no-op for a member already stopping or ended
    async with master.db.session() as session:
        return await cluster_detail(session, principal, cluster_id)


def cluster_view(cluster: Cluster, members: Sequence[Rental], events: Sequence[ClusterEvent] | None = None, *,
                 queue: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    view: dict[str, Any] = {
        "id": cluster.id,
        "state": cluster.state,
        "node_count": cluster.node_count,
        "gpus_per_node": cluster.gpus_per_node,
        "gpu_model": cluster.gpu_model,
        "allow_mixed": cluster.allow_mixed,
        "template": cluster.template,
        "workload": cluster.workload,
        "network": cluster.network,
        "private_network": cluster_network.view(cluster),
        "kind": cluster.kind,
        "bid_per_gpu_hour": money(cluster.bid_per_gpu_hour) if cluster.bid_per_gpu_hour is not None else None,
        "restart_policy": cluster.restart_policy,
        "price_tolerance": None if cluster.price_tolerance is None else tolerance_text(cluster.price_tolerance),
        "failure_reason": cluster.failure_reason,
        "created_at": cluster.created_at.isoformat(),
        "started_at": cluster.started_at.isoformat() if cluster.started_at else None,
        "stopped_at": cluster.stopped_at.isoformat() if cluster.stopped_at else None,
        "members": [_member_view(m) for m in members],
        "queued": queue is not None,
        "queue": queue,  # {position, length, message} while queued (cluster_queue.cluster_standing)
        "queue_until": min((m.queue_until for m in members if m.queue_until), default=None),
    }
    if view["queue_until"] is not None:
        view["queue_until"] = view["queue_until"].isoformat()
    if events is not None:
        view["events"] = [{"at": e.at.isoformat(), "from": e.from_state, "to": e.to_state, "cause": e.cause} for e in events]
    return view


def _member_view(member: Rental) -> dict[str, Any]:
    price = member.price_per_gpu_hour
    return {
        "rental_id": member.id, "node_rank": member.node_rank, "host_id": member.host_id, "state": member.state,
        "gpu_model": member.gpu_model, "gpu_uuids": member.gpu_uuids, "price_per_gpu_hour": money(price) if price is not None else None,
    }  # fmt: skip
