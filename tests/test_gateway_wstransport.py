"""``WebsocketTransport``: aiohttp's bytes as a websocket's messages, against a real websockets server on
localhost (the relay's side of a stream). End to end through a relay: tests/test_gateway.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

from master.services.gateway.wstransport import WebsocketTransport

DEADLINE = 10.0


class Recorder(asyncio.Protocol):
    """What aiohttp's protocol would see: data, pauses and the connection's end."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.events: list[str] = []
        self.lost = asyncio.Event()

    def data_received(self, data: bytes) -> None:
        self.data += data

    def pause_writing(self) -> None:
        self.events.append("pause")

    def resume_writing(self) -> None:
        self.events.append("resume")

    def connection_lost(self, exc: Exception | None) -> None:
        self.events.append("lost")
        self.lost.set()


@pytest.fixture
async def relay() -> AsyncIterator[dict[str, Any]]:
    """A websockets server that records each message and answers a ``close <code>`` message by closing with it."""
    state: dict[str, Any] = {"messages": [], "got": asyncio.Event()}

    async def handler(connection: ServerConnection) -> None:
        async for message in connection:
            state["messages"].append(message)
            state["got"].set()
            if isinstance(message, bytes) and message.startswith(b"close "):
                await connection.close(int(message.split()[1]), "asked to")
                return
            if message == b"echo":
                await connection.send(b"echoed")

    async with serve(handler, "127.0.0.1", 0) as server:
        state["url"] = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        yield state


async def _open(relay: dict[str, Any], **limits: int) -> tuple[WebsocketTransport, Recorder, asyncio.Task[None], list[int | None]]:
    ws = await connect(relay["url"])
    protocol, closes = Recorder(), list[int | None]()
    transport = WebsocketTransport(ws, protocol, on_close=closes.append, **limits)
    return transport, protocol, asyncio.create_task(transport.run()), closes


async def _messages(relay: dict[str, Any], count: int) -> list[bytes]:
    async with asyncio.timeout(DEADLINE):  # waiting for the server to have received ``count`` messages
        while len(relay["messages"]) < count:
            relay["got"].clear()
            await relay["got"].wait()
    return list(relay["messages"])


class TestWebsocketTransport:
    async def test_writes_waiting_together_leave_as_one_message_of_at_most_max_message(self, relay: dict[str, Any]) -> None:
        """What aiohttp wrote in one go (a head, then a body) is one message; a write larger than a message is cut."""
        transport, protocol, task, _ = await _open(relay, max_message=10)
        transport.write(b"abc")
        transport.write(b"defgh")
        transport.write(b"0123456789AB")
        assert await _messages(relay, 3) == [b"abcdefgh", b"0123456789", b"AB"]
        transport.close()
        async with asyncio.timeout(DEADLINE):  # the task ends once the websocket closed
            await task
        assert protocol.events == ["lost"]

    async def test_messages_received_reach_the_protocol_and_a_relay_close_ends_the_connection_with_its_code(
        self, relay: dict[str, Any]
    ) -> None:  # fmt: skip
        """The relay's answer arrives as data; its close (4410: the stream was reset) is aiohttp's connection_lost."""
        transport, protocol, task, closes = await _open(relay)
        transport.write(b"echo")
        assert not transport.can_write_eof()
        await _messages(relay, 1)
        transport.write(b"close 4410")
        async with asyncio.timeout(DEADLINE):  # the relay closes; the transport's task ends on it
            await task
        assert bytes(protocol.data) == b"echoed"
        assert protocol.events == ["lost"] and closes == [4410] and transport.is_closing()

    async def test_aiohttp_is_paused_past_the_high_water_mark_and_resumed_once_sent(self, relay: dict[str, Any]) -> None:
        transport, protocol, task, _ = await _open(relay, high_water=8, max_message=4)
        transport.write(b"0123456789")
        assert protocol.events == ["pause"] and transport.get_write_buffer_size() == 10
        assert await _messages(relay, 3) == [b"0123", b"4567", b"89"]
        assert protocol.events == ["pause", "resume"] and transport.get_write_buffer_size() == 0
        transport.abort()
        async with asyncio.timeout(DEADLINE):  # abort closes too
            await task

    async def test_cancelling_the_task_closes_the_websocket_and_tells_the_protocol(self, relay: dict[str, Any]) -> None:
        _, protocol, task, closes = await _open(relay)
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert protocol.events == ["lost"] and closes == [None]
