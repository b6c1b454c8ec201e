"""Faults: when a host's hardware stops deserving renters' trust, and how it earns it back.

A host becomes ``faulty`` (unrentable) when

* ``fault_threshold`` hardware faults arrive within ``fault_window_minutes`` — hardware
  XIDs (``FAULT_XIDS``) and double-bit ECC events, counted by the master's receive time
  from ``max(host.faults_since, now − window)``;
* one of them is XID 79 (the GPU fell off the bus): at once;
* a GPU it reported before is missing from its hello: at once;
* a health check fails (or cannot run): at once.

It leaves ``faulty`` only by passing a health check (the agent's ``health_check``
command), which also moves ``faults_since`` to the time of the check, so faults from
before it never count again. Healthy hosts may run a check too; a failed one makes them
faulty. Faults are never forgotten: ``master.services.market.reliability`` counts them in the
host's score.

Every function here runs inside the caller's transaction and commits nothing, except
``request_health_check``, which writes and publishes its command. Imports
``master.models`` and sibling services, never ``master.telemetry.hosts`` (which calls it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError
from sqlalchemy import and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql.elements import ColumnElement

from master.context import Master
from master.models import Command as CommandRow
from master.models import Gpu, GpuEvent, Host, Rental
from master.services import commands
from master.services.accounts import Principal
from master.services.lifecycle.hosts import TRANSITIONS, transition
from master.services.lifecycle.rentals import ACTIVE_STATES
from shared import protocol
from shared.errors import Conflict, NotFound
from shared.settings import MasterSettings

log = logging.getLogger(__name__)

ACTOR = "faults"
HEALTH_CHECK = "health_check"

# XIDs that mean the hardware (or its firmware) is failing, not the program on it.
# Sources: NVIDIA's "XID Errors" catalogue (docs.nvidia.com/deploy/xid-errors) and its
# GPU memory error management guide.
FAULT_XIDS: Mapping[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU fell off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
# Deliberately absent: 13 (graphics engine exception), 31 (GPU memory page fault) and 43
# (GPU stopped processing) are almost always the application's own bug (an illegal address,
# a bad kernel); counting them would let any renter make any host faulty. Single-bit ECC
# errors are corrected by the hardware; a GPU that has too many says so with XID 92.
FAULT_EVENT_KINDS = frozenset({"double_bit_ecc"})
# Faults that make a host faulty at once, whatever the threshold.
IMMEDIATE_XIDS = frozenset({79})

# Causes of the transitions made here start with these, so the host's history says why.
GPU_FAULTS_CAUSE = "GPU faults"
VANISHED_CAUSE = "GPU vanished"
CHECK_FAILED_CAUSE = "health check failed"
CHECK_PASSED_CAUSE = "health check passed"


def is_fault(kind: str, code: int | None) -> bool:
    """Whether a GPU event of this kind and code counts as a hardware fault."""
    return kind in FAULT_EVENT_KINDS or (kind == "xid" and code in FAULT_XIDS)


def fault_condition() -> ColumnElement[bool]:
    """``is_fault`` as SQL over ``gpu_events``."""
    return or_(GpuEvent.kind.in_(sorted(FAULT_EVENT_KINDS)), and_(GpuEvent.kind == "xid", GpuEvent.code.in_(list(FAULT_XIDS))))


def _describe(kind: str, code: int | None) -> str:
    if kind == "xid" and code is not None:
        return f"XID {code} ({FAULT_XIDS.get(code, 'unknown')})"
    return kind.replace("_", "-")


def _can_become_faulty(host: Host) -> bool:
    # enrolling (no GPUs known yet), maintenance and revoked hosts stay where they are.
    return "faulty" in TRANSITIONS.get(host.state, frozenset())


def _make_faulty(session: AsyncSession, host: Host, cause: str) -> bool:
    if host.state == "faulty":
        log.info("host %s is already faulty; also: %s", host.id, cause)
        return False
    if not _can_become_faulty(host):
        log.warning("host %s is %s and cannot become faulty; fault recorded only: %s", host.id, host.state, cause)
        return False
    return transition(session, host, "faulty", cause=cause, actor=ACTOR)


async def count_faults(session: AsyncSession, host: Host, *, window: timedelta, now: datetime) -> int:
    """Hardware faults of ``host`` received since ``max(host.faults_since, now − window)``."""
    since = now - window
    if host.faults_since is not None and host.faults_since > since:
        since = host.faults_since
    n = await session.scalar(
        select(func.count())
        .select_from(GpuEvent)
        .where(GpuEvent.host_id == host.id, GpuEvent.received_at >= since, fault_condition())
    )
    return int(n or 0)


async def after_gpu_events(
    session: AsyncSession, host: Host, events: Sequence[GpuEvent], *, settings: MasterSettings, now: datetime
) -> bool:
    """Judge newly stored GPU events (already flushed); returns whether the host became faulty.

    Only a batch with at least one fault can change anything, so a harmless event never
    tips a host over a threshold it had already crossed.
    """
    faults = [e for e in events if is_fault(e.kind, e.code)]
    if not faults:
        return False
    immediate = [e for e in faults if e.kind == "xid" and e.code in IMMEDIATE_XIDS]
    if immediate:
        first = immediate[0]
        return _make_faulty(session, host, f"{GPU_FAULTS_CAUSE}: {_describe(first.kind, first.code)} on {first.gpu_uuid}")
    window = timedelta(minutes=settings.fault_window_minutes)
    count = await count_faults(session, host, window=window, now=now)
    if count < settings.fault_threshold:
        log.info("host %s: %d of %d faults within %g min", host.id, count, settings.fault_threshold, settings.fault_window_minutes)
        return False
    seen = ", ".join(sorted({f"{_describe(e.kind, e.code)} on {e.gpu_uuid}" for e in faults}))
    cause = (
        f"{GPU_FAULTS_CAUSE}: {count} within {settings.fault_window_minutes:g} min "
        f"(threshold {settings.fault_threshold}); latest: {seen}"
    )
    return _make_faulty(session, host, cause)


async def after_gpus_vanished(session: AsyncSession, host: Host, uuids: Sequence[str], *, now: datetime) -> bool:
    """GPUs the host reported before are missing from its hello: faulty at once."""
    if not uuids:
        return False
    return _make_faulty(session, host, f"{VANISHED_CAUSE}: {', '.join(sorted(uuids))} missing from the hello at {now:%Y-%m-%dT%H:%M:%SZ}")


# ---- health checks -------------------------------------------------------------------


async def health_check_command(session: AsyncSession, host: Host) -> CommandRow:
    """A ``health_check`` command for ``host`` naming its present GPUs (the caller publishes it)."""
    uuids = (
        await session.scalars(select(Gpu.uuid).where(Gpu.host_id == host.id, Gpu.present.is_(True)).order_by(Gpu.index))
    ).all()
    return commands.new_command(session, host_id=host.id, command=protocol.HealthCheck(gpu_uuids=list(uuids)), rental_id=None)


async def request_health_check(master: Master, principal: Principal, host_id: str) -> str:
    """Ask the host's agent to check its GPUs; returns the command's id.

    The host's provider or an admin may ask (anyone else gets 404). A check already on its
    way is returned instead of a second one. Refused with 409 while the agent cannot answer
    (the host is revoked, offline or not connected yet).
    """
    async with master.db.session() as session:
        host = await session.get(Host, host_id)
        if host is None or (principal.role != "admin" and host.owner_id != principal.account_id):
            raise NotFound(f"no host {host_id!r} among your hosts", code="host_not_found")
        if host.state == "revoked":
            raise Conflict(f"host {host_id} was revoked; enroll the machine again with a new token", code="host_revoked")
        if host.state in ("offline", "enrolling"):
            raise Conflict(
                f"host {host_id} is {host.state}: start its agent and ask again once the host is connected",
                code="host_not_connected",
            )
        open_id = await session.scalar(
            select(CommandRow.id)
            .where(CommandRow.host_id == host.id, CommandRow.kind == HEALTH_CHECK, CommandRow.state.in_(commands.OPEN_STATES))
            .order_by(CommandRow.created_at)
            .limit(1)
        )
        command_id = open_id if open_id is not None else (await health_check_command(session, host)).id
    if open_id is None:
        log.info("health check %s requested for host %s by %s", command_id, host_id, principal.name)
    await commands.publish(master, [command_id])
    return command_id


def check_passed(ok: bool, data: Mapping[str, Any]) -> bool:
    """The verdict of a ``health_check`` result: it ran (``ok``) and found the host healthy.

    ``ok`` only says the agent could run the check; the reply's ``healthy`` is the verdict
    (``protocol.HealthCheckResult``, the agent's ``agent.health``). An agent that cannot run it
    (too old, no GPU backend) or whose reply is not a ``HealthCheckResult`` fails it.
    """
    if not ok:
        return False
    try:
        return protocol.HealthCheckResult.model_validate(data, strict=True).healthy
    except ValidationError:
        return False


def _failure_reason(ok: bool, detail: str, data: Mapping[str, Any]) -> str:
    if not ok:
        return f"the check could not run: {detail or 'no reason given'}"
    summary = data.get("summary")
    return str(summary) if summary else (detail or "no reason given")


async def after_health_check(
    session: AsyncSession, host: Host, *, ok: bool, detail: str, data: Mapping[str, Any], now: datetime
) -> None:
    """Apply the agent's answer to a ``health_check`` command (its first result only).

    Passed: faults count from ``now`` on, and a faulty host is rentable again (online, then
    rented if rentals are still active on it). Failed: the host becomes faulty.
    """
    if not check_passed(ok, data):
        _make_faulty(session, host, f"{CHECK_FAILED_CAUSE}: {_failure_reason(ok, detail, data)}"[:2000])
        return
    host.faults_since = now
    if host.state != "faulty":
        log.info("host %s passed a health check while %s", host.id, host.state)
        return
    failed_gpu = await session.scalar(
        select(Gpu.uuid).where(Gpu.host_id == host.id, Gpu.present.is_(True), Gpu.verification_outcome == "failed").limit(1)
    )
    if failed_gpu is not None:
        # Only a passing challenge lists it again (master/services/hosts/verification.py): health is not proof.
        log.info("host %s passed a health check but GPU %s failed its verification; it stays faulty", host.id, failed_gpu)
        return
    transition(session, host, "online", cause=CHECK_PASSED_CAUSE, actor=ACTOR)
    active = await session.scalar(
        select(func.count()).select_from(Rental).where(Rental.host_id == host.id, Rental.state.in_(ACTIVE_STATES))
    )
    if active:
        # The table has no faulty → rented edge; going through online records both steps.
        transition(session, host, "rented", cause=f"{CHECK_PASSED_CAUSE}; {active} rental(s) still active", actor=ACTOR)
