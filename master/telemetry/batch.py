"""Applying a whole read of heartbeats and telemetry reports in one transaction: the ingestor's fast path.

Nearly all of the bus traffic is heartbeats and telemetry, and nearly all of ingestion's time went to
Python per field and per row, so this path works on a read at once: the reports come decoded by
``shared.protocol.fastbus`` (msgspec Structs; a record that decoder leaves to ``decode_bus_envelope``
comes as a ``BusEnvelope``, and both kinds mix in one batch), impossible readings are refused column
by column over every GPU of the read (``store.refuse_impossible``), and on PostgreSQL the samples and
the hosts are written with one statement each, straight through asyncpg: ``INSERT … SELECT … FROM
unnest(…) ON CONFLICT (host_id, seq) DO NOTHING RETURNING`` for the samples (the JSON encoded by
msgspec, cast by the server) and ``UPDATE hosts … FROM unnest(…)`` for the hosts, their JSON
compressed with lz4 rather than pglz (``LZ4_FOR_THIS_TRANSACTION``). On SQLite the same
rows go through SQLAlchemy. De-duplication stays the database's: a redelivered ``(host, seq)`` is
skipped by the unique constraint, in this batch or any later one.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
from sqlalchemy import bindparam, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import IngestStats
from master.models import Host
from master.telemetry import hosts
from master.telemetry.store import clean_sample, refuse_impossible, sampled_too_far_ahead
from shared import protocol
from shared.errors import SequenceJump
from shared.protocol import fastbus

log = logging.getLogger(__name__)

Report = protocol.BusEnvelope | fastbus.BusReport
"""A heartbeat or telemetry record, from either decoder."""

# Rows per INSERT statement on SQLite: 10 columns each stays far below its bind-parameter limit.
INSERT_CHUNK = 1000

_INSERT_SAMPLES = """
INSERT INTO telemetry (host_id, seq, sampled_at, received_at, relay_id, gpus, window_s, aggregates, rolled)
SELECT host_id, seq, sampled_at, received_at, relay_id, gpus::json, window_s, aggregates::json, false
FROM unnest($1::text[], $2::bigint[], $3::timestamptz[], $4::timestamptz[], $5::text[], $6::text[], $7::float8[],
            $8::text[]) AS sample(host_id, seq, sampled_at, received_at, relay_id, gpus, window_s, aggregates)
ON CONFLICT (host_id, seq) DO NOTHING
RETURNING host_id, seq
"""

# Large JSON (a sample's GPUs, kilobytes) is compressed as it is stored; lz4 costs PostgreSQL far less CPU than its
# default pglz, for this transaction's writes only, on servers built with it (14 and later; elsewhere nothing changes).
LZ4_FOR_THIS_TRANSACTION = """
SELECT set_config('default_toast_compression', 'lz4', true)
FROM pg_settings WHERE name = 'default_toast_compression' AND 'lz4' = ANY(enumvals)
"""

# NULL in a column of the batch: keep what the host has. A host's latest sample is copied by the server from the row
# the batch has just inserted (its GPUs are neither encoded nor sent a second time), its time written in UTC.
_UPDATE_HOSTS = """
UPDATE hosts SET
    relay_id = seen.relay_id, last_seen_at = seen.last_seen_at, last_seq = seen.last_seq,
    spool_stats = COALESCE(seen.spool_stats::json, hosts.spool_stats),
    latest_telemetry_seq = COALESCE(seen.latest_seq, hosts.latest_telemetry_seq),
    latest_telemetry_at = COALESCE(seen.latest_at, hosts.latest_telemetry_at),
    latest_telemetry = CASE WHEN seen.latest_seq IS NULL THEN hosts.latest_telemetry ELSE (
        SELECT json_build_object('seq', t.seq, 'gpus', t.gpus,
                                 'sampled_at', to_char(t.sampled_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'))
        FROM telemetry AS t WHERE t.host_id = seen.id AND t.seq = seen.latest_seq) END
FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::bigint[], $5::text[], $6::bigint[], $7::timestamptz[])
    AS seen(id, relay_id, last_seen_at, last_seq, spool_stats, latest_seq, latest_at)
WHERE hosts.id = seen.id
"""


@dataclass(slots=True)
class _Host:
    """What a batch reads and writes of one host (the rest is not touched)."""

    id: str
    state: str
    last_seen_at: datetime | None
    last_seq: int
    relay_id: str | None
    latest_telemetry_seq: int
    rejected_fields: dict[str, Any]
    touched: bool = False
    spool: dict[str, Any] | None = None
    latest: tuple[int, datetime, list[Any]] | None = None
    rejected: Counter[str] = field(default_factory=Counter)
    woke: str = ""

    def saw(self, report: Report) -> None:
        """``hosts.saw``: the newest message says where the host is; last seen and last seq only move on."""
        hosts.saw(self, seq=report.message.seq, relay_id=report.relay_id, received_at=report.received_at)
        self.touched = True


@dataclass(slots=True)
class _Sample:
    host: _Host
    report: Report
    gpus: list[Any]
    aggregates: list[Any]


@dataclass
class BatchOutcome:
    stored: int = 0
    duplicates: int = 0
    refused: int = 0
    unknown_hosts: set[str] = field(default_factory=set)
    commands: list[str] = field(default_factory=list)
    """``stop_workload`` commands to publish once the batch has committed."""


def _is_telemetry(report: Report) -> bool:
    return isinstance(report.message, protocol.Telemetry | fastbus.Telemetry)


async def apply_batch(session: AsyncSession, reports: Sequence[Report], *, now: datetime, max_future_s: float,
                      stats: IngestStats) -> BatchOutcome:
    """Apply many heartbeats and telemetry reports in this one transaction.

    The hosts are locked in id order (``FOR NO KEY UPDATE``, which does not block the foreign
    keys of concurrent inserts), so two masters applying overlapping batches cannot deadlock.
    Every sample is stored once: a ``(host, seq)`` already stored, or twice in the batch, is counted
    as a duplicate.
    """
    outcome = BatchOutcome()
    ids = sorted({r.message.host_id for r in reports})
    rows = await session.execute(
        select(Host.id, Host.state, Host.last_seen_at, Host.last_seq, Host.relay_id, Host.latest_telemetry_seq,
               Host.rejected_fields)
        .where(Host.id.in_(ids)).order_by(Host.id).with_for_update(key_share=True)
    )
    by_id = {row.id: _Host(*row) for row in rows if row.state != "revoked"}
    outcome.unknown_hosts = set(ids) - set(by_id)
    running: dict[str, list[str]] = {}  # host → workloads its newest heartbeat reports
    samples: dict[tuple[str, int], _Sample] = {}
    fast: list[_Sample] = []  # of which decoded by fastbus: refused column by column
    for report in reports:
        message = report.message
        host = by_id.get(message.host_id)
        if host is None:
            continue
        try:
            protocol.check_seq(message.seq, host.last_seq, host_id=host.id)
        except SequenceJump as exc:
            log.warning("%s", exc)
            stats.seq_refused += 1
            outcome.refused += 1
            continue
        if not _is_telemetry(report):
            body = message.body
            assert isinstance(body, protocol.HeartbeatBody | fastbus.HeartbeatBody)
            host.saw(report)
            if body.spool is not None:
                spool = body.spool
                host.spool = spool.model_dump(mode="json") if isinstance(spool, protocol.SpoolStats) else msgspec.to_builtins(spool)
            running[host.id] = list(body.running_rentals)
            host.woke = host.woke or "heartbeat resumed"
            continue
        body = message.body
        assert isinstance(body, protocol.TelemetryBody | fastbus.TelemetryBody)
        if sampled_too_far_ahead(body.sampled_at, now, max_future_s):
            log.warning("host %s telemetry %d is dated %s, in the future; refused", host.id, message.seq,
                        body.sampled_at.isoformat())
            stats.samples_rejected += 1
            host.rejected["sampled_at"] += 1
            host.touched = True
            outcome.refused += 1
            continue
        key = (host.id, message.seq)
        if key in samples:  # the same report twice in one batch
            outcome.duplicates += 1
            continue
        if isinstance(body, fastbus.TelemetryBody):
            sample = _Sample(host, report, body.gpus, body.aggregates)
            fast.append(sample)
        else:
            clean = clean_sample((g.model_dump(mode="json") for g in body.gpus),
                                 (a.model_dump(mode="json") for a in body.aggregates))
            sample = _Sample(host, report, clean.gpus, clean.aggregates)
            _note_refused(sample, clean.rejected)
        samples[key] = sample
        host.saw(report)
        host.woke = host.woke or "telemetry resumed"
    for number, refused in refuse_impossible([(s.gpus, s.aggregates) for s in fast]).items():
        _note_refused(fast[number], refused)
    postgres = session.get_bind().dialect.name == "postgresql"
    if postgres:
        await (await _asyncpg(session)).execute(LZ4_FOR_THIS_TRANSACTION)
    stored = await (_insert_postgres if postgres else _insert_sqlalchemy)(session, list(samples.values()))
    for key in sorted(stored):  # by seq within a host: the newest stored sample is the host's latest
        sample = samples[key]
        if key[1] > sample.host.latest_telemetry_seq:
            sample.host.latest_telemetry_seq = key[1]
            body = sample.report.message.body
            assert isinstance(body, protocol.TelemetryBody | fastbus.TelemetryBody)
            sample.host.latest = (key[1], body.sampled_at, sample.gpus)
    outcome.stored = len(stored)
    outcome.duplicates += len(samples) - len(stored)
    touched = [host for host in by_id.values() if host.touched]
    await (_update_hosts_postgres if postgres else _update_hosts_sqlalchemy)(session, touched)
    await _count_refused(session, touched, stats)
    for host in touched:
        if host.state == "offline" and host.woke:
            row = await session.get(Host, host.id)
            assert row is not None
            await hosts.come_online(session, row, cause=host.woke)
    outcome.commands = await hosts.stop_strays_in_batch(session, running)
    stats.samples_stored += outcome.stored
    stats.samples_duplicate += outcome.duplicates
    return outcome


def _note_refused(sample: _Sample, refused: Counter[str]) -> None:
    if refused:
        message = sample.report.message
        log.info("host %s telemetry %d: refused impossible %s", sample.host.id, message.seq, ", ".join(sorted(refused)))
        sample.host.rejected.update(refused)
        sample.host.touched = True


async def _count_refused(session: AsyncSession, touched: list[_Host], stats: IngestStats) -> None:
    """Add what was refused to the master's and each host's counts (rare: one statement per such host)."""
    for host in touched:
        if not host.rejected:
            continue
        stats.rejected_fields.update(host.rejected)
        counts = dict(host.rejected_fields or {})
        for name, n in host.rejected.items():
            counts[name] = int(counts.get(name, 0)) + n
        await session.execute(update(Host).where(Host.id == host.id).values(rejected_fields=counts))


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


async def _asyncpg(session: AsyncSession) -> Any:
    """The asyncpg connection under the session, inside the session's transaction (which the hosts' lock began)."""
    raw = await (await session.connection()).get_raw_connection()
    driver = raw.driver_connection
    assert driver is not None and driver.is_in_transaction(), "the batch's statements must run in its transaction"
    return driver


async def _insert_postgres(session: AsyncSession, samples: list[_Sample]) -> set[tuple[str, int]]:
    if not samples:
        return set()
    columns: list[list[Any]] = [[], [], [], [], [], [], [], []]
    host_ids, seqs, sampled, received, relays, gpus, windows, aggregates = columns
    for sample in samples:
        report = sample.report
        message = report.message
        body = message.body
        assert isinstance(body, protocol.TelemetryBody | fastbus.TelemetryBody)
        host_ids.append(sample.host.id)
        seqs.append(message.seq)
        sampled.append(body.sampled_at)
        received.append(report.received_at)
        relays.append(report.relay_id)
        gpus.append(_json(sample.gpus))
        windows.append(body.window_s)
        aggregates.append(_json(sample.aggregates))
    connection = await _asyncpg(session)
    return {(row[0], row[1]) for row in await connection.fetch(_INSERT_SAMPLES, *columns)}


async def _insert_sqlalchemy(session: AsyncSession, samples: list[_Sample]) -> set[tuple[str, int]]:
    rows = []
    for sample in samples:
        report = sample.report
        message = report.message
        body = message.body
        assert isinstance(body, protocol.TelemetryBody | fastbus.TelemetryBody)
        rows.append({
            "host_id": sample.host.id, "seq": message.seq, "sampled_at": body.sampled_at,
            "received_at": report.received_at, "relay_id": report.relay_id, "gpus": msgspec.to_builtins(sample.gpus),
            "window_s": body.window_s, "aggregates": msgspec.to_builtins(sample.aggregates), "rolled": False,
        })
    stored: set[tuple[str, int]] = set()
    for start in range(0, len(rows), INSERT_CHUNK):
        result = await session.execute(hosts.insert_ignoring_duplicates(session, rows[start:start + INSERT_CHUNK]))
        stored.update((host_id, seq) for host_id, seq in result.all())
    return stored


def _latest(host: _Host) -> dict[str, Any] | None:
    if host.latest is None:
        return None
    seq, sampled_at, gpus = host.latest
    return {"seq": seq, "sampled_at": sampled_at.isoformat(), "gpus": gpus}


async def _update_hosts_postgres(session: AsyncSession, touched: list[_Host]) -> None:
    if not touched:
        return
    connection = await _asyncpg(session)
    await connection.execute(
        _UPDATE_HOSTS,
        [h.id for h in touched], [h.relay_id for h in touched], [h.last_seen_at for h in touched],
        [h.last_seq for h in touched], [None if h.spool is None else _json(h.spool) for h in touched],
        [None if h.latest is None else h.latest[0] for h in touched],
        [None if h.latest is None else h.latest[1] for h in touched],
    )


_SEEN = update(Host).where(Host.id == bindparam("b_id")).values(
    relay_id=bindparam("b_relay"), last_seen_at=bindparam("b_seen"), last_seq=bindparam("b_seq")
)
_SPOOL = update(Host).where(Host.id == bindparam("b_id")).values(spool_stats=bindparam("b_spool"))
_LATEST = update(Host).where(Host.id == bindparam("b_id")).values(
    latest_telemetry_seq=bindparam("b_seq"), latest_telemetry_at=bindparam("b_at"), latest_telemetry=bindparam("b_latest")
)


async def _update_hosts_sqlalchemy(session: AsyncSession, touched: list[_Host]) -> None:
    if not touched:
        return
    connection = await session.connection()
    await connection.execute(_SEEN, [{"b_id": h.id, "b_relay": h.relay_id, "b_seen": h.last_seen_at, "b_seq": h.last_seq}
                                     for h in touched])
    if spooled := [{"b_id": h.id, "b_spool": h.spool} for h in touched if h.spool is not None]:
        await connection.execute(_SPOOL, spooled)
    if latest := [{"b_id": h.id, "b_seq": h.latest[0], "b_at": h.latest[1], "b_latest": msgspec.to_builtins(_latest(h))}
                  for h in touched if h.latest is not None]:
        await connection.execute(_LATEST, latest)
