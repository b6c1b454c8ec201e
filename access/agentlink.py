"""One connected agent as the relay holds it: ``AgentLink``, what it costs in memory and how frames
reach the agent.

A relay holds tens of thousands of these, most of them idle between two messages, so a link
keeps only what it uses:

* Frames the link's own receive loop sends (the welcome and the acks) are written to the socket
  at once when nothing is waiting before them, in that loop's task: an agent that does not read
  fills the websocket's write buffer (``write_limit``), the loop stops reading it, and TCP flow
  control holds the agent back. Nothing grows in the relay.
* Frames from other tasks (commands, ``move``, close requests), and the loop's own while those
  wait, go through a bounded outbox drained by a writer task; both exist only while the outbox
  holds something (an empty ``deque`` is some 600 bytes). ``max_outbound_queue`` frames waiting
  closes the agent with 4007 (``CLOSE_SLOW_CONSUMER``).
* Renters' byte streams (``shared.streams``: multiplexer, ``StreamLink`` and its pump task) are
  created when the first stream opens or the agent sends the first stream frame.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from shared.ratelimit import TokenBucket
from shared.streams import LARGE_DATA, MAX_DATA, MAX_DATA_HEADER, Multiplexer, agree_max_data
from shared.streams.aio import StreamLink

log = logging.getLogger(__name__)


def close_reason(text: str) -> str:
    """Websocket close reasons are limited to 123 bytes."""
    encoded = text.encode()[:120]
    return encoded.decode(errors="ignore")


def forget_handshake(connection: ServerConnection) -> None:
    """Drop the opening handshake's headers from an established connection (some 3 KiB, the
    request's and the response's): ``connection.request`` and ``connection.response`` keep their
    path and status, with no headers. Emptied in place, since websockets' parser holds the request
    for the connection's life too; websockets reads neither after the handshake."""
    for message in (connection.request, connection.response):
        if message is not None:
            message.headers.clear()


@dataclass(frozen=True, slots=True)
class CloseRequest:
    """Queued behind the frames already waiting, so they are sent before the close."""

    code: int
    reason: str


@dataclass(frozen=True, slots=True)
class StreamOptions:
    """How a link's renter streams are bounded (``Relay`` keyword arguments)."""

    max_streams: int
    max_buffer: int
    turn_bytes: int
    window: int  # per stream while the link has room (``shared.streams``)
    link_send_buffer: int  # the agent socket's kernel buffers (``shared.streams.aio.bound_send_buffer``)
    max_data: int = LARGE_DATA  # the largest DATA frame the relay agrees to where the agent offers one


@dataclass(slots=True, eq=False)
class AgentLink:
    """One connected agent: its socket, certificate serial, message budget, outbox and streams."""

    host_id: str
    serial: str  # hex, as revocations are recorded
    connection: ServerConnection
    messages: TokenBucket
    max_outbound_queue: int
    stream_options: StreamOptions
    on_slow_consumer: Callable[[AgentLink], None]  # the relay counts it and closes the connection
    received: int = 0
    close_request: CloseRequest | None = None
    _outbox: collections.deque[str | CloseRequest] | None = field(default=None, repr=False)  # None: empty
    _writer: asyncio.Task[None] | None = field(default=None, repr=False)
    _streams: StreamLink | None = field(default=None, repr=False)
    _pump: asyncio.Task[None] | None = field(default=None, repr=False)
    agreed_max_data: int | None = field(default=None, init=False)  # None: the agent offered none, 64 KiB frames

    def __post_init__(self) -> None:
        request = self.connection.request  # read before ``forget_handshake``
        offered = request.headers.get(MAX_DATA_HEADER) if request is not None else None
        self.agreed_max_data = agree_max_data(offered, self.stream_options.max_data)

    # ---- frames to the agent -------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Frames waiting in the outbox."""
        return len(self._outbox) if self._outbox is not None else 0

    @property
    def writing(self) -> bool:
        """Whether a writer task exists (only while the outbox holds frames or one is being sent)."""
        return self._writer is not None

    async def send_own(self, frame: str) -> None:
        """Send a frame of the link's receive loop (the caller's task): now, or after what waits.

        Waits while the websocket's write buffer is over its limit. Raises ``ConnectionClosed``."""
        if self.close_request is not None:
            return  # closing: nothing more is sent after the close
        if self._writer is None:
            await self.connection.send(frame)
        else:
            self.queue(frame)

    def queue(self, frame: str, *, optional: bool = False) -> None:
        """Queue a frame behind those waiting. A full outbox closes the agent with 4007, or, for an
        ``optional`` frame, drops it."""
        if self.close_request is not None:
            return  # closing: nothing more is queued after the close
        if self.queued >= self.max_outbound_queue:
            if not optional:
                self.on_slow_consumer(self)
            return
        self._append(frame)

    def request_close(self, code: int, reason: str) -> bool:
        """Close once the frames already queued are sent; ``False`` when the outbox is full (the
        caller closes now, after ``stop_writer``). Idempotent (``True`` once requested)."""
        if self.close_request is not None:
            return True
        self.close_request = CloseRequest(code, close_reason(reason))
        if self.queued >= self.max_outbound_queue:
            return False
        self._append(self.close_request)
        return True

    def _append(self, item: str | CloseRequest) -> None:
        if self._outbox is None:
            self._outbox = collections.deque()
        self._outbox.append(item)
        if self._writer is None:
            self._writer = asyncio.create_task(self._write(), name=f"relay-write-{self.host_id}")

    async def _write(self) -> None:
        try:
            with contextlib.suppress(ConnectionClosed):
                while self._outbox:
                    item = self._outbox.popleft()
                    if isinstance(item, CloseRequest):
                        await self.connection.close(item.code, item.reason)
                        return
                    await self.connection.send(item)
        finally:
            if self._writer is asyncio.current_task():
                self._writer = None
                if not self._outbox:
                    self._outbox = None

    def stop_writer(self) -> None:
        """Drop whatever waits (the connection is being closed without it)."""
        self._outbox = None
        if self._writer is not None:
            self._writer.cancel()

    async def finish(self, close_timeout: float) -> None:
        """The receive loop ended: stop the streams, let a requested close go out (bounded: the agent
        may not be reading), then stop the writer and close if it did not."""
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        if self._streams is not None:
            self._streams.lost()
        writer = self._writer
        if writer is not None:
            if self.close_request is not None:
                await asyncio.wait({writer}, timeout=2 * close_timeout)
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
        request = self.close_request
        if request is not None and self.connection.state is State.OPEN:
            await self.connection.close(request.code, request.reason)

    # ---- renters' streams ------------------------------------------------------------------

    @property
    def streams(self) -> StreamLink:
        """The link's renter streams, created (with their pump task) on first use."""
        if self._streams is None:
            options = self.stream_options
            self._streams = StreamLink(
                Multiplexer(initiator=False, max_streams=options.max_streams, max_link_buffer=options.max_buffer,
                            window=options.window, max_data=self.agreed_max_data or MAX_DATA),
                self.connection.send, turn_bytes=options.turn_bytes,
            )
            self._pump = asyncio.create_task(self._run_pump(self._streams), name=f"relay-streams-{self.host_id}")
        return self._streams

    @property
    def has_streams(self) -> bool:
        return self._streams is not None

    @staticmethod
    async def _run_pump(streams: StreamLink) -> None:
        with contextlib.suppress(ConnectionClosed):
            await streams.run()
