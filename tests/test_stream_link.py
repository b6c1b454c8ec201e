"""``shared.streams.aio``: two ``StreamLink``s joined back to back, then a channel spliced to real sockets."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest

from shared.streams import Multiplexer, ResetCode
from shared.streams.aio import Channel, ChannelReset, OpenHandler, StreamLink, splice
from tests.helpers import eventually


class Pair:
    """An agent-side and a relay-side link whose sends are each other's feeds (as a websocket would)."""

    def __init__(self, on_open_agent: OpenHandler | None = None, *, window: int | None = None) -> None:
        self.agent = StreamLink(Multiplexer(initiator=True, window=window), self._to_relay, on_open=on_open_agent)
        self.relay = StreamLink(Multiplexer(initiator=False, window=window), self._to_agent)
        self.tasks = [asyncio.create_task(self.agent.run()), asyncio.create_task(self.relay.run())]
        self.sent_to_agent = 0

    async def _to_relay(self, frame: bytes) -> None:
        self.relay.feed(frame)

    async def _to_agent(self, frame: bytes) -> None:
        self.sent_to_agent += len(frame)
        self.agent.feed(frame)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def test_bytes_cross_both_ways_with_flow_control_and_end_cleanly() -> None:
    opened: list[Channel] = []
    served: list[asyncio.Task[None]] = []

    async def echo(channel: Channel) -> None:
        while data := await channel.read():
            await channel.write(data)
        channel.close()

    def on_open(channel: Channel) -> None:
        opened.append(channel)
        served.append(asyncio.create_task(echo(channel)))

    pair = Pair(on_open)
    payload = os.urandom(3 << 20)  # 3 MiB: many windows' worth
    channel = pair.relay.open(b'{"rental_id":"r-1","port":22,"kind":"ssh"}')

    async def send_all() -> None:
        for i in range(0, len(payload), 100_000):
            await channel.write(payload[i:i + 100_000])
        channel.close()

    sender = asyncio.create_task(send_all())
    received = bytearray()
    async with asyncio.timeout(10):
        while data := await channel.read():
            received += data
        await sender
        await served[0]
    assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()
    assert opened[0].header == b'{"rental_id":"r-1","port":22,"kind":"ssh"}'
    assert channel.bytes_out == channel.bytes_in == len(payload)
    assert opened[0].bytes_in == len(payload)

    async def forgotten() -> bool:  # both halves closed: forgotten on both sides
        return not pair.agent.channels and not pair.relay.channels

    await eventually(forgotten, timeout=2, what="both links to forget the stream")
    await pair.close()


async def test_a_reader_that_does_not_read_holds_the_sender_at_its_window() -> None:
    held: list[Channel] = []
    pair = Pair(held.append)
    channel = pair.relay.open(b"x")
    writer = asyncio.create_task(channel.write(os.urandom(4 << 20)))
    await asyncio.sleep(0.3)
    assert not writer.done()  # blocked: the agent side never reads
    assert pair.sent_to_agent < 1 << 20  # bounded by the window, not the 4 MiB written
    held[0].reset(ResetCode.REFUSED)
    with pytest.raises(ChannelReset) as caught:
        async with asyncio.timeout(2):
            await writer
    assert caught.value.by_peer and caught.value.code == ResetCode.REFUSED
    await pair.close()


async def test_losing_the_link_resets_every_channel() -> None:
    pair = Pair(lambda channel: None)
    channel = pair.relay.open(b"x")
    reader = asyncio.create_task(channel.read())
    await asyncio.sleep(0.05)
    pair.relay.lost()
    with pytest.raises(ChannelReset) as caught:
        await reader
    assert caught.value.code == ResetCode.LINK_LOST
    with pytest.raises(ConnectionError):
        pair.relay.open(b"y")
    await pair.close()


async def test_splice_carries_a_socket_both_ways_and_passes_eof_on() -> None:
    received = bytearray()
    done = asyncio.Event()

    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.extend(await reader.read())  # until the splice passes EOF on
        writer.write(b"bye:" + hashlib.sha256(received).hexdigest().encode())
        await writer.drain()
        writer.close()
        done.set()

    listener = await asyncio.start_server(server, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    splices: list[asyncio.Task[None]] = []

    async def serve(channel: Channel) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await splice(channel, reader, writer)

    pair = Pair(lambda channel: splices.append(asyncio.create_task(serve(channel))))
    channel = pair.relay.open(b"tcp")
    payload = os.urandom(1 << 20)
    await channel.write(payload)
    channel.close()
    answer = bytearray()
    async with asyncio.timeout(10):
        while data := await channel.read():
            answer += data
        await done.wait()
        await splices[0]
    assert bytes(answer) == b"bye:" + hashlib.sha256(payload).hexdigest().encode()
    listener.close()
    await pair.close()
