"""The host state machine: one explicit transition table; every change recorded with its cause.

    enrolling ─hello─▶ online ─rental running─▶ rented
        online/rented ─missed heartbeats─▶ offline ─hello/heartbeat─▶ online | rented
        online ─▶ draining ─▶ offline;  any ─▶ faulty ─health check─▶ online;  any ─▶ maintenance, revoked

Illegal transitions are refused and logged, never applied.
"""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Host, HostEvent
from shared.clock import utcnow
from shared.errors import Conflict

log = logging.getLogger(__name__)

HOST_STATES = ("enrolling", "online", "rented", "draining", "offline", "faulty", "maintenance", "revoked")

TRANSITIONS: dict[str, frozenset[str]] = {
    "enrolling": frozenset({"online", "offline", "revoked"}),
    "online": frozenset({"rented", "draining", "offline", "faulty", "maintenance", "revoked"}),
    "rented": frozenset({"online", "draining", "offline", "faulty", "revoked"}),
    "draining": frozenset({"online", "offline", "maintenance", "faulty", "revoked"}),
    "offline": frozenset({"online", "rented", "faulty", "maintenance", "revoked"}),
    "faulty": frozenset({"online", "offline", "maintenance", "revoked"}),
    "maintenance": frozenset({"online", "offline", "revoked"}),
    "revoked": frozenset(),
}

# States in which a host may receive new rentals.
RENTABLE_STATES = frozenset({"online", "rented"})


class IllegalTransition(Conflict):
    code = "illegal_transition"


def record_initial_state(session: AsyncSession, host: Host, *, cause: str, actor: str) -> None:
    session.add(HostEvent(host_id=host.id, from_state=None, to_state=host.state, cause=cause, actor=actor))


def transition(session: AsyncSession, host: Host, to_state: str, *, cause: str, actor: str, at: datetime | None = None) -> bool:
    """Move ``host`` to ``to_state`` if the table allows it; returns whether it changed.

    A transition to the current state is a no-op (``False``); a forbidden one raises
    ``IllegalTransition`` after logging it.
    """
    if host.state == to_state:
        return False
    if to_state not in TRANSITIONS.get(host.state, frozenset()):
        log.warning("refused illegal host transition %s: %s → %s (%s)", host.id, host.state, to_state, cause)
        raise IllegalTransition(f"host {host.id} cannot go from {host.state} to {to_state}")
    at = at or utcnow()
    session.add(HostEvent(host_id=host.id, from_state=host.state, to_state=to_state, cause=cause, actor=actor, at=at))
    log.info("host %s: %s → %s (%s)", host.id, host.state, to_state, cause)
    host.state = to_state
    host.state_changed_at = at
    return True
