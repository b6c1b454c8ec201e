"""The production topology as separate processes (`gpumarket topology`, `make cluster`) on the real
PostgreSQL and Redis: migration job, two masters, two relays in two regions behind the geo DNS,
Celery worker and beat, simulated agents; one rental followed end to end through all of them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gpumarket.cluster import REGIONS, Cluster, ClusterError, ProcessGroup
from master.db import head_revisions

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]


@pytest.fixture
async def cluster(tmp_path: Path, postgres_url: str, redis_url: str, bus_prefix: str) -> AsyncIterator[Cluster]:
    # A lost host's rentals fail 3 s after it went offline (not 120): the cluster check replaces a member within seconds.
    c = Cluster(tmp_path, database_url=postgres_url, redis_url=redis_url, bus_prefix=bus_prefix, agents=4,
                overrides={"master": {"GPUMARKET_RENTAL_GRACE_PERIOD": "3"}})
    try:
        await c.start()
        yield c
    except BaseException:
        print(c.processes.logs())
        raise
    finally:
        c.processes.kill_all()


class TestCluster:
    async def test_a_rental_goes_end_to_end_through_every_process(self, cluster: Cluster) -> None:
        """Every service is its own process; agents sit on their own region's relay; a rental made on one master
        runs, is charged by the Celery workers (the masters bill nothing) and stops; both masters agree; all stop cleanly."""
        procs = cluster.processes
        expected = {"master-1", "master-2", "relay-eu-west", "relay-us-east", "dns", "worker-beat", "worker-2",
                    *cluster.agent_names()}  # fmt: skip
        assert set(procs.running) == expected
        assert len({procs.running[name].process.pid for name in expected}) == len(expected)

        async with aiohttp.ClientSession() as http:
            for i in range(cluster.masters):
                status, body = await cluster.call(http, "GET", "/health", None, master=i)
                assert status == 200 and body["instance"] == f"master-{i + 1}", body
            status, hosts = await cluster.call(http, "GET", "/hosts", "admin", master=1)
            assert status == 200
            relay_of = {h["id"]: h["relay_id"] for h in hosts["items"]}
            for i, host_id in enumerate(cluster.host_ids):
                assert relay_of[host_id] == REGIONS[i % 2].relay_id
            assert {relay_of[h] for h in cluster.host_ids} == {r.relay_id for r in REGIONS}

        report = await cluster.check_rental()
        assert report["events"] == ["pending", "starting", "running", "stopping", "stopped"]
        assert Decimal(report["charged"]) > 0 and report["charged"] == report["credit_spent"]
        assert report["host_id"] in cluster.host_ids

        # The masters were told not to bill (billing_in_process=false): the workers' task log shows the ratings.
        assert "gpumarket.billing.rate" in (procs.log_dir / "worker-beat.log").read_text() + (
            procs.log_dir / "worker-2.log"
        ).read_text()
        killed = await _cluster_survives_a_killed_agent(cluster)
        codes = cluster.stop()
        assert codes == {name: (-9 if name == killed else 0) for name in expected}, procs.logs()

    async def test_masters_start_only_on_a_migrated_schema(self, tmp_path: Path, postgres_url: str, redis_url: str,
                                                           bus_prefix: str) -> None:  # fmt: skip
        """Without the migration job a master (migrate_on_start=false) exits at once saying to run `gpumarket migrate`;
        after it, the same command starts and serves."""
        c = Cluster(tmp_path, database_url=postgres_url, redis_url=redis_url, bus_prefix=bus_prefix)
        c.master_ports = [0]
        procs = c.processes
        procs.start("master-1", "master", env=c.master_env(0))
        assert procs.running["master-1"].process.wait(timeout=60) == 2
        assert "gpumarket migrate" in (procs.log_dir / "master-1.log").read_text()
        procs.cli("migrate", env=c.master_env())
        out = procs.cli("migrate", "--check", env=c.master_env())
        assert ", ".join(sorted(head_revisions())) in out


class TestProcessGroup:
    def test_a_failing_command_says_what_it_printed(self, tmp_path: Path) -> None:
        procs = ProcessGroup(tmp_path)
        with pytest.raises(ClusterError, match=r"(?s)exited 2.*invalid choice"):
            procs.cli("no-such-command", env={})

    def test_restart_reuses_the_command_and_refuses_a_live_process(self, tmp_path: Path) -> None:
        """kill -9 takes the whole process group; restart starts the same command again, never a second copy."""
        procs = ProcessGroup(tmp_path)
        env = {"GPUMARKET_REDIS_URL": "redis://127.0.0.1:6379/0", "PYTHONUNBUFFERED": "1"}
        first = procs.start("dns", "dns", "--port", "0", "--zone", "relays.test",
                            env=env)  # fmt: skip
        try:
            with pytest.raises(ClusterError, match="still running"):
                procs.restart("dns")
            while "listening on" not in (procs.log_dir / "dns.log").read_text() and procs.alive("dns"):
                time.sleep(0.1)
            procs.kill("dns")
            assert first.returncode == -9 and not procs.alive("dns")
            second = procs.restart("dns")
            assert second.pid != first.pid and second.args == first.args
            log = procs.log_dir / "dns.log"
            deadline = time.monotonic() + 30
            while log.read_text().count("listening on") < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert log.read_text().count("listening on") == 2, log.read_text()
            assert procs.stop("dns") == 0, "a started service stops cleanly on SIGTERM"
        finally:
            procs.kill_all()


async def _cluster_survives_a_killed_agent(cluster: Cluster) -> str:
    """A 2-node hold cluster (restart_policy replace) runs on two agents; one of them is killed (SIGKILL): the cluster
    is degraded and says why, its member fails as host lost, a replacement starts on another agent and the cluster
    runs again; then it is stopped. Returns the killed agent's name."""
    async with aiohttp.ClientSession() as http:
        status, created = await cluster.call(http, "POST", "/clusters", "renter", json={
            "node_count": 2, "gpus_per_node": 1, "allow_mixed": True, "restart_policy": "replace"}, headers={"Idempotency-Key": "kill-1"})  # fmt: skip
        assert status == 201, created
        cluster_id = created["id"]

        async def state(wanted: str, master: int = 1) -> dict[str, Any] | None:
            status, body = await cluster.call(http, "GET", f"/clusters/{cluster_id}", "renter", master=master)
            return body if status == 200 and body["state"] == wanted else None

        running = await cluster.until(lambda: state("running"), 60, "the cluster running")
        victim = running["members"][1]
        name = cluster.agent_names()[cluster.host_ids.index(victim["host_id"])]
        cluster.expected_down.add(name)
        cluster.processes.kill(name)
        degraded = await cluster.until(lambda: state("degraded", master=0), 60, "the cluster degraded")
        told = [e["cause"] for e in degraded["events"] if e["to"] == "degraded"]
        assert told and told[0].startswith(f"node 1 ({victim['rental_id']}): its host {victim['host_id']} went silent"), degraded["events"]

        def replacement(body: dict[str, Any]) -> dict[str, Any] | None:  # the members list keeps the replaced one
            return next((m for m in body["members"] if m["node_rank"] == 1 and m["rental_id"] != victim["rental_id"]), None)

        async def replaced() -> dict[str, Any] | None:
            body = await state("running")
            return body if body and replacement(body) else None

        again = await cluster.until(replaced, 60, "a replacement member running")
        new = replacement(again)
        assert new is not None and new["state"] == "running"
        assert new["host_id"] not in (victim["host_id"], again["members"][0]["host_id"])
        status, lost = await cluster.call(http, "GET", f"/rentals/{victim['rental_id']}", "renter")
        assert lost["state"] == "failed" and "lost" in lost["failure_reason"], lost
        status, _ = await cluster.call(http, "DELETE", f"/clusters/{cluster_id}", "renter")
        assert status == 202
        await cluster.until(lambda: state("stopped"), 60, "the cluster stopped")
    return name
