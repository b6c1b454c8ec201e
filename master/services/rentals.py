"""Rentals: placing a request on free GPUs, starting and stopping it through the agent.

States: pending → starting → running → stopping → stopped | failed. The GPUs are
claimed with a conditional UPDATE (``WHERE rental_id IS NULL``) inside a savepoint, so
two masters racing for the same GPU cannot both win: the loser tries the next host.
GPUs are freed only when the agent confirms the workload stopped (or failed to start).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import Master
from master.models import Command as CommandRow
from master.models import Gpu, Host, Rental, RentalEvent, RentalLogChunk
from master.services import commands
from master.services.accounts import Principal
from master.services.hoststate import RENTABLE_STATES, transition
from master.services.placement import FreeGpu, first_fit, model_matches
from shared.errors import Conflict, InsufficientCapacity, NotFound, ValidationFailed
from shared.ids import new_id

log = logging.getLogger(__name__)

RENTAL_STATES = ("pending", "starting", "running", "stopping", "stopped", "failed")
ACTIVE_STATES = ("pending", "starting", "running", "stopping")
RENTAL_TRANSITIONS: dict[str, frozenset[str]] = {
    "pending": frozenset({"starting", "stopping", "failed"}),
    "starting": frozenset({"running", "stopping", "failed"}),
    "running": frozenset({"stopping", "stopped", "failed"}),
    "stopping": frozenset({"stopped", "failed"}),
    "stopped": frozenset(),
    "failed": frozenset(),
}
MAX_GPUS_PER_RENTAL = 64
# Fresh reads of the free GPUs one placement may take after losing races to concurrent claims.
MAX_PLACEMENT_ROUNDS = 16


@dataclass(frozen=True)
class RentalRequest:
    gpu_count: int
    gpu_model: str | None = None
    workload: dict[str, Any] = field(default_factory=dict)
    restart_on_failure: bool = False
    avoid_hosts: frozenset[str] = frozenset()
    """Hosts not to place on (a re-placement avoids the host that was lost)."""
    replaces: str | None = None

    def fingerprint(self) -> str:
        fields: dict[str, Any] = {"n": self.gpu_count, "m": self.gpu_model, "w": self.workload}
        if self.restart_on_failure:
            fields["r"] = True
        blob = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()


def _set_state(session: AsyncSession, rental: Rental, to_state: str, cause: str) -> bool:
    if rental.state == to_state:
        return False
    if to_state not in RENTAL_TRANSITIONS[rental.state]:
        log.warning("ignored rental transition %s: %s → %s (%s)", rental.id, rental.state, to_state, cause)
        return False
    session.add(RentalEvent(rental_id=rental.id, from_state=rental.state, to_state=to_state, cause=cause))
    rental.state = to_state
    return True


async def _free_gpus(session: AsyncSession) -> list[FreeGpu]:
    rows = (
        await session.execute(
            select(Gpu.id, Gpu.host_id, Gpu.index, Gpu.uuid, Gpu.name)
            .join(Host, Host.id == Gpu.host_id)
            .where(Gpu.rental_id.is_(None), Gpu.present.is_(True), Host.state.in_(RENTABLE_STATES))
        )
    ).all()
    return [FreeGpu(gpu_id=r[0], host_id=r[1], index=r[2], uuid=r[3], name=r[4]) for r in rows]


async def _largest_host(session: AsyncSession, model: str | None) -> int:
    """How many matching GPUs the biggest host in the fleet has, rented or not."""
    rows = (await session.execute(select(Gpu.host_id, Gpu.name).where(Gpu.present.is_(True)))).all()
    counts: dict[str, int] = {}
    for host_id, name in rows:
        if model_matches(model, name):
            counts[host_id] = counts.get(host_id, 0) + 1
    return max(counts.values(), default=0)


async def create_rental(master: Master, renter: Principal, request: RentalRequest, *, idempotency_key: str | None) -> tuple[Rental, bool]:
    """Place and start a rental; returns ``(rental, created)``.

    With an ``idempotency_key``, a repeat of the same request returns the first
    rental (``created`` False); the same key with a different request is a conflict.
    Runs to completion once called: callers must not cancel it half-way.
    """
    if not 1 <= request.gpu_count <= MAX_GPUS_PER_RENTAL:
        raise ValidationFailed(f"gpu_count must be between 1 and {MAX_GPUS_PER_RENTAL}", code="invalid_gpu_count")
    if idempotency_key is not None:
        existing = await _by_idempotency_key(master, renter.account_id, idempotency_key)
        if existing is not None:
            return _check_replay(existing, request), False
    try:
        rental, command_id = await _place(master, renter, request, idempotency_key)
    except IntegrityError:
        # A concurrent request with the same key won the race: return its rental.
        if idempotency_key is None:
            raise
        existing = await _by_idempotency_key(master, renter.account_id, idempotency_key)
        if existing is None:
            raise
        return _check_replay(existing, request), False
    await commands.publish(master, [command_id])
    return rental, True


def _check_replay(existing: Rental, request: RentalRequest) -> Rental:
    if existing.request_fingerprint != request.fingerprint():
        raise Conflict(
            "this Idempotency-Key was already used for a different rental request; use a new key",
            code="idempotency_key_reused",
        )
    return existing


async def _by_idempotency_key(master: Master, renter_id: str, key: str) -> Rental | None:
    async with master.db.session() as session:
        return await session.scalar(select(Rental).where(Rental.renter_id == renter_id, Rental.idempotency_key == key))


async def _place(master: Master, renter: Principal, request: RentalRequest, idempotency_key: str | None) -> tuple[Rental, str]:
    async with master.db.session() as session:
        for _round in range(MAX_PLACEMENT_ROUNDS):
            # A lost race means another rental committed its claim since we read the free
            # GPUs; read them again instead of answering 409 while GPUs are still free.
            lost_a_race = False
            free = [g for g in await _free_gpus(session) if g.host_id not in request.avoid_hosts]
            options = first_fit(free, count=request.gpu_count, model=request.gpu_model)
            for gpus in options:
                rental = Rental(
                    id=new_id("r"),
                    renter_id=renter.account_id,
                    host_id=gpus[0].host_id,
                    gpu_model=gpus[0].name,
                    gpu_count=request.gpu_count,
                    gpu_uuids=[g.uuid for g in gpus],
                    state="pending",
                    workload=request.workload,
                    idempotency_key=idempotency_key,
                    request_fingerprint=request.fingerprint(),
                    restart_on_failure=request.restart_on_failure,
                    replaces_id=request.replaces,
                )
                async with session.begin_nested() as attempt:
                    session.add(rental)
                    await session.flush()
                    claimed = await session.execute(
                        update(Gpu)
                        .where(Gpu.id.in_([g.gpu_id for g in gpus]), Gpu.rental_id.is_(None))
                        .values(rental_id=rental.id)
                    )
                    if claimed.rowcount != len(gpus):  # type: ignore[attr-defined]
                        log.info("lost a race for GPUs on host %s; trying the next host", rental.host_id)
                        lost_a_race = True
                        await attempt.rollback()
                        continue
                cause = f"placed again after rental {request.replaces} lost its host" if request.replaces else "placed"
                session.add(RentalEvent(rental_id=rental.id, from_state=None, to_state="pending", cause=cause))
                command = commands.new_command(
                    session,
                    host_id=rental.host_id,
                    kind="start_workload",
                    args={"rental_id": rental.id, "gpu_uuids": rental.gpu_uuids, "workload": rental.workload},
                    rental_id=rental.id,
                )
                _set_state(session, rental, "starting", f"start command {command.id} sent to host {rental.host_id}")
                log.info("rental %s placed on host %s (%d GPU)", rental.id, rental.host_id, request.gpu_count)
                return rental, command.id
            if not lost_a_race:
                break
        largest = await _largest_host(session, request.gpu_model)
    what = f"{request.gpu_count} × {request.gpu_model or 'any GPU'}"
    if largest < request.gpu_count:
        raise InsufficientCapacity(
            f"no host has {what}: the largest host with that model has {largest}; ask for fewer GPUs or another model",
            code="exceeds_fleet",
        )
    raise InsufficientCapacity(f"no host has {what} free right now; try again later or ask for fewer GPUs")


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
        if rental.state in ("pending", "starting", "running"):
            command = commands.new_command(
                session, host_id=rental.host_id, kind="stop_workload", args={"rental_id": rental.id}, rental_id=rental.id
            )
            command_id = command.id
            _set_state(session, rental, "stopping", f"stop requested by {principal.name}")
    if command_id is not None:
        await commands.publish(master, [command_id])
    return rental


async def apply_command_result(session: AsyncSession, command: CommandRow, *, ok: bool, detail: str, at: datetime) -> None:
    """What an agent's confirmation means for the rental it concerns."""
    if command.rental_id is None:
        return
    rental = await session.get(Rental, command.rental_id, with_for_update=True)
    if rental is None:
        return
    if command.kind == "start_workload":
        if ok:
            if _set_state(session, rental, "running", "agent confirmed the workload started"):
                rental.started_at = at
                host = await session.get(Host, rental.host_id)
                if host is not None and host.state == "online":
                    transition(session, host, "rented", cause=f"rental {rental.id} running", actor="master")
        else:
            if _set_state(session, rental, "failed", f"workload failed to start: {detail}"):
                rental.failure_reason = detail
                rental.stopped_at = at
                await _release(session, rental)
    elif command.kind == "stop_workload" and ok:
        if _set_state(session, rental, "stopped", "agent confirmed the workload stopped"):
            rental.stopped_at = at
            await _release(session, rental)


async def apply_workload_exit(
    session: AsyncSession, host_id: str, rental_id: str, *, exit_code: int | None, reason: str, at: datetime
) -> None:
    """A workload ended on its own: exit 0 completes the rental, anything else fails it. GPUs are freed."""
    rental = await session.get(Rental, rental_id, with_for_update=True)
    if rental is None or rental.host_id != host_id:
        log.warning("host %s reported the exit of rental %s it does not run", host_id, rental_id)
        return
    if rental.state not in ("starting", "running"):
        return  # already stopping/stopped by request, or failed: nothing to add
    what = f"workload exited with code {exit_code}" if exit_code is not None else f"workload ended ({reason or 'unknown'})"
    target = "stopped" if exit_code == 0 else "failed"
    if rental.state == "starting" and target == "stopped":
        target = "failed"  # never confirmed running: treat as a failed start
    if _set_state(session, rental, target, what):
        rental.stopped_at = at
        if target == "failed":
            rental.failure_reason = what
        await _release(session, rental)


async def fail_rental(session: AsyncSession, rental: Rental, *, reason: str, at: datetime) -> None:
    """End an active rental as failed (its host is gone or untrusted) and free its GPUs.

    Its unanswered commands are cancelled, so a host that comes back is not told to start it.
    """
    if _set_state(session, rental, "failed", reason):
        rental.failure_reason = reason
        rental.stopped_at = at
        await session.execute(update(Gpu).where(Gpu.rental_id == rental.id).values(rental_id=None))
        await session.execute(
            update(CommandRow)
            .where(CommandRow.rental_id == rental.id, CommandRow.state.in_(commands.OPEN_STATES))
            .values(state="failed", completed_at=at, result={"ok": False, "detail": f"cancelled: {reason}"})
        )


async def fail_rentals_of_lost_hosts(session: AsyncSession, *, now: datetime, grace: timedelta) -> list[str]:
    """Fail the active rentals of hosts offline for longer than ``grace``; returns their ids.

    Billing stops at ``host_lost_at``, the last time the host was heard from, not at the
    moment the grace period ran out. A host back within the grace period resumes its rentals.
    """
    rows = (
        await session.execute(
            select(Rental, Host.last_seen_at)
            .join(Host, Host.id == Rental.host_id)
            .where(Host.state == "offline", Host.state_changed_at <= now - grace, Rental.state.in_(ACTIVE_STATES))
            .with_for_update(of=Rental, skip_locked=True)
        )
    ).all()
    for rental, last_seen in rows:
        lost_at = last_seen or now
        rental.host_lost_at = lost_at
        await fail_rental(
            session, rental, at=lost_at,
            reason=f"host {rental.host_id} lost: silent since {lost_at:%Y-%m-%dT%H:%M:%SZ}, past the {grace.total_seconds():g}s grace period",
        )
        log.warning("rental %s failed: host %s lost", rental.id, rental.host_id)
    return [rental.id for rental, _ in rows]


async def replace_lost(master: Master, rental_id: str) -> Rental | None:
    """Start a rental lost with its host again elsewhere, if it asked for that; returns the new one.

    Idempotent: the new rental's idempotency key is derived from the old one, so a retried
    call returns the same re-placement. The renter reads what happened in both rentals' events.
    """
    async with master.db.session() as session:
        old = await session.get(Rental, rental_id)
    if old is None or not old.restart_on_failure or old.state != "failed" or old.host_lost_at is None:
        return None
    renter = Principal(account_id=old.renter_id, name="master", role="renter")
    request = RentalRequest(
        gpu_count=old.gpu_count, gpu_model=old.gpu_model, workload=old.workload, restart_on_failure=True,
        avoid_hosts=frozenset({old.host_id}), replaces=old.id,
    )
    new: Rental | None = None
    try:
        new, created = await create_rental(master, renter, request, idempotency_key=f"replace:{old.id}")
        note = f"placed again as rental {new.id} on host {new.host_id}"
    except InsufficientCapacity as exc:
        note, created = f"could not be placed again: {exc}", True
    if created:
        async with master.db.session() as session:
            session.add(RentalEvent(rental_id=old.id, from_state="failed", to_state="failed", cause=note))
        log.info("rental %s %s", old.id, note)
    return new


async def stop_strays(session: AsyncSession, host_id: str, reported: Sequence[str]) -> list[str]:
    """Stop workloads a host says it runs that are not active rentals of that host.

    (A rental failed while its host was away, or ended by anyone while a stop got lost.)
    Returns the ids of new ``stop_workload`` commands to publish; one open stop per rental.
    """
    if not reported:
        return []
    wanted = set(reported)
    active = set(
        (
            await session.scalars(
                select(Rental.id).where(Rental.id.in_(wanted), Rental.host_id == host_id, Rental.state.in_(("pending", "starting", "running")))
            )
        ).all()
    )
    stopping = set(
        (
            await session.scalars(
                select(CommandRow.rental_id).where(
                    CommandRow.host_id == host_id, CommandRow.kind == "stop_workload",
                    CommandRow.rental_id.in_(wanted), CommandRow.state.in_(commands.OPEN_STATES),
                )
            )
        ).all()
    )
    known = set((await session.scalars(select(Rental.id).where(Rental.id.in_(wanted)))).all())
    ids = []
    for rental_id in sorted(wanted - active - stopping):
        log.warning("host %s runs workload %s, which is not an active rental there; stopping it", host_id, rental_id)
        command = commands.new_command(
            session, host_id=host_id, kind="stop_workload", args={"rental_id": rental_id},
            rental_id=rental_id if rental_id in known else None,
        )
        ids.append(command.id)
    return ids


async def _release(session: AsyncSession, rental: Rental) -> None:
    await session.execute(update(Gpu).where(Gpu.rental_id == rental.id).values(rental_id=None))
    host = await session.get(Host, rental.host_id)
    if host is None or host.state != "rented":
        return
    still = await session.scalar(
        select(func.count()).select_from(Rental).where(
            Rental.host_id == host.id, Rental.state.in_(ACTIVE_STATES), Rental.id != rental.id
        )
    )
    if not still:
        transition(session, host, "online", cause=f"rental {rental.id} ended; no rentals left", actor="master")


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
        "created_at": rental.created_at.isoformat(),
        "started_at": rental.started_at.isoformat() if rental.started_at else None,
        "stopped_at": rental.stopped_at.isoformat() if rental.stopped_at else None,
        "host_lost_at": rental.host_lost_at.isoformat() if rental.host_lost_at else None,
        "restart_on_failure": rental.restart_on_failure,
        "replaces": rental.replaces_id,
    }
    if events is not None:
        view["events"] = [
            {"at": e.at.isoformat(), "from": e.from_state, "to": e.to_state, "cause": e.cause} for e in events
        ]
    return view
