"""A service whose replicas cannot start: the streak of start failures, the wait before the next replica, ``failing``.

The policy, written down (docs/services.md, "When replicas cannot start"):

* **The streak.** Replicas asked for since ``services.backoff_from`` that ended ``failed`` before they were ever
  ready, newest first, while they share one failure code (``rentals.failure_code``). A replica turning ready
  resets it (``backoff_from`` moves to then), and so does the renter (``resume``: ``PUT …/replicas``).
* **Back-off, per cause.** After the streak's n-th failure no replacement is rented before
  ``service_backoff_base_s × 2^(n-1)`` seconds (5, 10, 20 … up to ``service_backoff_max_s``), and then one
  replica at a time: the next only once that one failed too. A new code starts its own streak at the base wait.
* **Failing.** ``service_failing_after`` failures in a row with one code turn the service ``failing``: one
  ``failing`` event, its endpoint answers 503 with the cause at once. A renter's cause (an image that does not
  exist, a registry login refused) is not retried at all: nothing changes until the renter does; any other
  cause (an image the host could not pull, a host lost) is retried every ``service_backoff_max_s``.
* **Events.** One ``start_failed`` event per cause (the first failure of a code), one ``failing`` when the
  service turns failing, one ``recovered`` or ``resumed`` when it stops; never one per replica.

``observe`` and ``resume`` change the service row inside the caller's transaction (the row locked by it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Rental, Service, ServiceEvent
from master.services.lifecycle.rentals import RentalState
from master.services.market import Owner
from shared.settings import MasterSettings

FAILING = "failing"
STREAK_READ = 100  # the streak is read this far back at most (its count shows no more)


@dataclass(frozen=True)
class Streak:
    """Replicas in a row that failed to start with one code (newest first)."""

    code: str
    owner: str
    message: str
    count: int
    newest: str  # the newest one's rental id


def streak_of(failed: Sequence[Rental]) -> Streak | None:
    """The streak that ``failed`` (replicas that failed before they were ready, newest first) begins with."""
    if not failed:
        return None
    first = failed[0]
    code = first.failure_code or "agent_failure"
    count = 0
    for rental in failed:
        if (rental.failure_code or "agent_failure") != code:
            break
        count += 1
    message = first.failure_reason or code
    return Streak(code=code, owner=first.failure_owner or Owner.PROVIDER.value, message=message, count=count, newest=first.id)


def delay_s(count: int, *, base_s: float, max_s: float) -> float:
    """The wait after a streak's ``count``-th failure: the base, doubled for each failure before it, capped."""
    return min(max_s, base_s * 2.0 ** min(max(count - 1, 0), 40))


def retried(service: Service) -> bool:
    """Whether the service's replicas are still retried (a failing service with a renter's cause is not)."""
    return not (service.state == FAILING and service.failure_owner == Owner.RENTER.value)


def cause(service: Service) -> str | None:
    """``code: message`` of the service's streak (what its endpoint answers), None without one."""
    if service.failure_code is None:
        return None
    message = service.failure_message or ""
    return message if message.startswith(service.failure_code) else f"{service.failure_code}: {message}".rstrip(": ")


async def failed_replicas(session: AsyncSession, service: Service) -> list[Rental]:
    """The replicas that count towards the streak: asked for since ``backoff_from``, failed and never ready, newest first."""
    query = select(Rental).where(Rental.service_id == service.id, Rental.state == RentalState.FAILED.value,
                                 Rental.ready_at.is_(None))  # fmt: skip
    if service.backoff_from is not None:
        query = query.where(Rental.created_at >= service.backoff_from)
    return list((await session.scalars(query.order_by(Rental.created_at.desc(), Rental.id.desc()).limit(STREAK_READ))).all())


async def observe(session: AsyncSession, service: Service, settings: MasterSettings, *, now: datetime) -> bool:
    """Bring ``service``'s streak up to date with its replicas (``service`` locked by the caller's transaction).

    A failure not seen before sets the wait before the next replica from ``now``; returns whether one was seen."""
    streak = streak_of(await failed_replicas(session, service))
    if streak is None or (streak.newest, streak.count) == (service.failure_rental_id, service.failure_count):
        return False  # nothing new (a replica asked for at once with others may fail after a newer one: the count says)
    new_cause = streak.code != service.failure_code
    service.failure_code, service.failure_owner, service.failure_message = streak.code, streak.owner, streak.message[:2000]
    service.failure_count, service.failure_rental_id = streak.count, streak.newest
    if new_cause:
        service.failure_since = now
    turns_failing = service.state == "active" and streak.count >= settings.service_failing_after
    if turns_failing:
        service.state = FAILING
    if service.state == FAILING:
        wait: float | None = None if not retried(service) else settings.service_backoff_max_s
    else:
        wait = delay_s(streak.count, base_s=settings.service_backoff_base_s, max_s=settings.service_backoff_max_s)
    service.next_attempt_at = None if wait is None else now + timedelta(seconds=wait)
    then = "not retried until you set its replicas again" if wait is None else f"the next replica in {wait:g} s"
    if new_cause:
        _event(session, service, now, "start_failed", f"replica {streak.newest} failed to start: {cause(service)}; {then}, "
                                                      "waiting longer after each failure with this cause")  # fmt: skip
    if turns_failing:
        _event(session, service, now, FAILING, f"failing: {streak.count} replicas in a row failed to start with "
                                               f"{streak.code} ({streak.owner}'s): {service.failure_message}; {then}")  # fmt: skip
    return True


def may_add(service: Service, live: Sequence[Rental], *, now: datetime) -> int | None:
    """How many replicas the autoscaler may rent now: None for no limit (no streak), else 0 or 1."""
    if service.failure_count == 0:
        return None
    if not retried(service) or (service.next_attempt_at is not None and now < service.next_attempt_at):
        return 0
    # One attempt at a time: the next waits until this one is ready (the streak ends) or failed (a longer wait).
    return 0 if any(r.ready_at is None for r in live) else 1


def reset(service: Service, *, now: datetime) -> bool:
    """End the streak (a replica is ready, or the renter resumed): back to ``active``; returns whether it was failing."""
    was_failing = service.state == FAILING
    if was_failing:
        service.state = "active"
    service.backoff_from, service.failure_code, service.failure_owner, service.failure_message = now, None, None, None
    service.failure_since, service.failure_count, service.failure_rental_id, service.next_attempt_at = None, 0, None, None
    return was_failing


def resume(session: AsyncSession, service: Service, *, now: datetime, by: str) -> None:
    """The renter asks again (``PUT …/replicas``): the streak ends, replicas are rented on the autoscaler's next pass."""
    had = cause(service)
    if had is None and service.state != FAILING:
        return
    reset(service, now=now)
    _event(session, service, now, "resumed", f"resumed by {by} after {had}; replicas are rented again")


def failure_view(service: Service) -> dict[str, object] | None:
    """The streak as the API shows it (``failure``), None without one."""
    if service.failure_code is None:
        return None
    return {
        "code": service.failure_code, "owner": service.failure_owner, "message": service.failure_message,
        "since": _iso(service.failure_since), "consecutive": service.failure_count, "retried": retried(service),
    }  # fmt: skip


def _iso(at: datetime | None) -> str | None:
    return at.isoformat().replace("+00:00", "Z") if at is not None else None


def _event(session: AsyncSession, service: Service, at: datetime, kind: str, cause_text: str) -> None:
    session.add(ServiceEvent(service_id=service.id, at=at, kind=kind, replicas=service.desired_replicas, cause=cause_text))
