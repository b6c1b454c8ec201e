"""Host liveness: the heartbeat sweep on a controlled clock, ingestion-lag awareness, the grace
period for blips, stray workloads, and two masters sharing ingestion with one killed mid-batch."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from billing.rating import RatingPolicy, rate_open_rentals
from master.app import close_master, open_master
from master.background.heartbeats import ingested_until, sweep
from master.context import Master
from master.models import Command, Gpu, Host, LedgerTransaction, Rental, TelemetrySample
from master.services.accounts.core import Principal
from master.services.hosts import enrollment
from master.services.rentals import core as rentals
from master.services.rentals import lifecycle as rental_lifecycle
from master.services.rentals import request as rental_request
from master.telemetry import batch as batches
from master.telemetry import hosts
from master.telemetry.ingest import Ingestor
from shared import protocol
from shared.bus import BusMessage, InProcessBus, open_bus
from shared.protocol import INGEST_GROUP as GROUP
from tests.factories import command_result, create_principal, gpu_info, master_settings, online_host
from tests.helpers import ManualClock, eventually

# A day ahead of the real clock. The factories stamp hellos with the real time, which must be older than
# anything the tests' clock says. (A fixed date here broke these tests once the real date passed it.)
T0 = datetime.now(UTC).replace(microsecond=0) + timedelta(days=1)


class WallClock:
    """The bus's wall clock (publish times), moved by hand."""

    def __init__(self, at: datetime) -> None:
        self.at = at.timestamp()

    def __call__(self) -> float:
        return self.at


@pytest.fixture
async def world(tmp_path: Path, database_url: str) -> AsyncIterator[tuple[Master, ManualClock, WallClock]]:
    clock = ManualClock(T0)
    wall = WallClock(T0)
    master = await open_master(
        master_settings(tmp_path, database_url=database_url, heartbeat_interval=10.0, missed_heartbeats_offline=3,
                        rental_grace_period=120.0),
        bus=InProcessBus(wall_clock=wall), clock=clock,
    )
    try:
        yield master, clock, wall
    finally:
        await close_master(master)


def beat(host_id: str, seq: int, at: datetime, running: list[str] | None = None) -> protocol.BusEnvelope:
    message = protocol.Heartbeat(host_id=host_id, seq=seq, ts=at,
                                 body=protocol.HeartbeatBody(uptime_s=1, running_rentals=running or []))
    return protocol.BusEnvelope(relay_id="relay-t", received_at=at, message=message)


async def heard_at(master: Master, host_id: str, seq: int, at: datetime, running: list[str] | None = None) -> list[str]:
    async with master.db.session() as session:
        return await hosts.handle_heartbeat(session, beat(host_id, seq, at, running))


async def state(master: Master, host_id: str) -> str:
    async with master.db.session() as session:
        host = await session.get(Host, host_id)
    assert host is not None
    return host.state


async def running_rental(master: Master, provider: Principal, clock: ManualClock) -> tuple[str, Rental]:
    host_id = await online_host(master, provider, [gpu_info(0)])
    await heard_at(master, host_id, 1, clock.now())
    renter, _ = await create_principal(master, "renter", "renter")
    rental, _ = await rentals.create_rental(master, renter, rental_request.RentalRequest(gpu_count=1), idempotency_key=None)
    async with master.db.session() as session:
        start = await session.scalar(select(Command).where(Command.rental_id == rental.id))
        assert start is not None
        result = protocol.BusEnvelope(relay_id="relay-t", received_at=clock.now(), message=command_result(host_id, 2, start.id))
        await hosts.handle_command_result(session, result)
    async with master.db.session() as session:
        fresh = await session.get(Rental, rental.id)
    assert fresh is not None and fresh.state == "running"
    assert await state(master, host_id) == "rented"
    return host_id, fresh


class TestSweep:
    async def test_a_host_silent_for_three_heartbeats_goes_offline_not_before(self, world: tuple[Master, ManualClock, WallClock]) -> None:
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await online_host(master, provider, [gpu_info(0)])
        await heard_at(master, host_id, 1, clock.now())
        clock.advance(29.9)
        assert await sweep(master) == ([], [])
        assert await state(master, host_id) == "online"
        clock.advance(0.2)
        gone, _ = await sweep(master)
        assert gone == [host_id] and await state(master, host_id) == "offline"
        await heard_at(master, host_id, 2, clock.now())
        assert await state(master, host_id) == "online"

    async def test_a_lagging_ingestion_is_not_mistaken_for_silent_hosts(self, world: tuple[Master, ManualClock, WallClock]) -> None:
        """Silence is judged as of the oldest unprocessed message, so a backlog flaps no host offline."""
        master, clock, wall = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await online_host(master, provider, [gpu_info(0)])
        await heard_at(master, host_id, 1, clock.now())
        await master.bus.ensure_group(protocol.AGENT_EVENTS_STREAM, GROUP)
        clock.advance(10)
        wall.at = clock.now().timestamp()
        # The host's next heartbeat is on the bus, but the master has not got to it yet.
        await master.bus.publish(protocol.AGENT_EVENTS_STREAM, beat(host_id, 2, clock.now()).model_dump_json().encode())
        clock.advance(100)
        assert await ingested_until(master) == T0 + timedelta(seconds=10)
        assert await sweep(master) == ([], [])
        assert await state(master, host_id) == "online"
        batch = await master.bus.read(protocol.AGENT_EVENTS_STREAM, GROUP, "t", block=None)
        await Ingestor(master).process(batch)
        assert await ingested_until(master) == clock.now()
        gone, _ = await sweep(master)  # caught up: now the host really has been silent for 100 s
        assert gone == [host_id]


class TestGracePeriod:
    async def test_a_host_back_within_the_grace_period_resumes_its_rental(self, world: tuple[Master, ManualClock, WallClock]) -> None:
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id, rental = await running_rental(master, provider, clock)
        clock.advance(31)
        gone, lost = await sweep(master)
        assert gone == [host_id] and lost == []
        clock.advance(119)  # offline for 119 s of the 120 s grace period
        assert (await sweep(master))[1] == []
        await heard_at(master, host_id, 3, clock.now(), running=[rental.id])
        assert await state(master, host_id) == "rented"
        async with master.db.session() as session:
            fresh = await session.get(Rental, rental.id)
            stops = await session.scalar(select(func.count()).select_from(Command).where(Command.kind == "stop_workload"))
        assert fresh is not None and fresh.state == "running" and fresh.host_lost_at is None
        assert stops == 0

    async def test_the_renter_hears_at_once_that_the_host_went_silent_and_that_it_came_back(
        self, world: tuple[Master, ManualClock, WallClock]
    ) -> None:
        """An event on the rental when its host goes offline (not only at the grace period's end), and when it returns."""
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id, rental = await running_rental(master, provider, clock)
        last_heard = clock.now()
        clock.advance(31)
        await sweep(master)
        clock.advance(5)
        await heard_at(master, host_id, 3, clock.now(), running=[rental.id])
        async with master.db.session() as session:
            causes = [e.cause for e in await rentals.rental_events(session, rental.id)]
        assert any(c.startswith(f"host unreachable since {last_heard:%Y-%m-%dT%H:%M:%SZ}: not charged while it is") for c in causes), causes
        assert any(c.startswith("host reachable again") and "charging resumes" in c for c in causes), causes

    async def test_a_revoked_hosts_rental_is_credited_like_a_lost_hosts(self, world: tuple[Master, ManualClock, WallClock]) -> None:
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id, rental = await running_rental(master, provider, clock)
        admin, _ = await create_principal(master, "admin", "admin")
        clock.advance(60)
        await enrollment.revoke_host(master, admin, host_id)
        async with master.db.session() as session:
            fresh = await session.get(Rental, rental.id)
            assert fresh is not None and fresh.state == "failed" and fresh.host_lost_at is not None
            assert fresh.started_at is not None and fresh.stopped_at is not None
            served = int((fresh.stopped_at - fresh.started_at).total_seconds())
        await rate_open_rentals(master.db, now=clock.now() + timedelta(minutes=1), policy=RatingPolicy(min_period_s=served + 3600))
        async with master.db.session() as session:
            kinds = dict((await session.execute(
                select(LedgerTransaction.kind, func.count()).where(LedgerTransaction.rental_id == rental.id).group_by(LedgerTransaction.kind)
            )).all())
        assert kinds.get("minimum") == 1 and kinds.get("downtime_credit") == 1, kinds  # the unserved minimum given back

    async def test_past_the_grace_period_the_rental_fails_as_of_the_last_heartbeat(self, world: tuple[Master, ManualClock, WallClock]) -> None:
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id, rental = await running_rental(master, provider, clock)
        last_heard = clock.now()
        clock.advance(31)
        await sweep(master)
        clock.advance(120)
        _, lost = await sweep(master)
        assert lost == [rental.id]
        async with master.db.session() as session:
            fresh = await session.get(Rental, rental.id)
            allocated = await session.scalar(select(func.count()).select_from(Gpu).where(Gpu.rental_id.is_not(None)))
        assert fresh is not None and fresh.state == "failed"
        assert fresh.host_lost_at == last_heard and fresh.stopped_at == last_heard
        assert fresh.failure_reason is not None and "grace period" in fresh.failure_reason
        assert allocated == 0
        # The host returns still running the workload: it is told to stop it, once.
        commands = await heard_at(master, host_id, 3, clock.now(), running=[rental.id])
        again = await heard_at(master, host_id, 4, clock.now(), running=[rental.id])
        assert len(commands) == 1 and again == []
        assert await state(master, host_id) == "online"
        async with master.db.session() as session:
            stop = await session.get(Command, commands[0])
        assert stop is not None and (stop.kind, stop.args) == ("stop_workload", {"rental_id": rental.id})

    async def test_a_rental_that_asked_for_it_is_placed_again_on_another_host(
        self, world: tuple[Master, ManualClock, WallClock]
    ) -> None:
        """restart_on_failure: past the grace period the rental fails and a new one starts elsewhere, once."""
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await online_host(master, provider, [gpu_info(0)])
        await heard_at(master, host_id, 1, clock.now())
        renter, _ = await create_principal(master, "renter", "renter")
        request = rental_request.RentalRequest(gpu_count=1, workload={"kind": "hold"}, restart_on_failure=True)
        rental, _ = await rentals.create_rental(master, renter, request, idempotency_key="k1")
        spare = await online_host(master, provider, [gpu_info(0)])  # free now, and silent later
        clock.advance(31)
        await heard_at(master, spare, 1, clock.now())  # only the rented host goes silent
        await sweep(master)
        clock.advance(120)
        await heard_at(master, spare, 2, clock.now())
        _, lost = await sweep(master)
        assert lost == [rental.id]
        async with master.db.session() as session:
            again = (await session.scalars(select(Rental).where(Rental.replaces_id == rental.id))).all()
            events = await rentals.rental_events(session, rental.id)
        assert len(again) == 1 and again[0].host_id == spare and again[0].state == "starting"
        assert again[0].restart_on_failure and again[0].workload == {"kind": "hold"}
        assert events[-1].cause == f"placed again as rental {again[0].id} on host {spare}"
        assert await rental_lifecycle.replace_lost(master, rental.id) is not None  # a retry finds the same one
        async with master.db.session() as session:
            n = await session.scalar(select(func.count()).select_from(Rental).where(Rental.replaces_id == rental.id))
        assert n == 1

    async def test_a_rental_that_cannot_be_placed_again_says_why(self, world: tuple[Master, ManualClock, WallClock]) -> None:
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await online_host(master, provider, [gpu_info(0)])
        await heard_at(master, host_id, 1, clock.now())
        renter, _ = await create_principal(master, "renter", "renter")
        request = rental_request.RentalRequest(gpu_count=1, restart_on_failure=True)
        rental, _ = await rentals.create_rental(master, renter, request, idempotency_key=None)
        clock.advance(31)
        await sweep(master)
        clock.advance(120)
        await sweep(master)
        async with master.db.session() as session:
            events = await rentals.rental_events(session, rental.id)
        assert events[-1].cause.startswith("could not be placed again: no host has 1")

    async def test_a_workload_the_master_never_heard_of_is_stopped(self, world: tuple[Master, ManualClock, WallClock]) -> None:
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await online_host(master, provider, [gpu_info(0)])
        assert len(await heard_at(master, host_id, 1, clock.now(), running=["r-ghost"])) == 1

    async def test_a_reported_workload_that_cannot_be_a_rental_is_ignored(self, world: tuple[Master, ManualClock, WallClock]) -> None:
        """Regression: a name no rental id can have (typed StopWorkload refuses it) made the heartbeat raise and dead-letter."""
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await online_host(master, provider, [gpu_info(0)])
        assert await heard_at(master, host_id, 1, clock.now(), running=["-rf", "a:b", "r-ghost"]) != []
        async with master.db.session() as session:
            stops = (await session.scalars(select(Command).where(Command.kind == "stop_workload"))).all()
            host = await session.get(Host, host_id)
        assert [c.args for c in stops] == [{"rental_id": "r-ghost"}]
        assert host is not None and host.last_seen_at is not None  # the heartbeat itself was applied


    async def test_batched_heartbeats_stop_strays_too(self, world: tuple[Master, ManualClock, WallClock]) -> None:
        """The ingestor's batch path finds strays with one query and stops only those."""
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id, rental = await running_rental(master, provider, clock)
        other = await online_host(master, provider, [gpu_info(0)])
        await master.bus.ensure_group(protocol.AGENT_EVENTS_STREAM, GROUP)
        for envelope in (beat(host_id, 5, clock.now(), [rental.id]), beat(other, 5, clock.now(), ["r-ghost"])):
            await master.bus.publish(protocol.AGENT_EVENTS_STREAM, envelope.model_dump_json().encode())
        await Ingestor(master).process(await master.bus.read(protocol.AGENT_EVENTS_STREAM, GROUP, "t", block=None))
        async with master.db.session() as session:
            stops = (await session.scalars(select(Command).where(Command.kind == "stop_workload"))).all()
        assert [(c.host_id, c.args) for c in stops] == [(other, {"rental_id": "r-ghost"})]


class KilledMidBatch(Ingestor):
    """Dies (as far as anyone can tell) after its batch's rows are written, before the commit."""

    def __init__(self, master: Master, reached: asyncio.Event, **kwargs: Any) -> None:
        super().__init__(master, **kwargs)
        self.reached = reached

    async def _apply_batch(self, batch: list[tuple[BusMessage, batches.Report]]) -> bool:
        async with self.master.db.session() as session:
            await batches.apply_batch(session, [e for _, e in batch], now=self.master.clock.now(),
                                    max_future_s=300, stats=self.master.stats)
            await session.flush()
            self.reached.set()
            await asyncio.Event().wait()  # cancelled here: the transaction rolls back, nothing is acked
        raise AssertionError("unreachable")


class TestTwoMasters:
    @pytest.mark.postgres
    @pytest.mark.redis
    @pytest.mark.parametrize("read_ahead", [False, True], ids=["one-read", "read-ahead"])
    async def test_one_master_killed_mid_batch_loses_and_duplicates_nothing(
        self, tmp_path: Path, postgres_url: str, redis_url: str, bus_prefix: str, read_ahead: bool
    ) -> None:
        """Two masters share the stream; one dies holding a batch (and, reading ahead, maybe the next read too);
        the other takes both over."""
        masters = []
        for name in ("master-a", "master-b"):
            settings = master_settings(tmp_path / name, database_url=postgres_url, redis_url=redis_url,
                                       bus_prefix=bus_prefix, instance_id=name, stale_message_idle=0.3)
            masters.append(await open_master(settings, bus=await open_bus(redis_url, prefix=bus_prefix)))
        a, b = masters
        try:
            provider, _ = await create_principal(a, "p", "provider")
            fleet = [(await online_host(a, provider, [gpu_info(0)])) for _ in range(10)]
            await a.bus.ensure_group(protocol.AGENT_EVENTS_STREAM, GROUP)
            sent = [(h, seq) for seq in range(1, 31) for h in fleet]
            for host_id, seq in sent:
                message = protocol.Telemetry(
                    host_id=host_id, seq=seq, ts=datetime.now(UTC),
                    body=protocol.TelemetryBody(sampled_at=datetime.now(UTC), gpus=[protocol.GpuSampleModel(index=0, uuid="GPU-x")]),
                )
                await a.bus.publish(protocol.AGENT_EVENTS_STREAM, protocol.encode_bus_envelope("relay-t", message, datetime.now(UTC)))
            reached = asyncio.Event()
            doomed = asyncio.create_task(KilledMidBatch(a, reached, batch=100, block=0.05, read_ahead=read_ahead).run())
            await asyncio.wait_for(reached.wait(), 15)
            doomed.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await doomed
            left = await a.bus.backlog(protocol.AGENT_EVENTS_STREAM, GROUP)
            # What the dead master held, unacknowledged: its batch, and the read ahead if that had reached Redis.
            assert left.pending in ((100, 200) if read_ahead else (100,))
            survivor = Ingestor(b, batch=100, block=0.05, claim_every=0.1)
            task = asyncio.create_task(survivor.run())
            try:
                async def all_stored() -> bool:
                    async with b.db.session() as session:
                        n = await session.scalar(select(func.count()).select_from(TelemetrySample))
                    backlog = await b.bus.backlog(protocol.AGENT_EVENTS_STREAM, GROUP)
                    return n == len(sent) and backlog.pending == 0 and backlog.undelivered == 0

                await eventually(all_stored, timeout=30, what="every sample stored and acknowledged")
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            async with b.db.session() as session:
                rows = [tuple(r) for r in (await session.execute(select(TelemetrySample.host_id, TelemetrySample.seq))).all()]
            assert sorted(rows) == sorted(sent)  # each exactly once
        finally:
            for m in masters:
                await close_master(m)
