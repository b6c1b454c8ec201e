"""End to end through ``gpumarket up``: simulated agents → TLS relay → bus → master → REST."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiodocker
import aiohttp
import pytest
from sqlalchemy import select
from websockets.exceptions import ConnectionClosed

from access.relay import Relay
from agent.gpu import open_backend
from agent.runner import Agent
from agent.timings import AgentTimings
from gpumarket.up import Marketplace, start_marketplace
from master.models import TelemetrySample
from shared.crypto import server_ssl_context
from tests.factories import MS
from tests.helpers import eventually

TICK = 100 * MS  # heartbeat and telemetry interval in these tests
MISSED = 30  # beats before "offline" (3 s): the agents run on the test's own event loop, which a loaded 2-core CI
# machine stalls for longer than half a second (with 10 beats of 50 ms, every host was once judged offline mid-test)

STOP_WITHIN_S = 15  # Ctrl-C to exit: the relay drains for at most 5 s, the rest is quick


class Api:
    def __init__(self, http: aiohttp.ClientSession, base: str, key: str) -> None:
        self.http, self.base, self.headers = http, base, {"Authorization": f"Bearer {key}"}

    async def call(self, method: str, path: str, **kw: Any) -> tuple[int, Any]:
        headers = {**self.headers, **kw.pop("headers", {})}
        async with self.http.request(method, self.base + path, headers=headers, **kw) as response:
            return response.status, await response.json()

    async def get(self, path: str) -> Any:
        status, body = await self.call("GET", path)
        assert status == 200, body
        return body


# These tests poll the API with one key every 20 ms, past the default per-key rate limit;
# tests/test_rate_limits.py covers the limits and tests/test_console_browser.py runs `up` with them on.
NO_RATE_LIMITS = {"GPUMARKET_RATE_LIMITS_ENABLED": "false"}


@pytest.fixture
async def market(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Marketplace]:
    for name, value in NO_RATE_LIMITS.items():
        monkeypatch.setenv(name, value)
    m = await start_marketplace(
        tmp_path / "data", agents=3, http_port=0, relay_port=0, heartbeat_interval=TICK, telemetry_interval=TICK,
        missed_heartbeats_offline=MISSED,
    )
    try:
        yield m
    finally:
        await m.stop()


@pytest.fixture
async def renter(market: Marketplace) -> AsyncIterator[Api]:
    async with aiohttp.ClientSession() as http:
        yield Api(http, market.api_url, market.credentials["renter"]["api_key"])


async def _containers_of(rental_id: str) -> list[str]:
    """The ids of the engine's containers labelled with the rental (running or not)."""
    async with aiodocker.Docker() as docker:
        found = await docker.containers.list(all=True, filters={"label": [f"gpumarket.rental={rental_id}"]})
        return [container.id for container in found]


async def _hosts_online(api: Api, n: int) -> list[dict[str, Any]] | None:
    hosts = (await api.get("/hosts"))["items"]
    online = [h for h in hosts if h["state"] in ("online", "rented")]
    return online if len(online) == n else None


class TestEmbeddedMarketplace:
    async def test_credentials_file_is_private_and_complete(self, market: Marketplace, tmp_path: Path) -> None:
        """credentials.json is mode 0600 and holds the URLs and the three demo keys."""
        path = tmp_path / "data" / "credentials.json"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        creds = json.loads(path.read_text())
        assert creds["api_url"] == market.api_url and creds["console_url"] == market.console_url
        assert all(creds[role]["api_key"].startswith("gmk_") for role in ("renter", "provider", "admin"))

    async def test_the_data_dir_is_closed_to_other_users(self, market: Marketplace, tmp_path: Path) -> None:
        """The data dir is 0700 and nothing directly in it is open to group or others (rentals run as other uids)."""
        data_dir = tmp_path / "data"
        assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
        loose = [entry.name for entry in data_dir.iterdir() if stat.S_IMODE(entry.stat().st_mode) & 0o077]
        assert loose == []

    async def test_agents_register_and_their_telemetry_reaches_the_api(self, market: Marketplace, renter: Api) -> None:
        """Every simulated host comes online with its GPUs, and its latest telemetry shows through the API."""
        online = await eventually(lambda: _hosts_online(renter, 3), what="3 hosts online")
        names = {g["name"] for h in online for g in h["gpus"]}
        assert {"NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 3060", "NVIDIA A100-SXM4-80GB"} <= names

        async def telemetry_seen() -> dict[str, Any] | None:
            detail = await renter.get(f"/hosts/{online[0]['id']}")
            return detail if detail["latest_telemetry"] else None

        detail = await eventually(telemetry_seen, what="telemetry on the host")
        sample = detail["latest_telemetry"]["gpus"][0]
        assert sample["uuid"] == detail["gpus"][0]["uuid"] and sample["temperature_c"] is not None
        assert detail["relay_id"] == "relay-local"

    async def test_rent_runs_on_the_agent_and_stop_frees_the_gpus(self, market: Marketplace, renter: Api) -> None:
        """A rental becomes running when the agent confirms, its GPUs stay idle (a hold runs nothing), and stopping
        frees them."""
        await eventually(lambda: _hosts_online(renter, 3), what="hosts online")

        async def a100s_offered() -> tuple[int, int]:
            """The A100s offered whole, and the free MIG instances (DEMO_FLEET: 4 whole, the fifth in MIG mode)."""
            offers = (await renter.get("/offers?gpu_model=A100"))["items"]
            return sum(o["num_gpus"] for o in offers), sum(o["mig_instances_free"] for o in offers)

        before = await a100s_offered()
        assert before[0] == 4 and before[1] >= 1, before  # the MIG GPU is never offered whole
        status, rental = await renter.call("POST", "/rentals", json={"gpu_count": 2, "gpu_model": "A100 80GB"})
        assert status == 201, rental

        async def in_state(state: str) -> dict[str, Any] | None:
            body = await renter.get(f"/rentals/{rental['id']}")
            return body if body["state"] == state else None

        running = await eventually(lambda: in_state("running"), what="rental running")
        assert [e["to"] for e in running["events"]] == ["pending", "starting", "running"]
        agent = next(a for a in market.agents if a.host_id == rental["host_id"])
        assert agent.workloads.running() == [rental["id"]]

        async def idle_in_telemetry() -> bool:
            latest = (await renter.get(f"/hosts/{rental['host_id']}"))["latest_telemetry"] or {"gpus": []}
            util = {g["uuid"]: g["gpu_util_pct"] for g in latest["gpus"]}
            return all(u in util and util[u] <= 5 for u in rental["gpu_uuids"])

        await eventually(idle_in_telemetry, what="the held GPUs idle in telemetry")
        assert (await renter.get(f"/hosts/{rental['host_id']}"))["state"] == "rented"

        status, _ = await renter.call("DELETE", f"/rentals/{rental['id']}")
        assert status == 202
        await eventually(lambda: in_state("stopped"), what="rental stopped")
        assert agent.workloads.running() == []

        async def a100s_free() -> bool:
            return await a100s_offered() == before

        await eventually(a100s_free, what="the A100s offered as before the rental")

    async def test_shares_and_preemption_run_on_the_real_agents(self, market: Marketplace, renter: Api) -> None:
        """Two half-GPU shares run side by side on one agent's GPU; an on-demand rental preempts an interruptible one,
        whose workload the agent stops before starting the new one."""
        await eventually(lambda: _hosts_online(renter, 3), what="hosts online")
        provider = Api(renter.http, market.api_url, market.credentials["provider"]["api_key"])
        [rtx] = [h for h in (await provider.get("/hosts"))["items"] if h["gpu_count"] == 1]
        status, body = await provider.call("PUT", f"/hosts/{rtx['id']}/listing",
                                           json={"price_per_gpu_hour": "0.10", "smallest_unit": "milli:250"})  # fmt: skip
        assert status in (200, 201), body
        shares = [await renter.call("POST", "/rentals", json={"gpu_milli": 500, "gpu_model": "RTX 3060"}) for _ in range(2)]
        assert [status for status, _ in shares] == [201, 201], shares
        assert shares[0][1]["gpu_uuids"] == shares[1][1]["gpu_uuids"]

        async def in_state(rental_id: str, state: str) -> dict[str, Any] | None:
            body = await renter.get(f"/rentals/{rental_id}")
            return body if body["state"] == state else None

        for _, share in shares:
            await eventually(lambda share=share: in_state(share["id"], "running"), what="share running")  # type: ignore[misc]
        agent = next(a for a in market.agents if a.host_id == rtx["id"])
        assert sorted(agent.workloads.running()) == sorted(share["id"] for _, share in shares)

        status, cheap = await renter.call("POST", "/rentals", json={"gpu_count": 4, "gpu_model": "A100", "kind": "interruptible", "bid": "0.30"})
        assert status == 201, cheap
        await eventually(lambda: in_state(cheap["id"], "running"), what="interruptible running")
        status, urgent = await renter.call("POST", "/rentals", json={"gpu_count": 2, "gpu_model": "A100"})
        assert status == 201, urgent
        assert set(urgent["gpu_uuids"]) <= set(cheap["gpu_uuids"])
        await eventually(lambda: in_state(urgent["id"], "running"), what="on-demand rental running")
        preempted = await renter.get(f"/rentals/{cheap['id']}")  # ended by the start's confirmation, its agent having stopped it
        assert (preempted["state"], preempted["preempted_by"], preempted["preempting_by"]) == ("preempted", urgent["id"], None)
        a100 = next(a for a in market.agents if a.host_id == urgent["host_id"])
        assert a100.workloads.running() == [urgent["id"]]

    async def test_a_workloads_output_reaches_the_renter_and_its_exit_ends_the_rental(self, market: Marketplace, renter: Api) -> None:
        """A process workload's output is readable through the API, and exiting 0 completes the rental."""
        await eventually(lambda: _hosts_online(renter, 3), what="hosts online")
        script = (
            "import os; print('hello from', os.environ['GPUMARKET_RENTAL_ID']); print('uid', os.getuid()); "
            "print('gpus', os.environ['CUDA_VISIBLE_DEVICES'])"
        )
        # Run as root, up gives each rental a uid of its own, which cannot reach an interpreter under /root.
        python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
        workload = {"kind": "process", "argv": [python, "-c", script]}
        status, rental = await renter.call("POST", "/rentals", json={"gpu_count": 1, "gpu_model": "RTX 3060", "workload": workload})
        assert status == 201, rental

        async def finished() -> dict[str, Any] | None:
            body = await renter.get(f"/rentals/{rental['id']}")
            return body if body["state"] in ("stopped", "failed") else None

        done = await eventually(finished, what="the workload to finish")
        assert done["state"] == "stopped", done
        assert [e["to"] for e in done["events"]][-2:] == ["running", "stopped"]

        async def output() -> str | None:
            logs = await renter.get(f"/rentals/{rental['id']}/logs")
            text: str = logs["data"]
            return text if "gpus" in text else None

        text = await eventually(output, what="the workload's output through the API")
        assert f"hello from {rental['id']}" in text and f"gpus {rental['gpu_uuids'][0]}" in text
        if os.geteuid() == 0:  # up as root: the rental ran under a uid of its own
            assert "uid 0\n" not in text and market.agents[0].isolation.facts.process_isolation == "uid"

    async def test_a_container_rental_runs_its_image_and_stop_removes_its_container(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docker_image: str
    ) -> None:
        """Through the whole marketplace: a container workload runs its image as a non-root user with only its
        GPUs named, its output reaches the renter, and stopping the rental removes its container."""
        for name, value in NO_RATE_LIMITS.items():
            monkeypatch.setenv(name, value)
        market = await start_marketplace(tmp_path / "data", agents=1, http_port=0, relay_port=0, heartbeat_interval=TICK,
                                         telemetry_interval=TICK, missed_heartbeats_offline=MISSED)  # fmt: skip
        try:
            async with aiohttp.ClientSession() as http:
                renter = Api(http, market.api_url, market.credentials["renter"]["api_key"])
                hosts = await eventually(lambda: _hosts_online(renter, 1), what="the host online")
                assert "container" in hosts[0]["isolation"]["kinds"], hosts[0]["isolation"]
                script = 'echo "gpus=$NVIDIA_VISIBLE_DEVICES user=$(id -u)"; ls /workspace; sleep 600'
                workload = {"kind": "container", "image": docker_image, "command": ["sh", "-c", script]}
                status, rental = await renter.call("POST", "/rentals", json={"gpu_count": 1, "workload": workload})
                assert status == 201, rental

                async def output() -> str | None:
                    text: str = (await renter.get(f"/rentals/{rental['id']}/logs"))["data"]
                    return text if "gpus=" in text else None

                text = await eventually(output, what="the container's output through the API")
                assert f"gpus={rental['gpu_uuids'][0]} user=1000" in text
                assert (await renter.get(f"/rentals/{rental['id']}"))["state"] == "running"
                containers = await _containers_of(rental["id"])
                assert len(containers) == 1
                status, _ = await renter.call("DELETE", f"/rentals/{rental['id']}")
                assert status in (200, 202)

                async def removed() -> bool:
                    return not await _containers_of(rental["id"])

                await eventually(removed, what="the rental's container to be removed")
        finally:
            await market.stop()

    async def test_stored_telemetry_is_served_with_sequence_numbers(self, market: Marketplace, renter: Api) -> None:
        """GET /hosts/{id}/metrics returns stored samples, each with its seq and the window's aggregates."""
        online = await eventually(lambda: _hosts_online(renter, 3), what="hosts online")
        host_id = online[0]["id"]

        async def samples() -> list[dict[str, Any]] | None:
            items: list[dict[str, Any]] = (await renter.get(f"/hosts/{host_id}/metrics"))["items"]
            return items if len(items) >= 3 else None

        items = await eventually(samples, what="3 stored samples")
        seqs = [i["seq"] for i in items]
        assert len(set(seqs)) == len(seqs)
        assert all(i["aggregates"] and i["gpus"] for i in items)

    async def test_a_silent_host_goes_offline_and_returns_with_no_telemetry_lost(self, market: Marketplace, renter: Api) -> None:
        """Stopping an agent makes its host offline after missed heartbeats; restarted, it resumes its sequence."""
        await eventually(lambda: _hosts_online(renter, 3), what="hosts online")
        index, agent = 0, market.agents[0]
        market.agent_tasks[index].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await market.agent_tasks[index]

        async def host_state() -> str:
            state: str = (await renter.get(f"/hosts/{agent.host_id}"))["state"]
            return state

        await eventually(lambda: _is(host_state, "offline"), what="host offline")
        last_seq = agent.window.next_seq
        await agent.close()
        again = Agent(agent.state, open_backend("sim:2xRTX4090", seed=agent.host_id), relay_urls=[market.relay.url],
                      isolation=market.isolation, timings=AgentTimings(sample_interval=TICK, telemetry_interval=TICK, heartbeat_interval=TICK, network_interval=0))
        assert again.window.next_seq > last_seq  # the lease never hands out a used number
        market.agents[index] = again
        market.agent_tasks[index] = asyncio.create_task(again.run())
        await eventually(lambda: _is(host_state, "online"), what="host back online")

    async def test_messages_sent_while_the_relay_is_down_are_replayed_exactly_once(self, market: Marketplace, renter: Api) -> None:
        """With the relay gone the agents keep their messages; a new relay receives them and each is stored once."""
        await eventually(lambda: _hosts_online(renter, 3), what="hosts online")
        port = market.relay.port
        await market.relay.close()
        agent = market.agents[0]
        await eventually(lambda: _true(not agent.connected.is_set()), what="agent disconnected")
        # Messages keep being written to the spool while disconnected.
        await eventually(lambda: _true(len(agent.window) >= 5), what="telemetry spooled while disconnected")
        queued = {seq for seq, frame in agent.window.pending() if json.loads(frame)["type"] == "telemetry"}
        assert len(queued) >= 1
        data_dir = Path(market.master.settings.data_dir)
        relay = Relay(
            relay_id="relay-local", bus=market.master.bus, port=port,
            ssl_context=server_ssl_context(data_dir / "relay" / "server.crt", data_dir / "relay" / "server.key", market.master.ca.cert_path),
            heartbeat_interval=TICK, telemetry_interval=TICK,
        )
        await relay.start()
        market.relay = relay
        await eventually(lambda: _true(agent.connected.is_set() and len(agent.window) == 0), what="window drained")


        async def stored() -> list[int] | None:
            async with market.master.db.session() as session:
                seqs = list((await session.scalars(select(TelemetrySample.seq).where(TelemetrySample.host_id == agent.host_id))).all())
            return seqs if queued <= set(seqs) else None

        seqs = await eventually(stored, what="replayed telemetry stored")
        assert len(seqs) == len(set(seqs))


    async def test_renewal_retires_the_old_certificate_and_revocation_refuses_every_one(
        self, market: Marketplace, renter: Api, tmp_path: Path
    ) -> None:
        """Regression (issue 21): a certificate from before a renewal still connected, even after the host was
        revoked, and the agent was never told. Once the agent connects with its renewed certificate the old one is
        refused (4005) at the relay; revoking the host then refuses the new one too and stops the agent."""
        from shared.crypto import client_ssl_context, load_certificate
        from shared.errors import ConfigError
        from shared.protocol import CLOSE_REVOKED
        from tests.relayharness import connect_to_relay, read_welcome

        await eventually(lambda: _hosts_online(renter, 3), what="hosts online")
        index, agent = 0, market.agents[0]
        old_key, old_cert = tmp_path / "old.key", tmp_path / "old.crt"
        old_key.write_bytes(agent.state.key_file.read_bytes())
        old_cert.write_bytes(agent.state.cert_file.read_bytes())
        old_serial = format(load_certificate(old_cert.read_bytes()).serial_number, "040x")

        async def refused(key_file: Path, cert_file: Path) -> int | None:
            context = client_ssl_context(agent.state.ca_file, cert_file=cert_file, key_file=key_file)
            async with connect_to_relay(market.relay.url, context) as ws:
                try:
                    await read_welcome(ws)
                except ConnectionClosed as exc:
                    return exc.rcvd.code if exc.rcvd else None
            return None

        await agent.certificate.request_renewal()
        await eventually(lambda: _true(agent.state.cert_file.read_bytes() != old_cert.read_bytes()), what="renewed certificate installed")
        assert not await market.master.registry.is_revoked(old_serial)  # still the connection's certificate
        await market.relay.agents[agent.host_id].connection.close(1012, "test: reconnect")  # the agent reconnects with the new one
        await eventually(lambda: market.master.registry.is_revoked(old_serial), what="old certificate retired")
        assert await refused(old_key, old_cert) == CLOSE_REVOKED
        await eventually(lambda: _true(agent.connected.is_set()), what="agent connected with its new certificate")

        provider = Api(renter.http, market.api_url, market.credentials["provider"]["api_key"])
        status, body = await provider.call("POST", f"/hosts/{agent.host_id}/revoke")
        assert status == 200, body
        async with asyncio.timeout(10):
            with pytest.raises(ConfigError, match="revoked"):
                await market.agent_tasks[index]  # stopped, not retrying
        assert await refused(agent.state.key_file, agent.state.cert_file) == CLOSE_REVOKED
        assert await refused(old_key, old_cert) == CLOSE_REVOKED


async def _is(get: Any, value: str) -> bool:
    return bool(await get() == value)


async def _true(value: bool) -> bool:
    return value


class TestUpCommand:
    def _start(self, data_dir: Path) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "gpumarket.cli", "up", "--agents", "2", "--data-dir", str(data_dir),
             "--http-port", "0", "--relay-port", "0", "--log-level", "WARNING"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **NO_RATE_LIMITS, "PYTHONUNBUFFERED": "1"},
        )

    def _wait_ready(self, process: subprocess.Popen[str]) -> list[str]:
        lines: list[str] = []
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if "Press Ctrl-C" in line:
                return lines
        raise AssertionError(f"gpumarket up exited early ({process.wait()}):\n{''.join(lines)}")

    def _interrupt(self, process: subprocess.Popen[str], data_dir: Path) -> str:
        """SIGINT, then the output of a clean exit. Quiet, the stop takes about 0.3 s; the bound is the relay's drain
        (5 s) with room for a machine whose cores other test workers share (it once took over 5 s there)."""
        process.send_signal(signal.SIGINT)
        try:
            out, _ = process.communicate(timeout=STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate()
            log = (data_dir / "up.log").read_text(errors="replace")[-20_000:]  # a slow step logs every task's stack
            raise AssertionError(
                f"gpumarket up did not stop within {STOP_WITHIN_S} s of Ctrl-C; its output:\n{out}\nthe end of its log:\n{log}"
            ) from None
        assert process.returncode == 0, out
        return out

    async def test_ctrl_c_stops_cleanly_and_a_restart_resumes_hosts_and_accounts(self, tmp_path: Path) -> None:
        """`gpumarket up` serves the API, stops on SIGINT within seconds, and resumes the same hosts and keys."""
        data_dir = tmp_path / "up"
        first = self._start(data_dir)
        try:
            banner = "".join(await asyncio.to_thread(self._wait_ready, first))
            creds = json.loads((data_dir / "credentials.json").read_text())
            assert creds["console_url"] in banner and creds["api_url"] in banner
            workloads = next(line for line in banner.splitlines() if line.strip().startswith("workloads:"))
            assert "demo agents run" in workloads and "hold" in workloads  # one line: what runs, and why the rest does not
            async with aiohttp.ClientSession() as http:
                api = Api(http, creds["api_url"], creds["renter"]["api_key"])
                hosts = await eventually(lambda: _hosts_online(api, 2), what="2 hosts online")
                async with http.get(creds["console_url"]) as page:
                    assert page.status == 200 and "gpumarket" in await page.text()
            assert "stopped cleanly" in await asyncio.to_thread(self._interrupt, first, data_dir)
        finally:
            if first.poll() is None:
                first.kill()
        second = self._start(data_dir)
        try:
            await asyncio.to_thread(self._wait_ready, second)
            again = json.loads((data_dir / "credentials.json").read_text())
            assert again["renter"]["api_key"] == creds["renter"]["api_key"]
            async with aiohttp.ClientSession() as http:
                api = Api(http, again["api_url"], again["renter"]["api_key"])
                resumed = await eventually(lambda: _hosts_online(api, 2), what="same hosts online again")
            assert {h["id"] for h in resumed} == {h["id"] for h in hosts}
            await asyncio.to_thread(self._interrupt, second, data_dir)
        finally:
            if second.poll() is None:
                second.kill()
