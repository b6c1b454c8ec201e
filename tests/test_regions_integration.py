"""Two relays in two regions, the geo DNS, the master and agents, every one its own OS process,
against the real PostgreSQL and Redis: agents find the relay of their own region through DNS,
and move to the other region's relay when theirs is drained."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from master.db import Database
from master.services.accounts.core import create_account
from tests.helpers import eventually
from tests.test_services_integration import Processes, _free_port, _json, _ok

pytestmark = pytest.mark.slow

ZONE = "relays.test"
REGIONS = {"eu": ("relay-eu", "eu-west", "127.0.0.2"), "us": ("relay-us", "us-east", "127.0.0.3")}


@pytest.fixture
def processes(tmp_path: Path) -> Any:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.kill_all()


class TestRegions:
    async def test_agents_use_their_regions_relay_and_move_when_it_drains(
        self, migrated_postgres_url: str, processes: Processes, tmp_path: Path, redis_url: str, bus_prefix: str
    ) -> None:
        """Each agent connects to its own region's relay via geo DNS; when that relay stops, the agent moves."""
        postgres_url = migrated_postgres_url  # put back only after `processes` has stopped every process
        http_port, dns_port = _free_port(), _free_port()
        common = {
            **os.environ, "GPUMARKET_REDIS_URL": redis_url, "GPUMARKET_BUS_PREFIX": bus_prefix,
            "GPUMARKET_HEARTBEAT_INTERVAL": "0.3", "GPUMARKET_TELEMETRY_INTERVAL": "0.3", "GPUMARKET_LOG_LEVEL": "INFO",
        }
        master_env = {
            **common, "GPUMARKET_DATA_DIR": str(tmp_path / "master"), "GPUMARKET_DATABASE_URL": postgres_url,
            "GPUMARKET_HTTP_PORT": str(http_port), "GPUMARKET_MISSED_HEARTBEATS_OFFLINE": "10",
        }
        provider_key, admin_key = await _create_accounts(postgres_url, "provider", "admin")
        processes.cli("admin", "issue-relay-cert", "--name", "localhost", "--name", "127.0.0.1", "--out", str(tmp_path / "relay"),
                      env=master_env)
        processes.start("master", "master", env=master_env)
        for relay_id, region, _ in REGIONS.values():
            processes.start(
                relay_id, "access", "--region", region, "--relay-id", relay_id,
                env={
                    **common, "GPUMARKET_PORT": str(_free_port()), "GPUMARKET_PUBLIC_HOST": "localhost",
                    "GPUMARKET_REGISTER_INTERVAL": "0.2",
                    "GPUMARKET_CERT_FILE": str(tmp_path / "relay" / "relay.crt"),
                    "GPUMARKET_KEY_FILE": str(tmp_path / "relay" / "relay.key"),
                    "GPUMARKET_CA_FILE": str(tmp_path / "relay" / "ca.crt"),
                },
            )
        processes.start(
            "dns", "dns", "--zone", ZONE, "--port", str(dns_port),
            env={
                **common, "GPUMARKET_REFRESH_INTERVAL": "0.2", "GPUMARKET_TTL": "1",
                "GPUMARKET_PREFIX_REGIONS": json.dumps({f"{src}/32": region for _, region, src in REGIONS.values()}),
                "GPUMARKET_REGION_DISTANCE": json.dumps({"eu-west:us-east": 80}),
            },
        )
        api = f"http://127.0.0.1:{http_port}/api/v1"
        try:
            async with aiohttp.ClientSession() as http:
                await eventually(lambda: _ok(http, f"{api}/health"), timeout=30, what="master healthy")

                async def both_relays() -> list[dict[str, Any]] | None:
                    status, body = await _json(http, "GET", f"{api}/relays", admin_key)
                    return body["items"] if status == 200 and len(body["items"]) == 2 else None

                relays = await eventually(both_relays, timeout=30, what="both relays registered")
                assert {r["region"] for r in relays} == {"eu-west", "us-east"}
                host_ids: dict[str, str] = {}
                for key, (_, _, source) in REGIONS.items():
                    status, token = await _json(http, "POST", f"{api}/enrollment-tokens", provider_key)
                    assert status == 201
                    env = {
                        **common, "GPUMARKET_DATA_DIR": str(tmp_path / f"agent-{key}"), "GPUMARKET_GPUS": "sim:1xRTX4090",
                        "GPUMARKET_ZONE": ZONE, "GPUMARKET_RESOLVER": "127.0.0.1", "GPUMARKET_RESOLVER_PORT": str(dns_port),
                        "GPUMARKET_RESOLVER_SOURCE": source, "GPUMARKET_NETWORK_INTERVAL": "0",
                        "GPUMARKET_RECONNECT_MAX_DELAY": "0.5",
                    }
                    out = processes.cli("agent", "enroll", "--master", f"http://127.0.0.1:{http_port}", "--token", token["token"], env=env)
                    host_ids[key] = out.split("enrolled as host ")[1].split(";")[0]
                    processes.start(f"agent-{key}", "agent", "run", env=env)

                async def relay_of(key: str, expected: str) -> bool:
                    status, host = await _json(http, "GET", f"{api}/hosts/{host_ids[key]}", admin_key)
                    return status == 200 and host["state"] == "online" and host["relay_id"] == expected

                for key, (relay_id, _, _) in REGIONS.items():
                    await eventually(functools.partial(relay_of, key, relay_id), timeout=30, what=f"agent-{key} on {relay_id}")

                # Drain the EU relay (SIGTERM): its agent must move to the US relay.
                assert processes.stop("relay-eu") == 0, processes.logs()
                await eventually(lambda: relay_of("eu", "relay-us"), timeout=30, what="agent-eu moved to relay-us")
                await eventually(lambda: _one_relay(http, api, admin_key), timeout=30, what="relay-eu gone from /relays")
                status, before = await _json(http, "GET", f"{api}/hosts/{host_ids['eu']}", admin_key)

                async def telemetry_continues() -> bool:
                    _, after = await _json(http, "GET", f"{api}/hosts/{host_ids['eu']}", admin_key)
                    return bool(after["latest_telemetry"]["seq"] > before["latest_telemetry"]["seq"])

                await eventually(telemetry_continues, timeout=30, what="telemetry through the new relay")
        except BaseException:
            print(processes.logs())
            raise
        for name in ("agent-eu", "agent-us", "relay-us", "dns", "master"):
            assert processes.stop(name) == 0, processes.logs()


async def _create_accounts(url: str, *roles: str) -> list[str]:
    """One account per role, written as `gpumarket admin create-account` writes it (the command itself is run in
    tests/test_services_integration.py and tests/test_migrate.py), in one transaction; their API keys."""
    db = Database(url)
    try:
        async with db.session() as session:
            return [(await create_account(session, f"{role}-1", role))[1] for role in roles]
    finally:
        await db.close()


async def _one_relay(http: aiohttp.ClientSession, api: str, key: str) -> bool:
    status, body = await _json(http, "GET", f"{api}/relays", key)
    return status == 200 and [r["relay_id"] for r in body["items"]] == ["relay-us"]
