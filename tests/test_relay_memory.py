"""Tests for what one agent connection holds in a relay: a real Relay over TLS 1.3 on loopback, an
in-process bus and real websocket clients. An idle agent holds no writer task, no stream state and
no TLS read buffer of its own; an agent that does not read cannot make the relay buffer for it."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import gc
import secrets
import socket
import ssl
import struct
import termios
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from access import tls
from access.relay import Relay
from shared import protocol
from shared.bus import InProcessBus
from shared.crypto import CertificateAuthority
from tests.pki import relay_server_context
from tests.relayharness import (
    StartRelay,
    connect_agent,
    events_bus,
    relay_options,
    started_relays,
    wait_for,
)

RELAY_ID = "relay-memory"
SOCKET_BUFFER = 16 << 10
WRITE_LIMIT = 4 << 10
FLOOD_TIMEOUT = 30.0  # a few thousand frames each way, on a loaded machine
TLS_READ_LIMIT = 8 << 10


@pytest.fixture
def server_context(ca: CertificateAuthority, tmp_path: Path) -> ssl.SSLContext:
    return relay_server_context(ca, tmp_path / "relay")


@pytest.fixture
async def bus() -> AsyncIterator[InProcessBus]:
    async with events_bus() as b:
        yield b


@pytest.fixture
async def start_relay(server_context: ssl.SSLContext, bus: InProcessBus) -> AsyncIterator[StartRelay]:
    async with started_relays() as start:

        async def start_with(**overrides: Any) -> Relay:
            return await start(**relay_options(RELAY_ID, bus, server_context) | overrides)

        yield start_with


@pytest.fixture
async def stack() -> AsyncIterator[contextlib.AsyncExitStack]:
    async with contextlib.AsyncExitStack() as exits:
        yield exits


class TestIdleAgent:
    """An agent between two messages costs the relay its socket, its TLS session and a few objects."""

    async def test_agents_share_their_loops_tls_read_buffer(
        self, start_relay: StartRelay, ca: CertificateAuthority, tmp_path: Path, stack: contextlib.AsyncExitStack
    ) -> None:
        """Every established agent connection reads through one buffer (asyncio's SSLProtocol internals
        are as access.tls expects), and both still work."""
        relay = await start_relay()
        first = await connect_agent(relay, ca, tmp_path, stack, "h-1")
        second = await connect_agent(relay, ca, tmp_path, stack, "h-2")

        protocols = [relay.agents[h].connection.transport._ssl_protocol for h in ("h-1", "h-2")]  # type: ignore[attr-defined]
        assert protocols[0]._ssl_buffer is protocols[1]._ssl_buffer
        assert protocols[0]._ssl_buffer_view is protocols[0].get_buffer(-1)  # asyncio reads into it
        await first.expect_ack(await first.send_heartbeat())
        await second.expect_ack(await second.send_heartbeat())

    async def test_a_plain_transport_is_left_alone(self) -> None:
        """share_read_buffer changes nothing on a transport that is not asyncio's TLS one."""
        loop = asyncio.get_running_loop()
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        async with server:
            _reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
            assert not tls.share_read_buffer(writer.transport)
            writer.close()
        assert loop.is_running()

    async def test_a_connection_keeps_no_empty_deque(
        self, start_relay: StartRelay, ca: CertificateAuthority, tmp_path: Path, stack: contextlib.AsyncExitStack,
    ) -> None:
        """websockets' drain waiters and frame queue and asyncio's TLS write backlog are small lists (an empty
        deque is 760 bytes), and frames still flow both ways through them."""
        relay = await start_relay()
        agent = await connect_agent(relay, ca, tmp_path, stack, "h-queues")
        connection = relay.agents["h-queues"].connection
        queues = (connection.drain_waiters, connection.recv_messages.frames.queue,
                  connection.transport._ssl_protocol._write_backlog)  # type: ignore[attr-defined]
        assert all(type(queue) is tls.SmallQueue for queue in queues)
        for _ in range(3):
            await agent.expect_ack(await agent.send_heartbeat())
        for _ in range(20):  # several frames queued at once, read in order
            await agent.ws.send(agent.heartbeat()[1])
        seqs = []
        for _ in range(20):
            ack = await agent.recv()
            assert isinstance(ack, protocol.Ack)
            seqs.append(ack.body.seq)
        assert seqs == sorted(seqs) and len(set(seqs)) == 20

    def test_a_small_queue_behaves_as_a_deque(self) -> None:
        ours, theirs = tls.SmallQueue([1, 2]), collections.deque([1, 2])
        for queue in (ours, theirs):
            queue.append(3)
            queue.extendleft(reversed([-1, 0]))  # as websockets' SimpleQueue.put_back
            assert queue.popleft() == -1
        assert list(ours) == list(theirs) == [0, 1, 2, 3]

    async def test_the_relay_sends_no_session_tickets(self, start_relay: StartRelay) -> None:
        relay = await start_relay()
        assert relay.ssl_context.num_tickets == 0

    async def test_an_idle_agent_has_no_writer_task_and_no_stream_state(
        self, start_relay: StartRelay, bus: InProcessBus, ca: CertificateAuthority, tmp_path: Path,
        stack: contextlib.AsyncExitStack,
    ) -> None:
        """After the welcome and a few acks the link holds no task of its own, no outbox and no
        multiplexer; a command starts a writer that ends, with its outbox, once the command is out."""
        relay = await start_relay()
        agent = await connect_agent(relay, ca, tmp_path, stack, "h-idle")
        for _ in range(3):
            await agent.expect_ack(await agent.send_heartbeat())
        link = relay.agents["h-idle"]
        await wait_for(lambda: not link.writing)
        assert not link.has_streams and link.queued == 0 and link._outbox is None  # not even an empty deque

        delivery = protocol.CommandDelivery(
            host_id="h-idle",
            command=protocol.Command(body=protocol.CommandBody(command_id="c-1", kind="health_check", args={})),
        )
        await bus.publish(protocol.commands_stream(RELAY_ID), delivery.model_dump_json().encode())
        command = await agent.recv()
        assert isinstance(command, protocol.Command) and command.body.command_id == "c-1"
        await wait_for(lambda: not link.writing)
        assert not link.has_streams
        assert link._outbox is None  # not even an empty deque


def _flow(transport: Any) -> str:
    """Where a TLS connection's bytes wait, for a failure's message: asyncio's buffers and pauses on
    both layers and the kernel's queues of its socket."""
    protocol_ = transport._ssl_protocol
    below = protocol_._transport
    sock = transport.get_extra_info("socket")
    queues = ""
    if sock is not None:
        unread, unsent = (struct.unpack("i", fcntl.ioctl(sock.fileno(), request, b"\0" * 4))[0]
                          for request in (termios.FIONREAD, termios.TIOCOUTQ))
        queues = f", kernel: {unread} B unread, {unsent} B unsent"
    return (f"(TLS: {protocol_._incoming.pending} B to decrypt, {protocol_._outgoing.pending} B encrypted, "
            f"app reading paused {protocol_._app_reading_paused}, socket reading paused {protocol_._ssl_reading_paused}, "
            f"writing paused {protocol_._ssl_writing_paused}, app writing paused {protocol_._app_writing_paused}; "
            f"socket transport: {below.get_write_buffer_size()} B to write, reading {below.is_reading()}{queues})")


def _holders(marker: str | bytes) -> list[object]:
    """Every object that references a string (``str`` or ``bytes``-like, as ``marker``) containing
    ``marker``, other than ``marker`` itself and bus records (they are what the relay forwards, the
    bus's memory: Redis's in production)."""
    kinds = (str,) if isinstance(marker, str) else (bytes, bytearray)
    gc.collect()
    return [
        holder
        for holder in gc.get_objects()
        for referent in gc.get_referents(holder)
        if isinstance(referent, kinds) and marker in referent and referent is not marker  # type: ignore[operator]
        and not (isinstance(referent, bytes) and referent.startswith(b'{"relay_id":'))
    ]


class TestWhatAConnectionKeeps:
    """What the relay keeps of an agent's connection once it is established and its frames acked."""

    async def test_no_frame_payload_is_held_once_acknowledged(
        self, start_relay: StartRelay, ca: CertificateAuthority, tmp_path: Path, stack: contextlib.AsyncExitStack
    ) -> None:
        """After a frame of a few KB is acknowledged, nothing in the process (the relay, websockets'
        parser and assembler, asyncio) references its payload: an idle agent costs no last frame."""
        relay = await start_relay()
        agent = await connect_agent(relay, ca, tmp_path, stack, "h-payload")
        marker = f"payload-{secrets.token_hex(8)}"
        rentals = [f"{marker}-{n:03d}" for n in range(100)]  # ~3 KB
        seq, frame = agent.window.heartbeat(protocol.HeartbeatBody(uptime_s=1.0, running_rentals=rentals))
        await agent.ws.send(frame)
        await agent.expect_ack(seq)
        assert relay.messages_forwarded == 1
        assert _holders(marker.encode()) == []
        await agent.expect_ack(await agent.send_heartbeat())  # and the connection still works

    async def test_no_decoded_peer_certificate_and_no_handshake_headers(
        self, start_relay: StartRelay, ca: CertificateAuthority, tmp_path: Path, stack: contextlib.AsyncExitStack
    ) -> None:
        """An agent's connection keeps neither asyncio's dict of its certificate nor the upgrade
        request's and response's headers; the relay still knows its certificate's serial."""
        relay = await start_relay()
        probe = f"probe-{secrets.token_hex(8)}"  # the agent's copy is this very str, the relay's its own
        agent = await connect_agent(relay, ca, tmp_path, stack, "h-lean", additional_headers={"X-Probe": probe})
        link = relay.agents["h-lean"]
        connection = link.connection
        assert connection.transport.get_extra_info("peercert") is None
        assert connection.transport.get_extra_info("ssl_object").getpeercert(binary_form=True)
        assert connection.request is not None and connection.request.path == "/v1/agent"
        assert connection.response is not None and connection.response.status_code == 101
        assert _holders(probe) == []
        assert not connection.request.headers and not connection.response.headers
        assert link.serial
        await agent.expect_ack(await agent.send_heartbeat())

    async def test_the_handler_holds_no_welcome_and_no_certificate(
        self, start_relay: StartRelay, ca: CertificateAuthority, tmp_path: Path, stack: contextlib.AsyncExitStack
    ) -> None:
        """The connection handler's frames, suspended while the agent is idle, hold neither the welcome
        model nor the certificate's DER."""
        relay = await start_relay()
        agent = await connect_agent(relay, ca, tmp_path, stack, "h-handler")
        await agent.expect_ack(await agent.send_heartbeat())
        der = relay.agents["h-handler"].connection.transport.get_extra_info("ssl_object").getpeercert(binary_form=True)
        gc.collect()
        handlers = [
            frame for frame in gc.get_objects()
            if type(frame).__name__ == "coroutine" and frame.cr_code is Relay._handle.__code__
        ]
        assert len(handlers) == 1
        held = gc.get_referents(handlers[0])
        assert not any(isinstance(value, protocol.Welcome) for value in held)
        assert der not in held


class TestAgentThatDoesNotRead:
    """An agent that keeps sending but reads none of its acks: the relay stops reading it instead of buffering."""

    async def test_the_relay_stops_reading_and_holds_at_most_its_write_limit(
        self, start_relay: StartRelay, bus: InProcessBus, ca: CertificateAuthority, tmp_path: Path,
        stack: contextlib.AsyncExitStack,
    ) -> None:
        """With small socket buffers on both sides, the relay's write buffer for the agent stays within
        websockets' write limit, nothing queues in its outbox, the agent is not closed, and once the
        agent reads again every message it sent is acknowledged."""
        relay = await start_relay(
            link_send_buffer=SOCKET_BUFFER, write_limit=WRITE_LIMIT, tls_read_limit=TLS_READ_LIMIT, max_messages_per_second=1e9,
            message_burst=1_000_000, ping_interval=60.0,
        )
        # A small send buffer on the agent's side too, so that its flood backs up in a few thousand frames. Its
        # receive buffer stays the kernel's to size: one fixed by SO_RCVBUF fills with the acks' small segments
        # (each costs the kernel far more than its bytes) while its window is still open, and the kernel drops
        # what arrives next; the relay's later segments then lie beyond the agent's window, so the agent ignores
        # the acknowledgements they carry and its flood stalls until the relay's retransmission timer, backing
        # off, fires again (1,588 frames, then 29 s without a send, on a loaded machine: TcpExtTCPRcvQDrop).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", relay.port))
        agent = await connect_agent(relay, ca, tmp_path, stack, "h-deaf", sock=sock, max_queue=1)
        agent.ws.transport.set_read_buffer_limits(high=1)  # type: ignore[attr-defined]  # stop reading the socket at once
        link = relay.agents["h-deaf"]
        transport = link.connection.transport
        sent: list[int] = []
        loop = asyncio.get_running_loop()
        last_sent = loop.time()

        async def flood() -> None:
            nonlocal last_sent
            while True:
                seq, frame = agent.heartbeat()
                sent.append(seq)  # before: a send cancelled while it waits has written its frame
                await agent.ws.send(frame)
                last_sent = loop.time()

        def state() -> str:
            return (f"{len(sent)} frames sent, the last send returned {loop.time() - last_sent:.1f} s ago; the relay's TLS read buffer {transport.get_read_buffer_size()} B, "  # type: ignore[attr-defined]
                    f"its write buffer {transport.get_write_buffer_size()} B, outbox {link.queued}, refused "
                    f"{dict(relay.refused)}, link closing: {transport.is_closing()}, agent state: {agent.ws.state.name}; "
                    f"relay {_flow(transport)}; agent {_flow(agent.ws.transport)}")  # fmt: skip

        # The agent reads again whatever happens below: a relay blocked writing to it would otherwise hold the
        # teardown (closing the relay waits for its handlers) until pytest's timeout, hiding the failure's cause.
        restore_reading = contextlib.ExitStack()
        restore_reading.callback(agent.ws.transport.set_read_buffer_limits)  # type: ignore[attr-defined]
        flooding = asyncio.create_task(flood())
        try:
            try:
                async with asyncio.timeout(FLOOD_TIMEOUT):
                    while True:
                        if transport.get_read_buffer_size() >= TLS_READ_LIMIT:  # type: ignore[attr-defined]
                            break
                        await asyncio.sleep(0.01)
            except TimeoutError:
                raise AssertionError(f"the relay never stopped reading within {FLOOD_TIMEOUT:g} s: {state()}") from None
            # The relay has stopped reading the agent: the acks it could not write hold up its
            # receive loop, websockets' queue is full, and the TLS layer stopped reading the socket.
            high_water = transport.get_write_buffer_limits()[1]
            assert transport.get_write_buffer_size() <= high_water + 1024  # at most one ack past the limit
            assert transport.get_read_buffer_size() <= TLS_READ_LIMIT + (256 << 10)  # type: ignore[attr-defined]  # + one read
            assert link.queued == 0 and "slow_consumer" not in relay.refused
        finally:
            flooding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flooding
            restore_reading.close()
        acked: set[int] = set()
        try:
            async with asyncio.timeout(FLOOD_TIMEOUT):
                while len(acked) < len(sent):
                    ack = await agent.recv()
                    assert isinstance(ack, protocol.Ack)
                    acked.add(ack.body.seq)
        except TimeoutError:
            raise AssertionError(f"{len(acked)} of {len(sent)} frames acknowledged within {FLOOD_TIMEOUT:g} s: {state()}") from None
        assert acked == set(sent) and "h-deaf" in relay.agents
