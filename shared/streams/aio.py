"""The asyncio side of a link's streams: ``StreamLink`` drives a ``Multiplexer`` over one websocket,
``Channel`` is one stream as an awaitable byte pipe, and ``splice`` joins a channel to a socket.

The agent and the relay each hold one ``StreamLink`` per agent connection. Everything that touches
the multiplexer runs on the event loop (the multiplexer is not thread-safe, and nothing here
awaits while holding its state), so a ``Channel`` call never interleaves with another's.

Sending. One *pump* task per link (``StreamLink.run``) sends the frames the multiplexer hands
out, at most ``turn_bytes`` a turn, and yields to the loop between turns: the link's JSON messages
(heartbeats, acks, commands), sent by other tasks on the same websocket, go out between two
turns, so a bulk copy adds at most one turn's worth of queueing before them.

Cancellation: cancelling ``Channel.read`` or ``Channel.write`` is safe (nothing read is lost;
a write may have buffered part of its bytes, which still go out). Cancelling ``run`` stops the
pump; call ``lost()`` when the websocket is gone so every channel ends with ``ChannelReset``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from shared.streams.frames import ResetCode, StreamProtocolError
from shared.streams.mux import DataReceived, Multiplexer, StreamClosed, StreamOpened, StreamReset, Writable

log = logging.getLogger(__name__)

DEFAULT_TURN_BYTES = 64 * 1024


class ChannelReset(ConnectionResetError):
    """The stream was reset (by either side, or because the link went): ``code`` says why."""

    def __init__(self, stream_id: int, code: int, by_peer: bool) -> None:
        super().__init__(f"stream {stream_id} reset ({_code_name(code)}{' by the peer' if by_peer else ''})")
        self.code = code
        self.by_peer = by_peer


def _code_name(code: int) -> str:
    try:
        return ResetCode(code).name.lower()
    except ValueError:
        return f"code {code}"


class Channel:
    """One stream of a link. ``read`` returns ``b""`` at the peer's end; ``close`` ends this side's half."""

    def __init__(self, link: StreamLink, stream_id: int, header: bytes) -> None:
        self.link = link
        self.stream_id = stream_id
        self.header = header
        self.bytes_in = 0  # read from the peer
        self.bytes_out = 0  # accepted for sending to the peer
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._eof = False
        self._reset: ChannelReset | None = None
        self.ended = asyncio.Event()  # reset, or closed in both directions

    @property
    def reset_error(self) -> ChannelReset | None:
        return self._reset

    async def read(self, max_bytes: int | None = None) -> bytes:
        """Up to ``max_bytes`` (default: the link's largest DATA frame) received bytes, waiting for some; ``b""``
        once the peer closed its half. Raises ``ChannelReset``. Cancelling is safe."""
        mux = self.link.mux
        max_bytes = mux.max_data if max_bytes is None else max_bytes
        while True:
            if self._reset is not None:
                raise self._reset
            data = mux.read(self.stream_id, max_bytes)
            if data:
                self.bytes_in += len(data)
                self.link.kick()  # a WINDOW frame may be due
                return data
            if self._eof:
                self.link._forget_if_done(self)
                return b""
            self._readable.clear()
            await self._readable.wait()

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send all of ``data``, waiting while the stream's send buffer is full (the peer's window
        bounds how much leaves). Raises ``ChannelReset``; ``BrokenPipeError`` after ``close``."""
        view = memoryview(data).cast("B")
        mux = self.link.mux
        while view:
            if self._reset is not None:
                raise self._reset
            try:
                taken = mux.send(self.stream_id, view)
            except Exception as exc:  # StreamClosedError: closed, reset or forgotten
                raise self._reset or BrokenPipeError(f"stream {self.stream_id} is closed for writing") from exc
            if taken:
                self.bytes_out += taken
                view = view[taken:]
                self.link.kick()
                continue
            self._writable.clear()
            await self._writable.wait()

    def write_nowait(self, data: bytes | bytearray | memoryview) -> int:
        """Buffer what fits of ``data`` in the stream's send buffer now, without waiting; how many bytes were taken
        (the caller keeps the rest for ``write``). Raises as ``write`` does."""
        if self._reset is not None:
            raise self._reset
        try:
            taken = self.link.mux.send(self.stream_id, data)
        except Exception as exc:  # StreamClosedError: closed, reset or forgotten
            raise self._reset or BrokenPipeError(f"stream {self.stream_id} is closed for writing") from exc
        if taken:
            self.bytes_out += taken
            self.link.kick()
        return taken

    def close(self) -> None:
        """Finish this side's half (after what is buffered). Idempotent."""
        self.link.mux.close(self.stream_id)
        self.link.kick()

    def reset(self, code: int = ResetCode.CANCEL) -> None:
        """Abort both halves now. Idempotent."""
        if self._reset is None:
            self.link.mux.reset(self.stream_id, code)
            self._ended(ChannelReset(self.stream_id, code, by_peer=False))
            self.link.kick()

    # -- called by the link --------------------------------------------------------------------

    def _ended(self, error: ChannelReset | None) -> None:
        if error is not None and self._reset is None:
            self._reset = error
        self._eof = True
        self._readable.set()
        self._writable.set()
        if error is not None:
            self.ended.set()


class OpenHandler(Protocol):
    def __call__(self, channel: Channel, /) -> None: ...


class StreamLink:
    """A ``Multiplexer`` driven over one websocket: ``feed`` it the binary messages received, let
    ``run`` send, ``open`` streams and take the peer's through ``on_open`` (which owns the channel:
    it must start whatever serves it, or reset it)."""

    def __init__(
        self,
        mux: Multiplexer,
        send: Callable[[bytes], Awaitable[None]],
        *,
        on_open: OpenHandler | None = None,
        turn_bytes: int = DEFAULT_TURN_BYTES,
    ) -> None:
        if turn_bytes < 1:
            raise ValueError("turn_bytes must be positive")
        self.mux = mux
        self._send = send
        self._on_open = on_open
        self.turn_bytes = turn_bytes
        self.channels: dict[int, Channel] = {}
        self._due = asyncio.Event()
        self._lost = False

    # -- receiving -----------------------------------------------------------------------------

    def feed(self, message: bytes | bytearray | memoryview) -> None:
        """Take one binary websocket message. Raises ``StreamProtocolError``: close the websocket
        with its ``close_code``."""
        self.mux.receive_frame(message)
        self._dispatch()

    def _dispatch(self) -> None:
        for event in self.mux.events():
            match event:
                case DataReceived(stream_id=sid):
                    channel = self.channels.get(sid)
                    if channel is not None:
                        channel._readable.set()
                case Writable(stream_id=sid):
                    channel = self.channels.get(sid)
                    if channel is not None:
                        channel._writable.set()
                case StreamClosed(stream_id=sid):
                    channel = self.channels.get(sid)
                    if channel is not None:
                        channel._ended(None)
                        self._forget_if_done(channel)
                case StreamReset(stream_id=sid, code=code, by_peer=by_peer):
                    channel = self.channels.pop(sid, None)
                    if channel is not None:
                        channel._ended(ChannelReset(sid, code, by_peer))
                case StreamOpened(stream_id=sid, header=header):
                    channel = Channel(self, sid, header)
                    self.channels[sid] = channel
                    if self._on_open is None:
                        channel.reset(ResetCode.REFUSED)
                    else:
                        self._on_open(channel)
        self._due.set()  # control frames (WINDOW, RESET) may be due

    def _forget_if_done(self, channel: Channel) -> None:
        if self.mux.state(channel.stream_id) is None:
            self.channels.pop(channel.stream_id, None)
            channel.ended.set()

    # -- opening and sending -------------------------------------------------------------------

    def open(self, header: bytes) -> Channel:
        """Open a stream towards the peer. Raises ``StreamLimitError`` (too many streams or bytes
        reserved on this link) and ``ConnectionError`` once the link is lost."""
        if self._lost:
            raise ConnectionError("the agent link is gone")
        stream_id = self.mux.open_stream(header)
        channel = Channel(self, stream_id, header)
        self.channels[stream_id] = channel
        self.kick()
        return channel

    def kick(self) -> None:
        """Something may be due to send: wake the pump."""
        self._due.set()

    async def run(self) -> None:
        """Send what the multiplexer hands out, a turn at a time, until cancelled or the send fails
        (the caller's websocket is gone: it calls ``lost``). Cancelling is safe."""
        while True:
            await self._due.wait()
            self._due.clear()
            frames = self.mux.data_to_send(self.turn_bytes)
            self._dispatch_local()
            for frame in frames:
                await self._send(frame)
            if frames:
                self._due.set()  # more may be due: come back after the others had their turn
                await asyncio.sleep(0)

    def _dispatch_local(self) -> None:
        # Sending can finish streams (both halves closed) and free send buffers (Writable).
        for event in self.mux.events():
            if isinstance(event, Writable):
                channel = self.channels.get(event.stream_id)
                if channel is not None:
                    channel._writable.set()
            elif isinstance(event, StreamReset):
                channel = self.channels.pop(event.stream_id, None)
                if channel is not None:
                    channel._ended(ChannelReset(event.stream_id, event.code, event.by_peer))
            elif isinstance(event, StreamClosed):
                channel = self.channels.get(event.stream_id)
                if channel is not None:
                    channel._ended(None)
        for channel in list(self.channels.values()):
            self._forget_if_done(channel)

    def lost(self) -> None:
        """The websocket is gone: every channel ends with ``ChannelReset`` (code ``LINK_LOST``)."""
        self._lost = True
        self.mux.connection_lost()
        for event in self.mux.events():
            if isinstance(event, StreamReset):
                channel = self.channels.pop(event.stream_id, None)
                if channel is not None:
                    channel._ended(ChannelReset(event.stream_id, event.code, by_peer=True))
        for channel in self.channels.values():
            channel._ended(ChannelReset(channel.stream_id, ResetCode.LINK_LOST, by_peer=True))
        self.channels.clear()


def bound_send_buffer(transport: asyncio.BaseTransport, size: int) -> None:
    """Cap the kernel's send buffer of a link's socket at ``size`` bytes (best effort).

    Frames a link has sent wait in this buffer in order, whatever stream they belong to: the
    kernel's own (auto-tuned to megabytes on a fast path) would put a keystroke behind every
    bulk stream's whole window. The streams' flow control keeps the rest in the multiplexer,
    where the round-robin lets a keystroke go first."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)


# ---- splicing ----------------------------------------------------------------------------------


async def first_done(*coroutines: Coroutine[Any, Any, None], grace: float = 0.0) -> None:
    """Run ``coroutines`` (the two pumps of a splice) as tasks until the first ends, however, then give the others
    ``grace`` seconds to end on their own, cancel those left and wait for them all. Their exceptions are not raised:
    where one pump ended is all a caller needs. Cancelling is safe: every task is cancelled and waited for."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if pending and grace > 0:
            await asyncio.wait(pending, timeout=grace)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def splice(channel: Channel, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, chunk: int | None = None) -> None:
    """Copy both ways between ``channel`` and a socket until both directions end (EOF is passed on as
    a half-close) or either fails (the channel is reset, the socket closed), ``chunk`` bytes a read at most
    (default: the link's largest DATA frame). Cancelling is safe: both are torn down. Returns quietly;
    counts stay on the channel."""
    chunk = channel.link.mux.max_data if chunk is None else chunk

    async def to_socket() -> None:
        while data := await channel.read(chunk):
            if writer.is_closing():  # asyncio drops the write, uvloop raises RuntimeError: both are a closed socket
                raise ConnectionResetError("the socket closed")
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    async def to_channel() -> None:
        while data := await reader.read(chunk):
            await channel.write(data)
        channel.close()

    tasks = [asyncio.ensure_future(to_socket()), asyncio.ensure_future(to_channel())]
    try:
        for finished in asyncio.as_completed(tasks):
            try:
                await finished
            except (ConnectionError, OSError, StreamProtocolError):
                channel.reset(ResetCode.CANCEL)
                break
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()
