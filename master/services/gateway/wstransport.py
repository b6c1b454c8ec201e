"""An asyncio transport whose bytes travel as a websocket's binary messages: aiohttp's client over a relay stream.

A replica's connection (``upstream.RelayConnector``) is one websocket to the relay; aiohttp's HTTP client
speaks to it through ``WebsocketTransport``, with no socket between them: what aiohttp writes is sent as
binary messages (what is waiting joined into one, at most ``max_message`` bytes: the relay takes renters'
messages up to ``MAX_DATA``), and each message received is handed to aiohttp's protocol as it comes. (A
socket pair and a copying task sat there before: two more socket writes, two reads and two wake-ups of
the event loop per request, a fifth of the gateway's CPU per request.)

Flow control both ways: aiohttp is told to pause writing while more than ``high_water`` bytes wait to be
sent (resumed at a quarter of it), and the websocket is not read while aiohttp pauses reading (websockets
then stops reading the socket once ``max_queue`` messages wait, and TCP holds the relay back).

``run`` is the connection's one task (its owner keeps it): it ends when either side ends. aiohttp closing
the transport sends what waits, then closes the websocket normally (1000); the relay closing the websocket
ends the transport, which aiohttp reads as the connection's end (``connection_lost(None)``: a body cut
short is aiohttp's ``ClientPayloadError``). Cancelling ``run`` is safe: the websocket is closed and aiohttp
told the connection is lost.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable
from typing import Any

from websockets.asyncio.client import ClientConnection

from shared.streams import MAX_DATA
from shared.streams.aio import first_done


class WebsocketTransport(asyncio.Transport):
    """aiohttp's end of one relay websocket (see the module docstring). Every limit is a keyword argument."""

    def __init__(
        self, ws: ClientConnection, protocol: asyncio.BaseProtocol, *, on_close: Callable[[int | None], None],
        # Limits
        high_water: int = 2 * MAX_DATA, max_message: int = MAX_DATA,
    ) -> None:  # fmt: skip
        super().__init__(extra={"peername": ws.remote_address})
        self._ws = ws
        self._protocol: Any = protocol  # aiohttp's ResponseHandler: an asyncio.Protocol
        self._on_close = on_close
        self._max_message = max_message
        self._high_water = high_water
        self._low_water = high_water // 4
        self._outgoing: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._has_outgoing = asyncio.Event()
        self._may_read = asyncio.Event()
        self._may_read.set()
        self._writing_paused = False
        self._closing = False
        protocol.connection_made(self)

    # ---- the connection's task -----------------------------------------------------------------

    async def run(self) -> None:
        """Move bytes both ways until either side ends; then close the websocket and tell aiohttp (see the module)."""
        try:
            await first_done(self._receive(), self._send())
        finally:
            self._closing = True
            self._outgoing.clear()
            self._protocol.connection_lost(None)  # at once: aiohttp need not wait for the websocket's closing handshake
            with contextlib.suppress(Exception):
                await self._ws.close()
            received = self._ws.protocol.close_rcvd
            self._on_close(received.code if received is not None and self._ws.protocol.close_rcvd_then_sent else None)

    async def _receive(self) -> None:
        async for message in self._ws:
            if not self._may_read.is_set():
                await self._may_read.wait()
            if self._closing:
                return
            self._protocol.data_received(message if isinstance(message, bytes) else message.encode())

    async def _send(self) -> None:
        while True:
            while not self._outgoing:
                if self._closing:
                    return
                self._has_outgoing.clear()
                await self._has_outgoing.wait()
            await self._ws.send(self._take())
            if self._writing_paused and self._buffered <= self._low_water:
                self._writing_paused = False
                self._protocol.resume_writing()

    def _take(self) -> bytes:
        """What waits, joined, up to ``max_message`` bytes."""
        first = self._outgoing.popleft()
        if len(first) > self._max_message:
            self._outgoing.appendleft(first[self._max_message :])
            first = first[: self._max_message]
        parts, size = [first], len(first)
        while self._outgoing and size + len(self._outgoing[0]) <= self._max_message:
            part = self._outgoing.popleft()
            parts.append(part)
            size += len(part)
        self._buffered -= size
        return parts[0] if len(parts) == 1 else b"".join(parts)

    # ---- asyncio.WriteTransport ----------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or not data:
            return
        self._outgoing.append(bytes(data))
        self._buffered += len(data)
        self._has_outgoing.set()
        if not self._writing_paused and self._buffered > self._high_water:
            self._writing_paused = True
            self._protocol.pause_writing()

    def can_write_eof(self) -> bool:
        return False  # a relay stream is closed whole; aiohttp never half-closes a connection

    def get_write_buffer_size(self) -> int:
        return self._buffered

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low_water, self._high_water

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._high_water = high if high is not None else self._high_water
        self._low_water = low if low is not None else self._high_water // 4

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Send what waits, then close the websocket (``run`` ends, and tells aiohttp)."""
        self._closing = True
        self._has_outgoing.set()
        self._may_read.set()

    def abort(self) -> None:
        """Drop what waits and close the websocket."""
        self._outgoing.clear()
        self._buffered = 0
        self.close()

    # ---- asyncio.ReadTransport -----------------------------------------------------------------

    def is_reading(self) -> bool:
        return self._may_read.is_set()

    def pause_reading(self) -> None:
        self._may_read.clear()

    def resume_reading(self) -> None:
        self._may_read.set()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol  # type: ignore[no-any-return]


__all__ = ["WebsocketTransport"]
