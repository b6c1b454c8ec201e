"""One autoscaler pass over every service: health-check the replicas, decide how many are wanted, rent or stop the difference.

Run by one master at a time (``master/background/autoscaler.py``, under the ``autoscaler`` lease).
For each service, in order:

1. **Health.** Every running replica is probed through the gateway (``probe``: ``GET health_path``
   through its relay). The first pass sets ``ready_at`` (the gateway sends it requests from then
   on; the event says how long it took from the decision that asked for it); a ready replica that
   fails ``service_unhealthy_after`` probes in a row loses ``ready_at`` until one passes again.
2. **Decision.** ``scaling.decide`` on the figures of ``service_figures.load_of``; a change moves
   ``desired_replicas`` and is written as an event with the figures that made it.
3. **Replicas.** Fewer live replicas than desired (the autoscaler asked for more, or a replica
   ended: preempted, its host lost, its workload exited) rents the difference — a replica that
   ended is thereby replaced. More than desired stops the surplus: queued ones first, then those
   not ready, then the newest ready ones, which are first *drained* — taken out of the gateway's
   rotation for one pass, so requests in flight on them finish — and stopped on the next pass.
   A deleted service's live replicas are all stopped.
4. **Back-off.** Replicas that fail before they are ready (an image that cannot be pulled) are not replaced at
   once: ``backoff.py`` keeps the streak per cause, waits longer after each failure, rents one replica at a
   time, and after ``service_failing_after`` turns the service ``failing`` (its endpoint answers 503 with the
   cause); a ready replica or the renter's ``PUT …/replicas`` ends it.

A rental the marketplace refuses (no credit, a fleet that can never hold it) is one event per
distinct reason, not one per pass.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import or_, select

from master.context import Master
from master.models import Rental, Service, ServiceEvent
from master.services import rentals
from master.services.endpoints import backoff
from master.services.endpoints import core as elastic
from master.services.endpoints.figures import load_of
from master.services.endpoints.scaling import decide
from master.services.lifecycle.rentals import RentalState
from shared.errors import ClientError

log = logging.getLogger(__name__)

Probe = Callable[[Service, Rental], Awaitable[str | None]]
"""Health-checks one replica: None when healthy, else why not."""


@dataclass
class AutoscalerMemory:
    """What one master's autoscaler keeps between passes (lost with the lease: the next holder starts afresh)."""

    failures: dict[str, int] = field(default_factory=dict)  # rental id → failed probes in a row
    draining: dict[str, datetime] = field(default_factory=dict)  # rental id → when it left the rotation
    refusals: dict[str, str] = field(default_factory=dict)  # service id → the last refusal written as an event


async def autoscale_pass(master: Master, probe: Probe, memory: AutoscalerMemory) -> int:
    """One pass over every active or failing service (and every deleted one with replicas left); returns how many."""
    async with master.db.session() as session:
        services = (await session.scalars(select(Service).where(or_(
            Service.state.in_(elastic.OPEN_STATES),
            Service.id.in_(select(Rental.service_id).where(Rental.service_id.is_not(None), Rental.state.in_(_LIVE))),
        )).order_by(Service.created_at))).all()  # fmt: skip
        replicas = await elastic.replicas_of(session, [s.id for s in services], live_only=True)
    for service in services:
        try:
            await _service_pass(master, service, replicas[service.id], probe, memory)
        except Exception:  # one service's trouble must not stop the others'
            log.exception("autoscaler pass over service %s failed; next pass retries", service.id)
    return len(services)


QUIET_BUCKETS = 3  # a scale-down waits at least this many figure buckets after a scale-up (scaling.decide)
_LIVE = [RentalState.PENDING.value, RentalState.STARTING.value, RentalState.RUNNING.value]


async def _service_pass(master: Master, service: Service, live: list[Rental], probe: Probe, memory: AutoscalerMemory) -> None:
    await _check_health(master, service, live, probe, memory)
    now = master.clock.now()
    async with master.db.session() as session:
        row = await session.get(Service, service.id, with_for_update=True)
        assert row is not None
        if row.state in elastic.OPEN_STATES:
            await backoff.observe(session, row, master.settings, now=now)
        if row.state in elastic.OPEN_STATES:
            load = await load_of(session, row, live, now=now, bucket_s=master.settings.service_stats_bucket_s)
            decision = decide(rule=row.scaling, min_replicas=row.min_replicas, max_replicas=row.max_replicas,
                              desired=row.desired_replicas, load=load, now=now, last_up=row.last_scale_up_at,
                              last_down=row.last_scale_down_at, waking=row.wake_requested_at is not None,
                              min_quiet_s=QUIET_BUCKETS * master.settings.service_stats_bucket_s)  # fmt: skip
            if decision.kind != "hold":
                session.add(ServiceEvent(service_id=row.id, at=now, kind=decision.kind, replicas=decision.replicas,
                                         cause=f"{row.desired_replicas} → {decision.replicas}: {decision.reason}"))  # fmt: skip
                row.desired_replicas = decision.replicas
                if decision.kind == "scale_up":
                    row.last_scale_up_at = now
                else:
                    row.last_scale_down_at = now
                log.info("service %s: %s to %d (%s)", row.id, decision.kind, decision.replicas, decision.reason)
        desired = row.desired_replicas if row.state in elastic.OPEN_STATES else 0
        service = row
    await _reconcile(master, service, live, desired, memory, now=now)


async def _check_health(master: Master, service: Service, live: Sequence[Rental], probe: Probe, memory: AutoscalerMemory) -> None:
    now = master.clock.now()
    for rental in live:
        if rental.state != RentalState.RUNNING or rental.id in memory.draining:
            continue
        problem = await probe(service, rental)
        if problem is None:
            memory.failures.pop(rental.id, None)
            if rental.ready_at is None:
                await _mark_ready(master, service, rental, now=master.clock.now())
            continue
        memory.failures[rental.id] = failures = memory.failures.get(rental.id, 0) + 1
        if rental.ready_at is not None and failures >= master.settings.service_unhealthy_after:
            await _set_ready(master, rental, None)
            await _event(master, service, "unhealthy", f"replica {rental.id} failed {failures} health checks in a row "
                                                       f"({problem}); no requests go to it until one passes", at=now)  # fmt: skip


async def _mark_ready(master: Master, service: Service, rental: Rental, *, now: datetime) -> None:
    """Ready from ``now``: its ``ready_at``, the event, and — a cold start's replica — the wake cleared, in one transaction."""
    took = (now - rental.created_at).total_seconds()
    async with master.db.session() as session:
        row = await session.get(Service, service.id, with_for_update=True)
        replica = await session.get(Rental, rental.id, with_for_update=True)
        if replica is not None:
            replica.ready_at = now
        replicas = row.desired_replicas if row is not None else service.desired_replicas
        session.add(ServiceEvent(service_id=service.id, at=now, kind="ready", replicas=replicas,
                                 cause=f"replica {rental.id} ready {took:.1f}s after it was asked for"))  # fmt: skip
        if row is not None and row.wake_requested_at is not None:
            waited = (now - row.wake_requested_at).total_seconds()
            # The waiting requests go to it now: its cool-downs count from here, as after a scale-up.
            row.wake_requested_at, row.last_scale_up_at = None, now
            session.add(ServiceEvent(service_id=row.id, at=now, kind="cold_start", replicas=row.desired_replicas,
                                     cause=f"cold start: a replica was ready {waited:.1f}s after the first request waited"))  # fmt: skip
        if row is not None and (row.failure_count or row.state == backoff.FAILING):
            had = backoff.cause(row)
            if backoff.reset(row, now=now):
                session.add(ServiceEvent(service_id=row.id, at=now, kind="recovered", replicas=row.desired_replicas,
                                         cause=f"replica {rental.id} ready: no longer failing ({had})"))  # fmt: skip
        elif row is not None:
            row.backoff_from = now  # failures of replicas asked for before this one no longer count
    rental.ready_at = now


async def _set_ready(master: Master, rental: Rental, at: datetime | None) -> None:
    async with master.db.session() as session:
        row = await session.get(Rental, rental.id, with_for_update=True)
        if row is not None:
            row.ready_at = at


async def _reconcile(master: Master, service: Service, live: list[Rental], desired: int, memory: AutoscalerMemory, *,
                     now: datetime) -> None:  # fmt: skip
    """Rent or stop replicas until ``desired`` are live (draining ready ones first, see the module's docstring)."""
    for rental_id in [r for r in memory.draining if r not in {x.id for x in live}]:
        memory.draining.pop(rental_id, None)
    if len(live) < desired:
        allowed = backoff.may_add(service, live, now=now)
        count = desired - len(live) if allowed is None else min(allowed, desired - len(live))
        if count > 0:
            await _add(master, service, count, desired, memory, now=now)
        return
    surplus = len(live) - desired
    if surplus <= 0:
        return
    order = sorted(live, key=lambda r: (r.state == RentalState.RUNNING, r.ready_at is not None, r.id not in memory.draining,
                                        -r.created_at.timestamp()))  # fmt: skip
    for rental in order[:surplus]:
        if rental.ready_at is not None and rental.id not in memory.draining and service.state in elastic.OPEN_STATES:
            memory.draining[rental.id] = now  # out of the rotation now, stopped next pass
            await _set_ready(master, rental, None)
            continue
        memory.draining.pop(rental.id, None)
        memory.failures.pop(rental.id, None)
        await rentals.stop_rental(master, elastic.owner_of(service), rental.id)
        log.info("service %s: stopped replica %s", service.id, rental.id)


async def _add(master: Master, service: Service, count: int, desired: int, memory: AutoscalerMemory, *, now: datetime) -> None:
    try:
        made = await elastic.add_replicas(master, service, count)
    except ClientError as refusal:
        reason = f"cannot rent a replica: {refusal} ({refusal.code})"
        if memory.refusals.get(service.id) != reason:
            memory.refusals[service.id] = reason
            await _event(master, service, "refused", reason, at=now)
        return
    memory.refusals.pop(service.id, None)
    if service.failure_count:
        return  # an attempt of a start failures' streak: its cause's event said it once (backoff.py)
    names = ", ".join(r.id for r in made)
    await _event(master, service, "replicas", f"rented {names} to have {desired} live", at=now)


async def _event(master: Master, service: Service, kind: str, cause: str, *, at: datetime) -> None:
    async with master.db.session() as session:
        current = await session.get(Service, service.id)
        replicas = current.desired_replicas if current is not None else service.desired_replicas
        session.add(ServiceEvent(service_id=service.id, at=at, kind=kind, replicas=replicas, cause=cause))
