"""Operator metrics: the fleet snapshot served as Prometheus text, and the cache in front of it.

``SnapshotCollector`` turns one ``master.telemetry.snapshot.FleetSnapshot`` into Prometheus
metric families; ``MetricsExporter`` keeps one snapshot (and its rendered exposition, plain
and gzipped) for ``metrics_cache_seconds``, so any number of scrapers and
``/api/v1/metrics`` callers (which get the snapshot's ``to_json``) cost one build per period.

Imports only ``master`` and ``shared`` (and ``prometheus_client``); the HTTP side lives in
``master/api/routes_metrics.py``.
"""

from __future__ import annotations

import asyncio
import gzip
import math
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from master.context import Master
from master.services.gateway import LATENCY_BOUNDS_MS
from master.telemetry.snapshot import FleetSnapshot, build_snapshot

# ---- Prometheus ------------------------------------------------------------------------

GPU_LABELS = ("host", "gpu", "uuid", "model", "tier", "region")
GZIP_LEVEL = 1
"""Fast and enough: exposition text is repetitive (70 MB for 80,000 GPUs packs to about 2 MB)."""


class SnapshotCollector:
    """A ``prometheus_client`` collector over one ``FleetSnapshot``: it queries nothing itself.

    ``MetricsExporter`` sets ``snapshot`` and renders under its lock; ``collect`` reads the
    attribute once, so each exposition is one consistent snapshot.
    """

    def __init__(self) -> None:
        self.snapshot: FleetSnapshot | None = None
        self.per_gpu = True

    def collect(self) -> Iterator[Metric]:
        snapshot = self.snapshot
        if snapshot is None:
            return
        if self.per_gpu:
            yield from _gpu_metrics(snapshot)
        yield from _host_metrics(snapshot)
        yield from _fleet_metrics(snapshot)
        yield from _relay_metrics(snapshot)
        yield from _ingestion_metrics(snapshot)
        yield from _business_metrics(snapshot)
        yield from _service_metrics(snapshot)
        yield from _meta_metrics(snapshot)


def _gpu_metrics(snapshot: FleetSnapshot) -> Iterator[Metric]:
    families = {
        "utilization": GaugeMetricFamily("gpumarket_gpu_utilization_ratio", "GPU busy fraction (0..1) in the latest sample.", labels=GPU_LABELS),
        "memory_used": GaugeMetricFamily("gpumarket_gpu_memory_used_bytes", "GPU memory in use in the latest sample.", labels=GPU_LABELS),
        "memory_total": GaugeMetricFamily("gpumarket_gpu_memory_total_bytes", "GPU memory the GPU has.", labels=GPU_LABELS),
        "temperature": GaugeMetricFamily("gpumarket_gpu_temperature_celsius", "GPU temperature in the latest sample.", labels=GPU_LABELS),
        "power": GaugeMetricFamily("gpumarket_gpu_power_watts", "GPU power draw in the latest sample.", labels=GPU_LABELS),
        "core_allocated": GaugeMetricFamily("gpumarket_gpu_core_allocated_ratio", "Share of the GPU's compute held by rentals (0..1).", labels=GPU_LABELS),
        "memory_allocated": GaugeMetricFamily("gpumarket_gpu_memory_allocated_bytes", "GPU memory held by rentals.", labels=GPU_LABELS),
    }
    for gpu in snapshot.gpus:
        labels = (gpu.host_id, str(gpu.index), gpu.uuid, gpu.model, gpu.tier, gpu.region)
        families["memory_total"].add_metric(labels, gpu.memory_total_bytes)
        families["core_allocated"].add_metric(labels, gpu.allocation.core_ratio)
        families["memory_allocated"].add_metric(labels, gpu.allocation.memory_bytes)
        for key, value in (
            ("utilization", gpu.utilization_ratio),
            ("memory_used", gpu.memory_used_bytes),
            ("temperature", gpu.temperature_celsius),
            ("power", gpu.power_watts),
        ):
            if value is not None:
                families[key].add_metric(labels, value)
    yield from families.values()


def _host_metrics(snapshot: FleetSnapshot) -> Iterator[Metric]:
    state = GaugeMetricFamily("gpumarket_host_state", "1 for the host's current state (revoked hosts are left out).",
                              labels=("host", "region", "state"))
    info = GaugeMetricFamily("gpumarket_host_info", "Always 1: the host's name, region and the relay it last spoke through.",
                             labels=("host", "name", "region", "relay"))
    telemetry_at = GaugeMetricFamily("gpumarket_host_telemetry_timestamp_seconds",
                                     "Unix time of the host's latest telemetry sample.", labels=("host", "region"))
    for host in snapshot.hosts:
        state.add_metric((host.host_id, host.region, host.state), 1)
        info.add_metric((host.host_id, host.name, host.region, host.relay_id or ""), 1)
        if host.telemetry_at is not None:
            telemetry_at.add_metric((host.host_id, host.region), host.telemetry_at.timestamp())
    yield from (state, info, telemetry_at)


def _fleet_metrics(snapshot: FleetSnapshot) -> Iterator[Metric]:
    hosts = GaugeMetricFamily("gpumarket_fleet_hosts", "Hosts by region and state (revoked included).", labels=("region", "state"))
    for row in snapshot.fleet_hosts:
        hosts.add_metric((row.region, row.state), row.hosts)
    gpus = GaugeMetricFamily("gpumarket_fleet_gpus", "Present GPUs by tier, region and state (allocated, available, unavailable).",
                             labels=("tier", "region", "state"))
    memory = GaugeMetricFamily("gpumarket_fleet_gpu_memory_bytes", "GPU memory by tier, region and state.",
                               labels=("tier", "region", "state"))
    for gpu_row in snapshot.fleet_gpus:
        gpus.add_metric((gpu_row.tier, gpu_row.region, gpu_row.state), gpu_row.gpus)
        memory.add_metric((gpu_row.tier, gpu_row.region, gpu_row.state), gpu_row.memory_total_bytes)
    yield from (hosts, gpus, memory)


def _relay_metrics(snapshot: FleetSnapshot) -> Iterator[Metric]:
    labels = ("relay", "region")
    connections = GaugeMetricFamily("gpumarket_relay_connections", "Agents connected to the relay.", labels=labels)
    capacity = GaugeMetricFamily("gpumarket_relay_capacity", "Agents the relay accepts at most.", labels=labels)
    draining = GaugeMetricFamily("gpumarket_relay_draining", "1 while the relay is draining.", labels=labels)
    for relay in snapshot.relays:
        connections.add_metric((relay.relay_id, relay.region), relay.connections)
        capacity.add_metric((relay.relay_id, relay.region), relay.capacity)
        draining.add_metric((relay.relay_id, relay.region), 1 if relay.draining else 0)
    yield from (connections, capacity, draining)


def _ingestion_metrics(snapshot: FleetSnapshot) -> Iterator[Metric]:
    ingestion = snapshot.ingestion
    if ingestion.backlog is not None and ingestion.lag_seconds is not None:
        yield GaugeMetricFamily("gpumarket_ingestion_lag_seconds",
                                "How long the oldest unfinished agent-events message has waited (0 when caught up).",
                                value=ingestion.lag_seconds)
        backlog = GaugeMetricFamily("gpumarket_ingestion_backlog_messages",
                                    "agent-events messages the master group has not finished.", labels=("kind",))
        backlog.add_metric(("undelivered",), ingestion.backlog.undelivered)
        backlog.add_metric(("pending",), ingestion.backlog.pending)
        yield backlog
    stats = ingestion.stats
    messages = CounterMetricFamily("gpumarket_ingest_messages_total", "Bus messages applied by this process, by type.",
                                   labels=("type",))
    for kind, count in sorted(stats.messages.items()):
        messages.add_metric((kind,), count)
    yield messages
    samples = CounterMetricFamily("gpumarket_ingest_samples_total", "Telemetry samples seen by this process, by outcome.",
                                  labels=("outcome",))
    samples.add_metric(("stored",), stats.samples_stored)
    samples.add_metric(("duplicate",), stats.samples_duplicate)
    samples.add_metric(("rejected",), stats.samples_rejected)
    yield samples
    fields = CounterMetricFamily("gpumarket_ingest_rejected_fields_total",
                                 "Telemetry readings refused as impossible by this process, by field.", labels=("field",))
    for name, count in sorted(stats.rejected_fields.items()):
        fields.add_metric((name,), count)
    yield fields
    yield CounterMetricFamily("gpumarket_ingest_failures_total", "Attempts to apply a message that raised (retried).",
                              value=stats.failed)
    yield CounterMetricFamily("gpumarket_ingest_dead_lettered_total", "Messages given up on and moved to the dead-letter stream.",
                              value=stats.dead_lettered)
    yield CounterMetricFamily("gpumarket_ingest_malformed_total", "Bus records dropped as malformed.", value=stats.malformed)
    yield CounterMetricFamily("gpumarket_ingest_seq_refused_total",
                              "Agent messages dropped for a sequence number absurdly far past their host's newest.",
                              value=stats.seq_refused)
    yield CounterMetricFamily("gpumarket_ingest_batches_total", "Batches written by this process.", value=stats.batches)
    yield CounterMetricFamily("gpumarket_ingest_batch_seconds_total", "Time spent writing batches.", value=stats.batch_seconds)
    yield GaugeMetricFamily("gpumarket_ingest_batch_seconds_max", "The longest batch this process has written.",
                            value=stats.batch_seconds_max)
    yield CounterMetricFamily("gpumarket_rollup_passes_total", "Telemetry roll-up passes run by this process.",
                              value=stats.rollup_passes)
    yield CounterMetricFamily("gpumarket_rollup_rows_total", "Raw telemetry rows folded into roll-ups by this process.",
                              value=stats.rollup_rows)
    deleted = CounterMetricFamily("gpumarket_retention_deleted_rows_total", "Telemetry rows deleted by retention, by kind.",
                                  labels=("kind",))
    for kind, count in sorted(stats.retention_deleted.items()):
        deleted.add_metric((kind,), count)
    yield deleted


def _business_metrics(snapshot: FleetSnapshot) -> Iterator[Metric]:
    rentals = GaugeMetricFamily("gpumarket_rentals", "Rentals by state (all time, stopped and failed included).", labels=("state",))
    for state, count in snapshot.rentals.items():
        rentals.add_metric((state,), count)
    alerts = GaugeMetricFamily("gpumarket_alerts_firing", "Alerts firing now, by severity.", labels=("severity",))
    for severity, count in snapshot.alerts_firing.items():
        alerts.add_metric((severity,), count)
    yield from (rentals, alerts)


def _service_metrics(snapshot: FleetSnapshot) -> Iterator[Metric]:
    """Elastic services' endpoints as this process served them (each master process exports its own)."""
    labels = ("service",)
    requests = CounterMetricFamily("gpumarket_service_requests_total", "Requests to the service's endpoint served by this process.", labels=labels)
    errors = CounterMetricFamily("gpumarket_service_errors_total",
                                 "Of those, answered 5xx (by the gateway or a replica) or broken off.", labels=labels)
    retries = CounterMetricFamily("gpumarket_service_retries_total", "Requests sent again to another replica.", labels=labels)
    inflight = GaugeMetricFamily("gpumarket_service_requests_in_flight", "Requests (and websockets) in flight now.", labels=labels)
    latency = HistogramMetricFamily("gpumarket_service_latency_seconds",
                                    "Time from a request's arrival to its answer's head leaving the gateway.", labels=labels)
    for service_id, stats in sorted(snapshot.services.items()):
        requests.add_metric((service_id,), stats.requests)
        errors.add_metric((service_id,), stats.errors)
        retries.add_metric((service_id,), stats.retries)
        inflight.add_metric((service_id,), stats.inflight)
        cumulative, buckets = 0, []
        for bound, count in zip((*LATENCY_BOUNDS_MS, math.inf), stats.latency_hist, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == math.inf else f"{bound / 1000:g}", cumulative))
        latency.add_metric((service_id,), buckets, sum_value=stats.latency_sum_ms / 1000)
    yield from (requests, errors, retries, inflight, latency)


def _meta_metrics(snapshot: FleetSnapshot) -> Iterator[Metric]:
    yield GaugeMetricFamily("gpumarket_metrics_snapshot_timestamp_seconds", "Unix time the served snapshot was built.",
                            value=snapshot.generated_at.timestamp())
    yield GaugeMetricFamily("gpumarket_metrics_snapshot_duration_seconds", "How long building the served snapshot took.",
                            value=snapshot.build_seconds)
    up = GaugeMetricFamily("gpumarket_metrics_source_up", "1 if the source answered when the snapshot was built.",
                           labels=("source",))
    for source, ok in sorted(snapshot.sources.items()):
        up.add_metric((source,), 1 if ok else 0)
    yield up


# ---- serving it ------------------------------------------------------------------------


class MetricsExporter:
    """One per master app: its own ``CollectorRegistry``, the cached snapshot and its rendering.

    Concurrent callers share one build: the lock makes the second wait for the first
    rather than query the database again.
    """

    def __init__(self, *, source_timeout: float = 5.0) -> None:
        self.source_timeout = source_timeout
        self.registry = CollectorRegistry(auto_describe=False)
        self._collector = SnapshotCollector()
        self.registry.register(self._collector)
        self._lock = asyncio.Lock()
        self._snapshot: FleetSnapshot | None = None
        self._built_at = 0.0
        self._exposition: bytes | None = None
        self._exposition_gzip: bytes | None = None
        self.builds = 0
        """Snapshots built so far (to see the cache work)."""

    async def snapshot(self, master: Master) -> FleetSnapshot:
        """The current snapshot, rebuilt if older than ``metrics_cache_seconds``. Cancelling is safe."""
        async with self._lock:
            return await self._fresh(master)

    async def exposition(self, master: Master, *, gzipped: bool = False) -> bytes:
        """The snapshot in the Prometheus text format (gzip-compressed if asked), rendered once per snapshot.

        Rendering tens of thousands of series takes seconds, so it runs in a worker thread
        (the snapshot is immutable); the compressed form is kept too, since every scraper
        asks for it and a large fleet's text is tens of megabytes. Cancelling is safe: an
        abandoned render is simply redone.
        """
        async with self._lock:
            snapshot = await self._fresh(master)
            if self._exposition is None:
                self._collector.snapshot = snapshot
                self._collector.per_gpu = master.settings.metrics_per_gpu
                self._exposition = await asyncio.to_thread(generate_latest, self.registry)
            if not gzipped:
                return self._exposition
            if self._exposition_gzip is None:
                self._exposition_gzip = await asyncio.to_thread(gzip.compress, self._exposition, compresslevel=GZIP_LEVEL)
            return self._exposition_gzip

    async def _fresh(self, master: Master) -> FleetSnapshot:
        now = master.clock.monotonic()
        if self._snapshot is not None and now - self._built_at < master.settings.metrics_cache_seconds:
            return self._snapshot
        snapshot = await build_snapshot(master, source_timeout=self.source_timeout)
        self._snapshot, self._built_at = snapshot, now
        self._exposition = self._exposition_gzip = None
        self.builds += 1
        return snapshot


__all__ = ["MetricsExporter", "SnapshotCollector"]
