"""``shared.streams.transport.ChannelTransport``: a protocol (asyncssh's, in production) straight on a link's stream,
with flow control both ways, its end and its failures; two ``StreamLink``s joined back to back."""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import cast

from shared.streams import ResetCode
from shared.streams.aio import Channel, ChannelReset
from shared.streams.transport import DEFAULT_HIGH_WATER, ChannelTransport, StreamTunnel
from tests.helpers import eventually
from tests.test_stream_link import Pair

HEADER = b'{"rental_id":"r-1","port":22,"kind":"ssh"}'


class Recorder(asyncio.Protocol):
    """Records what the transport tells it; echoes what it receives when ``echo``."""

    def __init__(self, *, echo: bool = False, paused: bool = False) -> None:
        self.echo, self.start_paused = echo, paused
        self.transport: asyncio.Transport | None = None
        self.received = bytearray()
        self.events: list[str] = []
        self.lost: list[Exception | None] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.start_paused:
            transport.pause_reading()

    def data_received(self, data: bytes) -> None:
        self.received += data
        if self.echo:
            assert self.transport is not None
            self.transport.write(data)

    def eof_received(self) -> bool | None:
        self.events.append("eof")
        return None

    def pause_writing(self) -> None:
        self.events.append("pause_writing")

    def resume_writing(self) -> None:
        self.events.append("resume_writing")

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.append(exc)


async def served(protocol: Recorder, *, high_water: int = DEFAULT_HIGH_WATER) -> tuple[Pair, Channel, list[ChannelTransport]]:
    """A pair of links; the agent side serves each stream with ``protocol`` on a ``ChannelTransport``."""
    transports: list[ChannelTransport] = []
    pair = Pair(lambda channel: transports.append(ChannelTransport(channel, protocol, linger=2.0, high_water=high_water)))
    return pair, pair.relay.open(HEADER), transports


class TestChannelTransport:
    async def test_a_protocol_echoes_megabytes_and_the_peers_end_closes_it(self) -> None:
        """Bytes cross both ways in order; the peer's CLOSE is eof_received, then the stream ends on both links."""
        protocol = Recorder(echo=True)
        pair, channel, transports = await served(protocol)
        payload = os.urandom(3 << 20)

        async def send_all() -> None:
            for i in range(0, len(payload), 100_000):
                await channel.write(payload[i : i + 100_000])
            channel.close()

        sender = asyncio.create_task(send_all())
        echoed = bytearray()
        async with asyncio.timeout(10):
            while data := await channel.read():
                echoed += data
            await sender
            await transports[0].wait_closed()
        assert hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest()
        assert protocol.events.count("eof") == 1 and protocol.lost == [None]
        assert transports[0].is_closing()

        async def forgotten() -> bool:
            return not pair.agent.channels and not pair.relay.channels

        await eventually(forgotten, timeout=2, what="both links to forget the stream")
        await pair.close()

    async def test_writes_past_the_high_water_pause_the_protocol_until_the_peer_reads(self) -> None:
        """The peer does not read: the stream's window fills, the transport keeps the rest and says pause_writing;
        once the peer reads, resume_writing and every byte arrives in order."""
        protocol = Recorder()
        pair, channel, transports = await served(protocol, high_water=64 * 1024)
        await channel.write(b"hello")
        await eventually(lambda: _true(bool(transports)), timeout=2, what="the stream to be served")
        transport = transports[0]
        payload = os.urandom(8 << 20)  # past the stream's window and send buffer
        for i in range(0, len(payload), 256 * 1024):
            transport.write(payload[i : i + 256 * 1024])
        assert protocol.events == ["pause_writing"] and transport.get_write_buffer_size() > 64 * 1024
        received = bytearray()
        async with asyncio.timeout(10):
            while len(received) < len(payload):
                received += await channel.read()
        assert received == payload
        await eventually(lambda: _true(transport.get_write_buffer_size() == 0), timeout=2, what="the kept bytes to go")
        assert protocol.events == ["pause_writing", "resume_writing"]
        transport.close()
        channel.close()
        async with asyncio.timeout(5):
            await transport.wait_closed()
        assert await channel.read() == b"" and protocol.lost == [None]
        await pair.close()

    async def test_a_write_while_a_kept_chunk_is_still_going_queues_behind_it(self) -> None:
        """Regression: a write while the writer task was still sending the last kept chunk went into the stream
        first (the chunk had left the queue): asyncssh's packets out of order, and the bench's scp ended
        "Connection closed"."""
        stream = SlowStream()
        transport = ChannelTransport(cast(Channel, stream), Recorder())
        transport.write(b"first")  # the stream's buffer is full: kept, and the writer task takes it
        await eventually(lambda: _true(stream.writing), timeout=2, what="the writer task to send it")
        stream.room = True  # the buffer has room again before the writer task is back
        transport.write(b"second")
        stream.gate.set()
        await eventually(lambda: _true(transport.get_write_buffer_size() == 0), timeout=2, what="the kept bytes")
        assert bytes(stream.sent) == b"firstsecond"
        transport.abort()
        stream.ended.set()
        async with asyncio.timeout(5):
            await transport.wait_closed()

    async def test_pause_reading_holds_the_streams_bytes_until_resumed(self) -> None:
        """A protocol that paused reading gets nothing; resumed, it gets what waited."""
        protocol = Recorder(paused=True)
        pair, channel, transports = await served(protocol)
        await channel.write(b"held back")
        await eventually(lambda: _true(bool(transports)), timeout=2, what="the stream to be served")
        for _ in range(50):  # the loop's turns: the frames cross, the reader would have had them
            await asyncio.sleep(0)
        assert protocol.received == b"" and not transports[0].is_reading()
        transports[0].resume_reading()
        await eventually(lambda: _true(protocol.received == b"held back"), timeout=2, what="the held bytes")
        transports[0].abort()
        channel.close()
        async with asyncio.timeout(5):
            await transports[0].wait_closed()
        await pair.close()

    async def test_abort_still_delivers_what_the_stream_took_then_its_end(self) -> None:
        """asyncssh aborts right after its last message (a disconnect): the message still reaches the peer, then EOF,
        as through a socket."""
        protocol = Recorder()
        pair, channel, transports = await served(protocol)
        await channel.write(b"x")
        await eventually(lambda: _true(bool(transports)), timeout=2, what="the stream to be served")
        transports[0].write(b"disconnect: bye")
        transports[0].abort()
        async with asyncio.timeout(5):
            assert await channel.read() == b"disconnect: bye"
            assert await channel.read() == b""
            channel.close()
            await transports[0].wait_closed()
        assert protocol.lost == [None]
        await pair.close()

    async def test_a_peer_that_never_closes_its_half_is_reset_after_the_linger(self) -> None:
        """Closed here, the transport waits ``linger`` for the peer's end, then resets the stream."""
        protocol = Recorder()
        transports: list[ChannelTransport] = []
        pair = Pair(lambda ch: transports.append(ChannelTransport(ch, protocol, linger=0.05)))
        channel = pair.relay.open(HEADER)
        await channel.write(b"x")
        await eventually(lambda: _true(bool(transports)), timeout=2, what="the stream to be served")
        transports[0].close()
        async with asyncio.timeout(5):
            assert await channel.read() == b""
            await transports[0].wait_closed()
            await eventually(lambda: _true(channel.reset_error is not None), timeout=2, what="the reset")
        await pair.close()

    async def test_the_peers_reset_is_connection_lost_with_its_error(self) -> None:
        """The renter's side resets the stream: the protocol's connection_lost carries the ChannelReset."""
        protocol = Recorder()
        pair, channel, transports = await served(protocol)
        await channel.write(b"x")
        await eventually(lambda: _true(bool(transports)), timeout=2, what="the stream to be served")
        channel.reset(ResetCode.CANCEL)
        async with asyncio.timeout(5):
            await transports[0].wait_closed()
        assert len(protocol.lost) == 1 and isinstance(protocol.lost[0], ChannelReset) and protocol.lost[0].by_peer
        transports[0].write(b"after the end")  # dropped, no error: the transport is closing
        await pair.close()


class TestStreamTunnel:
    async def test_create_connection_runs_the_factorys_protocol_on_the_stream(self) -> None:
        """asyncssh's ``tunnel=`` entry: the protocol the factory makes is connected to the stream itself."""
        protocol = Recorder(echo=True)
        tunnels: list[StreamTunnel] = []
        made: list[asyncio.Future[tuple[ChannelTransport, asyncio.BaseProtocol]]] = []

        def on_open(channel: Channel) -> None:
            tunnels.append(StreamTunnel(channel))
            made.append(asyncio.ensure_future(tunnels[0].create_connection(lambda: protocol, "ignored", 22)))

        pair = Pair(on_open)
        channel = pair.relay.open(HEADER)
        await channel.write(b"ping")
        async with asyncio.timeout(5):
            assert await channel.read() == b"ping"
        transport, made_protocol = await made[0]
        assert made_protocol is protocol and transport is tunnels[0].transport
        assert transport.get_extra_info("peername") == ("relay-stream", channel.stream_id)
        channel.close()
        async with asyncio.timeout(5):
            await transport.wait_closed()
        await pair.close()


class SlowStream:
    """A stream whose buffer takes nothing until ``room``, and whose ``write`` waits for ``gate``."""

    stream_id = 1

    def __init__(self) -> None:
        self.sent = bytearray()
        self.room = False
        self.writing = False
        self.gate = asyncio.Event()
        self.ended = asyncio.Event()

    def write_nowait(self, data: bytes) -> int:
        if not self.room:
            return 0
        self.sent += data
        return len(data)

    async def write(self, data: bytes) -> None:
        self.writing = True
        await self.gate.wait()
        self.sent += data

    async def read(self, max_bytes: int | None = None) -> bytes:
        await self.ended.wait()
        return b""

    def close(self) -> None:
        pass

    def reset(self, code: int = 0) -> None:
        self.ended.set()


async def _true(value: bool) -> bool:
    return value
