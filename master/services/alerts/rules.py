"""Alert rules: the conditions that hold now, and reconciling them with the open alerts.

Evaluation is level-triggered and idempotent: each pass computes the set of conditions that
hold *now* (from the database, the bus backlog and the relay registry) and reconciles it with
the open alerts in one transaction — a new condition raises an alert, a known one refreshes
it, an open alert whose condition is gone is resolved. Running a pass twice changes nothing
but ``last_seen_at``; a pass that dies half-way rolls back and the next one redoes it.

Dedupe is the database's: ``alerts.open_key`` equals the condition's key while the alert
fires and is NULL once it is resolved, under a unique constraint, so two evaluators can never
open the same alert twice. A condition that comes back after being resolved opens a new alert.

Every change an operator should hear about (``firing``, ``escalated``, ``resolved``) is written,
in the same transaction, to the ``alert_notifications`` outbox, which ``delivery`` posts to the
webhook. Notifications are queued only while ``alert_webhook_url`` is set: the alerts themselves
are the history, and turning a webhook on later does not replay months of old changes into it.
The loop that runs a pass every ``alert_interval`` is ``master.background.alerts``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import JSON, Select, and_, column, func, or_, select, true
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import Master
from master.models import Alert, AlertNotification, Gpu, GpuEvent, Host, Rental
from master.services.alerts import storage
from master.services.alerts.views import Severity, alert_view
from master.services.lifecycle.rentals import ACTIVE_STATES
from master.services.market import FAULT_XIDS
from shared import protocol
from shared.bus import Backlog
from shared.ids import new_id

log = logging.getLogger(__name__)

T = TypeVar("T")

_RANK: dict[str, int] = {"info": 0, "warning": 1, "critical": 2}

# XIDs that point at the GPU, its memory or its links rather than at the program running on it
# (NVIDIA's "XID errors" guide): 48 double-bit ECC error, 61/62 internal micro-controller
# breakpoint/halt, 63/64 ECC page retirement or row remapping event/failure, 74 NVLink error,
# 79 GPU fell off the bus, 92 high single-bit ECC rate, 94/95 contained/uncontained ECC error,
# 119/120 GSP timeout/error. They are critical. The rest — typically 13 (graphics engine
# exception), 31 (GPU memory page fault), 43 (GPU stopped processing), 45 (preemptive
# cleanup) — are usually the application's fault, so they only warn.
HARDWARE_XIDS = frozenset(FAULT_XIDS)  # one list: the XIDs that count as hardware faults

ECC_EVENT_KINDS = ("double_bit_ecc", "single_bit_ecc")

# Temperature: warn above the threshold, critical this far above it; an open alert clears only
# once the GPU is this far below the threshold, so a GPU hovering around it does not flap.
TEMPERATURE_CRITICAL_MARGIN_C = 10.0
TEMPERATURE_HYSTERESIS_C = 5.0

# Host states in which the latest telemetry is current (the agent is connected and reporting).
REPORTING_STATES = ("online", "rented", "draining")

# relay_dead looks at relays hosts spoke through this recently.
RELAY_MEMORY = timedelta(hours=24)



# ---- conditions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Condition:
    """One thing that is wrong now, under a stable key (the dedupe key of its alert)."""

    rule: str
    key: str
    severity: Severity
    summary: str
    host_id: str | None = None
    relay_id: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    # For event-backed rules (XID, ECC): events in the window and the newest event's id, so a
    # refreshed alert can count the events that arrived since the last pass.
    events: int = 0
    last_event_id: int | None = None
    # Keeps an open alert alive (hysteresis) but never raises a new one.
    sustain_only: bool = False


@dataclass(frozen=True)
class EvaluationResult:
    """What one pass changed."""

    raised: int = 0
    updated: int = 0
    """Open alerts whose condition still holds (refreshed, possibly with a new severity)."""
    resolved: int = 0
    escalated: int = 0
    """Of ``updated``, those whose severity rose (and were notified again)."""
    skipped_rules: tuple[str, ...] = ()
    """Rules whose source (bus, registry) could not be read: their open alerts were left as they were."""

    @property
    def changed(self) -> bool:
        return bool(self.raised or self.resolved or self.escalated)


@dataclass
class _EventGroup:
    """XID or ECC events of one GPU within the window, folded from the grouped query."""

    host_id: str
    gpu_uuid: str
    counts: dict[str, int] = field(default_factory=dict)  # "79" / "double_bit_ecc" → events
    events: int = 0
    last_event_id: int = 0
    last_at: datetime | None = None
    hardware: bool = False  # any XID of HARDWARE_XIDS among them

    def add(self, label: str, count: int, last_id: int, last_at: datetime, *, hardware: bool = False) -> None:
        self.counts[label] = self.counts.get(label, 0) + count
        self.hardware |= hardware
        self.events += count
        self.last_event_id = max(self.last_event_id, last_id)
        self.last_at = last_at if self.last_at is None else max(self.last_at, last_at)


async def gpu_event_conditions(session: AsyncSession, *, since: datetime, window_minutes: float) -> list[Condition]:
    """``xid`` and ``ecc`` conditions from the GPU events of the last ``window_minutes``.

    One grouped query over the window (per host, GPU, kind and code), whatever the fleet size.
    """
    rows = (
        await session.execute(
            select(
                GpuEvent.host_id,
                GpuEvent.gpu_uuid,
                GpuEvent.kind,
                GpuEvent.code,
                func.count(),
                func.max(GpuEvent.id),
                func.max(GpuEvent.at),
            )
            .join(Host, Host.id == GpuEvent.host_id)
            .where(GpuEvent.received_at >= since, GpuEvent.kind.in_(("xid", *ECC_EVENT_KINDS)), Host.state != "revoked")
            .group_by(GpuEvent.host_id, GpuEvent.gpu_uuid, GpuEvent.kind, GpuEvent.code)
        )
    ).all()
    xids: dict[tuple[str, str], _EventGroup] = {}
    eccs: dict[tuple[str, str], _EventGroup] = {}
    for host_id, uuid, kind, code, count, last_id, last_at in rows:
        if kind == "xid":
            group = xids.setdefault((host_id, uuid), _EventGroup(host_id, uuid))
            group.add("unknown" if code is None else str(code), count, last_id, last_at, hardware=code in HARDWARE_XIDS)
        else:
            eccs.setdefault((host_id, uuid), _EventGroup(host_id, uuid)).add(kind, count, last_id, last_at)
    window = f"{window_minutes:g} min"
    conditions = [_xid_condition(group, window) for group in xids.values()]
    conditions += [_ecc_event_condition(group, window) for group in eccs.values()]
    return conditions


def _xid_condition(group: _EventGroup, window: str) -> Condition:
    codes = sorted(group.counts, key=lambda c: (len(c), c))  # numeric order; "unknown" last
    listed = ", ".join(f"{c} ×{group.counts[c]}" if group.counts[c] > 1 else c for c in codes)
    kind = "hardware XID" if group.hardware else "XID"
    return Condition(
        rule="xid",
        key=f"xid:{group.host_id}:{group.gpu_uuid}",
        severity="critical" if group.hardware else "warning",
        summary=f"{kind} {listed} on GPU {group.gpu_uuid} of host {group.host_id} in the last {window}",
        host_id=group.host_id,
        details={
            "gpu_uuid": group.gpu_uuid,
            "codes": dict(group.counts),
            "hardware": group.hardware,
            "last_event_at": group.last_at.isoformat() if group.last_at else None,
        },
        events=group.events,
        last_event_id=group.last_event_id,
    )


def _ecc_event_condition(group: _EventGroup, window: str) -> Condition:
    double = group.counts.get("double_bit_ecc", 0)
    single = group.counts.get("single_bit_ecc", 0)
    what = ", ".join(p for p in (f"{double} double-bit" if double else "", f"{single} single-bit" if single else "") if p)
    return Condition(
        rule="ecc",
        key=f"ecc:{group.host_id}:{group.gpu_uuid}",
        severity="critical" if double else "warning",
        summary=f"{what} ECC error event(s) on GPU {group.gpu_uuid} of host {group.host_id} in the last {window}",
        host_id=group.host_id,
        details={
            "gpu_uuid": group.gpu_uuid,
            "double_bit_events": double,
            "single_bit_events": single,
            "last_event_at": group.last_at.isoformat() if group.last_at else None,
        },
        events=group.events,
        last_event_id=group.last_event_id,
    )


@dataclass(frozen=True)
class _GpuReading:
    host_id: str
    host_state: str
    uuid: str
    index: int | None
    temperature_c: float | None
    ecc_volatile_uncorrected: float | None


def _telemetry_gpus_query(dialect: str, *, warm_c: float) -> Select[Any]:
    """Hosts' latest-telemetry GPUs that are warm or report uncorrected ECC errors.

    The JSON is unnested and filtered by the database (``json_each`` on SQLite,
    ``json_array_elements`` on PostgreSQL), so only the few interesting GPUs travel, not
    every host's telemetry document.
    """
    value = column("value", JSON)
    if dialect == "sqlite":
        gpus = func.json_each(Host.latest_telemetry, "$.gpus").table_valued(value).alias("gpu")
    else:
        gpus = func.json_array_elements(Host.latest_telemetry["gpus"]).table_valued(value).alias("gpu")
    element = gpus.c.value
    temperature = element["temperature_c"].as_float()
    # As a float: a large counter must not overflow a 32-bit integer cast.
    ecc = element["ecc_volatile_uncorrected"].as_float()
    return (
        select(Host.id, Host.state, element["uuid"].as_string(), element["index"].as_float(), temperature, ecc)
        .select_from(Host)
        .join(gpus, true())
        .where(
            Host.state != "revoked",
            or_(and_(Host.state.in_(REPORTING_STATES), temperature > warm_c), ecc > 0),
        )
    )


async def telemetry_conditions(session: AsyncSession, *, threshold_c: float) -> list[Condition]:
    """``temperature`` and telemetry-backed ``ecc`` conditions from each host's latest telemetry.

    Temperature counts on hosts whose telemetry is current (online, rented, draining). An
    uncorrected ECC count in the latest telemetry counts on any host that is not revoked: the
    error stays in the volatile counter until the GPU is reset, whatever the host's state.
    """
    dialect = session.get_bind().dialect.name
    warm_c = threshold_c - TEMPERATURE_HYSTERESIS_C
    rows = (await session.execute(_telemetry_gpus_query(dialect, warm_c=warm_c))).all()
    conditions: list[Condition] = []
    for host_id, state, uuid, index, temperature, ecc in rows:
        if not uuid:
            continue
        reading = _GpuReading(host_id, state, uuid, None if index is None else int(index), temperature, ecc)
        if reading.host_state in REPORTING_STATES and reading.temperature_c is not None and reading.temperature_c > warm_c:
            conditions.append(_temperature_condition(reading, threshold_c))
        if reading.ecc_volatile_uncorrected is not None and reading.ecc_volatile_uncorrected > 0:
            conditions.append(_ecc_telemetry_condition(reading))
    return conditions


def _gpu_label(reading: _GpuReading) -> str:
    return f"GPU {reading.index} ({reading.uuid})" if reading.index is not None else f"GPU {reading.uuid}"


def _temperature_condition(reading: _GpuReading, threshold_c: float) -> Condition:
    assert reading.temperature_c is not None
    temperature = reading.temperature_c
    severity: Severity = "critical" if temperature >= threshold_c + TEMPERATURE_CRITICAL_MARGIN_C else "warning"
    if temperature > threshold_c:
        summary = f"{_gpu_label(reading)} of host {reading.host_id} at {temperature:g} °C, above {threshold_c:g} °C"
    else:
        summary = (f"{_gpu_label(reading)} of host {reading.host_id} cooling at {temperature:g} °C; "
                   f"clears below {threshold_c - TEMPERATURE_HYSTERESIS_C:g} °C")
    return Condition(
        rule="temperature",
        key=f"temperature:{reading.host_id}:{reading.uuid}",
        severity=severity,
        summary=summary,
        host_id=reading.host_id,
        details={"gpu_uuid": reading.uuid, "gpu_index": reading.index, "temperature_c": temperature,
                 "threshold_c": threshold_c},
        sustain_only=temperature <= threshold_c,
    )


def _ecc_telemetry_condition(reading: _GpuReading) -> Condition:
    assert reading.ecc_volatile_uncorrected is not None
    count = int(reading.ecc_volatile_uncorrected)
    return Condition(
        rule="ecc",
        key=f"ecc:{reading.host_id}:{reading.uuid}",
        severity="critical",
        summary=f"{_gpu_label(reading)} of host {reading.host_id} reports {count} uncorrected ECC error(s) since its last reset",
        host_id=reading.host_id,
        details={"gpu_uuid": reading.uuid, "gpu_index": reading.index, "ecc_volatile_uncorrected": count},
    )


async def host_state_conditions(session: AsyncSession) -> list[Condition]:
    """``host_offline`` (critical while it has active rentals) and ``host_faulty`` conditions."""
    active = (
        select(func.count())
        .select_from(Rental)
        .where(Rental.host_id == Host.id, Rental.state.in_(ACTIVE_STATES))
        .correlate(Host)
        .scalar_subquery()
    )
    rows = (
        await session.execute(
            select(Host.id, Host.name, Host.state, Host.state_changed_at, Host.last_seen_at, active)
            .where(Host.state.in_(("offline", "faulty")))
        )
    ).all()
    conditions: list[Condition] = []
    for host_id, name, state, since, last_seen, active_rentals in rows:
        label = f"host {host_id}" + (f" ({name})" if name else "")
        details = {
            "since": since.isoformat(),
            "last_seen_at": last_seen.isoformat() if last_seen else None,
            "active_rentals": int(active_rentals),
        }
        if state == "offline":
            with_rentals = f" with {active_rentals} active rental(s)" if active_rentals else ""
            conditions.append(Condition(
                rule="host_offline", key=f"host_offline:{host_id}",
                severity="critical" if active_rentals else "warning",
                summary=f"{label} is offline{with_rentals}", host_id=host_id, details=details,
            ))
        else:
            conditions.append(Condition(
                rule="host_faulty", key=f"host_faulty:{host_id}", severity="critical",
                summary=f"{label} is marked faulty", host_id=host_id, details=details,
            ))
    return conditions


async def verification_conditions(session: AsyncSession) -> list[Condition]:
    """``gpu_verification``: a host whose present GPU failed its last verification challenge (docs/verification.md);
    resolved when a challenge passes. Its provider sees it (alerts of their hosts) with the reason."""
    rows = (
        await session.execute(
            select(Gpu.host_id, Gpu.uuid, Gpu.index, Gpu.name, Gpu.verification_reason, Host.name)
            .join(Host, Host.id == Gpu.host_id)
            .where(Gpu.present.is_(True), Gpu.verification_outcome == "failed", Host.state != "revoked")
            .order_by(Gpu.host_id, Gpu.index)
        )
    ).all()
    failing: dict[str, list[tuple[str, int, str, str | None]]] = {}
    names: dict[str, str | None] = {}
    for host_id, uuid, index, gpu_name, reason, host_name in rows:
        failing.setdefault(host_id, []).append((uuid, index, gpu_name, reason))
        names[host_id] = host_name
    conditions: list[Condition] = []
    for host_id, gpus in failing.items():
        label = f"host {host_id}" + (f" ({names[host_id]})" if names[host_id] else "")
        reasons = sorted({reason or "failed" for *_rest, reason in gpus})
        conditions.append(Condition(
            rule="gpu_verification", key=f"gpu_verification:{host_id}", severity="critical",
            summary=f"{label} failed GPU verification ({', '.join(reasons)}) and is unlisted; GET /api/v1/hosts/{host_id}/verifications says why",
            host_id=host_id,
            details={"gpus": [{"gpu_uuid": uuid, "gpu_index": index, "name": name, "reason": reason} for uuid, index, name, reason in gpus]},
        ))  # fmt: skip
    return conditions


def ingestion_lag_conditions(backlog: Backlog, *, now: datetime, threshold_s: float) -> list[Condition]:
    """``ingestion_lag`` when the oldest unprocessed agent message has waited over ``threshold_s``."""
    lag = backlog.lag(now.timestamp())
    if lag <= threshold_s:
        return []
    return [Condition(
        rule="ingestion_lag", key="ingestion_lag", severity="critical",
        summary=(f"agent messages wait {lag:.0f}s to be ingested (threshold {threshold_s:g}s): "
                 f"{backlog.undelivered} undelivered, {backlog.pending} pending"),
        details={"lag_s": round(lag, 3), "threshold_s": threshold_s, "undelivered": backlog.undelivered,
                 "pending": backlog.pending},
    )]


async def relay_dead_conditions(
    session: AsyncSession, live_relays: Iterable[str], *, now: datetime, grace: timedelta
) -> list[Condition]:
    """``relay_dead`` for relays that recently seen hosts last spoke through but the registry lacks.

    A draining relay's agents reconnect elsewhere within seconds and their ``relay_id`` moves
    with them; so a relay only counts once its stranded hosts have been silent for ``grace``
    (the heartbeat deadline), which keeps an orderly drain from paging anyone.
    """
    live = set(live_relays)
    rows = (
        await session.execute(
            select(Host.relay_id, func.count(), func.max(Host.last_seen_at))
            .where(Host.relay_id.is_not(None), Host.state != "revoked", Host.last_seen_at >= now - RELAY_MEMORY)
            .group_by(Host.relay_id)
        )
    ).all()
    conditions: list[Condition] = []
    for relay_id, stranded, newest in rows:
        if relay_id in live or newest is None or newest > now - grace:
            continue
        conditions.append(Condition(
            rule="relay_dead", key=f"relay_dead:{relay_id}", severity="critical",
            summary=f"relay {relay_id} is gone from the registry; {stranded} host(s) last spoke through it",
            relay_id=relay_id,
            details={"hosts": int(stranded), "last_host_seen_at": newest.isoformat()},
        ))
    return conditions


# ---- evaluation ---------------------------------------------------------------------------


async def evaluate(master: Master, *, now: datetime | None = None, probe_timeout: float = 5.0) -> EvaluationResult:
    """Run every rule once and reconcile the open alerts with what holds now; one transaction.

    The bus and the registry are read first, each within ``probe_timeout`` seconds and with
    no database session open; a rule whose source cannot be read is skipped, leaving its open
    alerts untouched (unknown is not resolved). Cancelling is safe: the transaction rolls back
    and the next pass starts over.
    """
    now = now or master.clock.now()
    settings = master.settings
    backlog = await _probe(
        "ingestion_lag", master.bus.backlog(protocol.AGENT_EVENTS_STREAM, protocol.INGEST_GROUP), timeout=probe_timeout
    )
    relays = await _probe("relay_dead", master.registry.relays(), timeout=probe_timeout)
    skipped = tuple(rule for rule, source in (("ingestion_lag", backlog), ("relay_dead", relays)) if source is None)
    window = settings.alert_event_window_minutes
    async with master.db.session() as session:
        conditions = await gpu_event_conditions(session, since=now - timedelta(minutes=window), window_minutes=window)
        conditions += await telemetry_conditions(session, threshold_c=settings.alert_temperature_c)
        conditions += await host_state_conditions(session)
        conditions += await verification_conditions(session)
        conditions += [Condition(rule=storage.RULE, key=key, severity=severity, summary=summary, details=details)
                       for key, severity, summary, details in await storage.volume_grace(session, now=now)]  # fmt: skip
        if backlog is not None:
            conditions += ingestion_lag_conditions(backlog, now=now, threshold_s=settings.alert_ingestion_lag_s)
        if relays is not None:
            grace = timedelta(seconds=settings.heartbeat_interval * settings.missed_heartbeats_offline)
            conditions += await relay_dead_conditions(session, (r.relay_id for r in relays), now=now, grace=grace)
        return await reconcile(
            session, conditions, now=now, skipped_rules=skipped, notify=settings.alert_webhook_url is not None
        )


async def _probe(rule: str, source: Awaitable[T], *, timeout: float) -> T | None:
    """Await ``source`` within ``timeout``; on any failure log it and return None (the rule is skipped)."""
    try:
        async with asyncio.timeout(timeout):
            return await source
    except Exception as exc:  # a down Redis, a timeout: this rule cannot tell, the others still run
        log.warning("alert rule %s skipped this pass: its source failed (%s: %s)", rule, type(exc).__name__, exc)
        return None


def _combine(a: Condition, b: Condition) -> Condition:
    """Two conditions under one key (ECC from events and from telemetry): the graver one wins."""
    first, second = sorted((a, b), key=lambda c: (not c.sustain_only, _RANK[c.severity]), reverse=True)
    event_ids = [c.last_event_id for c in (a, b) if c.last_event_id is not None]
    return replace(
        first,
        details={**second.details, **first.details},
        events=max(a.events, b.events),
        last_event_id=max(event_ids) if event_ids else None,
        sustain_only=a.sustain_only and b.sustain_only,
    )


def _by_key(conditions: Iterable[Condition]) -> dict[str, Condition]:
    merged: dict[str, Condition] = {}
    for condition in conditions:
        seen = merged.get(condition.key)
        merged[condition.key] = condition if seen is None else _combine(seen, condition)
    return merged


async def reconcile(
    session: AsyncSession,
    conditions: Iterable[Condition],
    *,
    now: datetime,
    skipped_rules: Sequence[str] = (),
    notify: bool = True,
) -> EvaluationResult:
    """Make the open alerts match ``conditions``: raise new ones, refresh held ones, resolve the rest.

    Open alerts of ``skipped_rules`` are left alone. With ``notify``, each raise, escalation
    and resolution queues a webhook notification in the same transaction. A raise that loses
    a race with another evaluator (the unique ``open_key``) is dropped, not an error.
    """
    wanted = _by_key(conditions)
    query = select(Alert).where(Alert.open_key.is_not(None))
    if skipped_rules:
        query = query.where(Alert.rule.not_in(skipped_rules))
    # Locked (on PostgreSQL) so a second evaluator waits and then sees what this one changed.
    held = {alert.key: alert for alert in (await session.scalars(query.with_for_update())).all()}
    outbox: list[AlertNotification] = []

    def queue(alert: Alert, event: str, **extra: Any) -> None:
        if notify:
            payload = {"event": event, **extra, "alert": alert_view(alert)}
            outbox.append(AlertNotification(alert_id=alert.id, event=event, payload=payload, created_at=now,
                                            next_attempt_at=now))

    updated = escalated = resolved = 0
    for key, alert in held.items():
        condition = wanted.get(key)
        if condition is None:
            _resolve(alert, now)
            resolved += 1
            log.info("alert resolved: %s (%s)", alert.key, alert.summary)
            queue(alert, "resolved")
            continue
        previous = _refresh(alert, condition, now)
        updated += 1
        if previous is not None:
            escalated += 1
            log.warning("alert escalated %s → %s: %s", previous, alert.severity, alert.summary)
            queue(alert, "escalated", previous_severity=previous)
    await session.flush()  # refreshes and resolutions first, outside the insert savepoints below
    raised = await _open(session, [c for key, c in wanted.items() if key not in held and not c.sustain_only], now)
    for alert in raised:
        log.warning("alert raised [%s]: %s", alert.severity, alert.summary)
        queue(alert, "firing")
    session.add_all(outbox)
    return EvaluationResult(
        raised=len(raised), updated=updated, resolved=resolved, escalated=escalated, skipped_rules=tuple(skipped_rules)
    )


def _new_alert(condition: Condition, now: datetime) -> Alert:
    details = dict(condition.details)
    if condition.last_event_id is not None:
        details |= {"events": condition.events, "last_event_id": condition.last_event_id}
    return Alert(
        id=new_id("alert"), rule=condition.rule, key=condition.key, open_key=condition.key, severity=condition.severity,
        state="firing", host_id=condition.host_id, relay_id=condition.relay_id, summary=condition.summary,
        details=details, raised_at=now, last_seen_at=now, resolved_at=None, occurrences=max(1, condition.events),
    )


def _refresh(alert: Alert, condition: Condition, now: datetime) -> str | None:
    """Bring a held alert up to date; returns its previous severity when it escalated."""
    details = dict(condition.details)
    if condition.last_event_id is not None:
        if condition.last_event_id > int(alert.details.get("last_event_id") or 0):
            # The events since the last pass. Exact unless older events also left the window
            # in between, when it undercounts (but still counts at least one).
            alert.occurrences += max(1, condition.events - int(alert.details.get("events") or 0))
        details |= {"events": condition.events, "last_event_id": condition.last_event_id}
    previous = alert.severity
    alert.severity = condition.severity
    alert.summary = condition.summary
    alert.details = details
    alert.last_seen_at = now
    return previous if _RANK[condition.severity] > _RANK[previous] else None


def _resolve(alert: Alert, now: datetime) -> None:
    alert.state = "resolved"
    alert.open_key = None
    alert.resolved_at = now


async def _open(session: AsyncSession, conditions: Sequence[Condition], now: datetime) -> list[Alert]:
    """Insert alerts for ``conditions``; those another evaluator opened meanwhile are skipped."""
    if not conditions:
        return []
    alerts = [_new_alert(c, now) for c in conditions]
    try:
        async with session.begin_nested():
            session.add_all(alerts)
            await session.flush()
        return alerts
    except IntegrityError:
        log.info("another evaluator raised some of %d alerts at the same time; inserting one by one", len(alerts))
    opened: list[Alert] = []
    for condition in conditions:
        alert = _new_alert(condition, now)
        try:
            async with session.begin_nested():
                session.add(alert)
                await session.flush()
        except IntegrityError:
            log.info("alert %s was raised by another evaluator; keeping theirs", condition.key)
            continue
        opened.append(alert)
    return opened

