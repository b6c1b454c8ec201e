"""A Celery billing worker killed in the middle of a rating task.

To kill it *mid-task* rather than between tasks (a pass takes milliseconds), the test holds an
``EXCLUSIVE`` lock on ``ledger_transactions``: a rating task then stops at its first posting, inside
its transaction, with the rentals it rates locked. The task is one the test sends itself (no expiry;
beat's ticks expire after one period, and a late copy of one is dropped by design, since the next
tick does the same work), and beat is paused (SIGSTOP) meanwhile: a tick of its own would race the
test's task for the rentals, and the loser skips them (``SKIP LOCKED``) and posts nothing.

Two kills: the pool process running the task (SIGKILL: Celery's ``reject_on_worker_lost`` puts the
task back at once), and the whole worker, group and all (the task stays unacknowledged in Redis until
the visibility timeout, an hour, after which any worker restores it; the test moves that one message's
clock forward instead of waiting the hour, then restarts the worker).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

import asyncpg
import psutil  # type: ignore[import-untyped]
import pytest
import redis.asyncio as aioredis

from billing.celery_app import VISIBILITY_TIMEOUT_S, make_celery
from billing.tasks import task_name
from shared.settings import MasterSettings
from tests.faults.harness import BUS_PREFIX, Scenario

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

WORKERS = ("worker-beat", "worker-2")


def worker_logs(scenario: Scenario) -> dict[str, str]:
    return {name: (scenario.cluster.processes.log_dir / f"{name}.log").read_text(errors="replace") for name in WORKERS}


def send_rate_task(scenario: Scenario, tmp: Path) -> str:
    settings = MasterSettings.load(redis_url=scenario.bench.redis.url, database_url=scenario.cluster.database_url,
                                   bus_prefix=BUS_PREFIX, data_dir=tmp)  # fmt: skip
    app = make_celery(settings)
    try:
        return str(app.send_task(task_name("rate")).id)
    finally:
        app.close()


async def lock_ledger(scenario: Scenario) -> asyncpg.Connection:
    conn = await asyncpg.connect(scenario.bench.pg.url("gpumarket"), timeout=10)
    await conn.execute("BEGIN; LOCK TABLE ledger_transactions IN EXCLUSIVE MODE")
    return conn


async def blocked_in_task(scenario: Scenario, lock: asyncpg.Connection, task_id: str) -> tuple[str, psutil.Process] | None:
    """The worker that received ``task_id`` and its pool process, once that process waits on the lock inside the task.

    Any pool process of either worker is looked at (a pool process that replaced a killed one included): the one
    whose connection waits on ``ledger_transactions``; it counts once the worker that holds it logged the task."""
    logs = worker_logs(scenario)
    if not any(f"[{task_id}] received" in text for text in logs.values()):
        return None
    # Inside the lock's transaction pg_stat_activity is a snapshot taken at its first read: drop it, read afresh.
    await lock.execute("SELECT pg_stat_clear_snapshot()")
    waiting = {row["client_port"] for row in await lock.fetch(
        "SELECT client_port FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query ILIKE '%ledger_transactions%'"
    )}  # fmt: skip
    for name in WORKERS:
        main = psutil.Process(scenario.cluster.processes.running[name].process.pid)
        for child in main.children():
            try:
                connections = child.net_connections(kind="tcp")
            except psutil.NoSuchProcess:
                continue
            ports = {c.laddr.port for c in connections if c.raddr and c.raddr.port == scenario.bench.pg.port}
            if ports & waiting and f"[{task_id}] received" in logs[name]:
                return name, child
    return None


def beat_process(scenario: Scenario) -> psutil.Process:
    """The beat embedded in ``worker-beat``: of its child processes, the one that talks to Redis and not to
    PostgreSQL (the pool process runs the jobs on the database; the broker is the main process's)."""
    main = psutil.Process(scenario.cluster.processes.running["worker-beat"].process.pid)
    for child in main.children():
        peers = {c.raddr.port for c in child.net_connections(kind="tcp") if c.raddr}
        if scenario.bench.redis.port in peers and scenario.bench.pg.port not in peers:
            return child
    raise AssertionError("no child process of worker-beat looks like its beat")


_RECEIVED = re.compile(r"\[([0-9a-f-]{36})\] received")
_FINISHED = re.compile(r"\[([0-9a-f-]{36})\] (?:succeeded|raised|retry)|Discarding revoked task: [\w.]+\[([0-9a-f-]{36})\]")


async def workers_idle(scenario: Scenario) -> bool:
    """Whether every task either worker received has finished or was discarded: no tick of beat's still runs (one
    that ran into the test's ledger lock would hold the rentals, and the test's task would skip them and post nothing)."""
    logs = "".join(worker_logs(scenario).values())
    finished = {a or b for a, b in _FINISHED.findall(logs)}
    return set(_RECEIVED.findall(logs)) <= finished


def deliveries(scenario: Scenario, task_id: str) -> tuple[int, int]:
    """(times received, times succeeded) of ``task_id`` over both workers' logs."""
    logs = "".join(worker_logs(scenario).values())
    return logs.count(f"[{task_id}] received"), logs.count(f"[{task_id}] succeeded")


async def unacked_tag(client: aioredis.Redis, task_id: str) -> tuple[str, str] | None:
    """(delivery tag, index key) of ``task_id`` in kombu's unacknowledged-message hash, if it is there."""
    async for found in client.scan_iter(match=f"{BUS_PREFIX}celery:*unacked", count=1000):
        key = cast(bytes, found)
        for tag, raw in cast("dict[bytes, bytes]", await client.hgetall(key)).items():
            message = json.loads(raw)[0]
            if message.get("headers", {}).get("id") == task_id:
                return tag.decode(), key.decode() + "_index"
    return None


class TestBillingWorkerFaults:
    @pytest.mark.scenario("celery_worker_killed", "a Celery worker killed mid-task: its pool process, then a whole worker")
    @pytest.mark.timeout(150, func_only=True)
    async def test_a_rating_task_killed_midway_is_delivered_again_and_posts_nothing_twice(
        self, scenario: Scenario, tmp_path: Path
    ) -> None:
        """Two rentals run. A rating task blocked at its first posting loses its pool process to SIGKILL: the task is
        delivered again and succeeds once the lock goes. Another blocked one loses its whole worker: it waits in
        Redis's unacknowledged set, and (its visibility timeout moved forward) is restored and succeeds once the
        worker is back. Every rental is billed exactly once for its seconds and the trial balance holds."""
        cluster, report = scenario.cluster, scenario.report
        for _ in range(2):
            status, rental = await scenario.rent()
            assert status == 201, rental
            await scenario.wait_rental(rental["id"], "running")
            await scenario.wait_charged(rental["id"])
        # Beat's own rating ticks would race the test's task for the rentals (the loser skips them and posts nothing).
        beat = beat_process(scenario)
        beat.suspend()
        report.inject(f"beat paused (SIGSTOP, pid {beat.pid}) so that the test's tasks are the only rating passes")
        try:
            await asyncio.sleep(1.5)  # a tick beat sent and no worker received yet expires after one period (1 s)
            await scenario.until(lambda: workers_idle(scenario), "the workers done with beat's last ticks", timeout=30)
            await self._kill_the_pool_process(scenario, tmp_path)
            await self._kill_the_worker(scenario, tmp_path)
        finally:
            if beat.is_running():
                beat.resume()
        await cluster.wait_healthy()
        await scenario.invariants(covered_after=datetime.now(UTC))
        await scenario.stop_all_rentals()

    async def _blocked_task(self, scenario: Scenario, lock: asyncpg.Connection, tmp_path: Path) -> tuple[str, str, psutil.Process]:
        """Send a rating task with at least a second of usage to post, and wait until it waits to post it."""
        await asyncio.sleep(1.5)  # whole seconds are billed: a second accrues since the last pass
        task_id = await asyncio.to_thread(send_rate_task, scenario, tmp_path)
        holder, child = await scenario.until(lambda: blocked_in_task(scenario, lock, task_id), f"task {task_id} blocked mid-posting")
        return task_id, holder, child

    async def _kill_the_pool_process(self, scenario: Scenario, tmp_path: Path) -> None:
        report = scenario.report
        lock = await lock_ledger(scenario)
        try:
            task_id, holder, child = await self._blocked_task(scenario, lock, tmp_path)
            child.send_signal(signal.SIGKILL)
            report.inject(f"SIGKILL {holder}'s pool process (pid {child.pid}) while task {task_id} waits to post")
            await scenario.until(lambda: _received_again(scenario, task_id), f"task {task_id} delivered again", timeout=60)
        finally:
            await lock.close()  # the lock goes with its transaction
        report.inject("ledger lock released")
        await scenario.until(lambda: _succeeded(scenario, task_id), f"task {task_id} succeeded", timeout=60)
        received, succeeded = deliveries(scenario, task_id)
        report.verify("pool_process_killed", {"task": task_id, "worker": holder, "received": received, "succeeded": succeeded})
        assert succeeded == 1

    async def _kill_the_worker(self, scenario: Scenario, tmp_path: Path) -> None:
        cluster, report = scenario.cluster, scenario.report
        client = aioredis.Redis.from_url(scenario.bench.redis.url)
        try:
            lock = await lock_ledger(scenario)
            try:
                task_id, holder, _ = await self._blocked_task(scenario, lock, tmp_path)
                cluster.expected_down.add(holder)
                cluster.processes.kill(holder)
                report.inject(f"SIGKILL {holder} (the worker and its pool, process group) while task {task_id} waits to post")
                found = await unacked_tag(client, task_id)
                assert found is not None, f"task {task_id} is not among the unacknowledged messages"
                tag, index = found
            finally:
                await lock.close()
            report.inject("ledger lock released")
            # Instead of waiting VISIBILITY_TIMEOUT_S (an hour), date the delivery that far back.
            await client.zadd(index, {tag: time.time() - VISIBILITY_TIMEOUT_S - 1}, xx=True)
        finally:
            await client.aclose()
        report.inject(f"moved task {task_id}'s visibility timeout ({VISIBILITY_TIMEOUT_S} s) forward")
        cluster.processes.restart(holder)
        cluster.expected_down.discard(holder)
        report.inject(f"restarted {holder}")
        await scenario.until(lambda: _succeeded(scenario, task_id), f"task {task_id} restored and succeeded", timeout=90)
        received, succeeded = deliveries(scenario, task_id)
        report.verify("worker_killed", {"task": task_id, "worker": holder, "received": received, "succeeded": succeeded,
                                        "was_unacknowledged_in_redis": True})  # fmt: skip
        assert succeeded == 1


async def _received_again(scenario: Scenario, task_id: str) -> bool:
    return deliveries(scenario, task_id)[0] >= 2


async def _succeeded(scenario: Scenario, task_id: str) -> bool:
    return deliveries(scenario, task_id)[1] >= 1

