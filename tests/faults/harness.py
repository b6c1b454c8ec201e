"""The fault bench: the production topology on throwaway servers, with two links a scenario can break,
and the report each scenario writes.

``FaultCluster`` is ``gpumarket.cluster.Cluster`` (migration job, two masters, relays ``eu-west``
and ``us-east`` behind the geo DNS, Celery worker with beat and a second worker, four agents
finding their relay through the DNS) on its own PostgreSQL and its own Redis (``servers.py``),
plus:

* ``relay_bus``: a ``FaultProxy`` between ``relay-us-east`` and Redis, its only path to the
  masters (the bus) and to the relay registry: black-holing it partitions that relay from the
  masters;
* ``agent_link``: a ``FaultProxy`` between a fifth agent (``link_agent``, one RTX 4090, pinned to
  that URL: no DNS, no other relay to flee to) and ``relay-eu-west``: its network.

Settings are the cluster's short ones (heartbeats and telemetry every 1 s, a host offline after
3 missed heartbeats = 3 s, billing every 1 s), with ``rental_grace_period`` 60 s, stale bus
messages claimed after 2 s and unanswered commands resent after 3 s. The fail-over on a closed agent link
keeps its defaults (the relays' keepalive: a ping every 10 s, 10 s for its pong; the master's
``failover_after_s`` 20 s): the heartbeat backstop (3 s + 60 s) comes after it, as in production, so the
scenarios see the link fail rentals over.

``Scenario`` is one test's view: an HTTP session, the report, and helpers to rent and to check
the invariants (``checks.py``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import asyncpg
from sqlalchemy import text

from gpumarket.cluster import REGIONS, Cluster
from tests.faults import checks
from tests.faults.proxy import FaultProxy
from tests.faults.servers import PostgresServer, RedisServer

T = TypeVar("T")

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "faults"
BUS_PREFIX = "gmfaults:"
GRACE_S = 60.0  # the heartbeat backstop's grace: past the link's fail-over (at most 10 + 10 + 2 + 20 s)
OFFLINE_AFTER_S = 3.0  # the cluster's 3 missed heartbeats of 1 s
TELEMETRY_S = 1.0  # the cluster's telemetry_interval
ACTIVE = ("pending", "starting", "running", "stopping")


@dataclass
class FaultCluster:
    pg: PostgresServer
    redis: RedisServer
    cluster: Cluster
    relay_bus: FaultProxy
    agent_link: FaultProxy | None = None
    link_agent: str = ""
    wire: checks.Wire = field(init=False)
    agent_deaths: list[tuple[str, datetime]] = field(default_factory=list)
    """(host, when) a scenario killed a host's agent: the telemetry check excuses the gap around it."""

    def __post_init__(self) -> None:
        self.wire = checks.Wire(self.redis.url, BUS_PREFIX)

    @classmethod
    def create(cls, workdir: Path) -> FaultCluster:
        """Start the servers, the proxy in front of Redis, the cluster, then the proxied agent (synchronous: a fixture's work)."""
        pg, redis = PostgresServer(), RedisServer()
        relay_bus = FaultProxy("127.0.0.1", redis.port, name="relay-us-east-bus")
        cluster = Cluster(
            workdir, database_url=pg.url("gpumarket"), redis_url=redis.url, bus_prefix=BUS_PREFIX, agents=4,
            overrides={
                # stale messages claimed after 2 s (the cluster's 5, production's 30) keeps the takeovers short
                "master": {"GPUMARKET_RENTAL_GRACE_PERIOD": str(GRACE_S), "GPUMARKET_COMMAND_RETRY_INTERVAL": "3",
                           "GPUMARKET_STALE_MESSAGE_IDLE": "2"},
                # every agent here connects from 127.0.0.1: the per-source limit would count them all as one host
                "relay": {"GPUMARKET_MAX_CONNECTIONS_PER_SOURCE_PER_MINUTE": "600", "GPUMARKET_CONNECTION_BURST_PER_SOURCE": "100"},
            },
        )  # fmt: skip
        bench = cls(pg, redis, cluster, relay_bus)
        try:
            pg.start()
            redis.start()
            asyncio.run(_create_database(pg.admin_url, "gpumarket"))
            relay_bus.start()
            cluster.overrides[REGIONS[1].relay_id] = {"GPUMARKET_REDIS_URL": f"redis://127.0.0.1:{relay_bus.port}/0"}
            asyncio.run(cluster.start(timeout=180))
            bench.agent_link = FaultProxy("127.0.0.1", cluster.relay_ports[REGIONS[0].relay_id], name="agent-link")
            bench.agent_link.start()
            bench.link_agent = asyncio.run(cluster.add_agent(
                relay_url=f"wss://127.0.0.1:{bench.agent_link.port}/v1/agent", region=REGIONS[0], gpus="sim:1xRTX4090",
            ))  # fmt: skip
        except BaseException:
            bench.destroy()
            raise
        return bench

    def destroy(self) -> None:
        self.cluster.processes.kill_all()
        for proxy in (self.relay_bus, self.agent_link):
            if proxy is not None:
                proxy.close()
        self.redis.destroy()
        self.pg.destroy()

    def host_of(self, agent: str) -> str:
        return self.cluster.host_ids[self.cluster.agent_names().index(agent)]

    @property
    def dns_agents(self) -> list[str]:
        return [name for name in self.cluster.agent_names() if name != self.link_agent]

    async def restore(self) -> None:
        """Bring the bench back to health after whatever the last scenario left: servers up, links healed,
        every process running (restarted with its own command if it died)."""
        if self.redis.process is None or self.redis.process.poll() is not None:
            self.redis.start()
        if not (self.pg.root / "data" / "postmaster.pid").exists():
            self.pg.start()
        for proxy in (self.relay_bus, self.agent_link):
            if proxy is not None:
                proxy.heal()
        procs = self.cluster.processes
        for name in procs.running:
            if not procs.alive(name):
                procs.restart(name)
        self.cluster.expected_down.clear()
        await self.cluster.wait_healthy(timeout=90)


async def _create_database(admin_url: str, name: str) -> None:
    conn = await asyncpg.connect(admin_url, timeout=10)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


class Report:
    """What one scenario injected and verified, printed and written to ``test-artifacts/faults/<scenario>.json``."""

    def __init__(self, scenario: str, title: str) -> None:
        self.scenario = scenario
        self.began = time.monotonic()
        self.data: dict[str, Any] = {"scenario": scenario, "title": title, "started_at": _iso(datetime.now(UTC)),
                                     "injected": [], "verified": {}, "notes": []}  # fmt: skip

    def elapsed(self) -> float:
        return round(time.monotonic() - self.began, 2)

    def inject(self, what: str, **details: Any) -> datetime:
        """Record a fault as it is injected; returns when (UTC)."""
        at = datetime.now(UTC)
        self.data["injected"].append({"at_s": self.elapsed(), "at": _iso(at), "what": what, **details})
        return at

    def verify(self, what: str, figures: Any) -> None:
        self.data["verified"][what] = figures

    def note(self, text: str) -> None:
        self.data["notes"].append(text)

    def write(self, outcome: str) -> Path:
        self.data |= {"outcome": outcome, "runtime_s": self.elapsed()}
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{self.scenario}.json"
        path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        print(f"\n[fault scenario {self.scenario}: {outcome} in {self.data['runtime_s']} s]\n" + json.dumps(self.data, indent=2, default=str))
        return path


def _iso(at: datetime) -> str:
    return at.isoformat(timespec="milliseconds")


class Scenario:
    """One test's handle on the bench: the API, rentals, waits and the invariants."""

    def __init__(self, bench: FaultCluster, http: aiohttp.ClientSession, report: Report) -> None:
        self.bench = bench
        self.cluster = bench.cluster
        self.http = http
        self.report = report
        self.since = bench.wire.mark()

    async def call(self, method: str, path: str, role: str | None = "admin", *, master: int | None = None, **kw: Any) -> tuple[int, Any]:
        """An API call to ``master`` (default: the first one that answers, as a load balancer would)."""
        order = [master] if master is not None else list(range(self.cluster.masters))
        status, body = 0, None
        for i in order:
            if self.cluster.processes.alive(self.cluster.master_names()[i]):
                status, body = await self.cluster.call(self.http, method, path, role, master=i, **kw)
                if status:
                    return status, body
        return status, body

    async def until(self, check: Callable[[], Awaitable[T | None]], what: str, *, timeout: float = 60) -> T:
        return await self.cluster.until(check, timeout, what)

    async def host(self, host_id: str) -> dict[str, Any]:
        status, body = await self.call("GET", f"/hosts/{host_id}")
        assert status == 200, (status, body)
        return dict(body)

    async def hosts(self) -> dict[str, dict[str, Any]]:
        status, body = await self.call("GET", "/hosts?limit=500")
        assert status == 200, (status, body)
        return {h["id"]: h for h in body["items"]}

    async def offer(self, host_id: str) -> str:
        host = await self.host(host_id)
        return f"{host_id}:{host['gpus'][0]['name']}"

    async def rent(self, *, offer_id: str | None = None, restart_on_failure: bool = False, key: str | None = None,
                   master: int | None = None, workload: dict[str, Any] | None = None) -> tuple[int, Any]:  # fmt: skip
        body: dict[str, Any] = {"gpu_count": 1, "restart_on_failure": restart_on_failure}
        if workload is not None:
            body["workload"] = workload
        if offer_id is not None:
            body["offer_id"] = offer_id
        return await self.call("POST", "/rentals", "renter", master=master, json=body,
                               headers={"Idempotency-Key": key or str(uuid.uuid4())})  # fmt: skip

    async def rent_running_on(self, host_id: str, *, rated_after_s: float | None = None) -> dict[str, Any]:
        """A rental with ``restart_on_failure`` on ``host_id``'s offer, once it runs and the workers have rated it (up to
        ``rated_after_s`` past its start when given); returns its view as it runs."""
        status, rental = await self.rent(offer_id=await self.offer(host_id), restart_on_failure=True)
        assert status == 201, rental
        running = await self.wait_rental(rental["id"], "running")
        after = None if rated_after_s is None else datetime.fromisoformat(running["started_at"]) + timedelta(seconds=rated_after_s)
        await self.wait_charged(rental["id"], after=after)
        return running

    async def rental(self, rental_id: str) -> dict[str, Any]:
        status, body = await self.call("GET", f"/rentals/{rental_id}", "renter")
        assert status == 200, (status, body)
        return dict(body)

    async def wait_rental(self, rental_id: str, *states: str, timeout: float = 60) -> dict[str, Any]:
        async def reached() -> dict[str, Any] | None:
            status, body = await self.call("GET", f"/rentals/{rental_id}", "renter")
            return body if status == 200 and body["state"] in states else None

        return await self.until(reached, f"rental {rental_id} {' or '.join(states)}", timeout=timeout)

    async def wait_charged(self, rental_id: str, *, after: datetime | None = None, timeout: float = 60) -> None:
        """Until the workers have rated the rental (up to a time past ``after``)."""

        async def rated() -> bool:
            async with self.cluster.database() as db, db.session() as session:
                row = (await session.execute(text("SELECT rated_until FROM rentals WHERE id = :id"), {"id": rental_id})).one()
            return row[0] is not None and (after is None or row[0] > after)

        await self.until(rated, f"rental {rental_id} rated", timeout=timeout)

    async def stop_all_rentals(self, *, timeout: float = 60) -> int:
        """Stop every active rental and wait until none is left; returns how many were stopped."""
        status, body = await self.call("GET", "/rentals?limit=500", "renter")
        assert status == 200, (status, body)
        active = [r["id"] for r in body["items"] if r["state"] in ACTIVE]
        for rental_id in active:
            await self.call("DELETE", f"/rentals/{rental_id}", "renter")

        async def none_left() -> bool:
            status, body = await self.call("GET", "/rentals?limit=500", "renter")
            return status == 200 and not any(r["state"] in ACTIVE for r in body["items"])

        await self.until(none_left, "every rental ended", timeout=timeout)
        return len(active)

    async def invariants(self, *, covered_after: datetime, hosts: list[str] | None = None) -> None:
        """Telemetry exactly once with no gaps (through ``covered_after``), allocations, the ledger: into the report."""
        async with self.cluster.database() as db:
            self.report.verify("telemetry", await checks.check_telemetry(
                db, self.bench.wire, hosts=hosts or self.cluster.host_ids, since=self.since, covered_after=covered_after,
                interval=TELEMETRY_S, deaths=self.bench.agent_deaths,
            ))  # fmt: skip
            self.report.verify("allocations", await checks.check_allocations(db))
            self.report.verify("ledger", await checks.check_ledger(db))


def agent_log(bench: FaultCluster, name: str) -> str:
    return (bench.cluster.processes.log_dir / f"{name}.log").read_text(errors="replace")


def artifacts_logs(bench: FaultCluster, scenario: str) -> Path:
    """Copy every process's log tail next to the report (for a failed scenario)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{scenario}.logs.txt"
    path.write_text(bench.cluster.processes.logs(tail=20000))
    return path

