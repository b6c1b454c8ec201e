"""What the master does with each agent message (how hosts look through the API: ``host_views.py``).

Every handler is idempotent: the bus delivers at least once, and an agent replays
unacknowledged messages after reconnecting. Telemetry is de-duplicated by
``(host_id, seq)``; hello, heartbeat and command results converge to the same state
however often they arrive.
"""

from __future__ import annotations

import logging
from collections import Counter
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import IngestStats
from master.models import Command as CommandRow
from master.models import (
    Gpu,
    GpuEvent,
    Host,
    NetworkMeasurement,
    Rental,
    RentalLogChunk,
    TelemetrySample,
    TunnelUsage,
)
from master.services import accounts, commands, market, rentals, volumes
from master.services.hosts import VERIFICATION_KINDS, after_verification_result, verification_at_hello
from master.services.lifecycle import cluster_network
from master.services.lifecycle.hosts import transition
from master.services.lifecycle.rentals import ACTIVE_STATES, UNSTOPPED_STATES
from master.telemetry.store import CleanSample, clean_sample, sampled_too_far_ahead
from shared import protocol
from shared.clock import utcnow
from shared.ids import new_id
from shared.settings import MasterSettings

log = logging.getLogger(__name__)

ACTOR = "ingest"


class UnknownHost(LookupError):
    """A message from a host id the registry does not hold (dropped and logged)."""


async def _insert_once(session: AsyncSession, row: object) -> bool:
    """Insert ``row`` unless a unique constraint says it is already there (a redelivery)."""
    try:
        async with session.begin_nested():
            session.add(row)
            await session.flush()
    except IntegrityError:
        return False
    return True


async def _load_host(session: AsyncSession, host_id: str) -> Host:
    host = await session.get(Host, host_id)
    if host is None or host.state == "revoked":
        # A revoked host's messages still in flight are dropped like an unknown host's.
        raise UnknownHost(host_id)
    return host


async def _host_seen(session: AsyncSession, envelope: protocol.BusEnvelope) -> Host:
    """The host that sent ``envelope`` (``UnknownHost`` when there is none or it is revoked), noted as seen.

    Raises ``SequenceJump`` (and changes nothing) for a message numbered absurdly far past the host's newest.
    """
    host = await _load_host(session, envelope.message.host_id)
    protocol.check_seq(envelope.message.seq, host.last_seq, host_id=host.id)
    _saw(host, envelope)
    return host


class SeenHost(Protocol):
    """Where a host was last heard from: a ``Host`` row, or a batch's copy of one (``batch._Host``)."""

    relay_id: str | None
    last_seen_at: datetime | None
    last_seq: int


def saw(host: SeenHost, *, seq: int, relay_id: str, received_at: datetime) -> None:
    """A message ``seq`` came through ``relay_id`` at ``received_at``: last seen and last seq only move on."""
    if seq >= host.last_seq:
        # Only the newest message says where the host is now: a late copy of an older one (replayed
        # by a relay that was cut off) must not send its commands back to that relay.
        host.relay_id = relay_id
    if host.last_seen_at is None or received_at > host.last_seen_at:
        host.last_seen_at = received_at
    host.last_seq = max(host.last_seq, seq)


def _saw(host: Host, envelope: protocol.BusEnvelope) -> None:
    saw(host, seq=envelope.message.seq, relay_id=envelope.relay_id, received_at=envelope.received_at)


async def _has_active_rentals(session: AsyncSession, host_id: str) -> bool:
    n = await session.scalar(
        select(func.count()).select_from(Rental).where(Rental.host_id == host_id, Rental.state.in_(ACTIVE_STATES))
    )
    return bool(n)


async def come_online(session: AsyncSession, host: Host, cause: str) -> None:
    """An offline or enrolling host heard from again goes online (rented, where it has active rentals)."""
    if host.state == "offline":
        await rentals.note_host_back(session, host.id, silent_since=host.state_changed_at)
    if host.state in ("enrolling", "offline"):
        target = "rented" if await _has_active_rentals(session, host.id) else "online"
        if host.state == "enrolling":
            target = "online"
        transition(session, host, target, cause=cause, actor=ACTOR)


async def handle_hello(
    session: AsyncSession, envelope: protocol.BusEnvelope, *, settings: MasterSettings | None = None, now: datetime | None = None
) -> list[str]:
    """Register the host's facts and GPUs; returns the ids of open commands to resend.

    With ``settings.verification_required`` a new host stays ``enrolling`` (unlisted) and gets its enrollment
    challenge (``master.services.hosts.verification``), published by the caller after the commit."""
    message = envelope.message
    assert isinstance(message, protocol.Hello)
    body = message.body
    host = await _host_seen(session, envelope)
    if message.seq < host.last_hello_seq:
        log.info("stale hello %d from host %s ignored (newest is %d)", message.seq, host.id, host.last_hello_seq)
        return []
    host.last_hello_seq = message.seq
    host.agent_version = body.agent_version
    host.gpu_backend = body.gpu_backend
    # The cluster network's paths (``protocol.ClusterNetworkFacts``, validated with the hello) beside the host's own facts.
    host.facts = {**{k: v for k, v in body.host.items() if k != "cluster_network"},
                  **({"cluster_network": body.cluster_network.model_dump(mode="json")} if body.cluster_network is not None else {})}  # fmt: skip
    # None from an agent older than container workloads: placement treats the host as it always did.
    host.isolation = body.isolation.model_dump(mode="json") if body.isolation is not None else None
    host.region = body.region or host.region
    if body.host.get("hostname") and not host.name:
        host.name = str(body.host["hostname"])[:255]
    existing = {g.uuid: g for g in (await session.scalars(select(Gpu).where(Gpu.host_id == host.id))).all()}
    reported = {g.uuid for g in body.gpus}
    # A GPU UUID is globally unique; one already registered to another host means a cloned
    # machine or a forged report. Keep it where it is and refuse it here, loudly.
    claimed = set(
        (await session.scalars(select(Gpu.uuid).where(Gpu.uuid.in_(reported), Gpu.host_id != host.id))).all()
    )
    for uuid in sorted(claimed):
        log.warning("host %s reports GPU %s, which belongs to another host; ignoring it", host.id, uuid)
    for gpu in body.gpus:
        if gpu.uuid in claimed:
            continue
        row = existing.get(gpu.uuid)
        if row is None:
            row = Gpu(id=new_id("gpu"), host_id=host.id, index=gpu.index, uuid=gpu.uuid, name=gpu.name,
                      memory_total_mib=gpu.memory_total_mib, present=True)  # fmt: skip
            session.add(row)
        else:
            row.index, row.name, row.memory_total_mib, row.present = gpu.index, gpu.name, gpu.memory_total_mib, True
        row.set_info(gpu.model_dump(mode="json"))
    vanished: list[str] = []
    for uuid, row in existing.items():
        if uuid not in reported and row.present:
            log.warning("host %s no longer reports GPU %s", host.id, uuid)
            row.present = False
            vanished.append(uuid)
    # Before coming online: an offline host that comes back short of a GPU goes straight to faulty.
    await market.after_gpus_vanished(session, host, vanished, now=envelope.received_at)
    unverified = settings is not None and settings.verification_required and host.state == "enrolling"
    if not unverified:
        await come_online(session, host, cause=f"hello via relay {envelope.relay_id}")
    # New GPUs are ranked at once, not at the next scoring pass.
    market.classify_host_gpus(host, (await session.scalars(select(Gpu).where(Gpu.host_id == host.id))).all())
    if unverified:
        assert settings is not None
        await session.flush()
        await verification_at_hello(session, host, settings=settings, now=now or envelope.received_at)
    if await rentals.stop_strays(session, host.id, body.running_rentals):
        await session.flush()
    return await commands.open_command_ids(session, host.id)


async def handle_heartbeat(session: AsyncSession, envelope: protocol.BusEnvelope) -> list[str]:
    """Note the host alive; returns the ids of ``stop_workload`` commands for stray workloads."""
    message = envelope.message
    assert isinstance(message, protocol.Heartbeat)
    host = await _host_seen(session, envelope)
    if message.body.spool is not None:
        host.spool_stats = message.body.spool.model_dump(mode="json")
    if host.state == "offline":
        await come_online(session, host, cause="heartbeat resumed")
    return await rentals.stop_strays(session, host.id, message.body.running_rentals)


def _telemetry_row(host_id: str, envelope: protocol.BusEnvelope, clean: CleanSample) -> dict[str, Any]:
    message = envelope.message
    assert isinstance(message, protocol.Telemetry)
    return {
        "host_id": host_id,
        "seq": message.seq,
        "sampled_at": message.body.sampled_at,
        "received_at": envelope.received_at,
        "relay_id": envelope.relay_id,
        "gpus": clean.gpus,
        "window_s": message.body.window_s,
        "aggregates": clean.aggregates,
        "rolled": False,
    }


def _checked(host: Host, envelope: protocol.BusEnvelope, *, now: datetime, max_future_s: float,
             stats: IngestStats) -> CleanSample | None:
    """The sample with impossible fields refused (and counted), or None to refuse all of it."""
    message = envelope.message
    assert isinstance(message, protocol.Telemetry)
    if sampled_too_far_ahead(message.body.sampled_at, now, max_future_s):
        log.warning("host %s telemetry %d is dated %s, in the future; refused", host.id, message.seq,
                    message.body.sampled_at.isoformat())
        stats.samples_rejected += 1
        _count_rejected(host, Counter({"sampled_at": 1}), stats)
        return None
    clean = clean_sample(
        (g.model_dump(mode="json") for g in message.body.gpus), (a.model_dump(mode="json") for a in message.body.aggregates)
    )
    if clean.rejected:
        log.info("host %s telemetry %d: refused impossible %s", host.id, message.seq, ", ".join(sorted(clean.rejected)))
        _count_rejected(host, clean.rejected, stats)
    return clean


def _count_rejected(host: Host, rejected: Counter[str], stats: IngestStats) -> None:
    stats.rejected_fields.update(rejected)
    counts = dict(host.rejected_fields or {})
    for name, n in rejected.items():
        counts[name] = int(counts.get(name, 0)) + n
    host.rejected_fields = counts  # a new dict, so the JSON column is seen as changed


def _note_latest(host: Host, message: protocol.Telemetry, gpus: list[dict[str, Any]]) -> None:
    if message.seq > host.latest_telemetry_seq:
        host.latest_telemetry_seq = message.seq
        host.latest_telemetry_at = message.body.sampled_at
        host.latest_telemetry = {"seq": message.seq, "sampled_at": message.body.sampled_at.isoformat(), "gpus": gpus}


async def handle_telemetry(session: AsyncSession, envelope: protocol.BusEnvelope, *, now: datetime | None = None,
                           max_future_s: float = 300.0, stats: IngestStats | None = None) -> bool:
    """Store one sample once; returns False for a duplicate ``(host, seq)`` or a refused sample.

    The one-message path (``Ingestor(batched=False)`` and tests); ``master.telemetry.batch.apply_batch`` is the fast one.
    """
    message = envelope.message
    assert isinstance(message, protocol.Telemetry)
    stats = stats if stats is not None else IngestStats()
    host = await _load_host(session, message.host_id)
    protocol.check_seq(message.seq, host.last_seq, host_id=host.id)
    clean = _checked(host, envelope, now=now or utcnow(), max_future_s=max_future_s, stats=stats)
    if clean is None:
        return False
    if not await _insert_once(session, TelemetrySample(**_telemetry_row(host.id, envelope, clean))):
        log.debug("duplicate telemetry %s/%d ignored", host.id, message.seq)
        stats.samples_duplicate += 1
        return False
    stats.samples_stored += 1
    _saw(host, envelope)
    _note_latest(host, message, clean.gpus)
    if host.state == "offline":
        await come_online(session, host, cause="telemetry resumed")
    return True


def insert_ignoring_duplicates(session: AsyncSession, rows: list[dict[str, Any]]) -> Any:
    """``INSERT … ON CONFLICT (host_id, seq) DO NOTHING RETURNING host_id, seq`` for this dialect."""
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    return (
        insert(TelemetrySample)
        .values(rows)
        .on_conflict_do_nothing(index_elements=["host_id", "seq"])
        .returning(TelemetrySample.host_id, TelemetrySample.seq)
    )


async def stop_strays_in_batch(session: AsyncSession, running: dict[str, list[str]]) -> list[str]:
    """``rental_lifecycle.stop_strays`` for the hosts whose reported workloads are not all active there.

    One query for the whole batch finds them, so heartbeats of busy hosts stay cheap.
    """
    reported = {rental_id for ids in running.values() for rental_id in ids}
    if not reported:
        return []
    rows = await session.execute(
        select(Rental.id, Rental.host_id).where(Rental.id.in_(reported), Rental.state.in_(UNSTOPPED_STATES))
    )
    active = {(rental_id, host_id) for rental_id, host_id in rows}
    command_ids: list[str] = []
    for host_id, ids in sorted(running.items()):
        if any((rental_id, host_id) not in active for rental_id in ids):
            command_ids += await rentals.stop_strays(session, host_id, ids)
    return command_ids


async def handle_command_result(
    session: AsyncSession, envelope: protocol.BusEnvelope, *, sign: cluster_network.Signer | None = None,
    settings: MasterSettings | None = None, now: datetime | None = None,
) -> None:
    """Record an agent's result once and apply it (``sign``: the CA's token signer, for clusters' relay paths;
    ``now``: the master's clock, which times a GPU challenge's commitment)."""
    message = envelope.message
    assert isinstance(message, protocol.CommandResult)
    body = message.body
    # Locked: two masters handling a redelivered result must not both apply it.
    row = await session.get(CommandRow, body.command_id, with_for_update=True)
    if row is None or row.host_id != message.host_id:
        log.warning("host %s reported a result for unknown command %s", message.host_id, body.command_id)
        return
    host = await _host_seen(session, envelope)
    result = {"ok": body.ok, "detail": body.detail, "data": body.data, "finished_at": body.finished_at.isoformat()}
    if commands.complete(row, ok=body.ok, result=result, at=body.finished_at):
        code = None if body.ok else rentals.failure_code(body.data, body.detail)
        await rentals.apply_command_result(
            session, row, ok=body.ok, detail=body.detail, at=body.finished_at, code=code, data=body.data
        )
        if row.kind in cluster_network.KINDS:
            await cluster_network.apply_result(session, row, ok=body.ok, detail=body.detail, data=body.data, at=body.finished_at, sign=sign)
        if row.kind in volumes.KINDS:
            await volumes.apply_result(session, row, ok=body.ok, code=code, detail=body.detail, at=body.finished_at)
        if row.kind == volumes.COPY_KIND:
            await volumes.apply_copy_result(session, row, ok=body.ok, detail=body.detail, data=body.data, at=body.finished_at)
        if row.kind == market.HEALTH_CHECK:
            await market.after_health_check(session, host, ok=body.ok, detail=body.detail, data=body.data, now=envelope.received_at)
        if row.kind in VERIFICATION_KINDS:
            await after_verification_result(session, row, host, ok=body.ok, detail=body.detail, data=body.data,
                                            now=now or envelope.received_at, settings=settings or _DEFAULT_SETTINGS)  # fmt: skip


_DEFAULT_SETTINGS = MasterSettings.model_construct()


async def handle_gpu_events(session: AsyncSession, envelope: protocol.BusEnvelope, *, settings: MasterSettings | None = None) -> int:
    """Record XID / ECC events once per ``(host, seq, position)``; returns how many were new.

    New hardware faults count towards making the host faulty (``master/services/market/faults.py``).
    """
    message = envelope.message
    assert isinstance(message, protocol.GpuEvents)
    host = await _host_seen(session, envelope)
    new: list[GpuEvent] = []
    for position, event in enumerate(message.body.events):
        row = GpuEvent(host_id=host.id, seq=message.seq, position=position, gpu_uuid=event.uuid, kind=event.kind,
                       code=event.code, at=event.at, received_at=envelope.received_at)
        if not await _insert_once(session, row):
            continue
        new.append(row)
        log.warning("host %s GPU %s: %s event%s", host.id, event.uuid, event.kind, f" {event.code}" if event.code is not None else "")
    if new:
        await market.after_gpu_events(session, host, new, settings=settings or _DEFAULT_SETTINGS, now=envelope.received_at)
    return len(new)


async def handle_network_report(session: AsyncSession, envelope: protocol.BusEnvelope) -> bool:
    message = envelope.message
    assert isinstance(message, protocol.NetworkReport)
    host = await _host_seen(session, envelope)
    body = message.body
    data = body.model_dump(mode="json")
    row = NetworkMeasurement(
        host_id=host.id, seq=message.seq, measured_at=body.measured_at, relay_url=body.relay_url,
        download_mbps=body.download_mbps, upload_mbps=body.upload_mbps, latency_ms=body.latency_ms,
        jitter_ms=body.jitter_ms, loss=body.loss, data=data,
    )
    if not await _insert_once(session, row):
        return False
    if host.latest_network is None or str(host.latest_network.get("measured_at", "")) <= data["measured_at"]:
        host.latest_network = data
        # The measured network is an input of every GPU's tier: re-rank them now.
        market.classify_host_gpus(host, (await session.scalars(select(Gpu).where(Gpu.host_id == host.id))).all())
    return True


async def handle_workload_exited(session: AsyncSession, envelope: protocol.BusEnvelope, *, settings: MasterSettings | None = None) -> None:
    message = envelope.message
    assert isinstance(message, protocol.WorkloadExited)
    host = await _host_seen(session, envelope)
    retention = timedelta(hours=(settings or _DEFAULT_SETTINGS).workspace_retention_hours)
    await rentals.apply_workload_exit(
        session, host.id, message.body.rental_id, exit_code=message.body.exit_code, reason=message.body.reason, at=message.body.at,
        workspace_retention=retention,
    )


async def handle_workload_progress(session: AsyncSession, envelope: protocol.BusEnvelope) -> bool:
    """A step of a workload's start (an image pull) as a rental event the renter sees; returns whether one was stored."""
    message = envelope.message
    assert isinstance(message, protocol.WorkloadProgress)
    host = await _host_seen(session, envelope)
    body = message.body
    if body.stage == "copying":  # a volume copy's (copy_volume), under the destination volume's id
        return await volumes.apply_copy_progress(session, host.id, body.rental_id, text=body.text, at=body.at)
    return await rentals.apply_workload_progress(
        session, host.id, body.rental_id, stage=body.stage, text=body.text, percent=body.percent, at=body.at
    )


async def handle_tunnel_usage(session: AsyncSession, envelope: protocol.BusEnvelope) -> int:
    """Add the bytes renters moved to each rental of the report (once per host, seq and rental);
    returns how many rentals counted. A rental of another host is ignored."""
    message = envelope.message
    assert isinstance(message, protocol.TunnelUsage)
    host = await _host_seen(session, envelope)
    counted = 0
    for item in message.body.rentals:
        if item.rental_id.startswith("vol-"):  # a volume's file-only session (docs/volumes.md): no rental's bytes
            continue
        rental = await session.get(Rental, item.rental_id, with_for_update=True)
        if rental is None or rental.host_id != host.id:
            log.warning("host %s reported tunnel bytes of rental %s it does not run; dropped", host.id, item.rental_id[:80])
            continue
        row = TunnelUsage(host_id=host.id, seq=message.seq, rental_id=rental.id, bytes_in=item.bytes_in,
                          bytes_out=item.bytes_out, at=message.body.at)
        if await _insert_once(session, row):
            rental.tunnel_bytes_in += item.bytes_in
            rental.tunnel_bytes_out += item.bytes_out
            for fingerprint in item.keys_used:  # the SSH keys page's "last used"
                await accounts.mark_used(session, rental.renter_id, fingerprint, now=message.body.at)
            counted += 1
    return counted


# Newest log bytes kept per rental in the database; older chunks are pruned, once per LOG_PRUNE_STEP of log (so between
# MAX_LOG_BYTES_PER_RENTAL and that plus a step are kept): a service's replica logs a line per request, and a pruning
# DELETE with every chunk (16 KiB) was per-request work in disguise.
MAX_LOG_BYTES_PER_RENTAL = 8 << 20
LOG_PRUNE_STEP = 1 << 20


async def handle_workload_logs(session: AsyncSession, envelope: protocol.BusEnvelope) -> bool:
    message = envelope.message
    assert isinstance(message, protocol.WorkloadLogs)
    host = await _host_seen(session, envelope)
    body = message.body
    rental = await session.get(Rental, body.rental_id)
    if rental is None or rental.host_id != host.id:
        log.warning("host %s sent logs for rental %s it does not run; dropped", host.id, body.rental_id)
        return False
    if not await _insert_once(session, RentalLogChunk(rental_id=rental.id, offset=body.offset, length=body.length, data=body.data)):
        # A redelivery, or a re-shipment from a cursor the agent saved behind what it had sent (its log grew since,
        # so the chunk may reach further than the one kept): keep the longer, or the bytes past the old end are lost.
        longer = await session.execute(
            update(RentalLogChunk)
            .where(RentalLogChunk.rental_id == rental.id, RentalLogChunk.offset == body.offset, RentalLogChunk.length < body.length)
            .values(length=body.length, data=body.data)
        )
        if not longer.rowcount:  # type: ignore[attr-defined]
            return False
    # Keep the newest MAX_LOG_BYTES_PER_RENTAL: drop chunks that end before that window, when this chunk crosses into
    # another LOG_PRUNE_STEP of the log (nothing is older than the window before the log has outgrown it).
    newest_end = body.offset + body.length
    if newest_end <= MAX_LOG_BYTES_PER_RENTAL or body.offset // LOG_PRUNE_STEP == newest_end // LOG_PRUNE_STEP:
        return True
    await session.execute(
        delete(RentalLogChunk).where(
            RentalLogChunk.rental_id == rental.id,
            RentalLogChunk.offset + RentalLogChunk.length < newest_end - MAX_LOG_BYTES_PER_RENTAL,
        )
    )
    return True


async def mark_silent_hosts_offline(
    session: AsyncSession, *, now: datetime, deadline: timedelta, changed_at: datetime | None = None,
    grace: timedelta | None = None,
) -> list[str]:
    """Hosts not heard from within ``deadline`` of ``now`` go offline (as of ``changed_at``); their active rentals
    get an event saying so (``grace``: when they end if it stays away). Returns their ids."""
    cutoff = now - deadline
    hosts = (
        await session.scalars(
            select(Host).where(Host.state.in_(("online", "rented", "draining")), Host.last_seen_at < cutoff).with_for_update(skip_locked=True)
        )
    ).all()
    for host in hosts:
        since = host.last_seen_at or now
        transition(session, host, "offline", cause=f"no heartbeat since {since:%Y-%m-%dT%H:%M:%SZ}", actor="monitor", at=changed_at)
        # The renters hear it now, not when the grace period ends: billing pauses from this change on.
        await rentals.note_host_unreachable(session, host.id, since=since, until=(changed_at or now) + grace if grace else None)
    return [h.id for h in hosts]
