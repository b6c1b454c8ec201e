"""Tests for access.relay: a real Relay over TLS 1.3 on loopback, real websocket agents, an in-process bus."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.frames import Close

from access.commands import COMMAND_GROUP
from access.relay import Relay
from shared import protocol
from shared.bus import InProcessBus
from shared.crypto import (
    CertificateAuthority,
    client_ssl_context,
)
from shared.errors import BusError
from shared.outbound import OutboundWindow
from shared.streams import LARGE_DATA, MAX_DATA, MAX_DATA_HEADER
from tests.factories import MS
from tests.pki import agent_client_context, relay_server_context
from tests.relayharness import (
    EVENTS_GROUP,
    IO_TIMEOUT,
    RelayClient,
    StartRelay,
    connect_to_relay,
    events_bus,
    publish_command,
    read_welcome,
    relay_options,
    started_relays,
    wait_for,
)

MAX_FRAME = 4096
RELAY_ID = "relay-test"


# ---- certificates ------------------------------------------------------------------------


@pytest.fixture
def server_context(ca: CertificateAuthority, tmp_path: Path) -> ssl.SSLContext:
    return relay_server_context(ca, tmp_path / "relay")


MakeAgentContext = Callable[..., ssl.SSLContext]


@pytest.fixture
def agent_context(ca: CertificateAuthority, tmp_path: Path) -> MakeAgentContext:
    """Build a client TLS context presenting a certificate for ``host_id``, signed by ``signer`` (the CA by default)."""

    def make(host_id: str, *, signer: CertificateAuthority | None = None) -> ssl.SSLContext:
        # The agent always trusts our CA: only its own certificate varies.
        directory = tmp_path / "agents" / f"{host_id}-{id(signer or ca)}"
        return agent_client_context(ca, directory, host_id, signer=signer)

    return make


# ---- bus and relay -----------------------------------------------------------------------


class FailingBus(InProcessBus):
    """An in-process bus whose publish always fails, as if Redis were unreachable."""

    async def publish(self, stream: str, payload: bytes) -> str:
        raise BusError("bus is down (test)")


class GatedBus(InProcessBus):
    """An in-process bus whose publish of agent messages waits until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def publish(self, stream: str, payload: bytes) -> str:
        if stream == protocol.AGENT_EVENTS_STREAM:  # the agents' messages; link events pass
            self.entered.set()
            await self.gate.wait()
        return await super().publish(stream, payload)


@pytest.fixture
async def bus() -> AsyncIterator[InProcessBus]:
    async with events_bus() as b:
        yield b


@pytest.fixture
async def start_relay(server_context: ssl.SSLContext, bus: InProcessBus) -> AsyncIterator[StartRelay]:
    """Start relays on 127.0.0.1 port 0; every one started is closed (and its bus too) afterwards."""
    async with started_relays(close_buses=True) as start:

        # Depends on ``bus`` so that the shared bus outlives every relay using it.
        async def start_on(relay_bus: InProcessBus, **overrides: Any) -> Relay:
            return await start(**relay_options(RELAY_ID, relay_bus, server_context) | {"max_frame": MAX_FRAME} | overrides)

        yield start_on


@pytest.fixture
async def relay(start_relay: StartRelay, bus: InProcessBus) -> Relay:
    return await start_relay(bus)


# ---- agents ------------------------------------------------------------------------------


@dataclass
class Agent(RelayClient):
    """A relay client that also keeps the welcome it was sent."""

    welcome: protocol.Welcome

    async def send_telemetry(self) -> int:
        body = protocol.TelemetryBody(
            sampled_at=datetime.now(UTC),
            gpus=[protocol.GpuSampleModel(index=0, uuid="GPU-test-0", gpu_util_pct=42.0, temperature_c=55.0)],
        )
        seq, frame = self.window.telemetry(body)
        await self.ws.send(frame)
        return seq

    async def closed(self) -> Close:
        """Wait for the relay to close the connection, and the connection to be closed with the code of
        the close frame the relay sent; return that frame."""
        frame = await super().closed()
        async with asyncio.timeout(IO_TIMEOUT):
            await self.ws.wait_closed()
        assert self.ws.close_code == frame.code
        return frame


ConnectAgent = Callable[..., Awaitable[Agent]]


@pytest.fixture
async def connect_agent(agent_context: MakeAgentContext) -> AsyncIterator[ConnectAgent]:
    """Connect an agent for ``host_id`` to a relay and read its welcome; every agent is closed afterwards."""
    async with contextlib.AsyncExitStack() as stack:

        async def open_agent(relay: Relay, host_id: str, *, first_seq: int = 0) -> Agent:
            ws = await stack.enter_async_context(connect_to_relay(relay.url, agent_context(host_id)))
            welcome = await read_welcome(ws)
            return Agent(host_id, ws, OutboundWindow(host_id, first_seq=first_seq), welcome)

        yield open_agent


def _heartbeat_object(host_id: str, **changes: Any) -> dict[str, Any]:
    """A valid heartbeat envelope as a JSON object, with ``changes`` applied."""
    _, frame = OutboundWindow(host_id, first_seq=7).heartbeat(protocol.HeartbeatBody(uptime_s=1.0))
    obj: dict[str, Any] = json.loads(frame)
    obj.update(changes)
    return obj


async def _read_events(bus: InProcessBus) -> list[protocol.BusEnvelope]:
    batch = await bus.read(protocol.AGENT_EVENTS_STREAM, EVENTS_GROUP, "test", count=100, block=None)
    await bus.ack(protocol.AGENT_EVENTS_STREAM, EVENTS_GROUP, [m.id for m in batch])
    return [protocol.decode_bus_envelope(m.payload) for m in batch]


async def _publish_command(bus: InProcessBus, host_id: str, command_id: str) -> None:
    await publish_command(bus, RELAY_ID, host_id, command_id, {"image": "test"})


# ---- tests -------------------------------------------------------------------------------


class TestForwarding:
    """The relay welcomes certified agents, forwards their messages to the bus and acks what the bus accepted."""

    async def test_welcomes_the_agent_with_the_host_id_of_its_certificate(
        self, relay: Relay, connect_agent: ConnectAgent
    ) -> None:
        """A connecting agent first receives a welcome naming this relay, its certified host id and the frame limit."""
        agent = await connect_agent(relay, "h-1")

        assert agent.welcome.body.relay_id == RELAY_ID
        assert agent.welcome.body.host_id == "h-1"
        assert agent.welcome.body.max_frame == MAX_FRAME
        assert set(relay.agents) == {"h-1"}

    async def test_agrees_larger_stream_frames_only_with_an_agent_that_offers_them(
        self, relay: Relay, agent_context: MakeAgentContext
    ) -> None:
        """An agent offering larger DATA frames in its upgrade request gets the size in its welcome and a link of that
        size; one offering none (an older agent) gets a welcome without the field, which it would refuse, and 64 KiB."""
        offer = {MAX_DATA_HEADER: str(LARGE_DATA)}
        async with connect_to_relay(relay.url, agent_context("h-new"), additional_headers=offer) as ws:
            welcome = await read_welcome(ws)
            assert welcome.body.max_stream_data == LARGE_DATA
            assert relay.agents["h-new"].streams.mux.max_data == LARGE_DATA
        async with connect_to_relay(relay.url, agent_context("h-old")) as ws:
            async with asyncio.timeout(IO_TIMEOUT):
                raw = json.loads(await ws.recv())
            assert raw["type"] == "welcome" and "max_stream_data" not in raw["body"]
            assert relay.agents["h-old"].streams.mux.max_data == MAX_DATA

    async def test_puts_telemetry_and_heartbeats_on_the_bus_and_acks_their_seq(
        self, relay: Relay, bus: InProcessBus, connect_agent: ConnectAgent
    ) -> None:
        """Valid telemetry and heartbeat frames land on the agent-events stream with provenance and are acked by seq."""
        agent = await connect_agent(relay, "h-1", first_seq=10)

        telemetry_seq = await agent.send_telemetry()
        heartbeat_seq = await agent.send_heartbeat()
        await agent.expect_ack(telemetry_seq)
        await agent.expect_ack(heartbeat_seq)

        events = await _read_events(bus)
        assert [(e.relay_id, e.message.host_id, e.message.type, e.message.seq) for e in events] == [
            (RELAY_ID, "h-1", "telemetry", 10),
            (RELAY_ID, "h-1", "heartbeat", 11),
        ]
        assert relay.messages_forwarded == 2
        # Each record names the certificate the connection presented: the master retires a renewed host's older ones.
        serial = relay.agents["h-1"].serial
        assert len(serial) == 40 and {e.cert_serial for e in events} == {serial}

    async def test_acks_only_after_the_bus_accepted_the_message(
        self, start_relay: StartRelay, connect_agent: ConnectAgent
    ) -> None:
        """While the bus has not yet accepted a message, the agent gets no ack for it; once it has, the ack follows."""
        bus = GatedBus()
        relay = await start_relay(bus)
        await bus.ensure_group(protocol.AGENT_EVENTS_STREAM, EVENTS_GROUP)
        agent = await connect_agent(relay, "h-1")

        seq = await agent.send_heartbeat()
        async with asyncio.timeout(IO_TIMEOUT):
            await bus.entered.wait()
        with pytest.raises(TimeoutError):  # 50 MS of silence: the relay is still waiting on the bus
            async with asyncio.timeout(50 * MS):
                await agent.ws.recv()
        assert await bus.stream_length(protocol.AGENT_EVENTS_STREAM) == 0

        bus.gate.set()
        await agent.expect_ack(seq)
        assert [e.message.seq for e in await _read_events(bus)] == [seq]

    async def test_closes_with_bus_unavailable_and_no_ack_when_the_bus_refuses(
        self, start_relay: StartRelay, connect_agent: ConnectAgent
    ) -> None:
        """A message the bus refuses is never acked: the agent is closed with CLOSE_BUS_UNAVAILABLE to go elsewhere."""
        relay = await start_relay(FailingBus())
        agent = await connect_agent(relay, "h-1")

        await agent.send_heartbeat()
        close = await agent.closed()  # raises if an ack (or anything else) arrives first

        assert close.code == protocol.CLOSE_BUS_UNAVAILABLE
        assert "reconnect" in close.reason
        assert relay.messages_forwarded == 0

    async def test_replaces_an_older_connection_of_the_same_host(
        self, relay: Relay, connect_agent: ConnectAgent
    ) -> None:
        """A second connection of a host closes the first with CLOSE_REPLACED and carries on in its place."""
        first = await connect_agent(relay, "h-1")
        second = await connect_agent(relay, "h-1")

        close = await first.closed()

        assert close.code == protocol.CLOSE_REPLACED
        assert close.reason
        await second.expect_ack(await second.send_heartbeat())
        assert list(relay.agents) == ["h-1"]


async def _link_events(bus: InProcessBus, count: int) -> list[protocol.LinkEvent]:
    """The first ``count`` link events on the bus, once there are that many."""
    await wait_for(lambda: _stream_has(bus, protocol.AGENT_LINKS_STREAM, count))
    await bus.ensure_group(protocol.AGENT_LINKS_STREAM, "links-test")
    batch = await bus.read(protocol.AGENT_LINKS_STREAM, "links-test", "test", count=count, block=None)
    return [protocol.decode_link_event(m.payload) for m in batch]


async def _stream_has(bus: InProcessBus, stream: str, count: int) -> bool:
    return await bus.stream_length(stream) >= count


class TestLinkEvents:
    """The relay tells the master when an agent's link opens and closes (access.linkevents), one id per connection."""

    async def test_an_agent_link_is_announced_open_then_closed_with_one_connection_id(
        self, relay: Relay, bus: InProcessBus, connect_agent: ConnectAgent
    ) -> None:
        agent = await connect_agent(relay, "h-1")
        await agent.ws.close()
        opened, closed = await _link_events(bus, 2)
        assert (opened.event, closed.event) == ("open", "closed")
        assert opened.host_id == closed.host_id == "h-1" and opened.relay_id == closed.relay_id == RELAY_ID
        assert opened.connection_id == closed.connection_id
        assert opened.at <= closed.at and not closed.draining
        assert closed.code == 1000

    async def test_a_connection_replaced_by_a_newer_one_announces_no_close(
        self, relay: Relay, bus: InProcessBus, connect_agent: ConnectAgent
    ) -> None:
        """The old link's close says nothing the newer link's open did not: only the current link's close is announced."""
        first = await connect_agent(relay, "h-1")
        second = await connect_agent(relay, "h-1")
        assert (await first.closed()).code == protocol.CLOSE_REPLACED
        await second.ws.close()
        events = await _link_events(bus, 3)
        assert [e.event for e in events] == ["open", "open", "closed"]
        assert events[0].connection_id != events[1].connection_id == events[2].connection_id
        assert await bus.stream_length(protocol.AGENT_LINKS_STREAM) == 3

    async def test_a_draining_relay_says_so_in_the_closes(
        self, start_relay: StartRelay, bus: InProcessBus, connect_agent: ConnectAgent
    ) -> None:
        relay = await start_relay(bus)
        await connect_agent(relay, "h-1")
        await relay.close()
        opened, closed = await _link_events(bus, 2)
        assert closed.event == "closed" and closed.draining and closed.code == protocol.CLOSE_GOING_AWAY
        assert closed.connection_id == opened.connection_id

    async def test_a_bus_that_refuses_link_events_does_not_stop_the_agent(
        self, start_relay: StartRelay, connect_agent: ConnectAgent
    ) -> None:
        """Link events are advice: one the bus refuses is logged and dropped, and the agent is served as before."""

        class NoLinks(InProcessBus):
            async def publish(self, stream: str, payload: bytes) -> str:
                if stream == protocol.AGENT_LINKS_STREAM:
                    raise BusError("links refused (test)")
                return await super().publish(stream, payload)

        relay = await start_relay(NoLinks())
        agent = await connect_agent(relay, "h-1")
        await agent.expect_ack(await agent.send_heartbeat())


class TestBadInput:
    """A misbehaving or uncertified client loses only its own connection; everyone else is still served."""

    async def _assert_closes_only_offender(
        self, relay: Relay, connect_agent: ConnectAgent, frame: str, code: int
    ) -> str:
        """Send ``frame`` from one agent while another is connected; return the offender's close reason."""
        good = await connect_agent(relay, "h-good")
        bad = await connect_agent(relay, "h-bad")

        await bad.ws.send(frame)
        close = await bad.closed()

        assert close.code == code
        assert close.reason
        await good.expect_ack(await good.send_heartbeat())
        await wait_for(lambda: set(relay.agents) == {"h-good"})
        return close.reason

    async def test_closes_a_connection_that_sends_invalid_json(
        self, relay: Relay, connect_agent: ConnectAgent
    ) -> None:
        """A frame that is not JSON closes that connection with CLOSE_BAD_FRAME."""
        reason = await self._assert_closes_only_offender(
            relay, connect_agent, "{not json", protocol.CLOSE_BAD_FRAME
        )
        assert "JSON" in reason

    async def test_closes_a_connection_that_sends_json_that_is_not_an_object(
        self, relay: Relay, connect_agent: ConnectAgent
    ) -> None:
        """A JSON frame that is not an object closes that connection with CLOSE_BAD_FRAME."""
        await self._assert_closes_only_offender(relay, connect_agent, "[1, 2, 3]", protocol.CLOSE_BAD_FRAME)

    async def test_closes_a_connection_that_sends_an_unknown_message_type(
        self, relay: Relay, connect_agent: ConnectAgent
    ) -> None:
        """An envelope of an unknown type closes that connection with CLOSE_UNKNOWN_TYPE."""
        frame = json.dumps(_heartbeat_object("h-bad", type="reboot"))
        reason = await self._assert_closes_only_offender(
            relay, connect_agent, frame, protocol.CLOSE_UNKNOWN_TYPE
        )
        assert "reboot" in reason

    async def test_closes_a_connection_that_speaks_another_protocol_version(
        self, relay: Relay, connect_agent: ConnectAgent
    ) -> None:
        """An envelope of an unsupported protocol version closes that connection with CLOSE_UNSUPPORTED_VERSION."""
        frame = json.dumps(_heartbeat_object("h-bad", v=2))
        await self._assert_closes_only_offender(
            relay, connect_agent, frame, protocol.CLOSE_UNSUPPORTED_VERSION
        )

    async def test_closes_a_connection_that_violates_the_schema(
        self, relay: Relay, connect_agent: ConnectAgent
    ) -> None:
        """An envelope with a negative seq closes that connection with CLOSE_BAD_FRAME naming the field."""
        frame = json.dumps(_heartbeat_object("h-bad", seq=-1))
        reason = await self._assert_closes_only_offender(
            relay, connect_agent, frame, protocol.CLOSE_BAD_FRAME
        )
        assert "seq" in reason

    async def test_closes_a_connection_that_sends_a_frame_larger_than_max_frame(
        self, relay: Relay, connect_agent: ConnectAgent
    ) -> None:
        """A message larger than max_frame closes that connection with CLOSE_TOO_BIG."""
        frame = json.dumps(_heartbeat_object("h-bad", padding="x" * (2 * MAX_FRAME)))
        await self._assert_closes_only_offender(relay, connect_agent, frame, protocol.CLOSE_TOO_BIG)

    async def test_closes_a_connection_whose_message_claims_another_host(
        self, relay: Relay, connect_agent: ConnectAgent
    ) -> None:
        """A message naming a host other than the certificate's closes that connection with CLOSE_IDENTITY_MISMATCH."""
        frame = json.dumps(_heartbeat_object("h-good"))
        reason = await self._assert_closes_only_offender(
            relay, connect_agent, frame, protocol.CLOSE_IDENTITY_MISMATCH
        )
        assert "h-good" in reason

    async def test_refuses_an_agent_without_a_certificate(
        self, relay: Relay, ca: CertificateAuthority, connect_agent: ConnectAgent
    ) -> None:
        """A client presenting no certificate (renters connect so, to /v1/connect) is closed with 4003 on the
        agent endpoint before anything is read, and the relay goes on serving others."""
        good = await connect_agent(relay, "h-good")

        with pytest.raises(ConnectionClosed) as closed:
            async with connect_to_relay(relay.url, client_ssl_context(ca.cert_path)) as ws:
                await asyncio.wait_for(ws.recv(), IO_TIMEOUT)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == protocol.CLOSE_IDENTITY_MISMATCH
        assert "no usable client certificate" in closed.value.rcvd.reason

        await good.expect_ack(await good.send_heartbeat())
        assert set(relay.agents) == {"h-good"}

    async def test_refuses_a_client_certificate_from_another_ca(
        self,
        relay: Relay,
        other_ca: CertificateAuthority,
        agent_context: MakeAgentContext,
        connect_agent: ConnectAgent,
    ) -> None:
        """A client certificate signed by another CA fails the TLS handshake and the relay goes on serving others."""
        good = await connect_agent(relay, "h-good")

        with pytest.raises((OSError, InvalidHandshake)):
            async with connect_to_relay(relay.url, agent_context("h-forged", signer=other_ca)) as ws:
                await asyncio.wait_for(ws.recv(), IO_TIMEOUT)

        await good.expect_ack(await good.send_heartbeat())
        assert set(relay.agents) == {"h-good"}


class TestCommands:
    """The relay delivers the master's commands from its bus stream to the agents connected to it."""

    async def test_delivers_a_command_to_the_connected_host(
        self, relay: Relay, bus: InProcessBus, connect_agent: ConnectAgent
    ) -> None:
        """A CommandDelivery on this relay's command stream reaches the named host as a command frame."""
        agent = await connect_agent(relay, "h-1")

        await _publish_command(bus, "h-1", "cmd-1")
        message = await agent.recv()

        assert isinstance(message, protocol.Command)
        assert (message.body.command_id, message.body.kind, message.body.args) == (
            "cmd-1",
            "start_workload",
            {"image": "test"},
        )
        assert relay.commands_delivered == 1

    async def test_acks_and_drops_a_command_for_a_host_not_connected_here(
        self, relay: Relay, bus: InProcessBus, connect_agent: ConnectAgent
    ) -> None:
        """A delivery for an absent host is acknowledged on the bus and dropped, and other hosts get only their own commands."""
        agent = await connect_agent(relay, "h-1")
        stream = protocol.commands_stream(RELAY_ID)

        await _publish_command(bus, "h-absent", "cmd-lost")
        await _publish_command(bus, "h-1", "cmd-1")
        message = await agent.recv()

        assert isinstance(message, protocol.Command)
        assert message.body.command_id == "cmd-1"
        await wait_for(lambda: _pending_is_zero(bus, stream))
        # Both were read by the relay (nothing is left for its group) and acked, yet only one was delivered.
        assert await bus.read(stream, COMMAND_GROUP, "probe", block=None) == []
        assert relay.commands_delivered == 1
        await agent.expect_ack(await agent.send_heartbeat())  # nothing else was queued for h-1


class TestShutdown:
    """Closing the relay sends every agent elsewhere and stops accepting connections."""

    async def test_close_tells_every_agent_to_reconnect_elsewhere(
        self, relay: Relay, connect_agent: ConnectAgent
    ) -> None:
        """Closing the relay closes every agent connection with 1001 and a reason telling it to reconnect."""
        agents = [await connect_agent(relay, "h-1"), await connect_agent(relay, "h-2")]

        async with asyncio.timeout(IO_TIMEOUT):
            await relay.close()

        for agent in agents:
            close = await agent.closed()
            assert close.code == protocol.CLOSE_GOING_AWAY
            assert "reconnect" in close.reason
        assert relay.agents == {}

    async def test_refuses_new_connections_after_close(
        self, relay: Relay, agent_context: MakeAgentContext
    ) -> None:
        """Once closed, the relay no longer accepts connections."""
        url = relay.url

        async with asyncio.timeout(IO_TIMEOUT):
            await relay.close()

        with pytest.raises(OSError):
            async with connect_to_relay(url, agent_context("h-late")):
                pass


class TestHealth:
    """The relay answers plain HTTPS requests: /health with JSON, anything else with 404."""

    @pytest.fixture
    async def http(
        self, agent_context: MakeAgentContext
    ) -> AsyncIterator[tuple[aiohttp.ClientSession, ssl.SSLContext]]:
        # The relay requires a client certificate on every TLS connection, HTTP included.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=IO_TIMEOUT)) as session:
            yield session, agent_context("h-probe")

    async def test_health_reports_relay_id_and_connected_agents(
        self, relay: Relay, connect_agent: ConnectAgent, http: tuple[aiohttp.ClientSession, ssl.SSLContext]
    ) -> None:
        """GET /health answers JSON with the relay id, its status and how many agents are connected."""
        session, context = http
        await connect_agent(relay, "h-1")
        await connect_agent(relay, "h-2")

        async with session.get(f"https://127.0.0.1:{relay.port}/health", ssl=context) as response:
            assert response.status == 200
            body = await response.json()

        assert body["relay_id"] == RELAY_ID
        assert body["status"] == "ok"
        assert body["agents"] == 2

    async def test_health_has_a_single_json_content_type(
        self, relay: Relay, http: tuple[aiohttp.ClientSession, ssl.SSLContext]
    ) -> None:
        """Regression: /health sent two Content-Type headers, text/plain before application/json, so clients saw text."""
        session, context = http

        async with session.get(f"https://127.0.0.1:{relay.port}/health", ssl=context) as response:
            assert response.headers.getall("Content-Type") == ["application/json"]

    async def test_unknown_path_is_not_found(
        self, relay: Relay, http: tuple[aiohttp.ClientSession, ssl.SSLContext]
    ) -> None:
        """Any path other than /health and the agent endpoint answers 404."""
        session, context = http

        async with session.get(f"https://127.0.0.1:{relay.port}/nope", ssl=context) as response:
            assert response.status == 404


async def _pending_is_zero(bus: InProcessBus, stream: str) -> bool:
    return await bus.pending_count(stream, COMMAND_GROUP) == 0
