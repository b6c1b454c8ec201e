"""The cluster state machine: one explicit transition table, and the state derived from the members'.

    pending ─members placed─▶ starting ─every member running─▶ running
    running ─a member failed or lost its host─▶ degraded ─member replaced─▶ running
    pending, starting, running, degraded ─stop asked, or every member ended─▶ stopping ─every member ended─▶ stopped
    pending, starting ─a member failed before the cluster ran─▶ failed
    stopped and failed are final

A cluster's members are rentals (``rentals.cluster_id``) with their own state machine
(``rentalstate.py``). Whenever a member's state changes, ``rentalstate`` names the member's
cluster here (``member_changed``); before the session flushes, every cluster so named is moved
to what ``derive`` says its members add up to, each change recorded in ``cluster_events`` —
one place, whatever code path changed the member (a command result, a workload exit, a stop, a
lost host, billing's credit enforcement).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import event, select
from sqlalchemy.orm import Session

from master.models import Cluster, ClusterEvent, Rental
from shared.errors import Conflict

log = logging.getLogger(__name__)


class ClusterState(StrEnum):
    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    DEGRADED = "degraded"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


TRANSITIONS: dict[ClusterState, frozenset[ClusterState]] = {
    ClusterState.PENDING: frozenset({ClusterState.STARTING, ClusterState.STOPPING, ClusterState.FAILED}),
    ClusterState.STARTING: frozenset({ClusterState.RUNNING, ClusterState.STOPPING, ClusterState.FAILED}),
    ClusterState.RUNNING: frozenset({ClusterState.DEGRADED, ClusterState.STOPPING}),
    ClusterState.DEGRADED: frozenset({ClusterState.RUNNING, ClusterState.STOPPING}),
    ClusterState.STOPPING: frozenset({ClusterState.STOPPED}),
    ClusterState.STOPPED: frozenset(),
    ClusterState.FAILED: frozenset(),
}

ACTIVE_CLUSTER_STATES = (
    ClusterState.PENDING, ClusterState.STARTING, ClusterState.RUNNING, ClusterState.DEGRADED, ClusterState.STOPPING,
)  # fmt: skip
FINAL_CLUSTER_STATES = (ClusterState.STOPPED, ClusterState.FAILED)

# Member (rental) states, as plain strings: this module sits beside rentalstate, which imports it.
_ENDED = frozenset({"stopped", "failed", "preempted"})
_BROKEN = frozenset({"failed", "preempted"})


class IllegalClusterTransition(Conflict):
    code = "illegal_transition"


@dataclass(frozen=True)
class Member:
    """What the derivation reads of one member rental."""

    state: str
    host_lost: bool = False  # its host went silent past the grace period (the rental is failed with it, or about to be)


def allowed(from_state: str, to_state: ClusterState) -> bool:
    return to_state in TRANSITIONS[ClusterState(from_state)]


def derive(current: str, members: Sequence[Member]) -> list[ClusterState]:
    """The states a cluster in ``current`` goes through, given its members' states (empty: it stays).

    Every step is allowed by ``TRANSITIONS``; a path of two (``running → stopping → stopped``) is a
    cluster whose members all ended while it ran.
    """
    state = ClusterState(current)
    if state in FINAL_CLUSTER_STATES or not members:
        return []
    states = [m.state for m in members]
    broken = any(s in _BROKEN or m.host_lost for s, m in zip(states, members, strict=True))
    all_ended = all(s in _ENDED for s in states)
    if state in (ClusterState.PENDING, ClusterState.STARTING):
        if broken:
            return [ClusterState.FAILED]
        if all_ended:  # stopped before it ran (a stop asked of each member)
            return [ClusterState.STOPPING, ClusterState.STOPPED]
        if all(s == "running" for s in states):
            return [ClusterState.STARTING, ClusterState.RUNNING] if state == ClusterState.PENDING else [ClusterState.RUNNING]
        if state == ClusterState.PENDING and all(s in ("starting", "running") for s in states):
            return [ClusterState.STARTING]
        if any(s == "stopping" for s in states):
            return [ClusterState.STOPPING]
        return []
    if state == ClusterState.STOPPING:
        return [ClusterState.STOPPED] if all_ended else []
    if all_ended:
        return [ClusterState.STOPPING, ClusterState.STOPPED]
    if any(s == "stopping" for s in states):
        return [ClusterState.STOPPING]
    if broken:
        return [ClusterState.DEGRADED] if state == ClusterState.RUNNING else []
    if state == ClusterState.DEGRADED and all(s == "running" for s in states):
        return [ClusterState.RUNNING]
    return []


def transition(session: Session, cluster: Cluster, to_state: ClusterState, cause: str, *, at: datetime | None = None) -> bool:
    """Move ``cluster`` to ``to_state`` and record why; a change the table forbids raises ``IllegalClusterTransition``."""
    if cluster.state == to_state:
        return False
    if not allowed(cluster.state, to_state):
        log.warning("refused illegal cluster transition %s: %s → %s (%s)", cluster.id, cluster.state, to_state, cause)
        raise IllegalClusterTransition(f"cluster {cluster.id} cannot go from {cluster.state} to {to_state}")
    event_row = ClusterEvent(cluster_id=cluster.id, from_state=cluster.state, to_state=to_state.value, cause=cause)
    moment = at or datetime.now(UTC)
    event_row.at = moment
    session.add(event_row)
    cluster.state = to_state.value
    if to_state == ClusterState.RUNNING and cluster.started_at is None:
        cluster.started_at = moment
    if to_state in FINAL_CLUSTER_STATES and cluster.stopped_at is None:
        cluster.stopped_at = moment
    return True


# ---- the hook: members' changes move their cluster ---------------------------------------------

_CHANGED = "gpumarket_clusters_changed"  # session.info key: ids of clusters whose members changed state


def member_changed(session_info: dict[str, Any], rental: Rental) -> None:
    """Note that a member of ``rental.cluster_id`` changed state (``rentalstate._apply`` calls it); no-op for plain rentals."""
    if rental.cluster_id is not None:
        session_info.setdefault(_CHANGED, set()).add(rental.cluster_id)


def rederive(session: Session, cluster: Cluster, cause: str) -> None:
    """Move ``cluster`` to what its members' states (as this session sees them) add up to."""
    with session.no_autoflush:
        members = session.scalars(select(Rental).where(Rental.cluster_id == cluster.id).order_by(Rental.node_rank)).all()
    facts = [Member(m.state, host_lost=m.host_lost_at is not None) for m in members]
    for step in derive(cluster.state, facts):
        reason = cause
        if step in (ClusterState.FAILED, ClusterState.DEGRADED):
            reason = "; ".join(
                f"node {m.node_rank} ({m.id}) {m.state}" + (f": {m.failure_reason}" if m.failure_reason else "")
                for m in members if m.state in _BROKEN or m.host_lost_at is not None
            )  # fmt: skip
            if step == ClusterState.FAILED:
                cluster.failure_reason = reason
        transition(session, cluster, step, reason)


@event.listens_for(Session, "before_flush")
def _rederive_changed(session: Session, _context: Any, _instances: Any) -> None:
    changed: set[str] = session.info.pop(_CHANGED, set())
    for cluster_id in sorted(changed):
        with session.no_autoflush:
            cluster = session.get(Cluster, cluster_id)
        if cluster is not None:
            rederive(session, cluster, "member states changed")
