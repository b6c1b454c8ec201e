"""A queued cluster: waiting as one unit in the rental queue, placed whole, or given up at ``queue_until``.

A cluster asked with ``queue: true`` that the fleet could take but not now is ``pending`` with its member
rentals **queued** (``pending``, no host, each with the cluster's ``queue_until``): the members carry what
a queued rental carries (the request, the deadline), so nothing new is stored, billing and quotas skip
them as they skip any queued rental (neither counts a rental without a host), and every check that
guards a rental (its renter, ``DELETE /rentals/{id}``) guards them too.

The rental queue (``master.services.queue.process_queue``) walks queued rentals in fair-share order
(``master/scheduler/fairshare.py``: on-demand first, then the accounts holding least per weight, each
account's oldest first); a cluster is one item of its renter's, as old as its first member, and it is placed as one unit by
``cluster_placement.place_cluster`` over its queued members: all of them in one transaction, or none
(``place_queued``). A cluster that does not fit stays queued and the pass goes on to the rentals behind
it, as for a rental that does not fit: no head-of-line blocking, so a large cluster may wait while
smaller rentals behind it start, until its ``queue_until``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, distinct, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import Master
from master.models import Cluster, ClusterEvent, Rental, RentalEvent
from master.services import volumes
from master.services.clusters import placement as cluster_placement
from master.services.clusters.request import ClusterRequest
from master.services.lifecycle.clusters import ClusterState
from master.services.lifecycle.rentals import RentalState, advance
from master.services.market import FailureCode, record_failure
from shared.errors import ClientError, InsufficientCapacity

log = logging.getLogger(__name__)

QUEUE_TIMEOUT = "queue timeout"


def _waiting() -> tuple[Any, ...]:
    return Rental.state == RentalState.PENDING.value, Rental.host_id.is_(None)


def is_queued(cluster: Cluster, members: Sequence[Rental]) -> bool:
    return cluster.state == ClusterState.PENDING and bool(members) and all(m.host_id is None and m.state == "pending" for m in members)


async def enqueue(session: AsyncSession, cluster_id: str, renter_id: str, request: ClusterRequest, reason: ClientError, *,
                  now: datetime) -> None:  # fmt: skip
    """Queue the (flushed, pending) cluster: one queued member rental per node, each giving up at ``queue_until``."""
    until = now + timedelta(seconds=request.queue_timeout_s)
    for rank in range(request.node_count):
        member_request = request.member_request(rank)
        member = cluster_placement.new_member((cluster_id, renter_id), request, rank, member_request.spec(), now=now)
        member.queue_until = until
        session.add(member)
        await session.flush()
        if member_request.volumes:  # each node holds its own volumes while the cluster waits, as a queued rental does
            [mounts] = (await volumes.resolve(session, renter_id, member_request.volumes, rental_id=member.id)).options.values()
            await volumes.attach(session, member.id, mounts, at=now)
        session.add(RentalEvent(rental_id=member.id, from_state=None, to_state=RentalState.PENDING.value,
                                cause=f"queued as node {rank} of cluster {cluster_id}"))  # fmt: skip
    cause = f"queued for up to {request.queue_timeout_s:g}s: {reason}"
    session.add(ClusterEvent(cluster_id=cluster_id, from_state=ClusterState.PENDING.value, to_state=ClusterState.PENDING.value,
                             cause=cause, at=now))  # fmt: skip
    log.info("cluster %s queued: %s", cluster_id, reason)


async def place_queued(master: Master, cluster_id: str, *, now: datetime) -> list[str]:
    """Place a queued cluster whole (its members in one transaction) or leave it queued; returns the commands to publish.

    A cluster that cannot fit now (``insufficient_capacity``, ``exceeds_fleet``: hosts may come back) stays queued;
    any other refusal (credit, quota) fails it and its members, as the queue fails a rental it cannot place.
    """
    async with master.db.serialised_session() as session:
        cluster = await session.scalar(select(Cluster).where(Cluster.id == cluster_id).with_for_update(skip_locked=True))
        if cluster is None or cluster.state != ClusterState.PENDING:
            return []
        # Locked: a DELETE of one member waits for this placement (and then stops the placed cluster), or wins before it.
        members = (
            await session.scalars(select(Rental).where(Rental.cluster_id == cluster_id).order_by(Rental.node_rank).with_for_update())
        ).all()
        if not is_queued(cluster, members) or len(members) != cluster.node_count:
            return []  # a member was cancelled: the cluster is being stopped with it
        request = ClusterRequest.of_queued(cluster, members[0])
        queued = [m.id for m in members]
        try:
            commands = await cluster_placement.place_cluster(master, session, cluster, request, now=now, queued=queued)
        except InsufficientCapacity as exc:
            log.debug("queued cluster %s does not fit yet: %s", cluster_id, exc)
            return []
        except ClientError as exc:
            await _fail(session, cluster_id, f"cannot be placed from the queue: {exc}", str(exc), FailureCode.PLACEMENT_FAILED, now=now)
            return []
        log.info("queued cluster %s placed: %d nodes", cluster_id, len(queued))
        return commands


async def expire(session: AsyncSession, member: Rental, *, now: datetime) -> None:
    """Give up a queued cluster whose member ``member`` reached ``queue_until``: the cluster fails with the reason, and
    every queued member with it (the before-flush hook moves the cluster to ``failed``). Nothing was placed or billed."""
    assert member.cluster_id is not None
    waited = (now - member.created_at).total_seconds()
    await _fail(session, member.cluster_id, f"not placed within its queue timeout ({waited:.0f}s queued)", QUEUE_TIMEOUT, FailureCode.QUEUE_TIMEOUT,
                now=now)


async def _fail(
    session: AsyncSession, cluster_id: str, cause: str, member_reason: str, code: FailureCode, *, now: datetime
) -> None:
    cluster = await session.get(Cluster, cluster_id)  # an expired row (a rolled-back attempt) is read again
    if cluster is None or cluster.state != ClusterState.PENDING:
        return
    what = f"{cluster.node_count} hosts with {cluster.gpus_per_node} × {cluster.gpu_model or 'any GPU'} each"
    if cluster.failure_reason is None:
        cluster.failure_reason = f"{cause}: {what} were never free together; nothing was placed or charged"
    members = (await session.scalars(select(Rental).where(Rental.cluster_id == cluster_id, *_waiting()))).all()
    for member in members:
        if advance(session, member, RentalState.FAILED, f"cluster {cluster_id} {cause}", at=now):
            record_failure(member, code, member_reason)
            member.stopped_at = now


# ---- where a queued item stands ---------------------------------------------------------------


async def queue_length(session: AsyncSession) -> int:
    """Items in the queue: each queued rental, and each queued cluster once."""
    plain = await session.scalar(select(func.count()).select_from(Rental).where(*_waiting(), Rental.cluster_id.is_(None)))
    clusters = await session.scalar(select(func.count(distinct(Rental.cluster_id))).where(*_waiting(), Rental.cluster_id.is_not(None)))
    return int(plain or 0) + int(clusters or 0)


async def position(session: AsyncSession, created_at: datetime, first_id: str, *, cluster_id: str | None) -> int:
    """1 + the items the queue pass tries before the one whose first queued row is ``(created_at, first_id)``."""
    before = or_(Rental.created_at < created_at, and_(Rental.created_at == created_at, Rental.id < first_id))
    plain = await session.scalar(select(func.count()).select_from(Rental).where(*_waiting(), Rental.cluster_id.is_(None), before))
    others = Rental.cluster_id.is_not(None) if cluster_id is None else and_(Rental.cluster_id.is_not(None), Rental.cluster_id != cluster_id)
    clusters = await session.scalar(select(func.count(distinct(Rental.cluster_id))).where(*_waiting(), others, before))
    return int(plain or 0) + int(clusters or 0) + 1


async def cluster_standing(session: AsyncSession, cluster: Cluster, members: Sequence[Rental]) -> dict[str, Any] | None:
    """A queued cluster's ``{position, length, message}``; None when it is not queued."""
    if not is_queued(cluster, members):
        return None
    first = min(members, key=lambda m: (m.created_at, m.id))
    place = await position(session, first.created_at, first.id, cluster_id=cluster.id)
    length = max(await queue_length(session), place)
    until = min((m.queue_until for m in members if m.queue_until is not None), default=None)
    gives_up = f"; gives up at {until:%Y-%m-%d %H:%M} UTC" if until is not None else ""
    wanted = f"{cluster.node_count} hosts with {cluster.gpus_per_node} × {cluster.gpu_model or 'any GPU'} each"
    return {"position": place, "length": length, "message": f"queued: will start when {wanted} are free; position {place} of {length}{gives_up}"}
