"""Redis and PostgreSQL restarted under the running topology (the bench's own servers, never the machine's).

**What "nothing acknowledged is lost" means here.** Redis holds the bus. It runs as in production
(``deploy/compose.yaml``) with the append-only file on, and here ``appendfsync always``, so whatever
Redis acknowledged (a relay's XADD, after which the relay acks the agent; a master's XACK; Celery's
queue) is on disk and survives a SIGKILL: the scenario is about the services reconnecting and
retrying, not about Redis's durability knobs. What Redis did *not* acknowledge (a publish while it
was down) stays in the agent's spool and is replayed, or (a command) stays open in the database and is
resent. PostgreSQL is stopped with ``-m immediate`` (no checkpoint, crash recovery on start): a
committed transaction survives; a bus message whose transaction failed was not acknowledged on the
bus and is applied again.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
import redis.asyncio as aioredis
from sqlalchemy import text

from master.telemetry.ingest import DEAD_LETTERS_STREAM
from shared import protocol
from shared.protocol import INGEST_GROUP as GROUP
from tests.faults.harness import BUS_PREFIX, Scenario

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

DOWN_S = 3.0
PG_DOWN_S = 5.0  # longer than the offline threshold (3 s): a lagging ingestion must not pass for silent hosts
STREAM = BUS_PREFIX + protocol.AGENT_EVENTS_STREAM


def log_count(scenario: Scenario, names: list[str], needle: str) -> int:
    return sum((scenario.cluster.processes.log_dir / f"{n}.log").read_text(errors="replace").count(needle) for n in names)


async def bus_state(url: str) -> dict[str, object]:
    client = aioredis.Redis.from_url(url, socket_connect_timeout=5)
    try:
        last = cast("list[tuple[bytes, Any]]", await client.xrevrange(STREAM, count=1))
        groups = {g["name"].decode(): g for g in await client.xinfo_groups(STREAM)}
        return {"entries": await client.xlen(STREAM), "last_id": last[0][0].decode() if last else None,
                "last_delivered": groups[GROUP]["last-delivered-id"].decode(),
                "dead_letters": await client.xlen(BUS_PREFIX + DEAD_LETTERS_STREAM)}  # fmt: skip
    finally:
        await client.aclose()


async def entry_exists(url: str, entry_id: str) -> bool:
    client = aioredis.Redis.from_url(url, socket_connect_timeout=5)
    try:
        return bool(await client.xrange(STREAM, min=entry_id, max=entry_id))
    finally:
        await client.aclose()


async def offline_marks(scenario: Scenario, since: datetime) -> int:
    async with scenario.cluster.database() as db, db.session() as session:
        return int(await session.scalar(
            text("SELECT count(*) FROM host_events WHERE to_state = 'offline' AND at >= :since"), {"since": since}
        ) or 0)  # fmt: skip


class TestServerRestarts:
    @pytest.mark.scenario("redis_restart", "Redis (the bus, the registry, Celery's broker) killed and started again")
    @pytest.mark.timeout(150, func_only=True)
    async def test_every_service_reconnects_to_a_restarted_redis_and_nothing_acknowledged_is_lost(self, scenario: Scenario) -> None:
        """SIGKILL of Redis for 3 s while a rental runs; a rental asked for during the outage. Every entry and the
        consumer group survive; relays, masters, DNS and workers reconnect with back-off (none exits); agents replay
        what was not acknowledged; the command that could not be published is resent and the new rental runs;
        billing goes on; telemetry is stored exactly once with no gap."""
        bench, cluster, report = scenario.bench, scenario.cluster, scenario.report
        status, rental = await scenario.rent()
        assert status == 201, rental
        await scenario.wait_rental(rental["id"], "running")
        before = await bus_state(bench.redis.url)
        bench.redis.crash()
        down = report.inject("SIGKILL redis-server (appendonly yes, appendfsync always)", seconds=DOWN_S, bus_before=before)
        status, during = await scenario.rent(key=f"fault-redis-{uuid.uuid4()}")
        report.verify("rental_asked_during_outage", {"status": status, "state": during.get("state") if during else None})
        assert status == 201, during  # the rental is in the database; its start command waits for the bus
        await asyncio.sleep(max(0.0, DOWN_S - (datetime.now(UTC) - down).total_seconds()))
        bench.redis.start()
        up = report.inject("redis-server started again on the same port and files")

        after = await bus_state(bench.redis.url)
        assert before["last_id"] is None or await entry_exists(bench.redis.url, str(before["last_id"]))
        assert int(str(after["entries"])) >= int(str(before["entries"]))
        report.verify("bus_after_restart", {"entries_before": before["entries"], "entries_after": after["entries"],
                                            "last_entry_before_kept": True, "consumer_group_kept": True,
                                            "dead_letters": after["dead_letters"]})  # fmt: skip
        assert after["dead_letters"] == 0

        async def relays_back() -> bool:
            status, body = await scenario.call("GET", "/relays")
            return status == 200 and len(body["items"]) == 2

        await scenario.until(relays_back, "both relays registered again", timeout=60)
        await cluster.wait_healthy()
        await scenario.wait_rental(during["id"], "running", timeout=60)
        offline = await offline_marks(scenario, down)
        await scenario.wait_charged(rental["id"], after=up + timedelta(seconds=1))
        report.verify("reconnected", {
            "relays_registered": 2, "rental_asked_during_outage": "running", "billing_after_restart": True,
            "hosts_marked_offline_and_back": offline,  # unheard while no relay could publish: truly silent
            "processes_exited": [n for n in cluster.processes.running if not cluster.processes.alive(n)],
            "master_bus_retries_logged": log_count(scenario, cluster.master_names(), "bus unavailable"),
            "relay_bus_retries_logged": log_count(scenario, ["relay-eu-west", "relay-us-east"], "unavailable"),
            "worker_reconnects_logged": log_count(scenario, ["worker-beat", "worker-2"], "Trying to re-establish"),
        })  # fmt: skip
        await scenario.invariants(covered_after=up)
        await scenario.stop_all_rentals()

    @pytest.mark.scenario("postgres_restart", "PostgreSQL stopped (-m immediate) and started again")
    @pytest.mark.timeout(150, func_only=True)
    async def test_every_service_reconnects_to_a_restarted_postgres_and_unapplied_messages_are_retried(self, scenario: Scenario) -> None:
        """PostgreSQL crashes for 3 s while a rental runs: agent messages whose transaction failed stay pending on the
        bus and are applied afterwards (none dead-lettered), telemetry is stored exactly once with no gap; a rental
        asked for during the outage is refused, and the client's retry with the same Idempotency-Key gives one
        rental that runs; billing goes on once, and the masters and workers reconnect (none exits)."""
        bench, cluster, report = scenario.bench, scenario.cluster, scenario.report
        status, rental = await scenario.rent()
        assert status == 201, rental
        await scenario.wait_rental(rental["id"], "running")
        bench.pg.crash()
        down = report.inject("PostgreSQL stopped with pg_ctl -m immediate (no checkpoint)", seconds=PG_DOWN_S)
        key = f"fault-pg-{uuid.uuid4()}"
        status, refused = await scenario.rent(key=key)
        report.verify("rental_asked_during_outage", {"status": status, "code": (refused or {}).get("code")})
        # An outage to retry, not a bug: 503 database_unavailable (with Retry-After), never a 500.
        assert status == 503 and refused["code"] == "database_unavailable", (status, refused)
        await asyncio.sleep(max(0.0, PG_DOWN_S - (datetime.now(UTC) - down).total_seconds()))
        bench.pg.start()
        up = report.inject("PostgreSQL started again (crash recovery)")

        async def healthy(i: int) -> bool:
            status, _ = await cluster.call(scenario.http, "GET", "/health", None, master=i)
            return status == 200

        for i in range(cluster.masters):
            await scenario.until(lambda i=i: healthy(i), f"master-{i + 1} ready again", timeout=60)  # type: ignore[misc]
        status, retried = await scenario.rent(key=key)
        assert status == 201, retried
        await scenario.wait_rental(retried["id"], "running", timeout=60)
        await cluster.wait_healthy()
        await scenario.wait_charged(rental["id"], after=up + timedelta(seconds=1))
        state = await bus_state(bench.redis.url)
        assert state["dead_letters"] == 0
        # Silence is judged as of the oldest message not applied yet, so hosts that kept talking stay online.
        offline = await offline_marks(scenario, down)
        assert offline == 0, f"{offline} host(s) marked offline because the database was down"
        report.verify("reconnected", {
            "masters_ready": cluster.masters, "retried_rental": "running", "billing_after_restart": True,
            "dead_letters": state["dead_letters"], "hosts_marked_offline": offline,
            "processes_exited": [n for n in cluster.processes.running if not cluster.processes.alive(n)],
            "master_apply_failures_logged": log_count(scenario, cluster.master_names(), "stays pending for a retry"),
            "worker_task_failures_logged": log_count(scenario, ["worker-beat", "worker-2"], "raised unexpected"),
        })  # fmt: skip
        await scenario.invariants(covered_after=up)
        await scenario.stop_all_rentals()
