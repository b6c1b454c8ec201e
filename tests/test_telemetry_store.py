"""The telemetry store: batched writes, de-duplication, impossible readings, roll-ups, retention, series."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from sqlalchemy import func, select, text

from master.app import close_master, create_app, open_master
from master.context import Master
from master.models import Host, TelemetryRollup, TelemetrySample
from master.services.accounts.core import Principal
from master.telemetry import batch as batches
from master.telemetry import hosts, rollups, store
from master.telemetry.ingest import Ingestor
from shared import protocol
from shared.bus import InProcessBus
from shared.errors import BadRequest
from shared.protocol import INGEST_GROUP as GROUP
from shared.protocol import fastbus
from tests.factories import create_principal, envelope, gpu_info, master_settings, online_host
from tests.helpers import ManualClock

T0 = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)


def sample(host_id: str, seq: int, uuids: list[str], *, at: datetime | None = None, util: float | None = 50.0,
           extra: dict[str, Any] | None = None, aggregates: list[dict[str, Any]] | None = None) -> protocol.Telemetry:
    gpus = [{"index": i, "uuid": u, "gpu_util_pct": util, "memory_used_mib": 1000 + seq, "temperature_c": 60.0,
             "power_draw_w": 200.0, **(extra or {})} for i, u in enumerate(uuids)]
    body: dict[str, Any] = {"sampled_at": (at or datetime.now(UTC)).isoformat(), "gpus": gpus}
    if aggregates is not None:
        body["aggregates"] = aggregates
    frame = {"v": protocol.PROTOCOL_VERSION, "type": "telemetry", "host_id": host_id, "seq": seq,
             "ts": datetime.now(UTC).isoformat(), "body": body}
    # Through the real decoder, as the relay sees it: NaN is a JSON constant here.
    message = protocol.decode_agent_frame(json.dumps(frame))
    assert isinstance(message, protocol.Telemetry)
    return message


def heartbeat(host_id: str, seq: int) -> protocol.Heartbeat:
    return protocol.Heartbeat(host_id=host_id, seq=seq, ts=datetime.now(UTC), body=protocol.HeartbeatBody(uptime_s=1))


async def publish(master: Master, *messages: protocol.AnyAgentMessage) -> None:
    await master.bus.ensure_group(protocol.AGENT_EVENTS_STREAM, GROUP)
    for message in messages:
        await master.bus.publish(
            protocol.AGENT_EVENTS_STREAM, protocol.encode_bus_envelope("relay-t", message, datetime.now(UTC))
        )


async def drain(master: Master, ingestor: Ingestor) -> None:
    while batch := await master.bus.read(protocol.AGENT_EVENTS_STREAM, GROUP, "t", count=500, block=None):
        await ingestor.process(batch)


async def stored(master: Master) -> list[tuple[str, int]]:
    async with master.db.session() as session:
        return [tuple(r) for r in (await session.execute(  # type: ignore[misc]
            select(TelemetrySample.host_id, TelemetrySample.seq).order_by(TelemetrySample.host_id, TelemetrySample.seq)
        )).all()]


async def fleet(master: Master, n: int, gpus: int = 2) -> tuple[Principal, list[tuple[str, list[str]]]]:
    provider, _ = await create_principal(master, "prov", "provider")
    out = []
    for _ in range(n):
        infos = [gpu_info(i) for i in range(gpus)]
        out.append((await online_host(master, provider, infos), [g.uuid for g in infos]))
    return provider, out


class TestBatchedIngestion:
    async def test_a_batch_stores_each_sample_once_whatever_the_duplicates_and_order(self, master: Master) -> None:
        """Out-of-order, repeated and redelivered samples of several hosts end up stored exactly once."""
        _, hosts_ = await fleet(master, 3)
        messages: list[protocol.AnyAgentMessage] = []
        for host_id, uuids in hosts_:
            for seq in (3, 1, 2, 2, 5, 1):
                messages.append(sample(host_id, seq, uuids))
            messages.append(heartbeat(host_id, 6))
        await publish(master, *messages)
        ingestor = Ingestor(master)
        await drain(master, ingestor)
        await publish(master, sample(hosts_[0][0], 3, hosts_[0][1]))  # redelivered in a later batch
        await drain(master, ingestor)
        assert await stored(master) == sorted((h, s) for h, _ in hosts_ for s in (1, 2, 3, 5))
        assert await master.bus.pending_count(protocol.AGENT_EVENTS_STREAM, GROUP) == 0
        assert master.stats.batches == 2
        assert master.stats.samples_stored == 12
        assert master.stats.samples_duplicate == 3 * 2 + 1
        async with master.db.session() as session:
            host = await session.get(Host, hosts_[0][0])
        assert host is not None and host.latest_telemetry_seq == 5 and host.last_seq == 6
        assert host.latest_telemetry is not None and host.latest_telemetry["seq"] == 5

    async def test_the_one_by_one_path_stores_the_same(self, master: Master) -> None:
        """``batched=False`` (the benchmark's baseline) gives the same result."""
        _, hosts_ = await fleet(master, 2)
        await publish(master, *[sample(h, s, u) for h, u in hosts_ for s in (2, 1, 2)])
        await drain(master, Ingestor(master, batched=False))
        assert await stored(master) == sorted((h, s) for h, _ in hosts_ for s in (1, 2))
        assert master.stats.batches == 0

    async def test_a_failing_batch_is_applied_one_message_at_a_time(self, master: Master, monkeypatch: pytest.MonkeyPatch) -> None:
        """When the batch's transaction fails, every message is still applied on its own."""
        _, hosts_ = await fleet(master, 2)

        async def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("deadlock detected")

        monkeypatch.setattr(batches, "apply_batch", broken)
        await publish(master, *[sample(h, s, u) for h, u in hosts_ for s in (1, 2)])
        await drain(master, Ingestor(master))
        assert len(await stored(master)) == 4
        assert master.stats.failed == 1
        assert await master.bus.pending_count(protocol.AGENT_EVENTS_STREAM, GROUP) == 0

    async def test_messages_of_unknown_hosts_are_dropped_and_the_rest_stored(self, master: Master) -> None:
        _, hosts_ = await fleet(master, 1)
        host_id, uuids = hosts_[0]
        await publish(master, sample("h-forged", 1, uuids), sample(host_id, 1, uuids), heartbeat("h-forged", 2))
        await drain(master, Ingestor(master))
        assert await stored(master) == [(host_id, 1)]
        assert await master.bus.pending_count(protocol.AGENT_EVENTS_STREAM, GROUP) == 0


    async def test_records_of_both_decoders_mix_in_one_batch_each_stored_once(self, master: Master) -> None:
        """A record the fast decoder leaves to the full one (a newer agent's GPU field) is applied in the same batch,
        its field kept; heartbeats' spool statistics land from either; redeliveries of both kinds are duplicates."""
        _, hosts_ = await fleet(master, 2)
        (plain_host, plain_uuids), (newer_host, newer_uuids) = hosts_
        newer = sample(newer_host, 2, newer_uuids, extra={"nvlink_count": 4})
        beat = protocol.Heartbeat(host_id=plain_host, seq=3, ts=datetime.now(UTC), body=protocol.HeartbeatBody(
            uptime_s=5, spool=protocol.SpoolStats(pending=7)))
        payloads = [protocol.encode_bus_envelope("relay-t", m, datetime.now(UTC))
                    for m in (sample(plain_host, 1, plain_uuids), newer, beat)]
        assert [fastbus.decode_bus_report(p) is not None for p in payloads] == [True, False, True]
        await publish(master, sample(plain_host, 1, plain_uuids), newer, beat, newer, sample(plain_host, 1, plain_uuids))
        await drain(master, Ingestor(master))
        await publish(master, newer, sample(plain_host, 1, plain_uuids))  # redelivered in a later batch
        await drain(master, Ingestor(master))
        assert await stored(master) == sorted([(plain_host, 1), (newer_host, 2)])
        assert (master.stats.samples_stored, master.stats.samples_duplicate, master.stats.batches) == (2, 4, 2)
        assert 0 < master.stats.batch_seconds_max <= master.stats.batch_seconds  # the longer of the two batches
        async with master.db.session() as session:
            row = await session.scalar(select(TelemetrySample).where(TelemetrySample.host_id == newer_host))
            plain_row = await session.scalar(select(TelemetrySample).where(TelemetrySample.host_id == plain_host))
            plain = await session.get(Host, plain_host)
            other = await session.get(Host, newer_host)
        assert row is not None and [g["nvlink_count"] for g in row.gpus] == [4, 4]
        assert plain is not None and plain.spool_stats == {"pending": 7, "evicted": {}} and plain.last_seq == 3
        assert plain.latest_telemetry is not None and plain.latest_telemetry["seq"] == 1
        # The host's latest is the stored sample (on PostgreSQL copied by the server): its GPUs, its time as UTC ISO 8601.
        assert plain_row is not None and set(plain.latest_telemetry) == {"seq", "sampled_at", "gpus"}
        assert plain.latest_telemetry["gpus"] == plain_row.gpus
        assert datetime.fromisoformat(plain.latest_telemetry["sampled_at"]) == plain_row.sampled_at
        assert plain.latest_telemetry["sampled_at"].endswith("+00:00")
        assert other is not None and other.latest_telemetry is not None and other.latest_telemetry["gpus"] == row.gpus

    async def test_a_malformed_record_is_refused_and_acknowledged_the_rest_stored(self, master: Master) -> None:
        """Hostile records amid good ones (a GPU index out of bounds, a seq past 2**63, bytes that are no JSON) are
        counted as malformed and acknowledged; nothing fails, nothing is dead-lettered, the good samples are stored."""
        _, hosts_ = await fleet(master, 1)
        host_id, uuids = hosts_[0]
        good = protocol.encode_bus_envelope("relay-t", sample(host_id, 1, uuids), datetime.now(UTC))
        record = json.loads(good)
        record["message"]["body"]["gpus"][0]["index"] = 300
        bad_index = json.dumps(record).encode()
        record["message"]["body"]["gpus"][0]["index"], record["message"]["seq"] = 0, 1 << 63
        await master.bus.ensure_group(protocol.AGENT_EVENTS_STREAM, GROUP)
        for payload in (bad_index, good, json.dumps(record).encode(), b"\x80 not json"):
            await master.bus.publish(protocol.AGENT_EVENTS_STREAM, payload)
        await drain(master, Ingestor(master))
        assert await stored(master) == [(host_id, 1)]
        assert (master.stats.malformed, master.stats.failed, master.stats.dead_lettered) == (3, 0, 0)
        assert await master.bus.pending_count(protocol.AGENT_EVENTS_STREAM, GROUP) == 0


    @pytest.mark.parametrize("database_url", ["postgres"], indirect=True)  # column compression is PostgreSQL's
    async def test_samples_and_the_hosts_latest_are_compressed_with_lz4_on_postgresql(self, master: Master) -> None:
        """A batch's large JSON (16 GPUs: kilobytes, so stored compressed) is written with lz4, not pglz."""
        _, hosts_ = await fleet(master, 1, gpus=16)
        host_id, uuids = hosts_[0]
        await publish(master, sample(host_id, 1, uuids))
        await drain(master, Ingestor(master))
        async with master.db.session() as session:
            methods = (await session.execute(text(
                "SELECT pg_column_compression(t.gpus), pg_column_compression(h.latest_telemetry) "
                "FROM telemetry t JOIN hosts h ON h.id = t.host_id"
            ))).one()
        assert tuple(methods) == ("lz4", "lz4")


class TestImpossibleReadings:
    async def test_each_impossible_field_is_refused_and_counted_the_rest_kept(self, master: Master) -> None:
        """Negative memory, utilisation over 100 and NaN become null (not 0); the sample is kept."""
        _, hosts_ = await fleet(master, 1, gpus=1)
        host_id, uuids = hosts_[0]
        bad = sample(host_id, 1, uuids, util=150.0, extra={"memory_used_mib": -5, "temperature_c": math.nan, "fan_pct": 40.0},
                     aggregates=[{"uuid": uuids[0], "samples": 10, "gpu_util_avg": math.inf, "power_max_w": -1.0}])
        await publish(master, bad)
        await drain(master, Ingestor(master))
        async with master.db.session() as session:
            row = await session.scalar(select(TelemetrySample).where(TelemetrySample.host_id == host_id))
            host = await session.get(Host, host_id)
        assert row is not None and host is not None
        gpu = row.gpus[0]
        assert (gpu["gpu_util_pct"], gpu["memory_used_mib"], gpu["temperature_c"]) == (None, None, None)
        assert (gpu["fan_pct"], gpu["power_draw_w"]) == (40.0, 200.0)
        assert (row.aggregates[0]["gpu_util_avg"], row.aggregates[0]["power_max_w"]) == (None, None)
        refused = {"gpus.gpu_util_pct": 1, "gpus.memory_used_mib": 1, "gpus.temperature_c": 1,
                   "aggregates.gpu_util_avg": 1, "aggregates.power_max_w": 1}
        assert dict(master.stats.rejected_fields) == refused
        assert host.rejected_fields == refused

    async def test_impossible_readings_are_refused_the_same_on_the_fast_path(self, master: Master) -> None:
        """Without NaN the record takes the fast decoder, and its fields are refused column by column, counted alike."""
        _, hosts_ = await fleet(master, 2, gpus=2)
        (host_id, uuids), (other, other_uuids) = hosts_
        bad = sample(host_id, 1, uuids, util=150.0, extra={"memory_used_mib": -5},
                     aggregates=[{"uuid": uuids[0], "samples": 10, "power_max_w": -1.0}])
        assert fastbus.decode_bus_report(protocol.encode_bus_envelope("relay-t", bad, datetime.now(UTC))) is not None
        await publish(master, sample(other, 1, other_uuids), bad, sample(other, 2, other_uuids, util=100.0))
        await drain(master, Ingestor(master))
        async with master.db.session() as session:
            rows = {(r.host_id, r.seq): r for r in (await session.scalars(select(TelemetrySample))).all()}
            host = await session.get(Host, host_id)
            clean_host = await session.get(Host, other)
        assert [(g["gpu_util_pct"], g["memory_used_mib"], g["temperature_c"]) for g in rows[host_id, 1].gpus] == [(None, None, 60.0)] * 2
        assert rows[host_id, 1].aggregates[0]["power_max_w"] is None
        assert [g["gpu_util_pct"] for g in rows[other, 1].gpus + rows[other, 2].gpus] == [50.0, 50.0, 100.0, 100.0]
        refused = {"gpus.gpu_util_pct": 2, "gpus.memory_used_mib": 2, "aggregates.power_max_w": 1}
        assert dict(master.stats.rejected_fields) == refused
        assert host is not None and host.rejected_fields == refused
        assert clean_host is not None and clean_host.rejected_fields == {}

    def test_refuse_impossible_walks_only_the_columns_out_of_range(self) -> None:
        """Many samples at once: only the offending values become None, each counted under its own sample."""
        def gpu(util: float, temperature: float) -> fastbus.GpuSample:
            return fastbus.GpuSample(index=0, uuid="GPU-1", gpu_util_pct=util, temperature_c=temperature, pcie_gen_current=4)

        samples = [([gpu(10, 50), gpu(100, 150)], []), ([gpu(100.5, 60)], [fastbus.GpuAggregate(uuid="GPU-1", samples=1, gpu_util_max=-1)]),
                   ([gpu(0, -40)], [])]
        refused = store.refuse_impossible(samples)
        assert refused == {1: {"gpus.gpu_util_pct": 1, "aggregates.gpu_util_max": 1}}
        assert [[g.gpu_util_pct for g in gpus] for gpus, _ in samples] == [[10, 100], [None], [0]]
        assert samples[1][1][0].gpu_util_max is None and samples[0][0][1].temperature_c == 150

    async def test_a_sample_dated_far_in_the_future_is_refused_whole(self, master: Master) -> None:
        _, hosts_ = await fleet(master, 1, gpus=1)
        host_id, uuids = hosts_[0]
        ahead = datetime.now(UTC) + timedelta(seconds=master.settings.telemetry_max_future_s + 60)
        slightly = datetime.now(UTC) + timedelta(seconds=5)  # clock skew within bounds is fine
        await publish(master, sample(host_id, 1, uuids, at=ahead), sample(host_id, 2, uuids, at=slightly))
        await drain(master, Ingestor(master))
        assert await stored(master) == [(host_id, 2)]
        assert master.stats.samples_rejected == 1
        async with master.db.session() as session:
            host = await session.get(Host, host_id)
        assert host is not None and host.rejected_fields == {"sampled_at": 1}

    def test_clean_sample_keeps_every_plausible_value(self) -> None:
        gpus = [{"uuid": "GPU-1", "index": 0, "gpu_util_pct": 0, "memory_used_mib": 0, "temperature_c": -10.0,
                 "power_draw_w": 700.5, "pcie_gen_current": 5, "throttle_reasons": [], "future_field": 1.5}]
        clean = store.clean_sample(gpus, [])
        assert clean.gpus == gpus and not clean.rejected
        boundary = store.clean_sample([{"gpu_util_pct": 100.0, "mem_util_pct": 100.01, "pcie_gen_current": 0}], [])
        assert boundary.gpus[0]["gpu_util_pct"] == 100.0
        assert set(boundary.rejected) == {"gpus.mem_util_pct", "gpus.pcie_gen_current"}


async def _store(master: Master, host_id: str, seq: int, uuids: list[str], at: datetime, util: float, **kw: Any) -> None:
    async with master.db.session() as session:
        await hosts.handle_telemetry(session, envelope(sample(host_id, seq, uuids, at=at, util=util, **kw)), now=at)


async def _rollups(master: Master, resolution: int) -> dict[tuple[datetime, str], TelemetryRollup]:
    async with master.db.session() as session:
        rows = (await session.scalars(select(TelemetryRollup).where(TelemetryRollup.resolution == resolution))).all()
    return {(r.bucket_start, r.gpu_uuid): r for r in rows}


class TestRollups:
    async def test_samples_fold_into_minute_and_hour_buckets_exactly_once(self, master: Master) -> None:
        _, hosts_ = await fleet(master, 1, gpus=2)
        host_id, uuids = hosts_[0]
        for seq, (offset, util) in enumerate([(0, 10.0), (20, 20.0), (40, 30.0), (65, 70.0)], start=1):
            await _store(master, host_id, seq, uuids, T0 + timedelta(seconds=offset), util)
        assert await rollups.rollup(master) == 4
        assert await rollups.rollup(master) == 0  # nothing folds twice
        minute = await _rollups(master, store.MINUTE)
        first = minute[(T0, uuids[0])]
        assert (first.samples, first.util_sum / first.util_n, first.util_max) == (3, 20.0, 30.0)
        assert first.gpu_index == 0 and minute[(T0, uuids[1])].gpu_index == 1
        assert minute[(T0 + timedelta(minutes=1), uuids[0])].util_max == 70.0
        hour = (await _rollups(master, store.HOUR))[(T0, uuids[0])]
        assert (hour.samples, hour.util_sum / hour.util_n, hour.util_max) == (4, 32.5, 70.0)
        assert hour.temp_max == 60.0 and hour.mem_max == 1004

    async def test_a_late_sample_folds_into_its_existing_bucket(self, master: Master) -> None:
        _, hosts_ = await fleet(master, 1, gpus=1)
        host_id, uuids = hosts_[0]
        await _store(master, host_id, 1, uuids, T0, 10.0)
        await rollups.rollup(master)
        await _store(master, host_id, 2, uuids, T0 + timedelta(seconds=30), 50.0)  # spooled, arrives late
        await rollups.rollup(master)
        bucket = (await _rollups(master, store.MINUTE))[(T0, uuids[0])]
        assert (bucket.samples, bucket.util_sum / bucket.util_n, bucket.util_max) == (2, 30.0, 50.0)

    async def test_window_aggregates_weigh_by_their_sample_count(self, master: Master) -> None:
        """A report with aggregates over 10 samples counts 10 times the instant reading's weight."""
        _, hosts_ = await fleet(master, 1, gpus=1)
        host_id, uuids = hosts_[0]
        agg = [{"uuid": uuids[0], "samples": 10, "gpu_util_avg": 40.0, "gpu_util_max": 90.0, "power_avg_w": 300.0}]
        await _store(master, host_id, 1, uuids, T0, 100.0, aggregates=agg)
        await _store(master, host_id, 2, uuids, T0 + timedelta(seconds=10), 95.0)  # no aggregates: instant value
        await rollups.rollup(master)
        bucket = (await _rollups(master, store.MINUTE))[(T0, uuids[0])]
        assert bucket.util_n == 11 and bucket.util_sum == pytest.approx(40.0 * 10 + 95.0)
        assert bucket.util_max == 95.0  # the larger of the window's maximum (90) and the instant reading
        assert bucket.power_sum == pytest.approx(300.0 * 10 + 200.0)

    async def test_retention_expires_old_rows_but_never_unrolled_samples(self, master: Master) -> None:
        settings = master.settings
        _, hosts_ = await fleet(master, 1, gpus=1)
        host_id, uuids = hosts_[0]
        now = datetime.now(UTC)
        old = now - timedelta(hours=settings.raw_retention_hours + 1)
        await _store(master, host_id, 1, uuids, old, 10.0)
        await rollups.rollup(master)
        await _store(master, host_id, 2, uuids, old, 10.0)  # old but not rolled up yet
        await _store(master, host_id, 3, uuids, now, 10.0)
        deleted = await rollups.expire(master, now=now)
        assert deleted["raw"] == 1
        assert [s for _, s in await stored(master)] == [2, 3]
        await rollups.rollup(master)
        later = now + timedelta(days=settings.rollup_1m_retention_days)
        deleted = await rollups.expire(master, now=later)
        assert deleted["1m"] == 2 and deleted["1h"] == 0  # buckets of `old` and `now`
        assert deleted["raw"] == 2
        gone = await rollups.expire(master, now=now + timedelta(days=settings.rollup_1h_retention_days + 1))
        assert gone["1h"] == 2
        async with master.db.session() as session:
            assert await session.scalar(select(func.count()).select_from(TelemetryRollup)) == 0


class TestResolution:
    def test_auto_picks_by_span_and_a_bad_value_is_refused(self) -> None:
        now = T0
        assert store.pick_resolution(None, None, None, now) == "raw"
        assert store.pick_resolution("auto", now - timedelta(hours=2), None, now) == "raw"
        assert store.pick_resolution(None, now - timedelta(days=1), now, now) == "1m"
        assert store.pick_resolution(None, now - timedelta(days=20), None, now) == "1h"
        assert store.pick_resolution("1h", None, None, now) == "1h"
        with pytest.raises(BadRequest, match="resolution must be one of"):
            store.pick_resolution("5m", None, None, now)


@pytest.fixture
async def api(tmp_path: Path, database_url: str) -> AsyncIterator[tuple[Master, TestClient[Any, Any]]]:
    clock = ManualClock(T0 + timedelta(hours=1))
    master = await open_master(master_settings(tmp_path, database_url=database_url), bus=InProcessBus(), clock=clock)
    client = TestClient(TestServer(create_app(master, background=False)))
    await client.start_server()
    try:
        yield master, client
    finally:
        await client.close()
        await close_master(master)


class TestMetricsApi:
    async def test_series_at_each_resolution(self, api: tuple[Master, TestClient[Any, Any]]) -> None:
        master, client = api
        provider, key = await create_principal(master, "prov", "provider")
        host_id = await online_host(master, provider, [gpu_info(0)])
        detail = await client.get(f"/api/v1/hosts/{host_id}", headers={"Authorization": f"Bearer {key}"})
        uuid = (await detail.json())["gpus"][0]["uuid"]
        for seq in range(1, 7):  # one sample every 20 s over two minutes
            await _store(master, host_id, seq, [uuid], T0 + timedelta(seconds=20 * (seq - 1)), 10.0 * seq)
        await rollups.rollup(master)
        headers = {"Authorization": f"Bearer {key}"}
        raw = await (await client.get(f"/api/v1/hosts/{host_id}/metrics?resolution=raw", headers=headers)).json()
        assert raw["resolution"] == "raw" and [i["seq"] for i in raw["items"]] == [1, 2, 3, 4, 5, 6]
        minute = await (await client.get(f"/api/v1/hosts/{host_id}/metrics?resolution=1m", headers=headers)).json()
        assert [i["bucket_start"] for i in minute["items"]] == [T0.isoformat(), (T0 + timedelta(minutes=1)).isoformat()]
        first = minute["items"][0]["gpus"][0]
        assert (first["samples"], first["gpu_util_avg"], first["gpu_util_max"], first["uuid"]) == (3, 20.0, 30.0, uuid)
        newest = await (await client.get(f"/api/v1/hosts/{host_id}/metrics?resolution=1m&limit=1", headers=headers)).json()
        assert [i["bucket_start"] for i in newest["items"]] == [(T0 + timedelta(minutes=1)).isoformat()]
        since = (T0 - timedelta(days=1)).isoformat().replace("+00:00", "Z")
        auto = await (await client.get(f"/api/v1/hosts/{host_id}/metrics", params={"since": since}, headers=headers)).json()
        assert auto["resolution"] == "1m"
        hour = await (await client.get(f"/api/v1/hosts/{host_id}/metrics?resolution=1h", headers=headers)).json()
        assert hour["items"][0]["gpus"][0]["samples"] == 6
        bad = await client.get(f"/api/v1/hosts/{host_id}/metrics?resolution=weekly", headers=headers)
        assert bad.status == 400 and "resolution" in (await bad.json())["message"]
