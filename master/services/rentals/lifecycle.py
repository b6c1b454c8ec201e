"""A rental after placement: what the agent's results, start progress and workload exits mean, lost hosts,
re-placement, strays.

Every change goes through ``rentalstate.advance``: results, exits, stops and lost hosts race
(the bus delivers at least once, several masters apply messages), and the first ending wins.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from pydantic import ValidationError
from sqlalchemy import func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import Master
from master.models import Command as CommandRow
from master.models import Host, Rental, RentalEvent
from master.services import commands
from master.services.accounts import Principal
from master.services.lifecycle import clusters as clusterstate
from master.services.lifecycle.hosts import transition
from master.services.lifecycle.rentals import ACTIVE_STATES, UNSTOPPED_STATES, RentalState, advance
from master.services.market import (
    AGENT_STOP_CODES,
    AGENT_STOPPED_PREFIX,
    FailureCode,
    agent_failure_code,
    record_failure,
)
from master.services.rentals import allocation, preemption
from master.services.rentals.core import create_rental
from master.services.rentals.placement import cancel_commands
from master.services.rentals.request import RentalRequest
from shared import protocol
from shared.errors import ClientError

log = logging.getLogger(__name__)

# The agent's codes for a start that could not happen, recognised where an agent reports one as a workload's end
# (its reason leads with the code). A failed ``start_workload`` carries its code in ``data.code``: any ``FailureCode``.
# Such a rental ends ``failed`` with the code; it never started, so nothing is charged (docs/billing.md).
START_FAILURE_CODES = frozenset(
    {"image_pull_failed", "image_not_allowed", "image_too_large", "container_runtime_unavailable", "workload_not_isolated",
     "limits_exceed_host", "registry_auth_failed", "image_not_found", "registry_auth_unreadable", "program_not_executable",
     "volume_not_found"}
)
_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")

# Start progress (an image pull) becomes rental events, at most one per rental per this interval, except
# when the stage changes: a pull reports often, the renter needs to see that it moves.
PROGRESS_MIN_INTERVAL = timedelta(seconds=2)
PROGRESS_PREFIX = "workload "  # progress events' causes: "workload pulling: ...", "workload pulled: ..."
PROGRESS_STAGES = ("pulling", "pulled", "starting")  # WorkloadProgressBody.stage


def failure_code(data: Mapping[str, object], detail: str) -> str | None:
    """The stable code of a failed command's result: ``data["code"]``, else a known start failure leading ``detail``."""
    code = data.get("code")
    if isinstance(code, str) and _CODE.fullmatch(code):
        return code
    found = _CODE.match(detail)
    if found and found.group() in START_FAILURE_CODES:
        return found.group()
    return None


async def apply_command_result(
    session: AsyncSession, command: CommandRow, *, ok: bool, detail: str, at: datetime, code: str | None = None,
    data: Mapping[str, object] | None = None,
) -> None:
    """What an agent's confirmation means for the rental it concerns; ``code``: a failure's stable code,
    ``data``: the reply (a start's ``ssh_host_key`` is kept for renters' clients to pin)."""
    if command.rental_id is None:
        return
    rental = await session.get(Rental, command.rental_id, with_for_update=True)
    if rental is None or rental.state == RentalState.PREEMPTED:
        return  # a preempted rental ended when it was preempted; its stop's result adds nothing
    if command.kind == "start_workload":
        if ok:
            host_key = (data or {}).get("ssh_host_key")
            if isinstance(host_key, str) and 0 < len(host_key) <= 16384:
                rental.ssh_host_key = host_key
            if advance(session, rental, RentalState.RUNNING, "agent confirmed the workload started"):
                rental.started_at = at
                host = await session.get(Host, rental.host_id)
                if host is not None and host.state == "online":
                    transition(session, host, "rented", cause=f"rental {rental.id} running", actor="master")
        else:
            reason = detail if code is None or detail.startswith(code) else f"{code}: {detail}" if detail else code
            if advance(session, rental, RentalState.FAILED, f"workload failed to start: {reason}"):
                # Never confirmed started: ``started_at`` stays unset, so billing charges nothing, not even the minimum.
                # The owner follows the code (no code, or one this master does not know: the agent's failure).
                record_failure(rental, agent_failure_code(code), reason or "the agent gave no reason")
                rental.stopped_at = at
                await _release(session, rental, at=at)
        # The rentals it preempts: ended if its agent stopped them, else given their GPUs back (after its own release).
        await preemption.settle(session, rental, ok=ok, detail=detail, data=data, at=at)
    elif command.kind == "stop_workload" and ok:
        if advance(session, rental, RentalState.STOPPED, "agent confirmed the workload stopped"):
            rental.stopped_at = at
            await _release(session, rental, at=at)


async def apply_workload_progress(
    session: AsyncSession, host_id: str, rental_id: str, *, stage: str, text: str, percent: float | None, at: datetime
) -> bool:
    """Record a step of a workload's start (an image pull) as a rental event; returns whether one was stored.

    Only for a rental of that host that is starting or running. At most one event per
    ``PROGRESS_MIN_INTERVAL`` unless the stage changes; a redelivered or older report adds nothing.
    """
    rental = await session.get(Rental, rental_id, with_for_update=True)
    if rental is None or rental.host_id != host_id:
        log.warning("host %s reported progress of rental %s it does not run; dropped", host_id, rental_id[:80])
        return False
    if rental.state not in (RentalState.STARTING, RentalState.RUNNING):
        return False  # not started yet, or over: a late report says nothing the renter needs
    last = await session.scalar(
        select(RentalEvent)
        .where(
            RentalEvent.rental_id == rental.id,
            or_(*(RentalEvent.cause.startswith(f"{PROGRESS_PREFIX}{s}:", autoescape=True) for s in PROGRESS_STAGES)),
        )
        .order_by(RentalEvent.id.desc())
        .limit(1)
    )
    if last is not None:
        last_stage = last.cause.removeprefix(PROGRESS_PREFIX).split(":", 1)[0]
        if at < last.at or (last_stage == stage and at < last.at + PROGRESS_MIN_INTERVAL):
            return False
    line = " ".join(text.split())  # one line, whatever the registry said
    share = f" ({percent:.0f}%)" if percent is not None else ""
    session.add(RentalEvent(rental_id=rental.id, at=at, from_state=rental.state, to_state=rental.state,
                            cause=f"{PROGRESS_PREFIX}{stage}: {line}{share}"))  # fmt: skip
    return True


async def apply_workload_exit(
    session: AsyncSession, host_id: str, rental_id: str, *, exit_code: int | None, reason: str, at: datetime,
    workspace_retention: timedelta = timedelta(hours=24),
) -> None:
    """A workload ended on its own: exit 0 completes the rental, anything else fails it. GPUs are freed;
    its /workspace stays reachable over SFTP for ``workspace_retention`` (or until the renter releases it)."""
    rental = await session.get(Rental, rental_id, with_for_update=True)
    if rental is None or rental.host_id != host_id:
        log.warning("host %s reported the exit of rental %s it does not run", host_id, rental_id)
        return
    if rental.state not in (RentalState.STARTING, RentalState.RUNNING):
        return  # already stopping/stopped by request, or failed: nothing to add
    what = f"workload exited with code {exit_code}" if exit_code is not None else f"workload ended ({reason or 'unknown'})"
    target = RentalState.STOPPED if exit_code == 0 else RentalState.FAILED
    # An exit status: the renter's program ended (an OOM kill inside its own limit too). None: the agent lost track of it.
    code = FailureCode.WORKLOAD_EXITED if exit_code is not None else FailureCode.WORKLOAD_LOST
    stopped = _CODE.match(reason)
    if stopped is not None and stopped.group() in AGENT_STOP_CODES and reason[stopped.end():].startswith(":"):
        # Its agent stopped it for what the renter did (disk_quota_exceeded): failed, the renter's doing, saying why.
        what, code, target = f"{AGENT_STOPPED_PREFIX}{reason}", FailureCode(stopped.group()), RentalState.FAILED
    if rental.state == RentalState.STARTING:
        if target == RentalState.STOPPED:
            target = RentalState.FAILED  # never confirmed running: treat as a failed start (it exited 0: the renter's)
        start_code = failure_code({}, reason)  # an agent that reports a failed pull as the workload's end
        if start_code is not None:
            what, code = reason, agent_failure_code(start_code)
    if advance(session, rental, target, what):
        rental.stopped_at = at
        if rental.started_at is not None and workspace_retention > timedelta(0):
            rental.workspace_until = at + workspace_retention
        if target == RentalState.FAILED:
            record_failure(rental, code, what)
        await _release(session, rental, at=at)


async def note_host_unreachable(session: AsyncSession, host_id: str, *, since: datetime, until: datetime | None = None) -> int:
    """Tell the renters of the host's active rentals, as an event on each, that it went silent (last heard at
    ``since``); returns how many. Their meter pauses while the host is offline (billing leaves that time out);
    ``until``: when they end if it is still away (the grace period)."""
    ends = f"; ended (or placed again, if it asked for that) if still silent at {until:%Y-%m-%dT%H:%M:%SZ}" if until else ""
    cause = f"host unreachable since {since:%Y-%m-%dT%H:%M:%SZ}: not charged while it is{ends}"
    return await _note_rentals_of(session, host_id, cause)


async def note_host_back(session: AsyncSession, host_id: str, *, silent_since: datetime | None) -> int:
    """The host is heard from again: an event on each of its active rentals (charging resumes); returns how many."""
    since = f" (silent since {silent_since:%Y-%m-%dT%H:%M:%SZ})" if silent_since else ""
    return await _note_rentals_of(session, host_id, f"host reachable again{since}: charging resumes")


async def _note_rentals_of(session: AsyncSession, host_id: str, cause: str) -> int:
    rentals = (await session.scalars(select(Rental).where(Rental.host_id == host_id, Rental.state.in_(ACTIVE_STATES)))).all()
    for rental in rentals:
        session.add(RentalEvent(rental_id=rental.id, from_state=rental.state, to_state=rental.state, cause=cause))
        clusterstate.member_changed(session.info, rental)  # a member's silent host degrades its cluster, its return restores it
    return len(rentals)


async def fail_rental(
    session: AsyncSession, rental: Rental, *, code: FailureCode, reason: str, at: datetime, lost_at: datetime | None = None
) -> None:
    """End an active rental as failed (its host is gone or untrusted: ``code`` says which) and free its GPUs.

    Its unanswered commands are cancelled, so a host that comes back is not told to start it.
    ``lost_at``: the host was lost (silent, revoked) as of then — billing stops there and the
    minimum period is credited back (``billing.rating``).
    """
    if lost_at is not None and rental.host_lost_at is None:
        rental.host_lost_at = lost_at
    if advance(session, rental, RentalState.FAILED, reason):
        record_failure(rental, code, reason)
        rental.stopped_at = at
        await allocation.release(session, rental.id, at=at)
        await cancel_commands(session, rental.id, at=at, reason=reason)


async def fail_rentals_of_lost_hosts(session: AsyncSession, *, now: datetime, grace: timedelta) -> list[str]:
    """Fail the active rentals of hosts offline for longer than ``grace``; returns their ids.

    Billing stops at ``host_lost_at``, the last time the host was heard from, not at the
    moment the grace period ran out. A host back within the grace period resumes its rentals.
    A rental that asked for a longer ``failover_after_s`` waits that long from when the host was last heard.
    """
    rows = (
        await session.execute(
            select(Rental, Host.last_seen_at)
            .join(Host, Host.id == Rental.host_id)
            .where(Host.state == "offline", Host.state_changed_at <= now - grace, Rental.state.in_(ACTIVE_STATES))
            .with_for_update(of=Rental, skip_locked=True)
        )
    ).all()
    due = [(rental, last_seen) for rental, last_seen in rows
           if rental.failover_after_s is None or last_seen is None or now >= last_seen + timedelta(seconds=rental.failover_after_s)]
    for rental, last_seen in due:
        lost_at = last_seen or now
        rental.host_lost_at = lost_at
        await fail_rental(
            session, rental, code=FailureCode.HOST_LOST, at=lost_at,
            reason=f"host {rental.host_id} lost: silent since {lost_at:%Y-%m-%dT%H:%M:%SZ}, past the {grace.total_seconds():g}s grace period",
        )
        log.warning("rental %s failed: host %s lost", rental.id, rental.host_id)
    return [rental.id for rental, _ in due]


async def replace_lost(master: Master, rental_id: str) -> Rental | None:
    """Start a rental lost with its host again elsewhere, if it asked for that; returns the new one.

    Idempotent: the new rental's idempotency key is derived from the old one, so a retried
    call returns the same re-placement. The renter reads what happened in both rentals' events.
    """
    async with master.db.session() as session:
        old = await session.get(Rental, rental_id)
    if old is None or not old.restart_on_failure or old.state != RentalState.FAILED or old.host_lost_at is None:
        return None
    renter = Principal(account_id=old.renter_id, name="master", role="renter")
    # The same request anywhere but on the lost host (an offer named that host: keep its model instead).
    pinned = (old.spec or {}).get("offer_id") is not None
    request = RentalRequest.from_rental(
        old, avoid_hosts=frozenset({old.host_id} if old.host_id else ()), replaces=old.id, queue=False, offer_id=None,
        gpu_model=old.gpu_model if pinned else (old.spec or {}).get("gpu_model", old.gpu_model),
    )  # fmt: skip
    new: Rental | None = None
    try:
        new, created = await create_rental(master, renter, request, idempotency_key=f"replace:{old.id}")
        note = f"placed again as rental {new.id} on host {new.host_id}"
    except ClientError as exc:
        note, created = f"could not be placed again: {exc}", True
    if created:
        async with master.db.session() as session:
            session.add(RentalEvent(rental_id=old.id, from_state=RentalState.FAILED.value, to_state=RentalState.FAILED.value, cause=note))
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
                select(Rental.id).where(Rental.id.in_(wanted), Rental.host_id == host_id, Rental.state.in_(UNSTOPPED_STATES))
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
        try:
            stop = protocol.StopWorkload(rental_id=rental_id)
        except ValidationError:  # a faulty or hostile host: no agent could run a workload of that name
            log.warning("host %s reports a workload %r that cannot be a rental; not stopping it", host_id, rental_id[:80])
            continue
        log.warning("host %s runs workload %s, which is not an active rental there; stopping it", host_id, rental_id)
        command = commands.new_command(
            session, host_id=host_id, command=stop, rental_id=rental_id if rental_id in known else None,
        )
        ids.append(command.id)
    return ids


async def _release(session: AsyncSession, rental: Rental, *, at: datetime) -> None:
    await allocation.release(session, rental.id, at=at)
    if rental.host_id is None:
        return
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
