"""The fleet snapshot behind the operator metrics: what it holds and how it is built.

A ``FleetSnapshot`` is built from five queries in one read-only transaction (hosts by
region and state; non-revoked hosts with their latest telemetry; present GPUs joined to
their host; rentals by state; firing alerts by severity), never one query per host, plus
the bus backlog, the relay registry, this process's ``IngestStats`` and its gateway's figures per
elastic service (``build_snapshot``). Its ``to_json`` is the body of ``GET /api/v1/metrics``; the
Prometheus exposition and the cache are in ``master.telemetry.metrics``.

Readings that are missing (``None`` in the telemetry) or stale (the host is ``offline``)
are left out of the output, never written as 0: "unknown" is not "idle".

Imports only ``master`` and ``shared``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Text, cast, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import IngestStats, Master
from master.models import Alert, Gpu, Host, Rental
from master.services.gateway import Gateway, ServiceStats, percentile
from master.services.lifecycle.hosts import HOST_STATES, RENTABLE_STATES
from master.services.lifecycle.rentals import RENTAL_STATES
from shared import protocol
from shared.bus import Backlog

log = logging.getLogger(__name__)

MIB = 1 << 20
UNKNOWN = "unknown"
"""Label value for a region or tier the master does not know (never an empty label)."""
ALERT_SEVERITIES = ("critical", "warning", "info")
GPU_STATES = ("allocated", "available", "unavailable")
"""A GPU's state in fleet totals: held by a rental; free on a rentable host; free on a host
that takes no rentals now (enrolling, draining, offline, faulty, maintenance)."""
STALE_TELEMETRY_STATES = frozenset({"offline"})
"""Hosts whose last readings are not reported: they stopped talking, the values are old."""


# ---- the snapshot ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Allocation:
    """How much of one GPU rentals hold: compute share in 0..1 and memory in bytes.

    Rentals take whole GPUs today (``gpus.rental_id``). When fractional shares come, the
    per-GPU sums of the shares table are turned into this same record in ``_allocation``;
    nothing downstream changes.
    """

    core_ratio: float
    memory_bytes: int


@dataclass(frozen=True, slots=True)
class GpuGauges:
    host_id: str
    index: int
    uuid: str
    model: str
    tier: str
    region: str
    rental_id: str | None
    memory_total_bytes: int
    allocation: Allocation
    utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "host_id": self.host_id, "index": self.index, "uuid": self.uuid, "model": self.model,
            "tier": self.tier, "region": self.region, "rental_id": self.rental_id,
            "memory_total_bytes": self.memory_total_bytes,
            "core_allocated_ratio": self.allocation.core_ratio,
            "memory_allocated_bytes": self.allocation.memory_bytes,
            "utilization_ratio": self.utilization_ratio, "memory_used_bytes": self.memory_used_bytes,
            "temperature_celsius": self.temperature_celsius, "power_watts": self.power_watts,
        }


@dataclass(frozen=True, slots=True)
class HostGauges:
    host_id: str
    name: str
    state: str
    region: str
    relay_id: str | None
    telemetry_at: datetime | None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.host_id, "name": self.name, "state": self.state, "region": self.region, "relay_id": self.relay_id,
            "telemetry_at": self.telemetry_at.isoformat() if self.telemetry_at else None,
        }


@dataclass(frozen=True, slots=True)
class FleetGpus:
    tier: str
    region: str
    state: str  # one of GPU_STATES
    gpus: int
    memory_total_bytes: int


@dataclass(frozen=True, slots=True)
class FleetHosts:
    region: str
    state: str  # one of HOST_STATES
    hosts: int


@dataclass(frozen=True, slots=True)
class RelayGauges:
    relay_id: str
    region: str
    connections: int
    capacity: int
    draining: bool


@dataclass(frozen=True, slots=True)
class Ingestion:
    backlog: Backlog | None
    """None when the bus did not answer (``sources["bus"]`` is False)."""
    lag_seconds: float | None
    stats: IngestStats
    """A copy of this process's counters when the snapshot was taken."""


@dataclass(frozen=True)
class FleetSnapshot:
    generated_at: datetime
    build_seconds: float
    hosts: list[HostGauges]
    """Every host but revoked ones (those stay only in ``fleet_hosts``)."""
    gpus: list[GpuGauges]
    """Present GPUs of non-revoked hosts."""
    fleet_hosts: list[FleetHosts]
    fleet_gpus: list[FleetGpus]
    relays: list[RelayGauges]
    ingestion: Ingestion
    rentals: dict[str, int]
    alerts_firing: dict[str, int]
    sources: dict[str, bool] = field(default_factory=dict)
    """Whether each optional source (``bus``, ``registry``) answered; the database is not optional."""
    services: dict[str, ServiceStats] = field(default_factory=dict)
    """This process's gateway figures per elastic service (totals since it started), by service id."""

    def to_json(self) -> dict[str, Any]:
        """The body of ``GET /api/v1/metrics``: the same figures as ``/metrics``, as JSON."""
        stats = self.ingestion.stats
        backlog = self.ingestion.backlog
        hosts_by_state = Counter[str]()
        for row in self.fleet_hosts:
            hosts_by_state[row.state] += row.hosts
        gpus_by_state = Counter[str]()
        for gpu_row in self.fleet_gpus:
            gpus_by_state[gpu_row.state] += gpu_row.gpus
        return {
            "generated_at": self.generated_at.isoformat(),
            "build_seconds": round(self.build_seconds, 6),
            "sources": dict(self.sources),
            "fleet": {
                "hosts_by_state": {state: hosts_by_state.get(state, 0) for state in HOST_STATES},
                "gpus_by_state": {state: gpus_by_state.get(state, 0) for state in GPU_STATES},
                "hosts": [{"region": r.region, "state": r.state, "hosts": r.hosts} for r in self.fleet_hosts],
                "gpus": [
                    {"tier": g.tier, "region": g.region, "state": g.state, "gpus": g.gpus,
                     "memory_total_bytes": g.memory_total_bytes}
                    for g in self.fleet_gpus
                ],
            },
            "hosts": [h.to_json() for h in self.hosts],
            "gpus": [g.to_json() for g in self.gpus],
            "relays": [
                {"relay_id": r.relay_id, "region": r.region, "connections": r.connections, "capacity": r.capacity,
                 "draining": r.draining}
                for r in self.relays
            ],
            "ingestion": {
                "lag_seconds": self.ingestion.lag_seconds,
                "backlog": None if backlog is None else {"undelivered": backlog.undelivered, "pending": backlog.pending},
                "messages": dict(stats.messages),
                "samples": {"stored": stats.samples_stored, "duplicate": stats.samples_duplicate,
                            "rejected": stats.samples_rejected},
                "rejected_fields": dict(stats.rejected_fields),
                "failed": stats.failed,
                "dead_lettered": stats.dead_lettered,
                "malformed": stats.malformed,
                "batches": stats.batches,
                "batch_seconds": stats.batch_seconds,
                "batch_seconds_max": stats.batch_seconds_max,
                "rollup_passes": stats.rollup_passes,
                "rollup_rows": stats.rollup_rows,
                "retention_deleted": dict(stats.retention_deleted),
            },
            "rentals": dict(self.rentals),
            "alerts_firing": dict(self.alerts_firing),
            "services": {
                service_id: {"requests": s.requests, "errors": s.errors, "retries": s.retries, "inflight": s.inflight,
                             "latency_p50_ms": percentile(s.latency_hist, 0.5), "latency_p99_ms": percentile(s.latency_hist, 0.99)}
                for service_id, s in sorted(self.services.items())
            },
        }


# ---- building it -----------------------------------------------------------------------


async def build_snapshot(master: Master, *, source_timeout: float = 5.0) -> FleetSnapshot:
    """Read the fleet once: five queries, the bus backlog and the relay registry.

    Only the queries run on the event loop; decoding the hosts' telemetry and assembling
    tens of thousands of GPU records runs in a worker thread, so a large fleet does not
    stall ingestion. Read-only, so cancelling is safe. A bus or registry that does not
    answer within ``source_timeout`` seconds leaves its figures out (and ``sources[...]``
    False) rather than failing the scrape; a database error propagates.
    """
    started = master.clock.monotonic()
    generated_at = master.clock.now()
    async with master.db.session() as session:
        rows = await _load(session)
    sources: dict[str, bool] = {}
    backlog: Backlog | None = None
    try:
        async with asyncio.timeout(source_timeout):
            backlog = await master.bus.backlog(protocol.AGENT_EVENTS_STREAM, protocol.INGEST_GROUP)
        sources["bus"] = True
    except Exception as exc:  # a metrics scrape must survive a bus outage; the gap is reported
        log.warning("metrics: the bus backlog is unavailable: %s", exc or type(exc).__name__)
        sources["bus"] = False
    relays: list[RelayGauges] = []
    try:
        async with asyncio.timeout(source_timeout):
            records = await master.registry.relays()
        relays = [RelayGauges(r.relay_id, r.region or UNKNOWN, r.connections, r.capacity, r.draining) for r in records]
        sources["registry"] = True
    except Exception as exc:
        log.warning("metrics: the relay registry is unavailable: %s", exc or type(exc).__name__)
        sources["registry"] = False
    stats = copy.deepcopy(master.stats)
    hosts, gpus, fleet_gpus = await asyncio.to_thread(_assemble, rows)
    lag = None if backlog is None else backlog.lag(generated_at.timestamp())
    return FleetSnapshot(
        generated_at=generated_at,
        build_seconds=master.clock.monotonic() - started,
        hosts=hosts,
        gpus=gpus,
        fleet_hosts=rows.fleet_hosts,
        fleet_gpus=fleet_gpus,
        relays=relays,
        ingestion=Ingestion(backlog=backlog, lag_seconds=lag, stats=stats),
        rentals=rows.rentals,
        alerts_firing=rows.alerts_firing,
        sources=sources,
        services=master.gateway.stats.snapshot() if isinstance(master.gateway, Gateway) else {},
    )


@dataclass(frozen=True, slots=True)
class _Rows:
    """What the queries returned, before assembly (telemetry still JSON text)."""

    fleet_hosts: list[FleetHosts]
    hosts: list[tuple[Any, ...]]
    gpus: list[tuple[Any, ...]]
    rentals: dict[str, int]
    alerts_firing: dict[str, int]


async def _load(session: AsyncSession) -> _Rows:
    not_revoked = Host.state != "revoked"
    host_rows = await session.execute(
        select(
            Host.id, Host.name, Host.state, Host.region, Host.relay_id, Host.latest_telemetry_at,
            # As text (a SQL cast: asyncpg would decode json itself), decoded in the worker thread.
            cast(Host.latest_telemetry, Text),
        )
        .where(not_revoked)
        .order_by(Host.id)
    )
    hosts = [tuple(row) for row in host_rows]
    gpu_rows = await session.execute(
        select(Gpu.host_id, Gpu.index, Gpu.uuid, Gpu.name, Gpu.tier, Gpu.memory_total_mib, Gpu.rental_id, Host.region)
        .join(Host, Host.id == Gpu.host_id)
        .where(Gpu.present.is_(True), not_revoked)
        .order_by(Gpu.host_id, Gpu.index, Gpu.uuid)
    )
    gpus = [tuple(row) for row in gpu_rows]
    return _Rows(
        fleet_hosts=await _fleet_hosts(session),
        hosts=hosts,
        gpus=gpus,
        rentals=await _counts(session, Rental.state, RENTAL_STATES),
        alerts_firing=await _counts(session, Alert.severity, ALERT_SEVERITIES, Alert.state == "firing"),
    )


async def _fleet_hosts(session: AsyncSession) -> list[FleetHosts]:
    rows = await session.execute(select(Host.region, Host.state, func.count()).group_by(Host.region, Host.state))
    merged = Counter[tuple[str, str]]()
    for region, state, count in rows:
        merged[(region or UNKNOWN, state)] += int(count)
    return [FleetHosts(region, state, count) for (region, state), count in sorted(merged.items())]


async def _counts(session: AsyncSession, column: Any, known: tuple[str, ...], *where: Any) -> dict[str, int]:
    """Row counts by ``column``; every ``known`` value is present (0 when there are none)."""
    rows = await session.execute(select(column, func.count()).where(*where).group_by(column))
    counts = dict.fromkeys(known, 0)
    for value, count in rows:
        counts[str(value)] = int(count)
    return counts


def _assemble(rows: _Rows) -> tuple[list[HostGauges], list[GpuGauges], list[FleetGpus]]:
    """Hosts, GPU gauges and fleet GPU totals from the loaded rows; pure, so it runs in a worker thread."""
    hosts: list[HostGauges] = []
    readings: dict[str, dict[str, Mapping[str, Any]]] = {}
    for host_id, name, state, region, relay_id, telemetry_at, telemetry_text in rows.hosts:
        hosts.append(HostGauges(host_id, name or "", state, region or UNKNOWN, relay_id, telemetry_at))
        if state not in STALE_TELEMETRY_STATES and telemetry_text:
            readings[host_id] = _latest_readings(telemetry_text)
    gpus: list[GpuGauges] = []
    for host_id, index, uuid, model, tier, memory_total_mib, rental_id, region in rows.gpus:
        memory_total = int(memory_total_mib) * MIB
        sample = readings.get(host_id, {}).get(uuid, {})
        memory_used = _reading(sample, "memory_used_mib", MIB)
        gpus.append(
            GpuGauges(
                host_id=host_id, index=index, uuid=uuid, model=model, tier=tier or UNKNOWN, region=region or UNKNOWN,
                rental_id=rental_id, memory_total_bytes=memory_total,
                allocation=_allocation(rental_id, memory_total),
                utilization_ratio=_reading(sample, "gpu_util_pct", 0.01),
                memory_used_bytes=None if memory_used is None else int(memory_used),
                temperature_celsius=_reading(sample, "temperature_c"),
                power_watts=_reading(sample, "power_draw_w"),
            )
        )
    return hosts, gpus, fleet_gpu_totals(gpus, {h.host_id: h.state for h in hosts})


def _latest_readings(telemetry_text: str | bytes) -> dict[str, Mapping[str, Any]]:
    """``hosts.latest_telemetry`` (``{"seq", "sampled_at", "gpus": [...]}``) as GPU uuid → sample."""
    try:
        telemetry = json.loads(telemetry_text)
    except (TypeError, ValueError):
        log.warning("metrics: a host's latest telemetry is not JSON text; its readings are left out")
        return {}
    samples = telemetry.get("gpus") if isinstance(telemetry, dict) else None
    if not isinstance(samples, list):
        return {}
    return {s["uuid"]: s for s in samples if isinstance(s, dict) and isinstance(s.get("uuid"), str)}


def _allocation(rental_id: str | None, memory_total_bytes: int) -> Allocation:
    """A whole-GPU rental holds all of it; fractional shares will sum theirs here."""
    if rental_id is None:
        return Allocation(core_ratio=0.0, memory_bytes=0)
    return Allocation(core_ratio=1.0, memory_bytes=memory_total_bytes)


def _reading(sample: Mapping[str, Any], key: str, scale: float = 1.0) -> float | None:
    """One reading scaled to base units; None when missing or not a finite number."""
    value = sample.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return value * scale


def fleet_gpu_totals(gpus: list[GpuGauges], host_states: Mapping[str, str]) -> list[FleetGpus]:
    """GPUs and their memory by tier, region and GPU state (see ``GPU_STATES``)."""
    counts = Counter[tuple[str, str, str]]()
    memory = Counter[tuple[str, str, str]]()
    for gpu in gpus:
        if gpu.allocation.core_ratio > 0:
            state = "allocated"
        elif host_states.get(gpu.host_id) in RENTABLE_STATES:
            state = "available"
        else:
            state = "unavailable"
        key = (gpu.tier, gpu.region, state)
        counts[key] += 1
        memory[key] += gpu.memory_total_bytes
    return [FleetGpus(tier, region, state, n, memory[(tier, region, state)]) for (tier, region, state), n in sorted(counts.items())]


__all__ = [
    "MIB", "UNKNOWN", "FleetSnapshot", "GpuGauges", "HostGauges", "build_snapshot", "fleet_gpu_totals",
]  # fmt: skip
