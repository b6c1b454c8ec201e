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
import contextlib
from collections.abc import Callable

from websockets.asyncio.client import ClientConnection

from shared.streams import MAX_DATA
from shared.streams.aio import first_done
from shared.streams.transport import QueuedTransport


class WebsocketTransport(QueuedTransport):
    """aiohttp's end of one relay websocket (see the module docstring). Every limit is a keyword argument."""

    def __init__(
        self, ws: ClientConnection, protocol: asyncio.BaseProtocol, *, on_close: Callable[[int | None], None],
        # Limits
        high_water: int = 2 * MAX_DATA, max_message: int = MAX_DATA,
    ) -> None:  # fmt: skip
        super().__init__(protocol, high_water=high_water, extra={"peername": ws.remote_address})  # aiohttp's ResponseHandler
        self._ws = ws
        self._on_close = on_close
        self._max_message = max_message
        protocol.connection_made(self)

    # ---- the connection's task -----------------------------------------------------------------

    async def run(self) -> None:
        """Move bytes both ways until either side ends; then close the websocket and tell aiohttp (see the module)."""
        try:
            await first_done(self._receive(), self._send())
        finally:
            self._closing = True
            self._kept.clear()
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
            while not self._kept:
                if self._closing:
                    return
                self._has_kept.clear()
                await self._has_kept.wait()
            await self._ws.send(self._take())
            self._maybe_resume()

    def _take(self) -> bytes:
        """What waits, joined, up to ``max_message`` bytes."""
        first = self._kept.popleft()
        if len(first) > self._max_message:
            self._kept.appendleft(first[self._max_message :])
            first = first[: self._max_message]
        parts, size = [first], len(first)
        while self._kept and size + len(self._kept[0]) <= self._max_message:
            part = self._kept.popleft()
            parts.append(part)
            size += len(part)
        self._kept_size -= size
        return parts[0] if len(parts) == 1 else b"".join(parts)

    # ---- asyncio.WriteTransport (the rest: ``QueuedTransport``) --------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._closing and data:
            self._keep(data)


__all__ = ["WebsocketTransport"]
