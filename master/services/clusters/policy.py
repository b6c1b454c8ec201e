"""Replacing a ``replace`` cluster's broken members (the async half of the restart policies).

The synchronous half is ``clusterstate.act``: it runs in the before-flush hook, in the very transaction that changed a member
  (whatever changed it: an agent's result, a workload exit, a stop, a lost host, a preemption,
  billing's credit stop). A member stopped on its own (``DELETE /rentals/{member}``, billing) stops
  every other member; a member that failed, was preempted or lost its host stops every other member
  when the policy is ``stop`` (or the cluster never ran) and marks the cluster failing, so it ends
  ``failed`` with the reason. The stops are ``stop_workload`` commands written in that transaction:
  the command resender sends them (``rentals.stop_rental`` also publishes them at once, via
  ``issued_commands``).
``replace_broken_members`` (async: it places rentals) runs in the rental queue's pass: each
  ``degraded`` cluster whose policy is ``replace`` gets, per broken member, a new member rental of the
  same ``node_rank`` on a host the cluster does not use (the same GPU model unless ``allow_mixed``) and
  none measured outside the cluster's network bounds with its other members' hosts (``host_links``). If
  none can be placed, the cluster is stopped as ``stop`` would (it ends ``failed``).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select

from master.context import Master
from master.models import Cluster, Rental, RentalEvent
from master.services import commands, host_links, rentals
from master.services.lifecycle.clusters import (
    ClusterState,
    current_members,
    fail_cluster,
    is_broken,
    issued_commands,
)
from master.services.lifecycle.rentals import RentalState, stop_member
from master.services.rentals import RentalRequest
from shared.errors import ClientError, InsufficientCapacity
from shared.ids import new_id

log = logging.getLogger(__name__)

# ---- replacing broken members (async, in the rental queue's pass) -----------------------------


async def replace_broken_members(master: Master, *, limit: int = 20) -> list[str]:
    """Place a replacement for each broken member of degraded ``replace`` clusters; returns commands published."""
    async with master.db.session() as session:
        cluster_ids = list(
            (
                await session.scalars(
                    select(Cluster.id)
                    .where(Cluster.state == ClusterState.DEGRADED.value, Cluster.restart_policy == "replace")
                    .order_by(Cluster.created_at, Cluster.id)
                    .limit(limit)
                )
            ).all()
        )
    published: list[str] = []
    for cluster_id in cluster_ids:
        command_ids = await _replace_in(master, cluster_id)
        await commands.publish(master, command_ids)
        published += command_ids
    return published


async def _replace_in(master: Master, cluster_id: str) -> list[str]:
    now = master.clock.now()
    async with master.db.serialised_session() as session:
        cluster = await session.get(Cluster, cluster_id, with_for_update=True)
        if cluster is None or cluster.state != ClusterState.DEGRADED or cluster.restart_policy != "replace":
            return []  # another pass got there first
        members = current_members(
            (await session.scalars(select(Rental).where(Rental.cluster_id == cluster.id).order_by(Rental.node_rank))).all()
        )
        used = frozenset(
            m.host_id
            for m in (await session.scalars(select(Rental).where(Rental.cluster_id == cluster.id))).all()
            if m.host_id is not None
        )
        model = next((m.gpu_model for m in members if not is_broken(m)), None)
        bounds = host_links.NetworkBounds.of(cluster.network)
        since = now - timedelta(seconds=master.settings.host_link_max_age_s)
        staying = [m.host_id for m in members if not is_broken(m) and m.host_id is not None]
        apart = await host_links.breaching_peers(session, staying, bounds, since=since)  # measured outside the bounds with one
        command_ids: list[str] = []
        for old in [m for m in members if is_broken(m)]:
            new, placed, reason = await _place_replacement(master, session, cluster, old, used | apart, model, now=now)
            if reason is not None:
                log.warning("cluster %s: node %s could not be replaced: %s", cluster.id, old.node_rank, reason)
                fail_cluster(session.sync_session, cluster, members, stop_member, f"no host could replace it ({reason})")
                command_ids += issued_commands(session.info)
                break
            assert new is not None and new.host_id is not None
            used |= {new.host_id}
            apart |= await host_links.breaching_peers(session, [new.host_id], bounds, since=since)
            session.add(RentalEvent(rental_id=old.id, from_state=old.state, to_state=old.state,
                                    cause=f"replaced in cluster {cluster.id} by rental {new.id} on host {new.host_id}", at=now))  # fmt: skip
            command_ids += placed
        await session.flush()
        command_ids += issued_commands(session.info)
    return command_ids


async def _place_replacement(
    master: Master, session: Any, cluster: Cluster, old: Rental, used: frozenset[str], model: str | None, *, now: datetime
) -> tuple[Rental | None, list[str], ClientError | None]:
    """A new member for ``old``'s rank on a host the cluster does not use, placed in a savepoint (or nothing)."""
    pin = None if cluster.allow_mixed else model
    request = RentalRequest.from_rental(
        old, avoid_hosts=used, replaces=None, queue=False, offer_id=None,
        gpu_model=pin or (old.spec or {}).get("gpu_model"),
    )  # fmt: skip
    new = Rental(
        id=new_id("r"), renter_id=old.renter_id, host_id=None, gpu_model=request.gpu_model, gpu_count=old.gpu_count,
        gpu_uuids=[], state=RentalState.PENDING.value, workload=old.workload, restart_on_failure=False, kind=old.kind,
        gpu_milli=old.gpu_milli, gpu_memory_mib=0, bid_per_gpu_hour=old.bid_per_gpu_hour, spec=old.spec, created_at=now,
        cluster_id=cluster.id, node_rank=old.node_rank, replaces_id=old.id,
    )  # fmt: skip
    async with session.begin_nested() as attempt:
        placed, reason = await rentals.try_place(master, session, new, request, now=now)
        if reason is None and pin is not None and new.gpu_model != pin:
            reason = InsufficientCapacity(f"the only host left has {new.gpu_model}, not the cluster's {pin}")
        if reason is not None:
            await attempt.rollback()
            return None, [], reason
        session.add(RentalEvent(rental_id=new.id, from_state=new.state, to_state=new.state,
                                cause=f"replaces node {old.node_rank} ({old.id}, {old.state}) of cluster {cluster.id}", at=now))  # fmt: skip
    return new, placed, None

