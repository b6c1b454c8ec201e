"""The rental state machine: one explicit transition table; every change recorded in ``rental_events``.

    pending ─placed─▶ starting ─agent confirmed─▶ running ─workload exited with 0─▶ stopped
    pending, starting, running ─stop requested─▶ stopping ─agent confirmed─▶ stopped
    pending, starting, running ─▶ failed | preempted;  stopping ─▶ failed;  pending (queued) ─cancelled─▶ stopped
    stopped, failed and preempted are final

A queued rental is ``pending`` with no host. The column stays a string: ``RentalState`` is a
``StrEnum`` and compares equal to it; what is written to the row is the plain string.

Two ways to change a rental's state, both through the table:

* ``transition`` raises ``IllegalRentalTransition`` on a change the table forbids. For writers
  that have already checked the current state (billing's credit enforcement).
* ``advance`` logs and skips a forbidden change (returns ``False``). For writers that race with
  the agent and other masters on purpose and must converge: a command result, a workload exit,
  a stop, a lost host or a preemption can each find the rental already ended, and the first
  ending wins (the rental services use it everywhere).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import event, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, attributes

from master.models import Rental, RentalEvent, VolumeAttachment
from master.services.lifecycle import clusters as clusterstate
from shared.errors import Conflict

log = logging.getLogger(__name__)


class RentalState(StrEnum):
    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
    PREEMPTED = "preempted"


RENTAL_STATES = tuple(state.value for state in RentalState)  # plain strings, for labels and views

TRANSITIONS: dict[RentalState, frozenset[RentalState]] = {
    RentalState.PENDING: frozenset(
        {RentalState.STARTING, RentalState.STOPPING, RentalState.STOPPED, RentalState.FAILED, RentalState.PREEMPTED}
    ),
    RentalState.STARTING: frozenset({RentalState.RUNNING, RentalState.STOPPING, RentalState.FAILED, RentalState.PREEMPTED}),
    RentalState.RUNNING: frozenset({RentalState.STOPPING, RentalState.STOPPED, RentalState.FAILED, RentalState.PREEMPTED}),
    RentalState.STOPPING: frozenset({RentalState.STOPPED, RentalState.FAILED}),
    RentalState.STOPPED: frozenset(),
    RentalState.FAILED: frozenset(),
    RentalState.PREEMPTED: frozenset(),
}

# Rentals that hold (or are about to hold) GPUs: counted by quotas, and keeping their host rented.
ACTIVE_STATES = (RentalState.PENDING, RentalState.STARTING, RentalState.RUNNING, RentalState.STOPPING)
# Active and not asked to stop: what a host should be running (placed ones), what billing stops for want of credit.
UNSTOPPED_STATES = (RentalState.PENDING, RentalState.STARTING, RentalState.RUNNING)
# Ended: nothing runs and nothing more is billed.
FINAL_STATES = (RentalState.STOPPED, RentalState.FAILED, RentalState.PREEMPTED)


class IllegalRentalTransition(Conflict):
    code = "illegal_transition"


def allowed(from_state: str, to_state: RentalState) -> bool:
    """Whether the table lets a rental in ``from_state`` go to ``to_state``."""
    return to_state in TRANSITIONS[RentalState(from_state)]


def transition(session: AsyncSession, rental: Rental, to_state: RentalState, cause: str, *, at: datetime | None = None) -> bool:
    """Move ``rental`` to ``to_state`` and record why; returns whether it changed.

    A transition to the current state is a no-op (``False``); a forbidden one raises
    ``IllegalRentalTransition`` after logging it.
    """
    if rental.state == to_state:
        return False
    if not allowed(rental.state, to_state):
        log.warning("refused illegal rental transition %s: %s → %s (%s)", rental.id, rental.state, to_state, cause)
        raise IllegalRentalTransition(f"rental {rental.id} cannot go from {rental.state} to {to_state}")
    _apply(session, rental, to_state, cause, at=at)
    return True


def advance(session: AsyncSession, rental: Rental, to_state: RentalState, cause: str, *, at: datetime | None = None) -> bool:
    """Like ``transition``, but a forbidden change is logged and skipped (``False``), never raised."""
    if rental.state == to_state:
        return False
    if not allowed(rental.state, to_state):
        log.warning("ignored rental transition %s: %s → %s (%s)", rental.id, rental.state, to_state, cause)
        return False
    _apply(session, rental, to_state, cause, at=at)
    return True


def _apply(session: AsyncSession, rental: Rental, to_state: RentalState, cause: str, *, at: datetime | None) -> None:
    event = RentalEvent(rental_id=rental.id, from_state=rental.state, to_state=to_state.value, cause=cause)
    if at is not None:
        event.at = at
    session.add(event)
    rental.state = to_state.value
    clusterstate.member_changed(session.info, rental)  # a cluster's member: its cluster's state follows, at the flush


def stop_member(session: Session, rental: Rental, reason: str) -> None:
    """Move a cluster's member to stopping (its restart policy stops it; the caller wrote its ``stop_workload``)."""
    if allowed(rental.state, RentalState.STOPPING) and rental.state != RentalState.STOPPING:
        _apply(session, rental, RentalState.STOPPING, reason, at=None)  # type: ignore[arg-type]  # only adds rows


@event.listens_for(Session, "before_flush")
def _clusters_follow_members(session: Session, _context: Any, _instances: Any) -> None:
    """The one place a member's change moves its cluster (and its restart policy acts): before every flush. Then the
    rentals that ended in it let go of their volumes."""
    clusterstate.rederive_changed(session, stop_member)
    release_volumes(session)


def release_volumes(session: Session) -> int:
    """Release the volume attachments of every rental this flush ends (whichever path ended it: a stop, an exit, a
    failed start, a lost host, a preemption, a cancelled queue place, billing); returns how many rentals.
    Its volumes can then be mounted read-write by the next rental, or deleted (docs/volumes.md)."""
    ended = {
        obj.id: obj.stopped_at
        for obj in (*session.new, *session.dirty)
        if isinstance(obj, Rental) and obj.state in FINAL_STATES and attributes.get_history(obj, "state").added
    }
    if not ended:
        return 0
    now = datetime.now(UTC)
    for obj in session.new:  # written in this very transaction, not flushed yet
        if isinstance(obj, VolumeAttachment) and obj.rental_id in ended and obj.released_at is None:
            obj.released_at = ended[obj.rental_id] or now
    by_time: dict[datetime, list[str]] = {}
    for rental_id, at in ended.items():
        by_time.setdefault(at or now, []).append(rental_id)
    for at, ids in by_time.items():
        session.execute(
            update(VolumeAttachment)
            .where(VolumeAttachment.rental_id.in_(ids), VolumeAttachment.released_at.is_(None))
            .values(released_at=at)
            .execution_options(synchronize_session=False)
        )
    return len(ended)
