"""Masters under fault: kill -9 of one while it ingests, and while it places rentals."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
import redis.asyncio as aioredis
from sqlalchemy import text

from shared import protocol
from shared.protocol import INGEST_GROUP as GROUP
from tests.faults.checks import check_allocations
from tests.faults.harness import BUS_PREFIX, Scenario

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

VICTIM = "master-1"
RENTALS = 10  # single GPUs, of the fleet's 16


async def pending_of(client: aioredis.Redis, consumer: str) -> int:
    rows = await client.xpending_range(BUS_PREFIX + protocol.AGENT_EVENTS_STREAM, GROUP, min="-", max="+", count=10_000,
                                       consumername=consumer)  # fmt: skip
    return len(rows)


async def consumer_idle_ms(client: aioredis.Redis, consumer: str) -> int | None:
    for row in await client.xinfo_consumers(BUS_PREFIX + protocol.AGENT_EVENTS_STREAM, GROUP):
        if row["name"] in (consumer, consumer.encode()):
            return int(row["idle"])
    return None


class TestMasterFaults:
    @pytest.mark.scenario("master_kill_ingesting", "kill -9 a master while it holds unacknowledged agent messages")
    @pytest.mark.timeout(120, func_only=True)
    async def test_the_other_master_takes_over_what_a_killed_one_was_ingesting(self, scenario: Scenario) -> None:
        """master-1 is killed while messages delivered to it are pending (read, not yet acknowledged): master-2 claims
        them once they are stale (5 s here) and applies them; every telemetry report is stored exactly once; the
        restarted master-1 consumes again under its own name."""
        cluster, report = scenario.cluster, scenario.report
        client = aioredis.Redis.from_url(scenario.bench.redis.url)
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # poll tightly: a batch is pending for milliseconds
                if await pending_of(client, VICTIM):
                    break
                await asyncio.sleep(0.002)
            cluster.expected_down.add(VICTIM)
            cluster.processes.kill(VICTIM)
            stranded = await pending_of(client, VICTIM)
            killed = report.inject(f"SIGKILL {VICTIM} mid-ingestion", pending_on_it=stranded)
            if not stranded:
                report.note(f"{VICTIM} had acknowledged its batch by the time it died (no message was left pending)")
            began = time.monotonic()

            async def taken_over() -> bool:
                return await pending_of(client, VICTIM) == 0

            await scenario.until(taken_over, f"{VICTIM}'s pending messages claimed by master-2", timeout=60)
            claimed_after = round(time.monotonic() - began, 1)
            took_over = "took over" in (cluster.processes.log_dir / "master-2.log").read_text()
            report.verify("takeover", {"stranded_messages": stranded, "claimed_within_s": claimed_after,
                                       "master-2_logged_takeover": took_over,
                                       "stale_message_idle_s": float(cluster.overrides["master"]["GPUMARKET_STALE_MESSAGE_IDLE"])})  # fmt: skip
            assert not stranded or took_over

            cluster.processes.restart(VICTIM)
            cluster.expected_down.discard(VICTIM)
            report.inject(f"restarted {VICTIM}")

            async def consuming() -> bool:
                status, _ = await cluster.call(scenario.http, "GET", "/health", None, master=0)
                idle = await consumer_idle_ms(client, VICTIM)
                return status == 200 and idle is not None and idle < 2000

            await scenario.until(consuming, f"{VICTIM} consuming again", timeout=60)
            report.verify("restarted_master", {"consumer": VICTIM, "consuming": True})
        finally:
            await client.aclose()
        await cluster.wait_healthy()
        await scenario.invariants(covered_after=killed)

    @pytest.mark.scenario("master_kill_placing", "kill -9 a master while both masters place rentals")
    @pytest.mark.timeout(150, func_only=True)
    async def test_rentals_placed_while_a_master_dies_are_whole_and_never_share_a_gpu(self, scenario: Scenario) -> None:
        """Ten one-GPU rentals are asked for at once, half of each master; master-1 is killed as its first answer
        arrives. The unanswered requests are sent again to master-2 with the same Idempotency-Key (a client's retry):
        each key gives exactly one rental, every rental runs (start commands master-1 committed but never sent are
        resent by master-2), no rental is half-allocated, no GPU is held twice; then all stop."""
        cluster, report = scenario.cluster, scenario.report
        keys = [f"fault-place-{uuid.uuid4()}" for _ in range(RENTALS)]
        to_victim = {key: i % 2 == 0 for i, key in enumerate(keys)}

        async def ask(key: str) -> tuple[int, Any]:
            return await scenario.rent(key=key, master=0 if to_victim[key] else 1)

        tasks = {key: asyncio.create_task(ask(key)) for key in keys}
        victim_tasks = {tasks[k] for k in keys if to_victim[k]}
        await asyncio.wait(victim_tasks, return_when=asyncio.FIRST_COMPLETED)
        cluster.expected_down.add(VICTIM)
        cluster.processes.kill(VICTIM)
        answered_before = sum(t.done() for t in victim_tasks)
        killed = report.inject(f"SIGKILL {VICTIM} as its first rental answer arrived", requests=RENTALS, to_victim=len(victim_tasks),
                      victim_answered_before=answered_before)  # fmt: skip
        results = dict(zip(keys, await asyncio.gather(*tasks.values()), strict=True))
        cut_off = [k for k, (status, _) in results.items() if status == 0]
        refused = {k: body for k, (status, body) in results.items() if status not in (0, 200, 201)}
        assert not refused, refused
        replayed = 0
        for key in cut_off:  # the client retries on the master that answers, with the same key
            status, body = await scenario.rent(key=key, master=1)
            assert status in (200, 201), (status, body)
            replayed += status == 200  # master-1 committed it before dying; the retry gets that rental back
            results[key] = (status, body)
        rental_ids = [body["id"] for _, body in results.values()]
        assert len(set(rental_ids)) == RENTALS
        report.verify("requests", {"answered": RENTALS - len(cut_off), "cut_off_by_the_kill": len(cut_off),
                                   "retried_and_already_committed": replayed})  # fmt: skip

        running = [await scenario.wait_rental(r, "running", timeout=60) for r in rental_ids]
        uuids = [u for r in running for u in r["gpu_uuids"]]
        assert len(uuids) == len(set(uuids)) == RENTALS, uuids
        async with cluster.database() as db, db.session() as session:
            per_key = (await session.execute(
                text("SELECT idempotency_key, count(*) FROM rentals WHERE idempotency_key = ANY(:keys) GROUP BY idempotency_key"),
                {"keys": keys},
            )).all()  # fmt: skip
        assert sorted(n for _, n in per_key) == [1] * RENTALS, per_key
        report.verify("rentals", {"created": RENTALS, "rentals_per_key": 1, "running": len(running),
                                  "distinct_gpus": len(set(uuids))})  # fmt: skip

        cluster.processes.restart(VICTIM)
        cluster.expected_down.discard(VICTIM)
        report.inject(f"restarted {VICTIM}")
        async with cluster.database() as db:
            report.verify("allocations_while_running", await check_allocations(db))
        stopped = await scenario.stop_all_rentals()
        report.verify("stopped", {"rentals": stopped})
        await cluster.wait_healthy()
        await scenario.invariants(covered_after=killed)
