"""The agent against real relays over TLS, with the bus observed directly (no master):
commands, failover, the spool across restarts, relays that misbehave, events, network, logs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import ssl
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Self

import pytest
from websockets.asyncio.server import ServerConnection, serve

from access.relay import Relay
from agent.gpu.sim import SimulatedBackend
from agent.runner import Agent
from agent.runtimes.isolation import HostIsolation, ProcessIsolation, isolation_facts
from agent.state import AgentState
from shared import protocol
from shared.bus import InProcessBus
from shared.crypto import (
    CertificateAuthority,
    server_ssl_context,
)
from tests.agents import FAST, RecordingStore, enrolled_state, fast_timings
from tests.helpers import eventually

HOST = "h-runner-test"
UNISOLATED = HostIsolation(isolation_facts(ProcessIsolation("none", "the tests' choice"), container_engine=None, allow_unisolated=True))


class Harness:
    """A CA, relays on one in-process bus, and an enrolled agent state; observes the bus."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ca = CertificateAuthority.load_or_create(tmp / "ca")
        self.key_file, self.cert_file = self.ca.write_server_certificate(tmp / "relay", ["127.0.0.1", "localhost"])
        self.bus = InProcessBus()
        self.relays: list[Relay] = []
        self.state = self._enroll(tmp / "agent")
        self._seen: list[protocol.BusEnvelope] = []

    def _enroll(self, folder: Path) -> AgentState:
        return enrolled_state(self.ca, folder, HOST)

    def server_context(self) -> ssl.SSLContext:
        return server_ssl_context(self.cert_file, self.key_file, self.ca.cert_path)

    async def relay(self, relay_id: str, port: int = 0, **limits: Any) -> Relay:
        relay = Relay(relay_id=relay_id, bus=self.bus, ssl_context=self.server_context(), port=port,
                      heartbeat_interval=FAST.heartbeat_interval, telemetry_interval=FAST.telemetry_interval, **limits)
        await relay.start()
        self.relays.append(relay)
        return relay

    def agent(self, urls: list[str], backend: SimulatedBackend | None = None, **kw: Any) -> Agent:
        backend = backend or SimulatedBackend("sim:2xRTX4090", seed=HOST)
        kw.setdefault("isolation", UNISOLATED)  # these tests are about commands and exits (isolation: test_process_isolation.py)
        return Agent(self.state, backend, relay_urls=urls, timings=fast_timings(), rng=random.Random(7), **kw)

    async def events(self) -> list[protocol.BusEnvelope]:
        """Everything agents put on the bus so far (accumulated across calls)."""
        await self.bus.ensure_group(protocol.AGENT_EVENTS_STREAM, "observer")
        batch = await self.bus.read(protocol.AGENT_EVENTS_STREAM, "observer", "t", count=10_000, block=None)
        self._seen.extend(protocol.decode_bus_envelope(m.payload) for m in batch)
        return self._seen

    async def of_type(self, kind: type[Any]) -> list[Any]:
        return [e.message for e in await self.events() if isinstance(e.message, kind)]

    async def command(self, relay: Relay, command_id: str, kind: str, args: dict[str, Any]) -> None:
        delivery = protocol.CommandDelivery(
            host_id=HOST, command=protocol.Command(body=protocol.CommandBody(command_id=command_id, kind=kind, args=args))
        )
        await self.bus.publish(protocol.commands_stream(relay.relay_id), delivery.model_dump_json().encode())

    async def result(self, command_id: str) -> protocol.CommandResultBody:
        async def find() -> protocol.CommandResultBody | None:
            found = [m.body for m in await self.of_type(protocol.CommandResult) if m.body.command_id == command_id]
            return found[0] if found else None

        return await eventually(find, what=f"result of {command_id}")

    async def outage(self, agent: Agent, relay: Relay, *, backlog: int, what: str) -> None:
        """Once ``agent`` is connected, close ``relay`` and wait until ``backlog`` messages are spooled."""
        await eventually(lambda: _true(agent.connected.is_set()), what="connected")
        await relay.close()
        await eventually(lambda: _true(len(agent.window) >= backlog), what=what)

    async def close(self) -> None:
        """Close every relay started, then the bus."""
        for relay in self.relays:
            await relay.close()
        await self.bus.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    async with Harness(tmp_path) as h:
        yield h


@contextlib.asynccontextmanager
async def running(agent: Agent) -> AsyncIterator[Agent]:
    task = asyncio.create_task(agent.run())
    try:
        yield agent
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await agent.close()


async def _true(value: bool) -> bool:
    return value


class TestCommands:
    async def test_unknown_kinds_and_missing_fields_get_failed_results(self, harness: Harness) -> None:
        """A command the agent does not know, or one missing a field, is answered with a failed result and a reason."""
        relay = await harness.relay("relay-a")
        async with running(harness.agent([relay.url])) as agent:
            await agent.connected.wait()
            await harness.command(relay, "cmd-unknown", "reformat_disk", {})
            await harness.command(relay, "cmd-missing", "start_workload", {"gpu_uuids": []})
            unknown = await harness.result("cmd-unknown")
            missing = await harness.result("cmd-missing")
        assert not unknown.ok and "unknown command kind 'reformat_disk'" in unknown.detail and "start_workload" in unknown.detail
        assert not missing.ok and "rental_id" in missing.detail

    async def test_a_start_for_gpus_this_host_lacks_is_refused(self, harness: Harness) -> None:
        """Starting a workload on a GPU UUID the host does not have fails and starts nothing."""
        relay = await harness.relay("relay-a")
        async with running(harness.agent([relay.url])) as agent:
            await agent.connected.wait()
            await harness.command(relay, "cmd-1", "start_workload", {"rental_id": "r-1", "gpu_uuids": ["GPU-not-here"]})
            result = await harness.result("cmd-1")
            assert not result.ok and "GPU-not-here" in result.detail
            assert agent.workloads.running() == []

    async def test_an_agent_that_cannot_isolate_refuses_process_and_says_so_in_its_hello(self, harness: Harness) -> None:
        """With no uid isolation and no opt-out a process start fails with workload_not_isolated; the hello says why."""
        relay = await harness.relay("relay-a")
        uuid = SimulatedBackend("sim:2xRTX4090", seed=HOST).gpus()[0].uuid
        start = {"rental_id": "r-p", "gpu_uuids": [uuid], "workload": {"kind": "process", "argv": ["/bin/true"]}}
        async with running(harness.agent([relay.url], isolation=None)) as agent:
            await agent.connected.wait()
            await harness.command(relay, "cmd-p", "start_workload", start)
            result = await harness.result("cmd-p")
            assert agent.workloads.running() == []
        assert not result.ok and result.data == {"code": "workload_not_isolated"} and "process workloads are refused" in result.detail
        (hello, *_) = await harness.of_type(protocol.Hello)
        assert hello.body.isolation is not None and hello.body.isolation.kinds == ["hold"] and hello.body.isolation.reason

    async def test_a_repeated_command_id_is_not_run_twice(self, harness: Harness) -> None:
        """The second delivery of a command id returns the first result without executing again."""
        relay = await harness.relay("relay-a")
        backend = SimulatedBackend("sim:2xRTX4090", seed=HOST)
        uuid = backend.gpus()[0].uuid
        async with running(harness.agent([relay.url], backend)) as agent:
            await agent.connected.wait()
            args = {"rental_id": "r-1", "gpu_uuids": [uuid], "workload": {"kind": "hold"}}
            await harness.command(relay, "cmd-start", "start_workload", args)
            first = await harness.result("cmd-start")
            await agent.workloads.stop("r-1")  # if the repeat ran again, the workload would come back
            await harness.command(relay, "cmd-start", "start_workload", args)

            async def two_results() -> list[protocol.CommandResultBody] | None:
                found = [m.body for m in await harness.of_type(protocol.CommandResult) if m.body.command_id == "cmd-start"]
                return found if len(found) == 2 else None

            results = await eventually(two_results, what="the repeated result")
            assert results[0] == results[1] == first and first.ok
            assert agent.workloads.running() == []

    async def test_start_workload_passes_a_gpu_share_and_refuses_what_does_not_fit(self, harness: Harness) -> None:
        """``share`` in start_workload args reaches the workload; a share that overfills the GPU or is malformed fails the command."""
        relay = await harness.relay("relay-a")
        backend = SimulatedBackend("sim:2xRTX4090", seed=HOST)
        uuid = backend.gpus()[0].uuid
        script = "import os; print('milli', os.environ['GPUMARKET_GPU_MILLI'], os.environ['CUDA_MPS_PINNED_DEVICE_MEM_LIMIT'])"
        async with running(harness.agent([relay.url], backend, stop_workloads_on_close=True)) as agent:
            await agent.connected.wait()
            hold = {"rental_id": "r-held", "gpu_uuids": [uuid], "workload": {"kind": "hold"}, "share": {"milli": 600, "memory_mib": 0}}
            await harness.command(relay, "cmd-held", "start_workload", hold)
            run = {"rental_id": "r-run", "gpu_uuids": [uuid], "share": {"milli": 400, "memory_mib": 2048},
                   "workload": {"kind": "process", "argv": [sys.executable, "-c", script]}}
            await harness.command(relay, "cmd-run", "start_workload", run)
            full = {"rental_id": "r-full", "gpu_uuids": [uuid], "share": {"milli": 1, "memory_mib": 0}}
            await harness.command(relay, "cmd-full", "start_workload", full)
            await harness.command(relay, "cmd-bad", "start_workload", {**full, "rental_id": "r-bad", "share": {"milli": 1000, "memory_mib": 0}})
            assert (await harness.result("cmd-held")).ok and (await harness.result("cmd-run")).ok
            refused, bad = await harness.result("cmd-full"), await harness.result("cmd-bad")

            async def logged() -> str | None:
                text = "".join(m.body.data for m in await harness.of_type(protocol.WorkloadLogs) if m.body.rental_id == "r-run")
                return text or None

            text = await eventually(logged, what="the share workload's output")
            assert "r-full" not in agent.workloads.running() and "r-bad" not in agent.workloads.running()
        assert text == "milli 400 0=2048M\n"
        assert not refused.ok and "rental r-held (600/1000)" in refused.detail and "rental r-run (400/1000)" in refused.detail
        assert not bad.ok and "share.milli" in bad.detail

    async def test_stop_workload_with_grace_and_reason_kills_on_time_and_ships_the_reason(self, harness: Harness) -> None:
        """``grace_s`` bounds SIGTERM-to-SIGKILL and ``reason`` reaches the renter's logs; bad values fail and stop nothing."""
        relay = await harness.relay("relay-a")
        backend = SimulatedBackend("sim:2xRTX4090", seed=HOST)
        uuid = backend.gpus()[0].uuid
        script = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
        async with running(harness.agent([relay.url], backend, stop_workloads_on_close=True)) as agent:
            await agent.connected.wait()
            args = {"rental_id": "r-spot", "gpu_uuids": [uuid], "workload": {"kind": "process", "argv": [sys.executable, "-c", script]}}
            await harness.command(relay, "cmd-start", "start_workload", args)
            assert (await harness.result("cmd-start")).ok

            async def log_text() -> str | None:
                text = "".join(m.body.data for m in await harness.of_type(protocol.WorkloadLogs))
                return text if "ready" in text else None

            await eventually(log_text, what="the workload to ignore SIGTERM")
            for command_id, bad in (("cmd-neg", {"grace_s": -1}), ("cmd-long", {"grace_s": 601}), ("cmd-str", {"grace_s": "5"}),
                                    ("cmd-why", {"reason": "x" * 201}), ("cmd-int", {"reason": 7})):
                await harness.command(relay, command_id, "stop_workload", {"rental_id": "r-spot", **bad})
                result = await harness.result(command_id)
                assert not result.ok and ("grace" in result.detail or "reason" in result.detail), result.detail
            assert agent.workloads.running() == ["r-spot"]
            reason = "preempted by a higher-priority rental"
            began = time.monotonic()
            await harness.command(relay, "cmd-stop", "stop_workload", {"rental_id": "r-spot", "grace_s": 0.2, "reason": reason})
            stopped = await harness.result("cmd-stop")
            took = time.monotonic() - began

            async def shipped() -> str | None:
                text = "".join(m.body.data for m in await harness.of_type(protocol.WorkloadLogs))
                return text if "gpumarket: stopping" in text else None

            text = await eventually(shipped, what="the stop line shipped")
        assert stopped.ok and stopped.data == {"exit_code": -9}
        assert 0.2 <= took < 5.0  # the agent's own stop_timeout is 10 s
        assert text == f"ready\ngpumarket: stopping ({reason}); SIGKILL in 0.2s\n"


class TestRelays:
    async def test_fails_over_when_a_relay_dies_and_every_message_reaches_the_bus(self, harness: Harness) -> None:
        """Killing the agent's relay moves it to the next one; every non-hello message it wrote is on the bus."""
        relay_a, relay_b = await harness.relay("relay-a"), await harness.relay("relay-b")
        agent = harness.agent([relay_a.url, relay_b.url])
        recorder = RecordingStore(agent.window.store)
        agent.window.store = recorder
        async with running(agent):
            await eventually(lambda: _true(agent.relay_id == "relay-a" and agent.samples_taken > 5), what="on relay a")
            await relay_a.close()
            await eventually(lambda: _true(agent.relay_id == "relay-b" and agent.connected.is_set()), what="on relay b")
            await eventually(lambda: _true(agent.samples_taken > 20 and len(agent.window) == 0), what="drained on b")
            sent = {seq for seq, kind in recorder.added.items() if kind != "hello"}
            on_bus = {e.message.seq for e in await harness.events()}
        assert sent and sent <= on_bus
        assert {e.relay_id for e in harness._seen} == {"relay-a", "relay-b"}

    async def test_a_relay_that_sends_garbage_is_dropped_for_another(self, harness: Harness) -> None:
        """A server that answers with something that is not the protocol is marked failed; the next relay is used."""

        async def garbage(connection: ServerConnection) -> None:
            await connection.send("this is not a welcome")
            await connection.wait_closed()

        async with serve(garbage, "127.0.0.1", 0, ssl=harness.server_context()) as server:
            port = server.sockets[0].getsockname()[1]
            good = await harness.relay("relay-good")
            async with running(harness.agent([f"wss://127.0.0.1:{port}/v1/agent", good.url])) as agent:
                await eventually(lambda: _true(agent.relay_id == "relay-good" and agent.connected.is_set()), what="good relay")

    async def test_the_spool_survives_an_agent_restart_with_nothing_lost(self, harness: Harness) -> None:
        """Messages written while the relay was down are replayed by the restarted agent, once each."""
        relay = await harness.relay("relay-a")
        port = relay.port
        agent = harness.agent([relay.url])
        async with running(agent):
            await harness.outage(agent, relay, backlog=10, what="spooled while the relay is down")
        # The agent is gone; what it could not deliver is on disk.
        from agent.spool import SqliteSpool

        spool = SqliteSpool(harness.state.dir / "spool.db")
        waiting = {seq for seq, frame in spool.pending() if json.loads(frame)["type"] != "hello"}
        spool.close()
        assert len(waiting) >= 9
        relay_again = await harness.relay("relay-a", port=port)
        restarted = harness.agent([relay_again.url])
        assert restarted.window.next_seq > max(waiting)
        async with running(restarted):
            await eventually(lambda: _true(restarted.connected.is_set() and len(restarted.window) == 0), what="drained")
            seqs = [e.message.seq for e in await harness.events()]
        assert waiting <= set(seqs)


    async def test_relays_are_found_by_dns_srv_in_priority_order_and_failed_over(self, harness: Harness) -> None:
        """With a zone, the agent connects to the SRV record with the best priority, then fails over to the next."""
        from tests.dnsserver import LoopbackDnsServer

        primary, backup = await harness.relay("relay-primary"), await harness.relay("relay-backup")
        records = {
            ("_gpumarket._tcp.relays.test.", "SRV"): [
                f"10 5 {primary.port} 127.0.0.1.", f"20 5 {backup.port} 127.0.0.1.",
            ],
        }
        async with LoopbackDnsServer(records) as dns:
            agent = Agent(
                harness.state, SimulatedBackend("sim:2xRTX4090", seed=HOST), zone="relays.test",
                resolver="127.0.0.1", resolver_port=dns.port, timings=fast_timings(), rng=random.Random(3),
            )
            async with running(agent):
                await eventually(lambda: _true(agent.relay_id == "relay-primary" and agent.connected.is_set()), what="primary")
                await primary.close()
                await eventually(lambda: _true(agent.relay_id == "relay-backup" and agent.connected.is_set()), what="backup")
        assert any(q.name.startswith("_gpumarket._tcp.relays.test") for q in dns.queries)


    async def test_a_long_replay_stays_within_the_relays_message_budget(self, harness: Harness) -> None:
        """A spool of many frames is replayed at the rate the relay announces, without being cut off for flooding."""
        relay = await harness.relay("relay-a")
        port = relay.port
        agent = harness.agent([relay.url])
        async with running(agent):
            await harness.outage(agent, relay, backlog=80, what="a backlog while the relay is down")
            # The relay counts frames as it reads them: a burst of 40 at 100/s lets it fall 0.5 s behind the paced
            # agent (80/s, bursts of 32) on a busy machine, yet half the backlog must wait for the pace.
            strict = await harness.relay("relay-a", port=port, max_messages_per_second=100.0, message_burst=40)
            await eventually(lambda: _true(agent.connected.is_set() and len(agent.window) < 5), what="backlog drained")
            connections = agent.connections
        assert connections == 2  # one before the outage, one after: never closed for flooding
        assert strict.refused.get("message_rate", 0) == 0

    async def test_a_revoked_host_stops_and_says_to_enroll_again(self, harness: Harness) -> None:
        """When the relay refuses the certificate as revoked, the agent stops with advice instead of retrying forever."""
        from shared.crypto import load_certificate
        from shared.errors import ConfigError
        from shared.registry import MemoryRegistry

        registry = MemoryRegistry()
        serial = format(load_certificate(harness.state.cert_file.read_bytes()).serial_number, "040x")
        await registry.revoke(serial, until=4e9)
        relay = await harness.relay("relay-a", registry=registry)
        agent = harness.agent([relay.url])
        with pytest.raises(ConfigError, match="revoked"):
            async with asyncio.timeout(10):
                await agent.run()
        await agent.close()

    async def test_a_host_revoked_while_connected_is_closed_and_the_agent_stops(
        self, harness: Harness, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Regression (issue 21): the agent must be told. Its open connection is closed with 4005 once the serial
        is revoked, and the agent stops (one connection, no retry) and logs why."""
        from shared.crypto import load_certificate
        from shared.errors import ConfigError
        from shared.registry import MemoryRegistry

        registry = MemoryRegistry()
        relay = await harness.relay("relay-a", registry=registry, revocation_poll_interval=FAST.heartbeat_interval)
        agent = harness.agent([relay.url])
        task = asyncio.create_task(agent.run())
        try:
            await eventually(lambda: _true(agent.connected.is_set()), what="connected")
            serial = format(load_certificate(harness.state.cert_file.read_bytes()).serial_number, "040x")
            await registry.revoke(serial, until=4e9)
            with pytest.raises(ConfigError, match=r"revoked.*enroll again"):
                async with asyncio.timeout(10):
                    await task
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConfigError):
                await task
            await agent.close()
        assert agent.connections == 1 and relay.refused["revoked"] == 1
        assert "stopping: this host's certificate was revoked" in caplog.text


class TestReports:
    async def test_xid_events_are_pushed_at_once(self, harness: Harness) -> None:
        """An XID error on a GPU reaches the bus as a gpu_events message with its code."""
        relay = await harness.relay("relay-a")
        backend = SimulatedBackend("sim:2xRTX4090", seed=HOST)
        uuid = backend.gpus()[1].uuid
        async with running(harness.agent([relay.url], backend)) as agent:
            await agent.connected.wait()
            backend.inject_xid(uuid, 79)

            async def xid() -> list[protocol.GpuEventModel] | None:
                found = [e for m in await harness.of_type(protocol.GpuEvents) for e in m.body.events]
                return found or None

            events = await eventually(xid, what="gpu_events on the bus")
        assert [(e.uuid, e.kind, e.code) for e in events] == [(uuid, "xid", 79)]

    async def test_telemetry_carries_window_aggregates(self, harness: Harness) -> None:
        """Each report has the latest sample of every GPU and aggregates over several 1-tick samples."""
        relay = await harness.relay("relay-a")
        async with running(harness.agent([relay.url])) as agent:
            await agent.connected.wait()

            async def report() -> list[protocol.Telemetry] | None:
                found = [m for m in await harness.of_type(protocol.Telemetry) if m.body.aggregates]
                return found if len(found) >= 2 else None

            reports = await eventually(report, what="telemetry with aggregates")
        body = reports[-1].body
        assert len(body.gpus) == 2 and {a.uuid for a in body.aggregates} == {g.uuid for g in body.gpus}
        assert all(a.samples >= 1 and a.temperature_max_c is not None for a in body.aggregates)
        assert body.window_s is not None and body.window_s > 0

    async def test_the_relays_telemetry_interval_applies_at_once(self, harness: Harness) -> None:
        """Regression: an agent configured for hourly reports followed the relay's shorter interval only after the first hour."""
        relay = await harness.relay("relay-a")
        slow = fast_timings()
        slow.telemetry_interval = 3600.0
        agent = Agent(harness.state, SimulatedBackend("sim:2xRTX4090", seed=HOST), relay_urls=[relay.url], timings=slow)
        async with running(agent):

            async def reports() -> bool:
                return len(await harness.of_type(protocol.Telemetry)) >= 3

            await eventually(reports, what="three reports at the relay's 50 ms interval")

    async def test_a_network_measurement_on_command_reports_results(self, harness: Harness) -> None:
        """measure_network runs the speed test against the relay and reports it twice: as result data and as a report."""
        relay = await harness.relay("relay-a")
        agent = harness.agent([relay.url], network_target_seconds=0.02, network_max_bytes=1 << 20, network_probes=5)
        async with running(agent):
            await agent.connected.wait()
            await harness.command(relay, "cmd-net", "measure_network", {})
            result = await harness.result("cmd-net")
            reports = await harness.of_type(protocol.NetworkReport)
        assert result.ok, result.detail
        assert result.data["download_mbps"] > 0 and result.data["probes_answered"] == 5
        assert reports and reports[0].body.relay_url == relay.url and reports[0].body.error is None

    async def test_workload_output_and_exit_are_reported(self, harness: Harness) -> None:
        """A process workload's output is shipped as logs and its own exit is reported with the code."""
        relay = await harness.relay("relay-a")
        backend = SimulatedBackend("sim:2xRTX4090", seed=HOST)
        uuid = backend.gpus()[0].uuid
        script = "import os; print('visible', os.environ['CUDA_VISIBLE_DEVICES']); raise SystemExit(3)"
        async with running(harness.agent([relay.url], backend)) as agent:
            await agent.connected.wait()
            args = {"rental_id": "r-7", "gpu_uuids": [uuid], "workload": {"kind": "process", "argv": [sys.executable, "-c", script]}}
            await harness.command(relay, "cmd-run", "start_workload", args)
            assert (await harness.result("cmd-run")).ok

            async def exited() -> list[protocol.WorkloadExited] | None:
                return await harness.of_type(protocol.WorkloadExited) or None

            exits = await eventually(exited, what="workload exit")

            async def logged() -> str | None:
                text = "".join(m.body.data for m in await harness.of_type(protocol.WorkloadLogs))
                return text if "visible" in text else None

            text = await eventually(logged, what="workload output shipped")
        assert exits[0].body.rental_id == "r-7" and exits[0].body.exit_code == 3
        assert f"visible {uuid}" in text


class TestBackoff:
    def test_full_jitter_stays_within_the_capped_exponential(self, harness: Harness) -> None:
        """Each delay is uniform in [0, min(cap, base·2^n)], so agents do not reconnect in lockstep."""
        agent = harness.agent(["wss://127.0.0.1:1/v1/agent"])
        base, cap = FAST.reconnect_base_delay, FAST.reconnect_max_delay
        for failures in range(12):
            delays = [agent.backoff(failures) for _ in range(200)]
            ceiling = min(cap, base * 2**failures)
            assert all(0 <= d <= ceiling for d in delays)
            assert max(delays) - min(delays) > ceiling / 2  # spread over the range, not bunched
        fleet = [Agent.backoff(agent, 5) for _ in range(50)]
        assert len({round(d, 6) for d in fleet}) == 50
        agent.spool.close()


class TestSpoolDurability:
    async def test_a_frame_reaches_the_relay_only_once_fsynced_and_the_loop_is_free_meanwhile(self, harness: Harness) -> None:
        """``_emit`` awaits the spool's group commit (an fsync in a thread) before the send; the loop runs on."""
        agent = harness.agent(["wss://127.0.0.1:1/v1/agent"])
        release, fsynced = threading.Event(), threading.Event()
        real = agent.spool._fsync

        def slow_fsync(covers: int) -> int:
            release.wait(10)
            fsynced.set()
            return real(covers)

        agent.spool._fsync = slow_fsync  # type: ignore[method-assign]
        sent: list[str] = []

        class Link:
            async def send(self, frame: str) -> None:
                sent.append(frame)

        agent._ws = Link()  # type: ignore[assignment]
        body = protocol.HeartbeatBody(uptime_s=1.0, running_rentals=[])
        emitting = asyncio.create_task(agent._emit(*agent.window.heartbeat(body)))
        for _ in range(20):
            await asyncio.sleep(0)  # the loop is not blocked by the fsync
        assert not sent and not emitting.done() and not fsynced.is_set()
        release.set()
        await emitting
        assert fsynced.is_set() and len(sent) == 1 and agent.spool.unsynced == 0
        agent._ws = None
        agent.spool.close()



class TestCertificates:
    async def test_renewal_installs_a_new_key_and_certificate_used_by_the_next_connection(self, harness: Harness) -> None:
        """The agent sends a CSR for a fresh key; the signed certificate it gets back is installed and used to reconnect."""
        from cryptography import x509

        from shared.crypto import host_id_from_der, load_certificate

        relay = await harness.relay("relay-a")
        old_cert = harness.state.cert_file.read_bytes()
        old_key = harness.state.key_file.read_bytes()
        agent = harness.agent([relay.url])
        async with running(agent):
            await agent.connected.wait()
            await agent.certificate.request_renewal()

            async def csr() -> str | None:
                found = [m.body.csr for m in await harness.of_type(protocol.RenewCertificate)]
                return found[0] if found else None

            request = await eventually(csr, what="renewal request on the bus")
            assert x509.load_pem_x509_csr(request.encode()).is_signature_valid
            issued = harness.ca.sign_agent_csr(request.encode(), host_id=HOST)
            await harness.command(relay, "cmd-cert", "install_certificate",
                                  {"certificate": issued.cert_pem.decode(), "ca_certificate": harness.ca.cert_pem.decode()})
            result = await harness.result("cmd-cert")
            assert result.ok, result.detail
            assert harness.state.cert_file.read_bytes() == issued.cert_pem != old_cert
            assert not (harness.state.dir / "key.next.pem").exists()
            # The replaced key stays until the next renewal: a registry login sealed to it may be on its way.
            assert harness.state.previous_key_file.read_bytes() == old_key != harness.state.key_file.read_bytes()
            assert len(harness.state.opening_keys()) == 2
            # Reconnect: the relay must see the new certificate (and the key must match it, or TLS would fail).
            first = relay.agents[HOST].connection
            await first.close(1012, "test restart")

            def peer_serial() -> int | None:
                link = relay.agents.get(HOST)
                if link is None or link.connection is first:
                    return None
                der = link.connection.transport.get_extra_info("ssl_object").getpeercert(binary_form=True)
                assert host_id_from_der(der) == HOST
                return x509.load_der_x509_certificate(der).serial_number

            async def reconnected() -> int | None:
                return peer_serial()

            serial = await eventually(reconnected, what="reconnected with the new certificate")
        assert serial == load_certificate(issued.cert_pem).serial_number

    async def test_a_certificate_for_another_key_is_not_installed(self, harness: Harness) -> None:
        """An install_certificate whose certificate does not match our key is refused and changes nothing."""
        from shared.crypto import generate_private_key, make_csr

        relay = await harness.relay("relay-a")
        before = harness.state.cert_file.read_bytes()
        async with running(harness.agent([relay.url])) as agent:
            await agent.connected.wait()
            foreign = harness.ca.sign_agent_csr(make_csr(generate_private_key(), "x"), host_id=HOST)
            await harness.command(relay, "cmd-bad", "install_certificate", {"certificate": foreign.cert_pem.decode()})
            result = await harness.result("cmd-bad")
        assert not result.ok and "does not match" in result.detail
        assert harness.state.cert_file.read_bytes() == before

    def test_an_expired_certificate_means_enrolling_again(self, tmp_path: Path) -> None:
        """An agent whose certificate expired while it was offline refuses to start and says to re-enroll with a new token."""
        from datetime import UTC, datetime, timedelta

        from shared.crypto import generate_private_key, make_csr
        from shared.errors import ConfigError

        harness = Harness(tmp_path)
        key = generate_private_key()
        from shared.crypto import write_private_key

        write_private_key(harness.state.key_file, key)
        old = harness.ca.sign_agent_csr(make_csr(key, "x"), host_id=HOST, validity=timedelta(hours=1),
                                        now=datetime.now(UTC) - timedelta(hours=2))
        harness.state.cert_file.write_bytes(old.cert_pem)
        with pytest.raises(ConfigError, match="new token"):
            harness.agent(["wss://127.0.0.1:1/v1/agent"])

    def test_renewal_is_due_at_seventy_percent_of_the_lifetime(self, harness: Harness) -> None:
        """renew_at lies 70 % of the way from not-before to not-after."""
        agent = harness.agent(["wss://127.0.0.1:1/v1/agent"])
        lifetime = agent.certificate.not_after - agent.certificate.not_before
        assert agent.certificate.renew_at == agent.certificate.not_before + lifetime * 0.7
        agent.spool.close()
