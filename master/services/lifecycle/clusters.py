"""The cluster state machine: one explicit transition table, and the state derived from the members'.

    pending ─members placed─▶ starting ─every member running─▶ running
    running ─a member failed or lost its host (restart_policy replace)─▶ degraded ─member replaced─▶ running
    pending, starting, running, degraded ─stop asked, or every member ended─▶ stopping ─every member ended─▶ stopped
    running, degraded ─a member broke (restart_policy stop), or no replacement─▶ stopping ─every member ended─▶ failed
    pending, starting ─a member failed before the cluster ran─▶ failed
    stopped and failed are final

A cluster's members are rentals (``rentals.cluster_id``) with their own state machine
(``rentals.py``, beside this). Whenever a member's state changes, ``rentals`` names the member's
cluster here (``member_changed``); before the session flushes, every cluster so named is moved
to what ``derive`` says its members add up to, each change recorded in ``cluster_events`` —
one place, whatever code path changed the member (a command result, a workload exit, a stop, a
lost host, billing's credit enforcement).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from master.models import Cluster, ClusterEvent, Host, Rental, RentalEvent
from master.models import Command as CommandRow
from master.services.lifecycle import cluster_network
from shared import protocol
from shared.errors import Conflict
from shared.ids import new_id

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
    ClusterState.STOPPING: frozenset({ClusterState.STOPPED, ClusterState.FAILED}),
    ClusterState.STOPPED: frozenset(),
    ClusterState.FAILED: frozenset(),
}

ACTIVE_CLUSTER_STATES = (
    ClusterState.PENDING, ClusterState.STARTING, ClusterState.RUNNING, ClusterState.DEGRADED, ClusterState.STOPPING,
)  # fmt: skip
FINAL_CLUSTER_STATES = (ClusterState.STOPPED, ClusterState.FAILED)

# Member (rental) states, as plain strings: this module sits beside rentalstate, which imports it.
_ENDED = frozenset({"stopped", "failed", "preempted"})
_UNSTOPPED = frozenset({"pending", "starting", "running"})
_BROKEN = frozenset({"failed", "preempted"})


class IllegalClusterTransition(Conflict):
    code = "illegal_transition"


@dataclass(frozen=True)
class Member:
    """What the derivation reads of one member rental."""

    state: str
    host_lost: bool = False  # its host went silent past the grace period (the rental is failed with it, or about to be)
    silent: bool = False  # its host is offline now, within the grace period (its meter pauses; it may come back)


def allowed(from_state: str, to_state: ClusterState) -> bool:
    return to_state in TRANSITIONS[ClusterState(from_state)]


def derive(current: str, members: Sequence[Member], *, failing: bool = False) -> list[ClusterState]:
    """The states a cluster in ``current`` goes through, given its members' states (empty: it stays).

    Every step is allowed by ``TRANSITIONS``; a path of two (``running → stopping → stopped``) is a
    cluster whose members all ended while it ran. ``failing``: its restart policy stopped it because a
    member broke (``cluster_policy``), so it ends ``failed``, not ``stopped``.
    """
    end = ClusterState.FAILED if failing else ClusterState.STOPPED
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
        return [end] if all_ended else []
    if all_ended:
        return [ClusterState.STOPPING, end]
    if any(s == "stopping" for s in states):
        return [ClusterState.STOPPING]
    if broken or any(m.silent for m in members):
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


# ---- restart policies: what a broken or stopped member does to the others (sync, in the hook) ------

_ISSUED = cluster_network.ISSUED  # session.info key: the commands this session's hooks wrote (stops, private network)
_RUNNING_STATES = (ClusterState.PENDING, ClusterState.STARTING, ClusterState.RUNNING, ClusterState.DEGRADED)
# How a member is moved to stopping: ``rentalstate.stop_member`` (through the rental's table), handed in by
# rentalstate's hook, since rentalstate imports this module.
StopMember = Callable[[Session, Rental, str], object]


def current_members(members: Sequence[Rental]) -> list[Rental]:
    """The member of each node rank that counts now: the newest (a replacement supersedes the one it replaced)."""
    newest: dict[int, Rental] = {}
    for member in members:
        rank = member.node_rank if member.node_rank is not None else -1
        seen = newest.get(rank)
        if seen is None or (member.created_at, member.id) > (seen.created_at, seen.id):
            newest[rank] = member
    return [newest[rank] for rank in sorted(newest)]


def is_broken(member: Rental) -> bool:
    return member.state in _BROKEN or member.host_lost_at is not None


def act(session: Session, cluster: Cluster, members: Sequence[Rental], stop_member: StopMember) -> None:
    """Apply ``cluster``'s policy to its current ``members`` (sync: inside the before-flush hook)."""
    if cluster.state not in _RUNNING_STATES:
        return  # stopping (its stop is under way), or over
    cancelled = [m for m in members if m.state == "stopped" and m.host_id is None]
    if cluster.state == ClusterState.PENDING and cancelled:  # a queued member cancelled on its own: the whole queued cluster
        cancel_queued(session, members, f"node {cancelled[0].node_rank} ({cancelled[0].id}) was cancelled while queued, and the cluster with it")
        return
    stopped = [m for m in members if m.state == "stopping"]
    if stopped:
        first = stopped[0]
        stop_members(session, cluster, members, stop_member, f"node {first.node_rank} ({first.id}) was stopped, and the cluster with it")
        return
    broken = [m for m in members if is_broken(m)]
    if not broken:
        return
    never_ran = cluster.state in (ClusterState.PENDING, ClusterState.STARTING)
    if cluster.restart_policy == "replace" and not never_ran:
        return  # degraded; ``replace_broken_members`` places the replacement
    fail_cluster(session, cluster, members, stop_member, "restart_policy stop" if not never_ran else "it never ran")


def fail_cluster(session: Session, cluster: Cluster, members: Sequence[Rental], stop_member: StopMember, why: str) -> None:
    """Mark ``cluster`` failing (it ends ``failed``) with its broken members as the reason, and stop the rest."""
    broken = "; ".join(
        f"node {m.node_rank} ({m.id}) {m.state}" + (f": {m.failure_reason}" if m.failure_reason else "")
        for m in members if is_broken(m)
    )  # fmt: skip
    if cluster.failure_reason is None:
        cluster.failure_reason = f"{broken or 'a member ended'}; {why}: every other member stopped"
    stop_members(session, cluster, members, stop_member, f"cluster {cluster.id} failing: {broken or why}")


def stop_members(session: Session, cluster: Cluster, members: Sequence[Rental], stop_member: StopMember, reason: str) -> None:
    """Send each of ``members`` still running (or starting) a ``stop_workload`` and move it to stopping."""
    issued: list[str] = session.info.setdefault(_ISSUED, [])
    for member in members:
        if member.state not in _UNSTOPPED or member.host_id is None:
            continue
        command = CommandRow(
            id=new_id("cmd"), host_id=member.host_id, rental_id=member.id, kind="stop_workload",
            args=protocol.command_args(protocol.StopWorkload(rental_id=member.id, reason=reason[:200])), state="pending",
        )  # fmt: skip
        session.add(command)
        issued.append(command.id)
        stop_member(session, member, reason)
        log.info("cluster %s: stopping member %s (%s)", cluster.id, member.id, reason)


def cancel_queued(session: Session, members: Sequence[Rental], reason: str) -> None:
    """End each of ``members`` still queued (pending, no host) at once: ``stopped``, as ``DELETE`` ends a queued rental.

    Written here rather than through ``rentalstate`` (which imports this module): ``pending → stopped`` is in its table.
    """
    now = datetime.now(UTC)
    for member in members:
        if member.state == "pending" and member.host_id is None:
            session.add(RentalEvent(rental_id=member.id, from_state=member.state, to_state="stopped", cause=reason, at=now))
            member.state, member.stopped_at = "stopped", now


def issued_commands(session_info: dict[str, Any]) -> list[str]:
    """The commands the hooks wrote in a session (stops, the private network's rounds; read after its commit, to publish them at once)."""
    found: list[str] = session_info.pop(_ISSUED, [])
    return found


# ---- the hook: members' changes move their cluster ---------------------------------------------

_CHANGED = "gpumarket_clusters_changed"  # session.info key: ids of clusters whose members changed state


def member_changed(session_info: dict[str, Any], rental: Rental) -> None:
    """Note that a member of ``rental.cluster_id`` changed state (``rentalstate._apply`` calls it); no-op for plain rentals."""
    if rental.cluster_id is not None:
        session_info.setdefault(_CHANGED, set()).add(rental.cluster_id)


def rederive(session: Session, cluster: Cluster, cause: str, stop_member: StopMember) -> None:
    """Act on ``cluster``'s restart policy (``act``), then move it to what its current members' states (as this
    session sees them) add up to."""
    with session.no_autoflush:
        rows = session.scalars(select(Rental).where(Rental.cluster_id == cluster.id).order_by(Rental.node_rank)).all()
        for row in rows:  # what other transactions committed since this one read a member it has not changed (see _locked)
            if not session.is_modified(row):
                session.refresh(row)
        members = current_members(rows)
        act(session, cluster, members, stop_member)
        silent = {m.id for m in members if m.host_id is not None and m.state in _UNSTOPPED and _host_offline(session, m.host_id)}
    session.info.get(_CHANGED, set()).discard(cluster.id)  # the stops above changed members: already seen here
    facts = [Member(m.state, host_lost=m.host_lost_at is not None, silent=m.id in silent) for m in members]
    failing = cluster.failure_reason is not None
    for step in derive(cluster.state, facts, failing=failing):
        reason = cause
        if step == ClusterState.STOPPING and failing:
            reason = cluster.failure_reason or cause
        elif step == ClusterState.FAILED and failing and cluster.state == ClusterState.STOPPING:
            reason = "every member ended"
        elif step in (ClusterState.FAILED, ClusterState.DEGRADED):
            reason = "; ".join(
                f"node {m.node_rank} ({m.id}) {m.state}" + (f": {m.failure_reason}" if m.failure_reason else "")
                for m in members if m.state in _BROKEN or m.host_lost_at is not None
            ) or "; ".join(
                f"node {m.node_rank} ({m.id}): its host {m.host_id} went silent (not charged while it is; the member fails "
                "if the host stays away past the grace period)" for m in members if m.id in silent
            )  # fmt: skip
            if step == ClusterState.FAILED and cluster.failure_reason is None:
                cluster.failure_reason = reason
        transition(session, cluster, step, reason)
    cluster_network.follow(session, cluster, members)


def _host_offline(session: Session, host_id: str) -> bool:
    host = session.get(Host, host_id)
    return host is not None and host.state == "offline"


def rederive_changed(session: Session, stop_member: StopMember) -> None:
    """Rederive every cluster whose members this session changed (``rentalstate``'s before-flush hook calls it)."""
    changed: set[str] = session.info.pop(_CHANGED, set())
    for cluster_id in sorted(changed):  # sorted: two transactions lock clusters in one order
        with session.no_autoflush:
            cluster = _locked(session, cluster_id)
        if cluster is not None:
            rederive(session, cluster, "member states changed", stop_member)


def _locked(session: Session, cluster_id: str) -> Cluster | None:
    """The cluster, its row locked to the end of the transaction and re-read, unless this session changed it (then it
    locked it already). Without the lock two masters applying two members' results at once (PostgreSQL, read
    committed) each see the other member unchanged — write skew — and the cluster stays ``starting`` for good."""
    session.execute(select(Cluster.id).where(Cluster.id == cluster_id).with_for_update())
    cluster = session.get(Cluster, cluster_id)
    if cluster is not None and not session.is_modified(cluster):
        session.refresh(cluster)
    return cluster
