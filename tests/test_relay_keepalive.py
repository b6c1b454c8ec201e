"""Tests for the relay's one keepalive (``access.keepalive``): a real Relay over TLS 1.3 on loopback,
real websocket clients. Live connections are pinged and kept, a dead one (it stops reading: no pong)
is closed with 1011 after ``ping_timeout``, one that does not read cannot hold back the others'
pings, and no connection has a keepalive task of its own."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection
from websockets.frames import CloseCode
from websockets.protocol import State

from access import keepalive
from access.relay import Relay
from shared.crypto import CertificateAuthority
from tests.factories import MS
from tests.pki import relay_server_context
from tests.relayharness import (
    StartRelay,
    connect_agent,
    events_bus,
    relay_options,
    started_relays,
    wait_for,
)

RELAY_ID = "relay-keepalive"
PING = 100 * MS
# The client's own keepalive off: what is measured is the relay's pings and the client's automatic pongs.
NO_CLIENT_PINGS: dict[str, Any] = {"ping_interval": None}


@pytest.fixture
def server_context(ca: CertificateAuthority, tmp_path: Path) -> ssl.SSLContext:
    return relay_server_context(ca, tmp_path / "relay")


@pytest.fixture
async def start_relay(server_context: ssl.SSLContext) -> AsyncIterator[StartRelay]:
    async with events_bus() as bus, started_relays() as start:

        async def start_with(**overrides: Any) -> Relay:
            return await start(**relay_options(RELAY_ID, bus, server_context) | overrides)

        yield start_with


@pytest.fixture
async def stack() -> AsyncIterator[contextlib.AsyncExitStack]:
    async with contextlib.AsyncExitStack() as exits:
        yield exits


def _server_side(relay: Relay, host_id: str) -> ServerConnection:
    return relay.agents[host_id].connection


class TestKeepalive:
    async def test_live_agents_are_pinged_and_kept_by_one_task(
        self, start_relay: StartRelay, ca: CertificateAuthority, tmp_path: Path, stack: contextlib.AsyncExitStack,
    ) -> None:
        """Pongs come back (the relay measures latency), nobody is dropped over several intervals, and no
        connection has a keepalive task of its own; a closed connection leaves the keepalive."""
        relay = await start_relay(ping_interval=PING, ping_timeout=PING)
        agents = [await connect_agent(relay, ca, tmp_path, stack, f"h-live-{n}", **NO_CLIENT_PINGS) for n in range(3)]
        connections = [_server_side(relay, agent.host_id) for agent in agents]
        assert len(relay.keepalive) == 3
        assert all(connection.keepalive_task is None for connection in connections)
        await wait_for(lambda: all(connection.latency > 0 for connection in connections))  # each answered a ping
        await asyncio.sleep(5 * PING)
        for agent in agents:
            await agent.expect_ack(await agent.send_heartbeat())
        assert sorted(relay.agents) == [agent.host_id for agent in agents]
        assert relay.keepalive.timeouts == 0

        await agents[0].ws.close()
        await wait_for(lambda: len(relay.keepalive) == 2)

    async def test_a_dead_link_is_closed_with_1011_and_does_not_hold_back_the_others(
        self, start_relay: StartRelay, ca: CertificateAuthority, tmp_path: Path, stack: contextlib.AsyncExitStack,
    ) -> None:
        """An agent that stops reading sends no pong: ping_timeout later the relay fails it with 1011
        ("keepalive ping timeout") and forgets it; a live agent beside it is pinged and kept throughout."""
        relay = await start_relay(ping_interval=PING, ping_timeout=PING)
        live = await connect_agent(relay, ca, tmp_path, stack, "h-live", **NO_CLIENT_PINGS)
        dead = await connect_agent(relay, ca, tmp_path, stack, "h-dead", **NO_CLIENT_PINGS)
        dead_side = _server_side(relay, "h-dead")
        dead.ws.transport.pause_reading()  # a link gone quiet: the relay's pings are never answered
        await wait_for(lambda: "h-dead" not in relay.agents)
        assert dead_side.protocol.close_sent is not None
        assert (dead_side.protocol.close_sent.code, dead_side.protocol.close_sent.reason) == (
            CloseCode.INTERNAL_ERROR, keepalive.TIMEOUT_REASON,
        )
        assert relay.keepalive.timeouts == 1
        await wait_for(lambda: len(relay.keepalive) == 1)  # the dead one's transport was closed (or aborted)
        live_side = _server_side(relay, "h-live")
        latency_before = live_side.latency
        await wait_for(lambda: live_side.latency != latency_before)  # still pinged, still answering
        await live.expect_ack(await live.send_heartbeat())
        assert "h-live" in relay.agents

    async def test_a_peer_that_never_closes_is_aborted_after_close_timeout(
        self, start_relay: StartRelay, ca: CertificateAuthority, tmp_path: Path, stack: contextlib.AsyncExitStack,
    ) -> None:
        """The 1011 close cannot complete with a peer that reads nothing: the relay's transport is aborted
        ``close_timeout`` later (as websockets' own keepalive does), so the connection is lost and forgotten."""
        relay = await start_relay(ping_interval=PING, ping_timeout=PING, close_timeout=200 * MS)
        dead = await connect_agent(relay, ca, tmp_path, stack, "h-silent", **NO_CLIENT_PINGS)
        dead_side = _server_side(relay, "h-silent")
        dead.ws.transport.pause_reading()
        await wait_for(lambda: dead_side.connection_lost_waiter.done())
        assert relay.keepalive.timeouts == 1 and len(relay.keepalive) == 0


class _Protocol:
    def __init__(self, connection: _Connection) -> None:
        self.connection = connection
        self.state = State.OPEN
        self.failed: tuple[int, str] | None = None

    def send_ping(self, data: bytes) -> None:
        self.connection.pings.append(data)

    def fail(self, code: int, reason: str) -> None:
        self.failed, self.state = (code, reason), State.CLOSING


class _Connection:
    """What the keepalive reads of a websockets ``Connection``."""

    def __init__(self) -> None:
        self.protocol = _Protocol(self)
        self.pending_pings: dict[bytes, tuple[asyncio.Future[float], float]] = {}
        self.pings: list[bytes] = []
        self.connection_lost_waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.remote_address = ("127.0.0.1", 1)
        self.aborted = False
        self.transport = self

    def send_data(self) -> None:
        pass

    def abort(self) -> None:
        self.aborted = True

    def pong(self) -> None:
        """websockets' ``acknowledge_pings`` for the last ping."""
        future, _ = self.pending_pings.pop(self.pings[-1])
        future.set_result(0.001)


def _schedule(ping_interval: float, ping_timeout: float, count: int = 1) -> tuple[keepalive.Keepalive, list[Any], float]:
    """A keepalive (never run: the test ticks it) with ``count`` connections added now; and now."""
    schedule = keepalive.Keepalive(ping_interval=ping_interval, ping_timeout=ping_timeout, close_timeout=1.0)
    connections = [_Connection() for _ in range(count)]
    now = asyncio.get_running_loop().time()
    for connection in connections:
        schedule.add(connection, now=now)  # type: ignore[arg-type]
    return schedule, connections, now


class TestSchedule:
    """The keepalive's own bookkeeping, ticked by the test's clock, with connections that are only what it reads."""

    async def test_pings_every_interval_and_fails_a_connection_without_a_pong(self) -> None:
        schedule, [connection], t0 = _schedule(10.0, 10.0)
        assert schedule.tick(t0 + 5) == pytest.approx(t0 + 10, abs=0.1) and connection.pings == []
        schedule.tick(t0 + 10.1)
        assert len(connection.pings) == 1
        connection.pong()
        schedule.tick(t0 + 20.1)  # answered: pinged again an interval after the first ping
        assert len(connection.pings) == 2 and connection.protocol.failed is None
        schedule.tick(t0 + 30.2)  # not answered within ping_timeout: failed as websockets does
        assert connection.protocol.failed == (CloseCode.INTERNAL_ERROR, keepalive.TIMEOUT_REASON)
        assert schedule.timeouts == 1 and len(connection.pings) == 2  # a failing connection gets no more pings

    async def test_a_ping_timeout_longer_than_the_interval(self) -> None:
        """An answered connection is still pinged every interval; an unanswered one gets no second ping and
        is failed ping_timeout after its ping, not sooner."""
        schedule, [connection], t0 = _schedule(10.0, 40.0)
        schedule.tick(t0 + 10.1)
        connection.pong()
        schedule.tick(t0 + 20.1)
        assert len(connection.pings) == 2  # not held back by the first ping's deadline (t0 + 50)
        for now in (30.2, 40.2, 55.0):
            schedule.tick(t0 + now)
            assert len(connection.pings) == 2 and connection.protocol.failed is None
        schedule.tick(t0 + 60.2)
        assert connection.protocol.failed is not None

    async def test_connections_are_pinged_in_the_order_they_fall_due_and_forgotten_when_lost(self) -> None:
        schedule, connections, t0 = _schedule(10.0, 10.0, count=3)
        late = _Connection()
        schedule.tick(t0 + 5)
        schedule.add(late, now=t0 + 5)  # type: ignore[arg-type]
        schedule.tick(t0 + 10.1)
        assert [len(c.pings) for c in [*connections, late]] == [1, 1, 1, 0]
        for connection in connections:
            connection.pong()
        schedule.discard(connections[1])
        assert len(schedule) == 3
        schedule.tick(t0 + 15.2)
        assert [len(c.pings) for c in [*connections, late]] == [1, 1, 1, 1]
        schedule.tick(t0 + 20.2)
        assert [len(c.pings) for c in [*connections, late]] == [2, 1, 2, 1]

    async def test_a_failed_connection_is_aborted_after_close_timeout_unless_lost(self) -> None:
        schedule = keepalive.Keepalive(ping_interval=0.01, ping_timeout=0.01, close_timeout=0.05)
        lost, stuck = _Connection(), _Connection()
        now = asyncio.get_running_loop().time()
        for connection in (lost, stuck):
            schedule.add(connection, now=now)  # type: ignore[arg-type]
        schedule.tick(now + 0.02)
        schedule.tick(now + 0.04)
        assert lost.protocol.failed and stuck.protocol.failed
        lost.connection_lost_waiter.set_result(None)
        await wait_for(lambda: stuck.aborted)
        assert not lost.aborted

    def test_bad_settings_are_refused(self) -> None:
        with pytest.raises(ValueError, match="positive"):
            keepalive.Keepalive(ping_interval=0, ping_timeout=1, close_timeout=1)

    def test_the_resolution_is_a_twentieth_of_the_shorter_interval(self) -> None:
        assert keepalive.Keepalive(ping_interval=20, ping_timeout=10, close_timeout=1).resolution == 0.5
