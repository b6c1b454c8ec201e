"""Rentals as a renter sees them: creating one (idempotently), reading, listing, stopping, its logs and its view.

States and their changes: ``master/services/lifecycle/rentals.py``. Where a new rental goes:
``placement.py``; a queued one: ``master/services/queue.py``; what happens after it starts (agent
results, workload exits, lost hosts, re-placement, stray workloads): ``lifecycle.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import Master
from master.models import Rental, RentalEvent, RentalLogChunk
from master.services import commands, idempotency, volumes
from master.services.accounts import Principal
from master.services.lifecycle import clusters as clusterstate
from master.services.lifecycle.rentals import UNSTOPPED_STATES, RentalState, advance
from master.services.market import money
from master.services.rentals import templates
from master.services.rentals.placement import try_place
from master.services.rentals.request import RentalRequest
from shared import protocol
from shared.errors import NotFound
from shared.ids import new_id

log = logging.getLogger(__name__)


async def create_rental(master: Master, renter: Principal, request: RentalRequest, *, idempotency_key: str | None) -> tuple[Rental, bool]:
    """Place and start a rental (or queue it); returns ``(rental, created)``.

    With an ``idempotency_key``, a repeat of the same request returns the first
    rental (``created`` False); the same key with a different request is a conflict.
    Runs to completion once called: callers must not cancel it half-way.
    """
    request = request.check(max_queue_timeout_s=master.settings.max_queue_timeout_s)
    rental, command_ids = await idempotency.create_once(
        master, Rental, renter.account_id, idempotency_key, request.fingerprint(), what="rental",
        create=lambda: _create(master, renter, request, idempotency_key),
    )  # fmt: skip
    if command_ids is None:
        return rental, False
    await commands.publish(master, command_ids)
    return rental, True


async def _create(master: Master, renter: Principal, request: RentalRequest, idempotency_key: str | None) -> tuple[Rental, list[str]]:
    if request.template is not None and not request.workload:
        # The template as it is now: a later edit or deletion does not touch this rental.
        async with master.db.session() as session:
            request = replace(request, workload=await templates.workload_of(session, request.template))
        volumes.check_asks(request.volumes, request.workload, alternatives=request.service_id is not None)
    now = master.clock.now()
    rental = Rental(
        id=new_id("r"), renter_id=renter.account_id, host_id=None, gpu_model=request.gpu_model, gpu_count=request.gpu_count,
        gpu_uuids=[], state=RentalState.PENDING.value, workload=request.workload, idempotency_key=idempotency_key,
        request_fingerprint=request.fingerprint(), restart_on_failure=request.restart_on_failure,
        failover_after_s=request.failover_after_s, replaces_id=request.replaces, kind=request.kind, gpu_milli=request.share, gpu_memory_mib=request.gpu_memory_mib,
        mig_profile=request.mig_profile, bid_per_gpu_hour=request.bid, spec=request.spec(), created_at=now,
        service_id=request.service_id,
    )  # fmt: skip
    async with master.db.serialised_session() as session:  # quotas, credit and claim in one step, on SQLite too
        command_ids, reason = await try_place(master, session, rental, request, now=now)
        if command_ids:
            return rental, command_ids
        assert reason is not None
        if not request.queue or reason.code == "exceeds_fleet":
            raise reason
        rental.queue_until = now + timedelta(seconds=request.queue_timeout_s)
        session.add(rental)
        await session.flush()
        await _hold_volumes(session, rental, request, now=now)
        cause = f"queued for up to {request.queue_timeout_s:g}s: {reason}"
        session.add(RentalEvent(rental_id=rental.id, from_state=None, to_state=RentalState.PENDING.value, cause=cause))
        log.info("rental %s queued: %s", rental.id, reason)
    return rental, []


async def _hold_volumes(session: AsyncSession, rental: Rental, request: RentalRequest, *, now: datetime) -> None:
    """A queued rental holds its volumes while it waits (a second writer is refused, the volume cannot be deleted
    under it), where they are on one host; a service's replica with copies on several hosts attaches once placed."""
    if not request.volumes:
        return
    tied = await volumes.resolve(session, rental.renter_id, request.volumes, rental_id=rental.id,
                                 alternatives=request.service_id is not None)  # fmt: skip
    if len(tied.options) == 1:
        [mounts] = tied.options.values()
        await volumes.attach(session, rental.id, mounts, at=now)


# ---- reading and ending -----------------------------------------------------------------------


async def get_rental(session: AsyncSession, principal: Principal, rental_id: str, *, for_update: bool = False) -> Rental:
    rental = await session.get(Rental, rental_id, with_for_update=for_update)
    if rental is None or (principal.role != "admin" and rental.renter_id != principal.account_id):
        raise NotFound(f"no rental {rental_id!r} in your account", code="rental_not_found")
    return rental


async def list_rentals(session: AsyncSession, principal: Principal, *, limit: int, offset: int) -> tuple[list[Rental], int]:
    query = select(Rental)
    if principal.role != "admin":
        query = query.where(Rental.renter_id == principal.account_id)
    total = await session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = (await session.scalars(query.order_by(Rental.created_at.desc()).limit(limit).offset(offset))).all()
    return list(rows), total


async def rental_events(session: AsyncSession, rental_id: str) -> Sequence[RentalEvent]:
    return (await session.scalars(select(RentalEvent).where(RentalEvent.rental_id == rental_id).order_by(RentalEvent.id))).all()


async def stop_rental(master: Master, principal: Principal, rental_id: str) -> Rental:
    """Ask the agent to stop the workload; idempotent (stopping a stopped rental returns it)."""
    command_id: str | None = None
    async with master.db.session() as session:
        rental = await get_rental(session, principal, rental_id, for_update=True)
        if rental.state == RentalState.PENDING and rental.host_id is None:  # queued: nothing runs anywhere
            if advance(session, rental, RentalState.STOPPED, f"cancelled while queued, by {principal.name}"):
                rental.stopped_at = master.clock.now()
        elif rental.state in UNSTOPPED_STATES:
            assert rental.host_id is not None
            command = commands.new_command(
                session, host_id=rental.host_id, command=protocol.StopWorkload(rental_id=rental.id), rental_id=rental.id
            )
            command_id = command.id
            advance(session, rental, RentalState.STOPPING, f"stop requested by {principal.name}")
        elif rental.workspace_until is not None:
            # Ended on its own, /workspace kept for SFTP: releasing it tells the agent to drop it now.
            command_id = _release_workspace(session, rental, by=principal.name)
    # A cluster's member stopped on its own stops its cluster's other members (cluster_policy): send those too.
    await commands.publish(master, [*([command_id] if command_id else []), *clusterstate.issued_commands(session.info)])
    return rental


def _release_workspace(session: AsyncSession, rental: Rental, *, by: str) -> str | None:
    """Forget an ended rental's kept /workspace: a ``stop_workload`` the agent reads as "release"."""
    rental.workspace_until = None
    if rental.host_id is None:
        return None
    command = commands.new_command(
        session, host_id=rental.host_id, command=protocol.StopWorkload(rental_id=rental.id, reason=protocol.RELEASED), rental_id=rental.id
    )
    session.add(RentalEvent(rental_id=rental.id, from_state=rental.state, to_state=rental.state, cause=f"workspace released by {by}"))
    return command.id


async def release_expired_workspaces(master: Master, *, limit: int = 100) -> int:
    """Release the kept /workspace of rentals whose ``workspace_until`` has passed; returns how many."""
    command_ids: list[str] = []
    async with master.db.session() as session:
        rows = (await session.scalars(
            select(Rental).where(Rental.workspace_until <= master.clock.now()).limit(limit).with_for_update(skip_locked=True)
        )).all()
        for rental in rows:
            command_id = _release_workspace(session, rental, by="its retention period")
            if command_id is not None:
                command_ids.append(command_id)
    if command_ids:
        await commands.publish(master, command_ids)
    return len(rows)


async def rental_logs(session: AsyncSession, principal: Principal, rental_id: str, *, offset: int, limit: int) -> dict[str, Any]:
    """The workload's output from byte ``offset`` (as far as the agent has shipped it)."""
    rental = await get_rental(session, principal, rental_id)
    chunks = (
        await session.scalars(
            select(RentalLogChunk)
            .where(RentalLogChunk.rental_id == rental.id, RentalLogChunk.offset + RentalLogChunk.length > offset)
            .order_by(RentalLogChunk.offset)
        )
    ).all()
    # Chunks are whole slices of the agent's log; one that starts before ``offset`` is cut
    # by bytes (exact for valid UTF-8, approximate where the agent replaced invalid bytes).
    parts: list[str] = []
    start = chunks[0].offset if chunks and chunks[0].offset > offset else offset  # older bytes were pruned
    position = start
    for chunk in chunks:
        if chunk.offset + chunk.length <= position:
            continue  # within a longer chunk read already (a re-shipment from an earlier offset)
        if chunk.offset > position or position - start >= limit:
            break  # a gap (not shipped yet), or enough
        skip = position - chunk.offset
        text = chunk.data.encode()[skip:].decode(errors="replace") if skip else chunk.data
        parts.append(text)
        position = chunk.offset + chunk.length
    data = "".join(parts)
    return {
        "rental_id": rental.id,
        "offset": start,
        "next_offset": position,
        "data": data,
        "state": rental.state,
    }


def rental_view(rental: Rental, events: Sequence[RentalEvent] | None = None) -> dict[str, Any]:
    view: dict[str, Any] = {
        "id": rental.id,
        "state": rental.state,
        "host_id": rental.host_id,
        "gpu_model": rental.gpu_model,
        "gpu_count": rental.gpu_count,
        "gpu_uuids": rental.gpu_uuids,
        "workload": rental.workload,
        "failure_reason": rental.failure_reason,
        "failure_code": rental.failure_code,
        "failure_owner": rental.failure_owner,  # renter, provider or platform (docs/reliability.md)
        "template": (rental.spec or {}).get("template"),
        "created_at": rental.created_at.isoformat(),
        "started_at": rental.started_at.isoformat() if rental.started_at else None,
        "stopped_at": rental.stopped_at.isoformat() if rental.stopped_at else None,
        "host_lost_at": rental.host_lost_at.isoformat() if rental.host_lost_at else None,
        "restart_on_failure": rental.restart_on_failure,
        "failover_after_s": rental.failover_after_s,  # None: the master's failover_after_s
        "replaces": rental.replaces_id,
        "kind": rental.kind,
        "bid_per_gpu_hour": money(rental.bid_per_gpu_hour) if rental.bid_per_gpu_hour is not None else None,
        "price_per_gpu_hour": money(rental.price_per_gpu_hour) if rental.price_per_gpu_hour is not None else None,
        "gpu_milli": rental.gpu_milli,
        "gpu_memory_mib": rental.gpu_memory_mib,
        "mig_profile": rental.mig_profile,
        "offer_id": (rental.spec or {}).get("offer_id"),
        "requirements": (rental.spec or {}).get("query") or None,
        "price_tolerance": (rental.spec or {}).get("price_tolerance"),  # the renter's own; null: the platform's rule
        "network": (rental.spec or {}).get("network"),
        "queued": rental.state == RentalState.PENDING and rental.host_id is None,
        "queue_until": rental.queue_until.isoformat() if rental.queue_until else None,
        "preempted_by": rental.preempted_by_id,
        "preempting_by": rental.preempting_by_id,  # a preemption in flight: it runs until that rental's host has its image
        "requeued_from": rental.requeued_from_id,
        "ssh_host_key": rental.ssh_host_key,
        "workspace_until": rental.workspace_until.isoformat() if rental.workspace_until else None,
        "tunnel": {"bytes_in": rental.tunnel_bytes_in or 0, "bytes_out": rental.tunnel_bytes_out or 0},
        "service_id": rental.service_id,
        "ready_at": rental.ready_at.isoformat() if rental.ready_at else None,
        "volumes": (rental.spec or {}).get("volumes") or [],  # as asked: [{"name" | "id", "mount", "read_only"}]
    }
    if events is not None:
        view["events"] = [
            {"at": e.at.isoformat(), "from": e.from_state, "to": e.to_state, "cause": e.cause} for e in events
        ]
    return view
