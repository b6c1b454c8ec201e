"""`gpumarket master`, `gpumarket access` and `gpumarket agent` as separate OS processes,
against the real PostgreSQL and Redis: one telemetry message and one start/stop command
followed all the way through."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest
import redis.asyncio as aioredis

from gpumarket.cluster import ProcessGroup, free_port
from tests.helpers import eventually

pytestmark = pytest.mark.slow


# The process harness `gpumarket topology` uses; the fault tests use it too.
Processes = ProcessGroup
_free_port = free_port


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.kill_all()


async def _json(http: aiohttp.ClientSession, method: str, url: str, key: str | None = None, **kw: Any) -> tuple[int, Any]:
    headers = dict(kw.pop("headers", {}))
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        async with http.request(method, url, headers=headers, **kw) as response:
            return response.status, await response.json()
    except aiohttp.ClientConnectionError:
        return 0, None


async def top_up(http: aiohttp.ClientSession, api: str, admin_key: str, renter_key: str, amount: str = "1000.00") -> None:
    """Give the renter prepaid credit through the API, as an admin (a payment integration) would."""
    status, account = await _json(http, "GET", f"{api}/account", renter_key)
    assert status == 200, account
    body = {"account_id": account["id"], "amount": amount, "reference": "test-credit"}
    status, answer = await _json(http, "POST", f"{api}/account/credits", admin_key, json=body)
    assert status in (200, 201), answer


class TestSeparateProcesses:
    async def test_telemetry_and_commands_cross_every_process(
        self, processes: Processes, tmp_path: Path, postgres_url: str, redis_url: str, bus_prefix: str
    ) -> None:
        """Agent → access → Redis → master → PostgreSQL, and a start/stop command back, with every service its own process."""
        http_port, relay_port = _free_port(), _free_port()
        relay_url = f"wss://127.0.0.1:{relay_port}/v1/agent"
        common = {
            **os.environ,
            "GPUMARKET_REDIS_URL": redis_url,
            "GPUMARKET_BUS_PREFIX": bus_prefix,
            "GPUMARKET_HEARTBEAT_INTERVAL": "0.2",
            "GPUMARKET_TELEMETRY_INTERVAL": "0.2",
            "GPUMARKET_LOG_LEVEL": "INFO",
        }
        master_env = {
            **common,
            "GPUMARKET_DATA_DIR": str(tmp_path / "master"),
            "GPUMARKET_DATABASE_URL": postgres_url,
            "GPUMARKET_HTTP_PORT": str(http_port),
            "GPUMARKET_RELAY_URLS": json.dumps([relay_url]),
            "GPUMARKET_COMMAND_RETRY_INTERVAL": "1.0",
            "GPUMARKET_MISSED_HEARTBEATS_OFFLINE": "10",
        }
        provider_key = processes.cli("admin", "create-account", "--name", "prov", "--role", "provider", env=master_env).strip()
        renter_key = processes.cli("admin", "create-account", "--name", "rent", "--role", "renter", env=master_env).strip()
        admin_key = processes.cli("admin", "create-account", "--name", "ops", "--role", "admin", env=master_env).strip()
        processes.cli("admin", "issue-relay-cert", "--name", "127.0.0.1", "--name", "localhost", "--out", str(tmp_path / "relay"), env=master_env)
        processes.start("master", "master", env=master_env)
        processes.start(
            "access",
            "access",
            env={
                **common,
                "GPUMARKET_RELAY_ID": "relay-a",
                "GPUMARKET_PORT": str(relay_port),
                "GPUMARKET_CERT_FILE": str(tmp_path / "relay" / "relay.crt"),
                "GPUMARKET_KEY_FILE": str(tmp_path / "relay" / "relay.key"),
                "GPUMARKET_CA_FILE": str(tmp_path / "relay" / "ca.crt"),
            },
        )
        api = f"http://127.0.0.1:{http_port}/api/v1"
        try:
            async with aiohttp.ClientSession() as http:
                await eventually(lambda: _ok(http, f"{api}/health"), timeout=30, what="master healthy")
                status, token = await _json(http, "POST", f"{api}/enrollment-tokens", provider_key)
                assert status == 201, token
                agent_env = {**common, "GPUMARKET_DATA_DIR": str(tmp_path / "agent"), "GPUMARKET_GPUS": "sim:2xRTX4090"}
                out = processes.cli("agent", "enroll", "--master", f"http://127.0.0.1:{http_port}", "--token", token["token"], env=agent_env)
                host_id = out.split("enrolled as host ")[1].split(";")[0]
                processes.start("agent", "agent", "run", env=agent_env)

                # 1. One telemetry message, all the way to PostgreSQL.
                async def telemetry() -> dict[str, Any] | None:
                    status, host = await _json(http, "GET", f"{api}/hosts/{host_id}", renter_key)
                    return host if status == 200 and host["latest_telemetry"] else None

                host = await eventually(telemetry, timeout=30, what="telemetry through every process")
                seq = host["latest_telemetry"]["seq"]
                assert host["state"] == "online" and host["relay_id"] == "relay-a" and host["gpu_count"] == 2
                db = await asyncpg.connect(postgres_url)
                try:
                    row = await db.fetchrow("SELECT relay_id, gpus FROM telemetry WHERE host_id = $1 AND seq = $2", host_id, seq)
                finally:
                    await db.close()
                assert row is not None and row["relay_id"] == "relay-a"
                assert [g["uuid"] for g in json.loads(row["gpus"])] == [g["uuid"] for g in host["gpus"]]
                bus = aioredis.Redis.from_url(redis_url)
                try:
                    assert await bus.xlen(f"{bus_prefix}agent-events") > 0
                finally:
                    await bus.aclose()

                # 2. A start command and its confirmation, then a stop.
                await top_up(http, api, admin_key, renter_key)
                status, rental = await _json(http, "POST", f"{api}/rentals", renter_key, json={"gpu_count": 1, "gpu_model": "RTX 4090"})
                assert status == 201, rental

                async def rental_state(state: str) -> dict[str, Any] | None:
                    status, body = await _json(http, "GET", f"{api}/rentals/{rental['id']}", renter_key)
                    return body if status == 200 and body["state"] == state else None

                await eventually(lambda: rental_state("running"), timeout=30, what="rental running")
                status, _ = await _json(http, "DELETE", f"{api}/rentals/{rental['id']}", renter_key)
                assert status == 202
                stopped = await eventually(lambda: rental_state("stopped"), timeout=30, what="rental stopped")
                assert [e["to"] for e in stopped["events"]] == ["pending", "starting", "running", "stopping", "stopped"]
                db = await asyncpg.connect(postgres_url)
                try:
                    commands = await db.fetch("SELECT kind, state FROM commands WHERE rental_id = $1 ORDER BY created_at", rental["id"])
                finally:
                    await db.close()
                assert [(c["kind"], c["state"]) for c in commands] == [("start_workload", "succeeded"), ("stop_workload", "succeeded")]
        except BaseException:
            print(processes.logs())
            raise
        for name in ("agent", "access", "master"):
            assert processes.stop(name) == 0, processes.logs()


async def _ok(http: aiohttp.ClientSession, url: str) -> bool:
    status, _ = await _json(http, "GET", url)
    return status == 200
