"""The ingestion loop: consume agent events from the bus, apply them once, survive bad ones."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import Master
from master.db import Database
from master.models import Gpu, Host, TelemetrySample
from master.telemetry.ingest import DEAD_LETTERS_STREAM, Ingestor
from shared import protocol
from shared.bus import BusMessage
from shared.protocol import INGEST_GROUP as GROUP
from tests.factories import create_principal, enroll_host, gpu_info, hello, online_host, telemetry
from tests.helpers import eventually


async def _publish(master: Master, message: protocol.Hello | protocol.Telemetry) -> str:
    return await master.bus.publish(
        protocol.AGENT_EVENTS_STREAM, protocol.encode_bus_envelope("relay-i", message, datetime.now(UTC))
    )


async def _pending(master: Master) -> int:
    return await master.bus.pending_count(protocol.AGENT_EVENTS_STREAM, GROUP)


async def _ingest(master: Master, n: int) -> None:
    """Run an ingestor until it has processed ``n`` messages."""
    ingestor = Ingestor(master, block=0.05)
    task = asyncio.create_task(ingestor.run())
    try:
        await eventually(lambda: _done(ingestor, n), what=f"{n} messages processed")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class BrokenIngestor(Ingestor):
    """Fault injection at our own seam: applying any message fails, as during a database outage."""

    async def _apply_one(self, envelope: protocol.BusEnvelope) -> None:
        raise RuntimeError("database unavailable")


class FlakyIngestor(Ingestor):
    """Its first pass with messages fails with an error the bus did not raise (the database, mid-batch)."""

    failures = 1

    async def process(self, messages: list[BusMessage]) -> None:
        if messages and self.failures:
            self.failures -= 1
            raise ConnectionRefusedError("the database went away between the commit and the publish")
        await super().process(messages)


async def _true(value: bool) -> bool:
    return value


class TestIngestor:
    async def test_applies_and_acknowledges_agent_events(self, master: Master) -> None:
        """Hello and telemetry from the bus land in the database and leave nothing pending."""
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await enroll_host(master, provider)
        gpus = [gpu_info(0)]
        await _publish(master, hello(host_id, 0, gpus))
        await _publish(master, telemetry(host_id, 1, gpus))
        await _publish(master, telemetry(host_id, 1, gpus))  # a redelivery
        await _ingest(master, 3)
        assert await _pending(master) == 0
        async with master.db.session() as session:
            host = await session.get(Host, host_id)
            seqs = (await session.scalars(select(TelemetrySample.seq).where(TelemetrySample.host_id == host_id))).all()
        assert host is not None and host.state == "online"
        assert list(seqs) == [1]

    async def test_a_late_copy_through_an_old_relay_does_not_move_the_host_back(self, master: Master) -> None:
        """The host's relay (where its commands go) follows its newest message, not a stale one delivered late."""
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await enroll_host(master, provider)
        gpus = [gpu_info(0)]
        now = datetime.now(UTC)
        for relay_id, message in (("relay-new", hello(host_id, 5, gpus)), ("relay-new", telemetry(host_id, 6, gpus)),
                                  ("relay-old", telemetry(host_id, 4, gpus))):  # fmt: skip
            await master.bus.publish(protocol.AGENT_EVENTS_STREAM, protocol.encode_bus_envelope(relay_id, message, now))
        await _ingest(master, 3)
        async with master.db.session() as session:
            host = await session.get(Host, host_id)
            seqs = (await session.scalars(select(TelemetrySample.seq).where(TelemetrySample.host_id == host_id))).all()
        assert host is not None and host.relay_id == "relay-new" and host.last_seq == 6
        assert sorted(seqs) == [4, 6], "the late message is still stored"

    async def test_malformed_records_are_dropped_not_retried(self, master: Master) -> None:
        """A bus record that is not an envelope is logged and acknowledged."""
        await master.bus.ensure_group(protocol.AGENT_EVENTS_STREAM, GROUP)
        await master.bus.publish(protocol.AGENT_EVENTS_STREAM, b"not an envelope")
        ingestor = Ingestor(master)
        await ingestor.process(await master.bus.read(protocol.AGENT_EVENTS_STREAM, GROUP, "t", block=None))
        assert await _pending(master) == 0

    async def test_a_failing_message_stays_pending_then_goes_to_dead_letters(self, master: Master) -> None:
        """A message that cannot be applied is retried, and after max_deliveries parked in the dead-letter stream."""
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await enroll_host(master, provider)
        await master.bus.ensure_group(protocol.AGENT_EVENTS_STREAM, GROUP)
        await _publish(master, hello(host_id, 0, [gpu_info(0)]))
        broken = BrokenIngestor(master, max_deliveries=2, error_backoff=0)
        await broken.process(await master.bus.read(protocol.AGENT_EVENTS_STREAM, GROUP, "a", block=None))
        assert await _pending(master) == 1  # kept for a retry, not lost
        await broken.process(await master.bus.claim_stale(protocol.AGENT_EVENTS_STREAM, GROUP, "b", min_idle=0))
        assert await _pending(master) == 0
        assert (broken.failed, broken.dead_lettered) == (2, 1)
        assert await master.bus.stream_length(DEAD_LETTERS_STREAM) == 1

    async def test_messages_failing_while_the_database_is_down_are_never_dead_lettered(self, master: Master, tmp_path: Path) -> None:
        """Regression (tests/faults): during a database outage every message fails, and once one had been claimed
        max_deliveries times it was parked in the dead-letter stream: acknowledged messages lost. Now a message failing
        while the database does not answer stays pending however often it is delivered, and is applied once it is back."""
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await enroll_host(master, provider)
        await master.bus.ensure_group(protocol.AGENT_EVENTS_STREAM, GROUP)
        await _publish(master, hello(host_id, 0, [gpu_info(0)]))
        unreachable = Database(f"sqlite:///{tmp_path}/gone/gpumarket.db" if master.db.is_sqlite
                               else "postgresql://postgres@127.0.0.1:1/gpumarket")  # fmt: skip
        try:
            outage = Ingestor(dataclasses.replace(master, db=unreachable), max_deliveries=2, error_backoff=0)
            await outage.process(await master.bus.read(protocol.AGENT_EVENTS_STREAM, GROUP, "a", block=None))
            for consumer in ("b", "c", "d"):  # claimed again and again while the database is down
                await outage.process(await master.bus.claim_stale(protocol.AGENT_EVENTS_STREAM, GROUP, consumer, min_idle=0))
        finally:
            await unreachable.close()
        assert (outage.failed, outage.dead_lettered) == (4, 0)
        assert await _pending(master) == 1
        assert await master.bus.stream_length(DEAD_LETTERS_STREAM) == 0
        await Ingestor(master).process(await master.bus.claim_stale(protocol.AGENT_EVENTS_STREAM, GROUP, "e", min_idle=0))
        assert await _pending(master) == 0
        async with master.db.session() as session:
            host = await session.get(Host, host_id)
        assert host is not None and host.state == "online"

    async def test_the_loop_outlives_an_error_that_is_not_the_buss(self, master: Master) -> None:
        """Regression (tests/faults): an exception other than BusError escaping a pass (the database failing between a
        batch's commit and publishing its stop commands) ended the ingestion task, and that master ingested nothing more."""
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await enroll_host(master, provider)
        gpus = [gpu_info(0)]
        ingestor = FlakyIngestor(master, block=0.05)
        task = asyncio.create_task(ingestor.run())
        try:
            await _publish(master, hello(host_id, 0, gpus))
            await eventually(lambda: _true(ingestor.failures == 0), what="the pass that fails")
            await _publish(master, telemetry(host_id, 1, gpus))
            await eventually(lambda: _done(ingestor, 1), timeout=10, what="a later message applied")
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class TestSequenceJumps:
    async def test_a_message_numbered_absurdly_far_ahead_is_dropped_and_pins_nothing(self, master: Master) -> None:
        """Regression (issue 21): a hello with seq 2**62 became the host's newest for good, so every later real
        hello was ignored as stale (the inventory pinned) and its relay stuck. Such messages (hello, heartbeat,
        telemetry) are now dropped and counted; the agent's next ordinary messages are applied."""
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await enroll_host(master, provider)
        gpu0, gpu1 = gpu_info(0), gpu_info(1)
        absurd = 2**62
        heartbeat = protocol.Heartbeat(host_id=host_id, seq=absurd + 1, ts=datetime.now(UTC),
                                       body=protocol.HeartbeatBody(uptime_s=1.0))
        now = datetime.now(UTC)
        for relay_id, message in (
            ("relay-a", hello(host_id, 5, [gpu0])),
            ("relay-x", hello(host_id, absurd, [gpu0, gpu1])),
            ("relay-x", heartbeat),
            ("relay-x", telemetry(host_id, absurd + 2, [gpu0])),
            ("relay-a", hello(host_id, 6, [gpu0])),
            ("relay-a", telemetry(host_id, 7, [gpu0])),
        ):
            await master.bus.publish(protocol.AGENT_EVENTS_STREAM, protocol.encode_bus_envelope(relay_id, message, now))
        ingestor = Ingestor(master, block=0.05)
        task = asyncio.create_task(ingestor.run())
        try:
            async def settled() -> bool:
                return master.stats.seq_refused == 3 and master.stats.samples_stored == 1 and await _pending(master) == 0

            await eventually(settled, what="three messages refused, one sample stored, all acknowledged")
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        async with master.db.session() as session:
            host = await session.get(Host, host_id)
            seqs = (await session.scalars(select(TelemetrySample.seq).where(TelemetrySample.host_id == host_id))).all()
            uuids = (await session.scalars(select(Gpu.uuid).where(Gpu.host_id == host_id))).all()
        assert host is not None and (host.last_hello_seq, host.last_seq, host.relay_id) == (6, 7, "relay-a")
        assert list(seqs) == [7] and list(uuids) == [gpu0.uuid]

    def test_the_bound_lets_every_ordinary_jump_through(self) -> None:
        """A jump of exactly MAX_SEQ_JUMP past the newest (or past nothing yet) passes; one more is refused."""
        from shared.errors import SequenceJump

        protocol.check_seq(protocol.MAX_SEQ_JUMP, -1)
        protocol.check_seq(1000 + protocol.MAX_SEQ_JUMP, 1000)
        with pytest.raises(SequenceJump, match="more than"):
            protocol.check_seq(1001 + protocol.MAX_SEQ_JUMP, 1000)


class TestGpuIdentity:
    async def test_a_gpu_claimed_by_another_host_is_refused(self, master: Master) -> None:
        """A hello reporting a GPU UUID registered to another host does not move it or fail."""
        provider, _ = await create_principal(master, "p", "provider")
        shared_gpu = gpu_info(0)
        first = await online_host(master, provider, [shared_gpu])
        second = await online_host(master, provider, [shared_gpu, gpu_info(1)])
        async with master.db.session() as session:
            owners = await _owners(session)
        assert owners[shared_gpu.uuid] == first
        assert list(owners.values()).count(second) == 1


async def _owners(session: AsyncSession) -> dict[str, str]:
    return {uuid: host for uuid, host in (await session.execute(select(Gpu.uuid, Gpu.host_id))).all()}


async def _done(ingestor: Ingestor, n: int) -> bool:
    return ingestor.processed >= n
