"""Tests for the relay's limits, revocation, registration and drain: a real Relay over TLS 1.3 on
loopback port 0, an in-process bus, a ``MemoryRegistry`` and real websocket clients."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.frames import Close

from access.relay import AGENT_PATH, SPEEDTEST_PATH, Relay
from agent.gpu.sim import SimulatedBackend
from agent.runner import Agent
from agent.service import agent_from_settings
from shared import protocol
from shared.bus import InProcessBus
from shared.crypto import (
    CertificateAuthority,
    certificate_public_key,
    client_ssl_context,
    generate_private_key,
    make_csr,
    serial_hex_from_der,
    write_private_key,
)
from shared.crypto.tokens import new_claims
from shared.errors import BusError
from shared.outbound import OutboundWindow
from shared.ratelimit import SourceRateLimiter, TokenBucket, source_key
from shared.registry import MemoryRegistry, RedisRegistry, RelayRecord
from shared.settings import AgentSettings
from shared.streams import CONNECT_PATH, LARGE_DATA
from tests.agents import RecordingStore, enrolled_state, fast_timings
from tests.factories import MS
from tests.pki import relay_server_context
from tests.relayharness import (
    EVENTS_GROUP,
    IO_TIMEOUT,
    RelayClient,
    ServerFrame,
    StartRelay,
    connect_to_relay,
    events_bus,
    publish_command,
    read_welcome,
    relay_options,
    started_relays,
    wait_for,
)

RELAY_ID = "relay-limits"


# ---- certificates ------------------------------------------------------------------------


@pytest.fixture
def server_context(ca: CertificateAuthority, tmp_path: Path) -> ssl.SSLContext:
    return relay_server_context(ca, tmp_path / "relay")


@dataclass(frozen=True)
class Credentials:
    """A client TLS context presenting one host's certificate, and that certificate's serial."""

    host_id: str
    context: ssl.SSLContext
    serial: str


Issue = Callable[..., Credentials]


@pytest.fixture
def issue(ca: CertificateAuthority, tmp_path: Path) -> Issue:
    """Issue a certificate for ``host_id`` (``sign_agent_csr`` keyword arguments pass through)."""
    counter = iter(range(1_000_000))

    def make(host_id: str, **sign: Any) -> Credentials:
        directory = tmp_path / "agents" / f"{host_id}-{next(counter)}"
        directory.mkdir(parents=True)
        key = generate_private_key()
        issued = ca.sign_agent_csr(make_csr(key, host_id), host_id=host_id, **sign)
        key_file, cert_file = directory / "agent.key", directory / "agent.crt"
        write_private_key(key_file, key)
        cert_file.write_bytes(issued.cert_pem)
        context = client_ssl_context(ca.cert_path, cert_file=cert_file, key_file=key_file)
        return Credentials(host_id, context, issued.serial_hex)

    return make


# ---- bus, registry and relay -------------------------------------------------------------


@pytest.fixture
async def bus() -> AsyncIterator[InProcessBus]:
    async with events_bus() as b:
        yield b


class RecordingRegistry(MemoryRegistry):
    """A memory registry that also keeps every relay record put and every removal, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[RelayRecord | str] = []

    async def put_relay(self, record: RelayRecord, *, ttl: float) -> None:
        self.history.append(record)
        await super().put_relay(record, ttl=ttl)

    async def remove_relay(self, relay_id: str) -> None:
        self.history.append(f"removed {relay_id}")
        await super().remove_relay(relay_id)


class BrokenRegistry(MemoryRegistry):
    """A registry whose every call fails, as if Redis were unreachable."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def put_relay(self, record: RelayRecord, *, ttl: float) -> None:
        self.calls += 1
        raise BusError("registry is down (test)")

    async def remove_relay(self, relay_id: str) -> None:
        raise BusError("registry is down (test)")

    async def revoked(self) -> frozenset[str]:
        self.calls += 1
        raise BusError("registry is down (test)")

    async def is_revoked(self, serial: str) -> bool:
        raise BusError("registry is down (test)")


@pytest.fixture
def registry() -> RecordingRegistry:
    return RecordingRegistry()


@pytest.fixture
async def start_relay(
    server_context: ssl.SSLContext, bus: InProcessBus, registry: RecordingRegistry
) -> AsyncIterator[StartRelay]:
    """Start relays on 127.0.0.1 port 0 with the bus and registry; every one is closed afterwards."""
    async with started_relays() as start:

        async def start_with(**overrides: Any) -> Relay:
            options = relay_options(RELAY_ID, bus, server_context) | {
                "registry": registry,
                "drain_timeout": 2.0,
                "register_interval": 50 * MS,
                "revocation_poll_interval": 50 * MS,
            }
            return await start(**options | overrides)

        yield start_with


# ---- agents ------------------------------------------------------------------------------


class Client(RelayClient):
    """A relay client that can also read everything up to the close."""

    async def frames_until_closed(self) -> tuple[list[ServerFrame], Close]:
        """Everything the relay still sends, then the close frame."""
        frames = []
        async with asyncio.timeout(IO_TIMEOUT):
            while True:
                try:
                    frames.append(protocol.decode_server_frame(await self.ws.recv()))
                except ConnectionClosed as exc:
                    assert exc.rcvd is not None, "the relay dropped the connection without a close frame"
                    return frames, exc.rcvd


Open = Callable[..., Awaitable[Client]]


@pytest.fixture
async def open_client() -> AsyncIterator[Open]:
    """Connect ``credentials`` to a relay and read the welcome; every client is closed afterwards."""
    async with contextlib.AsyncExitStack() as stack:

        async def open_one(relay: Relay, credentials: Credentials, **kwargs: Any) -> Client:
            ws = await stack.enter_async_context(connect_to_relay(relay.url, credentials.context, **kwargs))
            await read_welcome(ws)
            return Client(credentials.host_id, ws, OutboundWindow(credentials.host_id, first_seq=1))

        yield open_one


async def _refused_with(relay: Relay, credentials: Credentials) -> Close:
    """Connect, and return the close frame the relay answers with before anything else."""
    async with connect_to_relay(relay.url, credentials.context) as ws:
        try:
            async with asyncio.timeout(IO_TIMEOUT):
                frame = await ws.recv()
        except ConnectionClosed as exc:
            assert exc.rcvd is not None
            return exc.rcvd
    raise AssertionError(f"expected to be refused, got {frame!r}")


async def _publish_command(bus: InProcessBus, host_id: str, command_id: str, *, padding: int = 0) -> None:
    await publish_command(bus, RELAY_ID, host_id, command_id, {"pad": "x" * padding})


async def _record(registry: MemoryRegistry) -> RelayRecord | None:
    records = [r for r in await registry.relays() if r.relay_id == RELAY_ID]
    return records[0] if records else None


# ---- rate limits, Sans-I/O ---------------------------------------------------------------


class TestTokenBuckets:
    """Token buckets and the per-source limiter are pure functions of a monotonic time, in bounded memory."""

    def test_a_bucket_allows_its_burst_then_its_rate(self) -> None:
        """A full bucket gives ``burst`` tokens at once, then one per 1/rate seconds."""
        bucket = TokenBucket(rate=10.0, burst=3, updated=100.0)

        assert [bucket.take(100.0) for _ in range(4)] == [True, True, True, False]
        assert bucket.wait(100.0) == pytest.approx(0.1)
        assert not bucket.take(100.05)
        assert bucket.take(100.1)

    def test_refilled_sources_are_forgotten(self) -> None:
        """A source whose bucket has refilled is dropped, so memory follows only recently active sources."""
        limiter = SourceRateLimiter(rate=1.0, burst=2, max_sources=100)
        for number in range(50):
            assert limiter.admit(f"10.0.0.{number}", now=0.0) == 0.0
        assert len(limiter) == 50

        assert limiter.admit("10.0.1.1", now=10.0) == 0.0

        assert len(limiter) == 1

    def test_the_number_of_tracked_sources_is_capped(self) -> None:
        """Beyond ``max_sources`` the least recently seen source is forgotten."""
        limiter = SourceRateLimiter(rate=0.001, burst=1, max_sources=3)
        for number in range(10):
            limiter.admit(f"10.0.0.{number}", now=float(number))

        assert len(limiter) == 3
        assert limiter.admit("10.0.0.9", now=10.0) > 0  # still tracked: refused
        assert limiter.admit("10.0.0.0", now=10.0) == 0.0  # forgotten: a fresh bucket

    def test_ipv6_sources_count_per_64_prefix(self) -> None:
        """Addresses inside one IPv6 /64 share a bucket; IPv4-mapped addresses count as their IPv4 address."""
        assert source_key("2001:db8:1:2::1") == source_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
        assert source_key("::ffff:192.0.2.7") == "192.0.2.7"
        assert source_key("127.0.0.1") == "127.0.0.1"


# ---- over the network --------------------------------------------------------------------


class TestMessageRate:
    """An agent sending faster than its message rate loses its own connection, and only that one."""

    async def test_a_flood_closes_that_agent_with_rate_limited_after_acking_what_it_forwarded(
        self, start_relay: StartRelay, issue: Issue, open_client: Open, bus: InProcessBus
    ) -> None:
        """50 frames at once against 20/s with a burst of 5 close the flooder with 4004; the other agent is served."""
        relay = await start_relay(max_messages_per_second=20.0, message_burst=5)
        calm = await open_client(relay, issue("h-calm"))
        flooder = await open_client(relay, issue("h-flood"))

        frames = [flooder.heartbeat() for _ in range(50)]
        for _seq, frame in frames:
            with contextlib.suppress(ConnectionClosed):
                await flooder.ws.send(frame)
        received, close = await flooder.frames_until_closed()

        assert close.code == protocol.CLOSE_RATE_LIMITED
        assert "messages/s" in close.reason
        acked = [m.body.seq for m in received if isinstance(m, protocol.Ack)]
        # The burst (and whatever refilled meanwhile) was forwarded, acked before the close, and nothing more.
        assert len(acked) >= 5 and acked == [seq for seq, _ in frames[: len(acked)]]
        assert relay.messages_forwarded == len(acked) < 50
        await calm.expect_ack(await calm.send_heartbeat())
        await wait_for(lambda: set(relay.agents) == {"h-calm"})
        assert relay.refused["message_rate"] == 1

    async def test_an_agent_within_its_rate_is_not_closed(
        self, start_relay: StartRelay, issue: Issue, open_client: Open
    ) -> None:
        """Frames spaced below the rate are all forwarded, well past the burst."""
        relay = await start_relay(max_messages_per_second=200.0, message_burst=3)
        client = await open_client(relay, issue("h-1"))

        for _ in range(15):
            await client.expect_ack(await client.send_heartbeat())
            await asyncio.sleep(10 * MS)  # 100/s at most, half the rate

        assert relay.messages_forwarded == 15 and set(relay.agents) == {"h-1"}


class TestSourceConnectionRate:
    """New connections from one source address beyond its rate are refused with HTTP 429 before the upgrade."""

    async def test_the_connection_beyond_the_burst_is_refused_and_another_source_is_accepted(
        self, start_relay: StartRelay, issue: Issue, open_client: Open
    ) -> None:
        """After its burst of 3, the 4th connection from 127.0.0.1 gets 429 with Retry-After; 127.0.0.2 still connects."""
        relay = await start_relay(max_connections_per_source_per_minute=1.0, connection_burst_per_source=3)
        clients = [await open_client(relay, issue(f"h-{n}")) for n in range(3)]

        with pytest.raises(InvalidStatus) as refused:
            async with connect_to_relay(relay.url, issue("h-late").context):
                pass

        assert refused.value.response.status_code == 429
        assert int(refused.value.response.headers["Retry-After"]) >= 1
        other = await open_client(relay, issue("h-elsewhere"), local_addr=("127.0.0.2", 0))
        await other.expect_ack(await other.send_heartbeat())
        for client in clients:
            await client.expect_ack(await client.send_heartbeat())
        assert relay.refused["source_rate"] == 1

    async def test_a_service_gateway_is_not_held_to_the_renters_limit_and_a_forged_one_is(
        self, start_relay: StartRelay, ca: CertificateAuthority
    ) -> None:
        """A master's gateway streams (kind svc) pass the renters' burst of 2 from one source; renters' tcp tokens, and a
        token claiming svc under a bad signature, get 429 beyond it. (No host is connected: an admitted one is 404.)"""
        relay = await start_relay(token_key=certificate_public_key(ca.certificate), renter_connection_burst_per_source=2,
                                  max_renter_connections_per_source_per_minute=1.0)  # fmt: skip
        url = relay.url.replace(AGENT_PATH, CONNECT_PATH)
        client = ssl.create_default_context(cadata=ca.cert_pem.decode())

        async def status(kind: str, *, forge: bool = False) -> int:
            claims = new_claims(account_id="a-1", rental_id="r-1", host_id="h-away", kind=kind, port=8000, expires_at=time.time() + 60)
            token = ca.sign_connect_token(claims)
            if forge:
                token = token[:-6] + ("AAAAAA" if not token.endswith("AAAAAA") else "BBBBBB")
            with pytest.raises(InvalidStatus) as refused:
                async with connect_to_relay(url, client, additional_headers={"Authorization": f"Bearer {token}"}):
                    pass
            return int(refused.value.response.status_code)

        assert [await status("svc") for _ in range(5)] == [404] * 5
        assert [await status("tcp") for _ in range(3)] == [404, 404, 429]
        assert await status("svc", forge=True) == 429

    async def test_health_checks_are_not_rate_limited(
        self, start_relay: StartRelay, issue: Issue
    ) -> None:
        """/health answers however many probes one source sends."""
        relay = await start_relay(max_connections_per_source_per_minute=1.0, connection_burst_per_source=1)
        context = issue("h-probe").context
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=IO_TIMEOUT)) as session:
            for _ in range(5):
                async with session.get(f"https://127.0.0.1:{relay.port}/health", ssl=context) as response:
                    assert response.status == 200
                    body = await response.json()
        assert body["draining"] is False and body["capacity"] == relay.max_connections


class TestCapacity:
    """A full relay turns away new hosts and keeps serving the ones it has."""

    async def test_a_full_relay_closes_the_next_host_with_too_many_connections(
        self, start_relay: StartRelay, issue: Issue, open_client: Open
    ) -> None:
        """With max_connections=2, a third host is closed with 4009 and the first two are unaffected."""
        relay = await start_relay(max_connections=2)
        first, second = await open_client(relay, issue("h-1")), await open_client(relay, issue("h-2"))

        close = await _refused_with(relay, issue("h-3"))

        assert close.code == protocol.CLOSE_TOO_MANY_CONNECTIONS and "another relay" in close.reason
        await first.expect_ack(await first.send_heartbeat())
        await second.expect_ack(await second.send_heartbeat())
        assert set(relay.agents) == {"h-1", "h-2"}


class TestSlowConsumer:
    """An agent that does not read what the relay sends it is disconnected instead of buffering without bound."""

    async def test_an_agent_that_never_reads_is_closed_with_slow_consumer(
        self, start_relay: StartRelay, issue: Issue, open_client: Open, bus: InProcessBus
    ) -> None:
        """Commands keep arriving for an agent that reads nothing: once 4 are queued it is closed with 4007."""
        relay = await start_relay(max_outbound_queue=4, close_timeout=IO_TIMEOUT)
        calm = await open_client(relay, issue("h-calm"))
        stuck = await open_client(relay, issue("h-stuck"), max_queue=1)

        number = 0
        async with asyncio.timeout(IO_TIMEOUT):
            # 32 KiB commands fill the socket buffers between us; then the relay's queue fills.
            while not relay.refused["slow_consumer"]:
                await _publish_command(bus, "h-stuck", f"cmd-{number}", padding=32 << 10)
                number += 1
                await asyncio.sleep(1 * MS)
        _, close = await stuck.frames_until_closed()

        assert close.code == protocol.CLOSE_SLOW_CONSUMER
        await calm.expect_ack(await calm.send_heartbeat())
        await wait_for(lambda: set(relay.agents) == {"h-calm"})


class TestRevocation:
    """A revoked certificate cannot connect, and a connection whose certificate gets revoked is closed within seconds."""

    async def test_a_revoked_certificate_is_refused_at_connect(
        self, start_relay: StartRelay, issue: Issue, registry: RecordingRegistry
    ) -> None:
        """Connecting with a revoked serial gets 4005 telling the host to re-enroll."""
        relay = await start_relay(revocation_poll_interval=60.0)  # only the check at connect can refuse it
        credentials = issue("h-revoked")
        await registry.revoke(credentials.serial, until=time.time() + 3600)

        close = await _refused_with(relay, credentials)

        assert close.code == protocol.CLOSE_REVOKED and "re-enroll" in close.reason
        assert relay.agents == {}

    async def test_revoking_a_connected_agent_closes_it_within_the_poll_interval(
        self, start_relay: StartRelay, issue: Issue, open_client: Open, registry: RecordingRegistry
    ) -> None:
        """With a 50 MS poll, a connected agent whose serial is revoked is closed with 4005 soon after; another stays."""
        relay = await start_relay(revocation_poll_interval=50 * MS)
        kept, doomed_credentials = issue("h-kept"), issue("h-doomed")
        kept_client, doomed = await open_client(relay, kept), await open_client(relay, doomed_credentials)
        assert relay.agents["h-doomed"].serial == doomed_credentials.serial

        started = time.monotonic()
        await registry.revoke(doomed_credentials.serial, until=time.time() + 3600)
        close = await doomed.closed()

        assert close.code == protocol.CLOSE_REVOKED and "re-enroll" in close.reason
        assert time.monotonic() - started < 20 * 50 * MS
        await kept_client.expect_ack(await kept_client.send_heartbeat())
        assert set(relay.agents) == {"h-kept"}

    async def test_revoking_a_certificate_ends_its_running_speed_test(
        self, start_relay: StartRelay, issue: Issue, registry: RecordingRegistry
    ) -> None:
        """A speed test connection is closed with 4005 when its certificate is revoked."""
        relay = await start_relay(revocation_poll_interval=50 * MS)
        credentials = issue("h-tester")
        async with connect_to_relay(f"wss://127.0.0.1:{relay.port}{SPEEDTEST_PATH}", credentials.context) as ws:
            async with asyncio.timeout(IO_TIMEOUT):
                assert '"hello"' in str(await ws.recv())
            await registry.revoke(credentials.serial, until=time.time() + 3600)
            with pytest.raises(ConnectionClosed) as closed:
                async with asyncio.timeout(IO_TIMEOUT):
                    await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == protocol.CLOSE_REVOKED

    async def test_a_failing_registry_is_logged_and_the_relay_keeps_serving(
        self, start_relay: StartRelay, issue: Issue, open_client: Open, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Registry errors (publish, revocation reads) are logged and retried; agents are still served."""
        broken = BrokenRegistry()
        caplog.set_level(logging.WARNING, logger="access.relay")
        relay = await start_relay(registry=broken)
        client = await open_client(relay, issue("h-1"))

        await client.expect_ack(await client.send_heartbeat())
        await wait_for(lambda: broken.calls >= 6)  # retried, not given up on

        assert "cannot read revoked certificates" in caplog.text
        assert "cannot publish its registry record" in caplog.text
        await client.expect_ack(await client.send_heartbeat())

    async def test_an_expired_certificate_fails_the_tls_handshake(
        self, start_relay: StartRelay, issue: Issue, open_client: Open
    ) -> None:
        """A certificate whose validity ended is refused by TLS itself; nobody is registered and others are served."""
        relay = await start_relay()
        good = await open_client(relay, issue("h-good"))
        expired = issue("h-expired", now=datetime.now(UTC) - timedelta(hours=2), validity=timedelta(minutes=5))

        with pytest.raises((OSError, InvalidHandshake)):
            async with connect_to_relay(relay.url, expired.context) as ws:
                async with asyncio.timeout(IO_TIMEOUT):
                    await ws.recv()

        await good.expect_ack(await good.send_heartbeat())
        assert set(relay.agents) == {"h-good"}
        # The control: a certificate issued as long ago, but still valid, is accepted.
        recent = issue("h-recent", now=datetime.now(UTC) - timedelta(hours=2), validity=timedelta(hours=4))
        await open_client(relay, recent)

    def test_the_serial_read_from_der_matches_the_issued_serial(self, ca: CertificateAuthority) -> None:
        """serial_hex_from_der gives the same 40 hex digits as IssuedCertificate.serial_hex."""
        from cryptography import x509
        from cryptography.hazmat.primitives.serialization import Encoding

        issued = ca.sign_agent_csr(make_csr(generate_private_key(), "h-1"), host_id="h-1")
        der = x509.load_pem_x509_certificate(issued.cert_pem).public_bytes(Encoding.DER)

        assert serial_hex_from_der(der) == issued.serial_hex
        assert len(issued.serial_hex) == 40


class TestRegistration:
    """The relay publishes its record with live load, says when it drains, and removes itself when closed."""

    async def test_the_record_lists_the_relay_with_its_live_connection_count(
        self, start_relay: StartRelay, issue: Issue, open_client: Open, registry: RecordingRegistry
    ) -> None:
        """After start the registry has the relay's URL, capacity and 0 connections; connections count up as agents join."""
        relay = await start_relay(max_connections=50)
        record = await _record(registry)
        assert record is not None
        assert (record.url, record.host, record.port, record.capacity, record.draining) == (
            relay.url, "127.0.0.1", relay.port, 50, False
        )
        assert record.connections == 0

        await open_client(relay, issue("h-1"))
        await open_client(relay, issue("h-2"))

        async def two_connections() -> bool:
            current = await _record(registry)
            return current is not None and current.connections == 2

        await wait_for(two_connections)

    async def test_the_public_url_is_what_is_published(
        self, start_relay: StartRelay, registry: RecordingRegistry
    ) -> None:
        """With public_url set, the record names it, and its host and port."""
        await start_relay(public_url="wss://relay-1.example.net:8443/v1/agent")

        record = await _record(registry)

        assert record is not None
        assert (record.url, record.host, record.port) == ("wss://relay-1.example.net:8443/v1/agent", "relay-1.example.net", 8443)

    async def test_close_publishes_draining_then_removes_the_record(
        self, start_relay: StartRelay, issue: Issue, open_client: Open, registry: RecordingRegistry
    ) -> None:
        """Closing puts a draining record first (with the agents still counted), and removes the record last."""
        relay = await start_relay()
        await open_client(relay, issue("h-1"))
        await wait_for(lambda: relay.agents != {})

        async with asyncio.timeout(IO_TIMEOUT):
            await relay.close()

        draining = [r for r in registry.history if isinstance(r, RelayRecord) and r.draining]
        assert len(draining) == 1 and draining[0].connections == 1
        assert registry.history[-1] == f"removed {RELAY_ID}"
        assert registry.history.index(draining[0]) == len(registry.history) - 2  # nothing published in between
        assert await registry.relays() == []


class TestDrain:
    """close() tells every agent to move, closes with 1001, and finishes within its bound."""

    async def test_close_sends_each_agent_a_move_then_closes_with_going_away(
        self, start_relay: StartRelay, issue: Issue, open_client: Open
    ) -> None:
        """Each agent in session gets its pending ack, a move with retry_after 0, then close 1001."""
        relay = await start_relay()
        clients = [await open_client(relay, issue(f"h-{n}")) for n in range(3)]
        seqs = []
        for client in clients:
            seqs.append(await client.send_heartbeat())
            await client.expect_ack(seqs[-1])

        async with asyncio.timeout(IO_TIMEOUT):
            await relay.close()

        for client in clients:
            frames, close = await client.frames_until_closed()
            assert len(frames) == 1 and isinstance(frames[0], protocol.Move), frames
            assert frames[0].body.retry_after == 0 and frames[0].body.reason
            assert close.code == protocol.CLOSE_GOING_AWAY and "reconnect" in close.reason
        assert relay.agents == {}

    async def test_close_with_many_agents_finishes_within_the_drain_bound(
        self, start_relay: StartRelay, issue: Issue, open_client: Open
    ) -> None:
        """With 40 agents connected, close() does not wait out drain_timeout: it returns once every agent has gone,
        each closed with going-away (the guard is half the drain bound)."""
        relay = await start_relay(drain_timeout=120.0, connection_burst_per_source=40)
        clients = [await open_client(relay, issue(f"h-{n}")) for n in range(40)]
        for client in clients:
            await client.send_heartbeat()

        async with asyncio.timeout(60.0):  # a close that waited for the drain bound would run past this
            await relay.close()

        assert relay.agents == {}
        for client in clients:
            _, close = await client.frames_until_closed()
            assert close.code == protocol.CLOSE_GOING_AWAY and "reconnect" in close.reason

    async def test_a_client_stuck_in_its_handshake_does_not_hold_up_close(
        self, start_relay: StartRelay, issue: Issue
    ) -> None:
        """A client that finished TLS but never sends its upgrade request is dropped once drain_timeout is up."""
        relay = await start_relay(drain_timeout=200 * MS)  # open_timeout is IO_TIMEOUT: far longer
        credentials = issue("h-silent")
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port, ssl=credentials.context)
        try:
            await asyncio.sleep(50 * MS)  # the relay has accepted it and waits for the request
            started = time.monotonic()
            async with asyncio.timeout(IO_TIMEOUT):
                await relay.close()
            assert time.monotonic() - started < 1.0
            async with asyncio.timeout(IO_TIMEOUT):
                with contextlib.suppress(OSError):
                    assert await reader.read() == b""  # dropped
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


# ---- a real agent moving between relays ----------------------------------------------------

AGENT_START_S = 60.0  # a hang guard for a whole agent's start and its first samples on a loaded CI machine
HOST = "h-mover"


async def _events(bus: InProcessBus) -> list[protocol.BusEnvelope]:
    batch = await bus.read(protocol.AGENT_EVENTS_STREAM, EVENTS_GROUP, "t", count=10_000, block=None)
    return [protocol.decode_bus_envelope(m.payload) for m in batch]


class TestAgentMoves:
    """A real agent on a draining relay moves to the next relay without losing a message."""

    async def test_the_agent_moves_to_relay_b_when_a_drains_and_every_message_reaches_the_bus(
        self,
        start_relay: StartRelay,
        ca: CertificateAuthority,
        bus: InProcessBus,
        tmp_path: Path,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """Closing relay A sends the agent a move; it reconnects to B, and every non-hello message it wrote is on the bus."""
        caplog.set_level(logging.INFO, logger="agent.runner")
        relay_a = await start_relay(relay_id="relay-a")
        relay_b = await start_relay(relay_id="relay-b")
        agent = Agent(
            enrolled_state(ca, tmp_path / "agent", HOST), SimulatedBackend("sim:2xRTX4090", seed=HOST),
            relay_urls=[relay_a.url, relay_b.url], timings=fast_timings(), rng=random.Random(7),
        )
        recorder = RecordingStore(agent.window.store)
        agent.window.store = recorder
        seen: list[protocol.BusEnvelope] = []

        async def collect() -> list[protocol.BusEnvelope]:
            seen.extend(await _events(bus))
            return seen

        task = asyncio.create_task(agent.run())
        try:
            await wait_for(lambda: agent.relay_id == "relay-a" and agent.samples_taken > 5, timeout=AGENT_START_S)
            # The real agent offers larger stream frames and the relay agrees them (shared.streams.agree_max_data).
            assert agent.streams is not None and agent.streams.mux.max_data == LARGE_DATA
            assert relay_a.agents[HOST].streams.mux.max_data == LARGE_DATA
            async with asyncio.timeout(IO_TIMEOUT):
                await relay_a.close()
            await wait_for(lambda: agent.relay_id == "relay-b" and agent.connected.is_set(), timeout=AGENT_START_S)
            await wait_for(lambda: agent.samples_taken > 20 and len(agent.window) == 0, timeout=AGENT_START_S)
            sent = {seq for seq, kind in recorder.added.items() if kind != "hello"}
            on_bus = {e.message.seq for e in await collect()}
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await agent.close()

        assert "relay asks us to move" in caplog.text
        assert sent and sent <= on_bus
        assert {e.relay_id for e in seen} == {"relay-a", "relay-b"}


class TestRedisRegistry:
    """Against real Redis, the relay publishes its record and enforces a revocation recorded there."""

    @pytest.mark.redis
    async def test_record_and_revocation_through_redis(
        self, start_relay: StartRelay, issue: Issue, open_client: Open, redis_url: str, bus_prefix: str
    ) -> None:
        """The record appears under the test prefix, a revocation written to Redis closes the agent with 4005, and close removes the record."""
        redis_registry = RedisRegistry.from_url(redis_url, prefix=bus_prefix)
        try:
            relay = await start_relay(registry=redis_registry)
            credentials = issue("h-redis")
            client = await open_client(relay, credentials)

            async def listed_with_one() -> bool:
                return [(r.relay_id, r.connections) for r in await redis_registry.relays()] == [(RELAY_ID, 1)]

            await wait_for(listed_with_one)
            await redis_registry.revoke(credentials.serial, until=time.time() + 3600)
            close = await client.closed()
            assert close.code == protocol.CLOSE_REVOKED

            async with asyncio.timeout(IO_TIMEOUT):
                await relay.close()
            assert await redis_registry.relays() == []
        finally:
            await redis_registry.close()


class TestTlsBuffer:
    def test_the_tls_read_buffer_setting_resizes_asyncios_buffer(self) -> None:
        """set_tls_read_buffer changes the per-connection TLS read buffer (the relays in the region test run with it)."""
        import asyncio.sslproto

        from access.service import set_tls_read_buffer

        before = asyncio.sslproto.SSLProtocol.max_size
        try:
            assert set_tls_read_buffer(32)
            assert asyncio.sslproto.SSLProtocol.max_size == 32 * 1024
        finally:
            asyncio.sslproto.SSLProtocol.max_size = before


class TestStreamDataSetting:
    """``stream_data_kib`` decides the DATA frame an agent built from its settings offers, and the relay agrees it."""

    @pytest.mark.parametrize("kib", [64, 128])
    async def test_the_agent_offers_its_setting_and_the_link_uses_it(
        self, start_relay: StartRelay, ca: CertificateAuthority, tmp_path: Path, kib: int
    ) -> None:
        relay = await start_relay()
        enrolled_state(ca, tmp_path / "agent", HOST)
        agent = agent_from_settings(AgentSettings(data_dir=tmp_path / "agent", gpus="sim:1xRTX4090", relay_url=relay.url, stream_data_kib=kib))
        agent.timings = fast_timings()
        task = asyncio.create_task(agent.run())
        try:
            # A hang guard: a whole agent's start (its key, TLS, hello, welcome) took over 5 s on a CI machine at load 14.
            await wait_for(lambda: agent.streams is not None and HOST in relay.agents, timeout=AGENT_START_S)
            assert agent.streams is not None and agent.streams.mux.max_data == kib << 10
            assert relay.agents[HOST].streams.mux.max_data == kib << 10
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await agent.close()

    def test_a_setting_outside_64_to_256_is_refused(self) -> None:
        for kib in (32, 512):
            with pytest.raises(ValueError, match="stream_data_kib"):
                AgentSettings(stream_data_kib=kib)
