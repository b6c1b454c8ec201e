"""Preemption in flight: victims marked when a placement takes their GPUs, ended only when the taker really starts.

A preemption is decided by placement (``placement._find_victims``) but carried out by the host, in order:
the preempting rental's ``start_workload`` names its victims (``StartWorkload.preempts``), and the agent first
does what can fail on its own (the GPUs' check, the image's pull), then stops the victims (each with the
``preemption_grace_s`` grace), then starts the new workload (``agent.commands``).

* ``mark`` (at placement, in the placement's transaction): each victim stays in its state, ``preempting_by_id``
  naming the taker, with an event. Its GPU allocations are released for the taker's claim; the victim keeps
  running — and keeps being billed — on GPUs it no longer holds in the books, for the length of the taker's pull.
* ``settle`` (the taker's start result, in the same transaction as the result): the victims the agent stopped
  (all of them when the start succeeded; those in the failed result's ``data.preempted`` otherwise) end
  ``preempted`` then — billing stops at the result — and an interruptible one sent with ``queue: true`` is queued
  again (``requeue``). The others get their GPUs back (``allocation.reclaim``, after the taker released them), the
  mark is cleared and an event says the preemption was rolled back: they never stopped. Should their GPUs be
  gone meanwhile (nothing else can take them while the taker holds them), the victim ends ``preempted`` all the
  same and its agent, which still runs it, is told to stop it by the next heartbeat's stray check.
* A preemption that never hears back: its host is lost (``lifecycle.fail_rentals_of_lost_hosts`` fails every
  active rental of the host, victims and taker alike); a stop of the taker queues behind its start on the agent,
  which answers the start first.

**Requeue.** Billing meters a rental as one segment on one host (``started_at`` to ``stopped_at``), so a preempted
rental is not put back itself: it ends ``preempted`` as before and a new queued rental with its request
(``requeued_from_id`` naming it, idempotency key ``requeue:<id>``) takes its place in the queue — its
``created_at`` is the preempted rental's, which is what the queue orders by (``master.services.queue``). Its
``queue_until`` is counted afresh from the preemption. A cluster's member (its cluster ends with it) and a
service's replica (its autoscaler replaces it) are not requeued.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from decimal import Decimal

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Rental, RentalEvent
from master.services import commands
from master.services.lifecycle.rentals import ACTIVE_STATES, RentalState, advance
from master.services.market import money
from master.services.rentals import allocation
from shared import protocol
from shared.ids import new_id

log = logging.getLogger(__name__)

REQUEUE_KEY = "requeue:"  # a requeued rental's idempotency key: this and the preempted rental's id


def _by(rental: Rental) -> str:
    return "an on-demand rental" if rental.kind == "on_demand" else f"a higher bid ({money(rental.bid_per_gpu_hour or Decimal(0))})"


async def mark(session: AsyncSession, victims: Sequence[str], by: Rental, *, grace_s: float, now: datetime) -> list[protocol.Preemption] | None:
    """Mark ``victims`` as being preempted by ``by`` and release their GPUs for its claim; returns what its start
    command names, or None if one of them is no longer preemptible (ended, or already being preempted)."""
    rows = (
        await session.scalars(select(Rental).where(Rental.id.in_(list(victims))).order_by(Rental.id).with_for_update())
    ).all()
    if len(rows) != len(victims) or any(
        r.state not in ACTIVE_STATES or r.kind != "interruptible" or r.preempting_by_id is not None for r in rows
    ):
        return None
    marked = []
    for victim in rows:
        victim.preempting_by_id = by.id
        session.add(RentalEvent(
            rental_id=victim.id, at=now, from_state=victim.state, to_state=victim.state,
            cause=f"being preempted by {_by(by)}, rental {by.id}: keeps running until its host has rental {by.id}'s image, "
                  f"then is given {grace_s:g}s to stop",
        ))  # fmt: skip
        await allocation.release(session, victim.id, at=now)
        marked.append(protocol.Preemption(rental_id=victim.id, grace_s=grace_s, reason=f"preempted by rental {by.id}"))
        log.info("rental %s being preempted by %s on host %s", victim.id, by.id, victim.host_id)
    return marked


def stopped_by_agent(ok: bool, data: Mapping[str, object] | None) -> set[str] | None:
    """The victims a start's result says the agent stopped; None: all of them (a start that succeeded)."""
    if ok:
        return None
    preempted = (data or {}).get("preempted")
    return {str(v) for v in preempted} if isinstance(preempted, list) else set()


async def settle(session: AsyncSession, by: Rental, *, ok: bool, detail: str, data: Mapping[str, object] | None, at: datetime) -> None:
    """The preempting rental ``by``'s start answered: end the victims the agent stopped, give the others their GPUs back.

    Idempotent: a victim is settled once (its mark is cleared); call after ``by``'s own GPUs are released on a failure."""
    victims = (
        await session.scalars(select(Rental).where(Rental.preempting_by_id == by.id).order_by(Rental.id).with_for_update())
    ).all()
    stopped = stopped_by_agent(ok, data)
    for victim in victims:
        victim.preempting_by_id = None
        if stopped is None or victim.id in stopped:
            await _end(session, victim, by, at=at)
        else:
            await _roll_back(session, victim, by, detail=detail, at=at)


async def _end(session: AsyncSession, victim: Rental, by: Rental, *, at: datetime) -> None:
    requeue = victim.kind == "interruptible" and bool((victim.spec or {}).get("queue")) and victim.cluster_id is None \
        and victim.service_id is None  # fmt: skip
    cause = f"preempted by {_by(by)}, rental {by.id}: its host had its image and stopped this workload"
    if not advance(session, victim, RentalState.PREEMPTED, cause, at=at):
        return  # ended meanwhile (stopped by its renter, exited): that ending stands
    victim.stopped_at = at  # billing ends here
    victim.preempted_by_id = by.id
    victim.failure_reason = f"preempted by rental {by.id}"
    await allocation.release(session, victim.id, at=at)  # nothing, normally: released when marked
    await commands.cancel_open(session, victim.id, at=at, reason="the rental was preempted")
    log.info("rental %s preempted by %s on host %s", victim.id, by.id, victim.host_id)
    if requeue:
        await _requeue(session, victim, by, at=at)


async def _roll_back(session: AsyncSession, victim: Rental, by: Rental, *, detail: str, at: datetime) -> None:
    why = f"rental {by.id}'s start failed before this workload was touched ({' '.join(detail.split())[:200] or 'no reason given'})"
    if victim.state not in ACTIVE_STATES:
        session.add(RentalEvent(rental_id=victim.id, at=at, from_state=victim.state, to_state=victim.state,
                                cause=f"preemption by rental {by.id} rolled back: {why}"))  # fmt: skip
        return
    async with session.begin_nested() as attempt:
        back = await allocation.reclaim(session, victim.id, at=at)
        if not back:
            await attempt.rollback()
    if back:
        session.add(RentalEvent(rental_id=victim.id, at=at, from_state=victim.state, to_state=victim.state,
                                cause=f"preemption by rental {by.id} rolled back: {why}; it kept running and keeps its GPUs"))  # fmt: skip
        log.info("preemption of rental %s by %s rolled back", victim.id, by.id)
        return
    # Its GPUs went to another rental meanwhile: it cannot stay. Its agent still runs it: the stray check stops it.
    log.warning("preemption of rental %s by %s rolled back, but its GPUs are taken; ending it", victim.id, by.id)
    await _end(session, victim, by, at=at)


async def _requeue(session: AsyncSession, old: Rental, by: Rental, *, at: datetime) -> Rental:
    """Queue ``old``'s request again as a new rental that keeps its place (its ``created_at``)."""
    spec = old.spec or {}
    timeout = float(spec.get("queue_timeout_s") or 600.0)
    new = Rental(
        id=new_id("r"), renter_id=old.renter_id, host_id=None, gpu_model=spec.get("gpu_model", old.gpu_model), gpu_count=old.gpu_count,
        gpu_uuids=[], state=RentalState.PENDING.value, workload=old.workload, idempotency_key=f"{REQUEUE_KEY}{old.id}",
        request_fingerprint=old.request_fingerprint, restart_on_failure=old.restart_on_failure, kind=old.kind,
        gpu_milli=old.gpu_milli, gpu_memory_mib=old.gpu_memory_mib if old.mig_profile is None else 0, mig_profile=old.mig_profile,
        bid_per_gpu_hour=old.bid_per_gpu_hour, spec=spec, created_at=old.created_at, queue_until=at + timedelta(seconds=timeout),
        requeued_from_id=old.id,
    )  # fmt: skip
    session.add(new)
    await session.flush()
    session.add(RentalEvent(
        rental_id=new.id, at=at, from_state=None, to_state=RentalState.PENDING.value,
        cause=f"queued again for up to {timeout:g}s: rental {old.id} was preempted by rental {by.id}; keeps its place "
              f"in the queue (since {old.created_at:%Y-%m-%dT%H:%M:%SZ})",
    ))  # fmt: skip
    session.add(RentalEvent(rental_id=old.id, at=at, from_state=old.state, to_state=old.state,
                            cause=f"requeued as rental {new.id}, in its place in the queue"))  # fmt: skip
    log.info("rental %s preempted by %s: queued again as %s", old.id, by.id, new.id)
    return new
