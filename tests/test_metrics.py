"""Operator metrics: ``GET /metrics`` (Prometheus text), ``GET /api/v1/metrics`` (JSON), the Grafana dashboard.

Each test drives the real aiohttp app on loopback over a master on SQLite and on a fresh
PostgreSQL database. The fleet is made of real rows: hosts enrolled and fed hello and
telemetry through ``master.telemetry.hosts`` as the ingestor would, with regions, tiers,
rentals and alerts set on their rows; a relay record in the registry; a message waiting
on the in-process bus.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from sqlalchemy import event, update

from master.api.base import API
from master.api.routes_metrics import METRICS_EXPORTER, accepts_gzip
from master.app import create_app
from master.context import Master
from master.models import Alert, Gpu, Host, Rental
from master.services.accounts.core import Principal
from master.telemetry import hosts
from master.telemetry.snapshot import MIB
from shared import protocol
from shared.bus import Backlog, InProcessBus
from shared.errors import BusError
from shared.protocol import INGEST_GROUP as GROUP
from shared.registry import RelayRecord
from tests.factories import create_principal, envelope, gpu_info, online_host

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "gpumarket-dashboard.json"
RTX = "NVIDIA GeForce RTX 4090"
A100 = "NVIDIA A100-SXM4-80GB"
BACKLOG_AGE_S = 30.0


class FakeClock:
    """A ``Clock`` whose monotonic time only moves when the test says so."""

    def __init__(self) -> None:
        self.mono = 1000.0

    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return self.mono


class SilentBus(InProcessBus):
    """A bus whose backlog query fails, as Redis does when it is down."""

    async def backlog(self, stream: str, group: str) -> Backlog:
        raise BusError("connection refused")


@dataclass
class Fleet:
    """What ``build_fleet`` made, to assert against."""

    eu_host: str
    eu_uuids: list[str]
    us_host: str
    us_uuid: str
    revoked_host: str
    rental_id: str


@dataclass
class Metrics:
    """The running app, an admin and a renter key, and ways to read both endpoints."""

    master: Master
    client: TestClient[Any, Any]
    admin_key: str
    renter_key: str
    provider: Principal

    async def scrape(self, headers: dict[str, str] | None = None) -> tuple[int, str, str]:
        async with self.client.get("/metrics", headers=headers or {}) as response:
            return response.status, response.headers.get("Content-Type", ""), await response.text()

    async def families(self, headers: dict[str, str] | None = None) -> list[Sample]:
        status, _, text = await self.scrape(headers)
        assert status == 200, text
        return [s for family in text_string_to_metric_families(text) for s in family.samples]

    async def json(self, key: str | None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with self.client.get(API + "/metrics", headers=headers) as response:
            return response.status, await response.json()

    def settings(self, **changes: Any) -> None:
        self.master.settings = self.master.settings.model_copy(update=changes)


def values(samples: list[Sample], name: str, **labels: str) -> list[float]:
    """The values of ``name``'s samples whose labels include ``labels``."""
    return [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]


def value(samples: list[Sample], name: str, **labels: str) -> float:
    [found] = values(samples, name, **labels)
    return found


@pytest.fixture
async def metrics(master: Master) -> AsyncIterator[Metrics]:
    _, admin_key = await create_principal(master, "ops", "admin")
    _, renter_key = await create_principal(master, "renter-1", "renter")
    provider, _ = await create_principal(master, "provider-1", "provider")
    # Open on purpose (metrics_open), so each test scrapes without a token; TestAccess closes it.
    master.settings = master.settings.model_copy(update={"metrics_cache_seconds": 0.0, "metrics_token": None, "metrics_open": True})
    client: TestClient[Any, Any] = TestClient(TestServer(create_app(master, background=False)))
    await client.start_server()
    try:
        yield Metrics(master, client, admin_key, renter_key, provider)
    finally:
        await client.close()


def sample(
    uuid: str, index: int, *, gpu_util_pct: float | None = None, memory_used_mib: int | None = None,
    temperature_c: float | None = None, power_draw_w: float | None = None,
) -> protocol.GpuSampleModel:
    return protocol.GpuSampleModel(index=index, uuid=uuid, gpu_util_pct=gpu_util_pct, memory_used_mib=memory_used_mib,
                                   temperature_c=temperature_c, power_draw_w=power_draw_w)


async def report(master: Master, host_id: str, seq: int, samples: list[protocol.GpuSampleModel], *, relay: str) -> None:
    message = protocol.Telemetry(
        host_id=host_id, seq=seq, ts=datetime.now(UTC),
        body=protocol.TelemetryBody(sampled_at=datetime.now(UTC), gpus=samples),
    )
    async with master.db.session() as session:
        assert await hosts.handle_telemetry(session, envelope(message, relay=relay))


async def set_rows(master: Master, host_id: str, *, region: str, tier: str, state: str | None = None) -> None:
    async with master.db.session() as session:
        await session.execute(update(Gpu).where(Gpu.host_id == host_id).values(tier=tier))
        changes: dict[str, Any] = {"region": region}
        if state is not None:
            changes["state"] = state
        await session.execute(update(Host).where(Host.id == host_id).values(**changes))


async def build_fleet(m: Metrics) -> Fleet:
    """Three hosts (online in eu-west, offline in us-east, revoked), a rental, alerts, a relay, a backlog, counters."""
    master = m.master
    eu_gpus = [gpu_info(0, name=RTX), gpu_info(1, name=RTX)]
    eu_host = await online_host(master, m.provider, eu_gpus)
    await report(master, eu_host, 1, [
        sample(eu_gpus[0].uuid, 0, gpu_util_pct=50.0, memory_used_mib=1024, temperature_c=61.0, power_draw_w=300.5),
        sample(eu_gpus[1].uuid, 1, gpu_util_pct=0.0, memory_used_mib=0),  # no temperature, no power
    ], relay="relay-eu-1")
    await set_rows(master, eu_host, region="eu-west", tier="prosumer")

    us_gpu = gpu_info(0, name=A100, memory=81920)
    us_host = await online_host(master, m.provider, [us_gpu])
    await report(master, us_host, 1, [sample(us_gpu.uuid, 0, gpu_util_pct=90.0, temperature_c=70.0)], relay="relay-us-1")
    await set_rows(master, us_host, region="us-east", tier="datacenter", state="offline")

    revoked_host = await online_host(master, m.provider, [gpu_info(0, name=RTX)])
    await set_rows(master, revoked_host, region="eu-west", tier="prosumer", state="revoked")

    renter_id = (await create_principal(master, "renter-2", "renter"))[0].account_id
    async with master.db.session() as session:
        session.add(Rental(id="rnt_running", renter_id=renter_id, host_id=eu_host, gpu_count=1,
                           gpu_uuids=[eu_gpus[0].uuid], state="running"))
        session.add(Rental(id="rnt_done", renter_id=renter_id, host_id=eu_host, gpu_count=1, state="stopped"))
        await session.flush()
        await session.execute(update(Gpu).where(Gpu.uuid == eu_gpus[0].uuid).values(rental_id="rnt_running"))
        await session.execute(update(Host).where(Host.id == eu_host).values(state="rented"))
        session.add(Alert(id="alr_1", rule="host_offline", key=f"host_offline:{us_host}", open_key=f"host_offline:{us_host}",
                          severity="critical", state="firing", host_id=us_host, summary="host offline"))
        session.add(Alert(id="alr_2", rule="hot_gpu", key="hot_gpu:x", severity="warning", state="resolved", summary="hot"))

    await master.registry.put_relay(
        RelayRecord(relay_id="relay-eu-1", region="eu-west", url="wss://r/v1/agent", host="r", port=443,
                    connections=7, capacity=100, draining=False, updated_at=time.time()),
        ttl=60,
    )
    # One agent-events message published BACKLOG_AGE_S ago and not yet read by the master group.
    master.bus = InProcessBus(wall_clock=lambda: time.time() - BACKLOG_AGE_S)
    await master.bus.publish(protocol.AGENT_EVENTS_STREAM, b"{}")
    await master.bus.ensure_group(protocol.AGENT_EVENTS_STREAM, GROUP)

    stats = master.stats
    stats.messages.update({"telemetry": 3, "hello": 1})
    stats.samples_stored, stats.samples_duplicate, stats.samples_rejected = 3, 1, 0
    stats.rejected_fields["temperature_c"] += 2
    stats.failed, stats.dead_lettered, stats.malformed = 1, 0, 0
    stats.batches, stats.batch_seconds, stats.batch_seconds_max = 2, 0.25, 0.2
    stats.rollup_passes, stats.rollup_rows = 1, 3
    stats.retention_deleted.update({"raw": 7})
    return Fleet(eu_host, [g.uuid for g in eu_gpus], us_host, us_gpu.uuid, revoked_host, "rnt_running")


class TestPrometheusGauges:
    async def test_gpu_gauges_are_in_base_units(self, metrics: Metrics) -> None:
        """Utilization is a 0..1 ratio, memory is bytes, temperature °C and power W, labelled by host, GPU and model."""
        fleet = await build_fleet(metrics)
        samples = await metrics.families()
        gpu0 = {"host": fleet.eu_host, "gpu": "0", "uuid": fleet.eu_uuids[0], "model": RTX, "tier": "prosumer", "region": "eu-west"}
        assert value(samples, "gpumarket_gpu_utilization_ratio", **gpu0) == 0.5
        assert value(samples, "gpumarket_gpu_memory_used_bytes", **gpu0) == 1024 * MIB
        assert value(samples, "gpumarket_gpu_memory_total_bytes", **gpu0) == 24564 * MIB
        assert value(samples, "gpumarket_gpu_temperature_celsius", **gpu0) == 61.0
        assert value(samples, "gpumarket_gpu_power_watts", **gpu0) == 300.5

    async def test_allocation_gauges_follow_the_rental(self, metrics: Metrics) -> None:
        """A rented GPU is allocated whole (ratio 1, all its memory); a free one is 0."""
        fleet = await build_fleet(metrics)
        samples = await metrics.families()
        rented, free = ({"uuid": u} for u in fleet.eu_uuids)
        assert value(samples, "gpumarket_gpu_core_allocated_ratio", **rented) == 1.0
        assert value(samples, "gpumarket_gpu_memory_allocated_bytes", **rented) == 24564 * MIB
        assert value(samples, "gpumarket_gpu_core_allocated_ratio", **free) == 0.0
        assert value(samples, "gpumarket_gpu_memory_allocated_bytes", **free) == 0.0

    async def test_missing_readings_are_left_out_not_zero(self, metrics: Metrics) -> None:
        """A GPU that reported no temperature or power has no such series; its zero utilization is kept."""
        fleet = await build_fleet(metrics)
        samples = await metrics.families()
        free = fleet.eu_uuids[1]
        assert values(samples, "gpumarket_gpu_temperature_celsius", uuid=free) == []
        assert values(samples, "gpumarket_gpu_power_watts", uuid=free) == []
        assert value(samples, "gpumarket_gpu_utilization_ratio", uuid=free) == 0.0

    async def test_offline_hosts_readings_are_left_out(self, metrics: Metrics) -> None:
        """An offline host's last readings are stale: not reported; its GPU's size and allocation are."""
        fleet = await build_fleet(metrics)
        samples = await metrics.families()
        assert values(samples, "gpumarket_gpu_utilization_ratio", uuid=fleet.us_uuid) == []
        assert values(samples, "gpumarket_gpu_temperature_celsius", uuid=fleet.us_uuid) == []
        assert value(samples, "gpumarket_gpu_memory_total_bytes", uuid=fleet.us_uuid) == 81920 * MIB
        assert value(samples, "gpumarket_gpu_core_allocated_ratio", uuid=fleet.us_uuid) == 0.0

    async def test_host_state_is_one_series_per_host_for_its_current_state(self, metrics: Metrics) -> None:
        """Each non-revoked host has ``gpumarket_host_state`` 1 for its state only; revoked hosts have none."""
        fleet = await build_fleet(metrics)
        samples = await metrics.families()
        host_states = {s.labels["host"]: (s.labels["state"], s.value) for s in samples if s.name == "gpumarket_host_state"}
        assert host_states == {fleet.eu_host: ("rented", 1.0), fleet.us_host: ("offline", 1.0)}
        assert value(samples, "gpumarket_host_info", host=fleet.eu_host) == 1.0
        assert values(samples, "gpumarket_host_info", host=fleet.eu_host, relay="relay-eu-1") == [1.0]
        assert value(samples, "gpumarket_host_telemetry_timestamp_seconds", host=fleet.eu_host) == pytest.approx(time.time(), abs=60)

    async def test_fleet_totals_by_tier_region_and_state(self, metrics: Metrics) -> None:
        """GPUs are counted as allocated, available or unavailable per tier and region; hosts per region and state."""
        await build_fleet(metrics)
        samples = await metrics.families()
        gpus = {(s.labels["tier"], s.labels["region"], s.labels["state"]): s.value
                for s in samples if s.name == "gpumarket_fleet_gpus"}
        assert gpus == {
            ("prosumer", "eu-west", "allocated"): 1,
            ("prosumer", "eu-west", "available"): 1,
            ("datacenter", "us-east", "unavailable"): 1,
        }
        assert value(samples, "gpumarket_fleet_gpu_memory_bytes", tier="datacenter") == 81920 * MIB
        hosts_ = {(s.labels["region"], s.labels["state"]): s.value for s in samples if s.name == "gpumarket_fleet_hosts"}
        assert hosts_ == {("eu-west", "rented"): 1, ("eu-west", "revoked"): 1, ("us-east", "offline"): 1}

    async def test_unknown_region_and_tier_are_labelled_unknown(self, metrics: Metrics) -> None:
        """A host without a region and an unclassified GPU get the label value ``unknown``, never an empty label."""
        host_id = await online_host(metrics.master, metrics.provider, [gpu_info(0)])
        async with metrics.master.db.session() as session:  # not classified yet (a hello classifies at once)
            await session.execute(update(Gpu).where(Gpu.host_id == host_id).values(tier=None))
        samples = await metrics.families()
        assert value(samples, "gpumarket_fleet_gpus", tier="unknown", region="unknown", state="available") == 1
        assert value(samples, "gpumarket_fleet_hosts", region="unknown", state="online") == 1


class TestPrometheusPipelineAndBusiness:
    async def test_relays_backlog_rentals_and_alerts(self, metrics: Metrics) -> None:
        """Relay load, the ingestion backlog and its age, rentals by state and firing alerts by severity."""
        await build_fleet(metrics)
        samples = await metrics.families()
        assert value(samples, "gpumarket_relay_connections", relay="relay-eu-1", region="eu-west") == 7
        assert value(samples, "gpumarket_relay_capacity", relay="relay-eu-1") == 100
        assert value(samples, "gpumarket_relay_draining", relay="relay-eu-1") == 0
        assert value(samples, "gpumarket_ingestion_backlog_messages", kind="undelivered") == 1
        assert value(samples, "gpumarket_ingestion_backlog_messages", kind="pending") == 0
        assert BACKLOG_AGE_S <= value(samples, "gpumarket_ingestion_lag_seconds") < BACKLOG_AGE_S + 30
        rentals = {s.labels["state"]: s.value for s in samples if s.name == "gpumarket_rentals"}
        assert rentals == {"pending": 0, "starting": 0, "running": 1, "stopping": 0, "stopped": 1, "failed": 0, "preempted": 0}
        alerts = {s.labels["severity"]: s.value for s in samples if s.name == "gpumarket_alerts_firing"}
        assert alerts == {"critical": 1, "warning": 0, "info": 0}
        assert value(samples, "gpumarket_metrics_source_up", source="bus") == 1

    async def test_ingest_counters_are_prometheus_counters(self, metrics: Metrics) -> None:
        """The process's ``IngestStats`` appear as ``_total`` counters with their labels."""
        await build_fleet(metrics)
        status, _, text = await metrics.scrape()
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert families["gpumarket_ingest_messages"].type == "counter"
        samples = [s for f in families.values() for s in f.samples]
        assert value(samples, "gpumarket_ingest_messages_total", type="telemetry") == 3
        assert value(samples, "gpumarket_ingest_messages_total", type="hello") == 1
        assert value(samples, "gpumarket_ingest_samples_total", outcome="stored") == 3
        assert value(samples, "gpumarket_ingest_samples_total", outcome="duplicate") == 1
        assert value(samples, "gpumarket_ingest_rejected_fields_total", field="temperature_c") == 2
        assert value(samples, "gpumarket_ingest_failures_total") == 1
        assert value(samples, "gpumarket_ingest_batch_seconds_total") == 0.25
        assert value(samples, "gpumarket_ingest_batch_seconds_max") == 0.2
        assert value(samples, "gpumarket_retention_deleted_rows_total", kind="raw") == 7

    async def test_a_bus_outage_leaves_out_the_lag_but_serves_the_rest(self, metrics: Metrics) -> None:
        """When the bus does not answer, the scrape still succeeds, without lag figures and with source_up{bus} 0."""
        await build_fleet(metrics)
        metrics.master.bus = SilentBus()
        samples = await metrics.families()
        assert values(samples, "gpumarket_ingestion_lag_seconds") == []
        assert values(samples, "gpumarket_ingestion_backlog_messages") == []
        assert value(samples, "gpumarket_metrics_source_up", source="bus") == 0
        assert value(samples, "gpumarket_metrics_source_up", source="registry") == 1
        assert values(samples, "gpumarket_fleet_hosts", state="rented") == [1]

    async def test_answers_in_the_prometheus_text_format(self, metrics: Metrics) -> None:
        """The response carries prometheus_client's content type and every family has HELP and TYPE."""
        from prometheus_client import CONTENT_TYPE_LATEST

        status, content_type, text = await metrics.scrape()
        assert status == 200
        assert content_type == CONTENT_TYPE_LATEST
        helps = set(re.findall(r"^# HELP (\S+)", text, re.M))
        types = set(re.findall(r"^# TYPE (\S+)", text, re.M))
        assert helps == types
        assert "gpumarket_fleet_gpus" in types


    async def test_compresses_for_scrapers_that_accept_gzip(self, metrics: Metrics) -> None:
        """Prometheus asks for gzip and gets the same text compressed; a client that does not gets it plain."""
        await build_fleet(metrics)
        metrics.settings(metrics_cache_seconds=600.0)  # both answers from one snapshot
        async with metrics.client.get("/metrics", headers={"Accept-Encoding": "identity"}) as response:
            assert "Content-Encoding" not in response.headers
            plain = await response.read()
        async with metrics.client.get("/metrics", headers={"Accept-Encoding": "gzip"}, auto_decompress=False) as response:
            assert response.headers["Content-Encoding"] == "gzip"
            compressed = await response.read()
        assert gzip.decompress(compressed) == plain

    @pytest.mark.parametrize(
        ("header", "expected"),
        [("gzip", True), ("deflate, gzip;q=1.0, *;q=0.5", True), ("identity", False), ("", False),
         ("gzip;q=0", False), ("*", True), ("*, gzip;q=0", False), ("GZIP", True), ("gzip;q=nonsense", False)],
    )
    def test_reads_accept_encoding(self, header: str, expected: bool) -> None:
        """``Accept-Encoding`` allows gzip when it names gzip (or ``*``) with a non-zero quality."""
        assert accepts_gzip(header) is expected


class TestAccess:
    async def test_closed_without_a_metrics_token_unless_opened_on_purpose(self, metrics: Metrics) -> None:
        """With no ``metrics_token`` set, /metrics refuses every scrape (401 ``metrics_token_unset``; an admin's API key
        does not apply), and answers without credentials only with ``metrics_open``. Issue 39: it answered anyone."""
        metrics.settings(metrics_open=False)
        for headers in (None, {"Authorization": f"Bearer {metrics.admin_key}"}):
            status, _, body = await metrics.scrape(headers)
            assert (status, json.loads(body)["code"]) == (401, "metrics_token_unset")
        metrics.settings(metrics_open=True)
        status, _, _ = await metrics.scrape()
        assert status == 200

    async def test_token_is_required_when_set(self, metrics: Metrics) -> None:
        """With ``metrics_token`` set, no token or a wrong one is 401; the right one is 200."""
        metrics.settings(metrics_token="s3cret-token")
        status, _, body = await metrics.scrape()
        assert status == 401
        assert json.loads(body)["code"] == "missing_metrics_token"
        status, _, body = await metrics.scrape({"Authorization": "Bearer s3cret-tokeX"})
        assert status == 401
        assert json.loads(body)["code"] == "invalid_metrics_token"
        status, _, _ = await metrics.scrape({"Authorization": f"Bearer {metrics.admin_key}"})
        assert status == 401
        status, _, text = await metrics.scrape({"Authorization": "Bearer s3cret-token"})
        assert status == 200
        assert "gpumarket_fleet_hosts" in text

    async def test_json_is_for_admins_only(self, metrics: Metrics) -> None:
        """``/api/v1/metrics`` needs an API key (401) of an admin (403 for a renter)."""
        status, body = await metrics.json(None)
        assert (status, body["code"]) == (401, "missing_api_key")
        status, body = await metrics.json(metrics.renter_key)
        assert (status, body["code"]) == (403, "forbidden")
        status, _ = await metrics.json(metrics.admin_key)
        assert status == 200

    async def test_json_has_the_same_figures(self, metrics: Metrics) -> None:
        """The JSON carries fleet totals, hosts, GPU gauges (null when missing), relays, ingestion, rentals and alerts."""
        fleet = await build_fleet(metrics)
        status, body = await metrics.json(metrics.admin_key)
        assert status == 200, body
        assert body["fleet"]["hosts_by_state"]["rented"] == 1
        assert body["fleet"]["hosts_by_state"]["revoked"] == 1
        assert body["fleet"]["gpus_by_state"] == {"allocated": 1, "available": 1, "unavailable": 1}
        assert {"tier": "datacenter", "region": "us-east", "state": "unavailable", "gpus": 1,
                "memory_total_bytes": 81920 * MIB} in body["fleet"]["gpus"]
        assert {h["id"]: h["state"] for h in body["hosts"]} == {fleet.eu_host: "rented", fleet.us_host: "offline"}
        gpus = {g["uuid"]: g for g in body["gpus"]}
        assert gpus[fleet.eu_uuids[0]]["utilization_ratio"] == 0.5
        assert gpus[fleet.eu_uuids[0]]["core_allocated_ratio"] == 1.0
        assert gpus[fleet.eu_uuids[0]]["rental_id"] == fleet.rental_id
        assert gpus[fleet.eu_uuids[1]]["temperature_celsius"] is None
        assert body["relays"] == [{"relay_id": "relay-eu-1", "region": "eu-west", "connections": 7, "capacity": 100,
                                   "draining": False}]
        assert body["ingestion"]["backlog"] == {"undelivered": 1, "pending": 0}
        assert body["ingestion"]["lag_seconds"] >= BACKLOG_AGE_S
        assert body["ingestion"]["messages"] == {"telemetry": 3, "hello": 1}
        assert body["rentals"]["running"] == 1
        assert body["alerts_firing"] == {"critical": 1, "warning": 0, "info": 0}
        assert body["sources"] == {"bus": True, "registry": True}

    async def test_json_route_is_in_the_openapi_document(self, metrics: Metrics) -> None:
        """``GET /api/v1/metrics`` is documented like every other route."""
        async with metrics.client.get(API + "/openapi.json") as response:
            document = await response.json()
        assert "get" in document["paths"]["/api/v1/metrics"]


class TestSnapshotCache:
    async def test_a_second_scrape_within_the_cache_time_reuses_the_snapshot(self, metrics: Metrics) -> None:
        """Within ``metrics_cache_seconds`` a new host is not seen and nothing is rebuilt; after it, it is."""
        clock = FakeClock()
        metrics.master.clock = clock
        metrics.settings(metrics_cache_seconds=10.0)
        exporter = metrics.client.app[METRICS_EXPORTER]
        first = await metrics.families()
        await online_host(metrics.master, metrics.provider, [gpu_info(0)])
        clock.mono += 9.0
        second = await metrics.families()
        status, body = await metrics.json(metrics.admin_key)
        assert status == 200
        assert exporter.builds == 1
        assert values(second, "gpumarket_fleet_hosts") == values(first, "gpumarket_fleet_hosts") == []
        assert body["hosts"] == []
        clock.mono += 1.0
        third = await metrics.families()
        assert exporter.builds == 2
        assert value(third, "gpumarket_fleet_hosts", state="online") == 1

    async def test_with_no_cache_every_scrape_sees_new_data(self, metrics: Metrics) -> None:
        """With ``metrics_cache_seconds = 0`` each scrape builds a new snapshot."""
        assert values(await metrics.families(), "gpumarket_fleet_hosts") == []
        await online_host(metrics.master, metrics.provider, [gpu_info(0)])
        assert value(await metrics.families(), "gpumarket_fleet_hosts", state="online") == 1
        assert metrics.client.app[METRICS_EXPORTER].builds == 2

    async def test_per_gpu_series_can_be_turned_off(self, metrics: Metrics) -> None:
        """``metrics_per_gpu = false`` drops the per-GPU gauges; fleet totals stay."""
        await online_host(metrics.master, metrics.provider, [gpu_info(0), gpu_info(1)])
        assert len(values(await metrics.families(), "gpumarket_gpu_memory_total_bytes")) == 2
        metrics.settings(metrics_per_gpu=False)
        samples = await metrics.families()
        assert values(samples, "gpumarket_gpu_memory_total_bytes") == []
        assert sum(values(samples, "gpumarket_fleet_gpus")) == 2

    async def test_each_app_has_its_own_registry(self, metrics: Metrics) -> None:
        """Two apps over one master do not share (or collide in) a Prometheus registry."""
        other: TestClient[Any, Any] = TestClient(TestServer(create_app(metrics.master, background=False)))
        await other.start_server()
        try:
            async with other.get("/metrics") as response:
                assert response.status == 200
            assert other.app[METRICS_EXPORTER].registry is not metrics.client.app[METRICS_EXPORTER].registry
        finally:
            await other.close()

    async def test_query_count_does_not_grow_with_the_fleet(self, metrics: Metrics) -> None:
        """Building a snapshot runs the same few queries for one host as for five (no per-host queries)."""
        statements: list[str] = []

        def count(*args: Any) -> None:
            statements.append(str(args[2]))

        engine = metrics.master.db.engine.sync_engine
        await online_host(metrics.master, metrics.provider, [gpu_info(0), gpu_info(1)])
        event.listen(engine, "before_cursor_execute", count)
        try:
            await metrics.families()
            one_host = len(statements)
            for _ in range(4):
                await online_host(metrics.master, metrics.provider, [gpu_info(i) for i in range(8)])
            statements.clear()
            await metrics.families()
        finally:
            event.remove(engine, "before_cursor_execute", count)
        assert len(statements) == one_host <= 6, statements


def promql_metric_names(expression: str) -> set[str]:
    return set(re.findall(r"\b(gpumarket_[a-z0-9_]+)", expression))


def dashboard_expressions(dashboard: dict[str, Any]) -> list[str]:
    expressions = []
    for panel in dashboard["panels"]:
        expressions += [target["expr"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable["query"]
        expressions.append(query["query"] if isinstance(query, dict) else query)
    return expressions


class TestGrafanaDashboard:
    def test_is_an_importable_dashboard(self) -> None:
        """The dashboard is valid JSON with a Prometheus datasource input used by every panel and query."""
        dashboard = json.loads(DASHBOARD.read_text())
        assert dashboard["schemaVersion"] >= 39
        assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
        assert {v["name"] for v in dashboard["templating"]["list"]} == {"region", "host"}
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids))
        for panel in dashboard["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
            assert panel["targets"], panel["title"]
            for target in panel["targets"]:
                assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
        assert any("rate(gpumarket_ingest_messages_total[5m])" in e for e in dashboard_expressions(dashboard))

    async def test_uses_only_metrics_that_metrics_exports(self, metrics: Metrics) -> None:
        """Every ``gpumarket_*`` name in the dashboard's PromQL, and every label it selects on, is one /metrics produces."""
        await build_fleet(metrics)
        samples = await metrics.families()
        produced = {s.name for s in samples}
        expressions = dashboard_expressions(json.loads(DASHBOARD.read_text()))
        used = set().union(*(promql_metric_names(e) for e in expressions))
        assert used, "the dashboard queries no gpumarket metric"
        assert used <= produced, f"the dashboard uses metrics /metrics does not produce: {sorted(used - produced)}"
        for expression in expressions:
            for name, selector in re.findall(r"\b(gpumarket_[a-z0-9_]+)\{([^}]*)\}", expression):
                labels = set(re.findall(r"([a-z_]+)\s*(?:=~|!~|!=|=)", selector))
                have = set().union(*(s.labels for s in samples if s.name == name))
                assert labels <= have, f"{name} has no label(s) {sorted(labels - have)} (in {expression})"

