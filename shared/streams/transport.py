"""``ChannelTransport``: one stream (``shared.streams.aio.Channel``) as an asyncio ``Transport``, for a protocol
that would otherwise need a socket pair spliced to the stream (the agent's SSH server, asyncssh).

Bytes go straight between the stream's buffers and the protocol: no socket, no system call, no copy through a
kernel buffer. Flow control both ways:

* to the stream: ``write`` hands the stream's send buffer what fits at once (``Channel.write_nowait``) and keeps
  the rest in order for a writer task; past ``high_water`` bytes kept the protocol is told ``pause_writing``, and
  ``resume_writing`` once they are down to ``low_water``;
* from the stream: one reader task feeds ``data_received`` with what the stream delivers; ``pause_reading`` stops
  it between two reads, so the stream's window (not this transport) holds the peer back.

The stream's end (the peer closed its half) is ``eof_received``; closing this side when it answers falsy. ``close``
stops reading, sends what is kept, then closes the stream's half; ``abort`` drops what is kept first. As a socket's
close, neither drops what the stream has already taken (asyncssh aborts its transport right after its last message,
a disconnect, which must still reach the client). Then the transport waits up to ``linger`` seconds for the peer to
close its half (what it sends meanwhile is dropped), and resets the stream if it did not. The protocol's
``connection_lost`` comes after that, with the error when the stream failed (``ChannelReset``: reset by the peer, or
the link lost). ``wait_closed`` waits for it; cancelling that is safe (the transport goes on).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

from shared.streams.aio import Channel

DEFAULT_HIGH_WATER = 256 * 1024


class QueuedTransport(asyncio.Transport):
    """What ``ChannelTransport`` and the gateway's ``WebsocketTransport`` share: the bytes written and not yet sent, kept
    in order (``_keep``), with the protocol told ``pause_writing`` past ``high_water`` bytes kept and ``resume_writing``
    at ``low_water`` (``_maybe_resume``, after each send); reading paused and resumed by the protocol; ``close`` (send
    what is kept, then end) and ``abort`` (drop it first) for the subclass's tasks to act on."""

    def __init__(self, protocol: asyncio.BaseProtocol, *, high_water: int, low_water: int | None = None,
                 extra: dict[str, Any] | None = None) -> None:  # fmt: skip
        super().__init__(extra=extra)
        if high_water < 1:
            raise ValueError("high_water must be positive")
        self._protocol: Any = protocol  # an asyncio.Protocol
        self._high_water = high_water
        self._low_water = high_water // 4 if low_water is None else low_water
        self._kept: collections.deque[bytes] = collections.deque()  # written, not sent yet, in order
        self._kept_size = 0
        self._has_kept = asyncio.Event()
        self._may_read = asyncio.Event()
        self._may_read.set()
        self._writing_paused = False
        self._closing = False

    def _keep(self, data: bytes | bytearray | memoryview) -> None:
        self._kept.append(bytes(data))
        self._kept_size += len(data)
        self._has_kept.set()
        if not self._writing_paused and self._kept_size > self._high_water:
            self._writing_paused = True
            self._protocol.pause_writing()

    def _maybe_resume(self) -> None:
        if self._writing_paused and self._kept_size <= self._low_water:
            self._writing_paused = False
            self._protocol.resume_writing()

    # ---- asyncio.WriteTransport ----------------------------------------------------------------

    def can_write_eof(self) -> bool:
        return False  # a stream is closed whole here

    def get_write_buffer_size(self) -> int:
        return self._kept_size

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low_water, self._high_water

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._high_water = high if high is not None else self._high_water
        self._low_water = low if low is not None else self._high_water // 4
        self._maybe_resume()

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Stop reading, send what is kept, then end (the subclass's tasks see ``_closing``). Idempotent."""
        self._closing = True
        self._has_kept.set()
        self._may_read.set()

    def abort(self) -> None:
        """Drop what is kept and close as ``close`` does."""
        self._kept.clear()
        self._kept_size = 0
        self.close()

    # ---- asyncio.ReadTransport -----------------------------------------------------------------

    def is_reading(self) -> bool:
        return self._may_read.is_set() and not self._closing

    def pause_reading(self) -> None:
        self._may_read.clear()

    def resume_reading(self) -> None:
        self._may_read.set()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol  # type: ignore[no-any-return]


class ChannelTransport(QueuedTransport):
    """``protocol`` over ``channel``, started at once (``connection_made``). Every limit is a keyword argument."""

    def __init__(
        self, channel: Channel, protocol: asyncio.BaseProtocol, *,
        # Timeouts
        linger: float = 5.0,
        # Limits
        high_water: int = DEFAULT_HIGH_WATER, low_water: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(protocol, high_water=high_water, low_water=low_water, extra=extra)
        if linger < 0:
            raise ValueError("linger must not be negative")
        self._channel = channel
        self._linger = linger
        self._error: Exception | None = None
        protocol.connection_made(self)
        self._done = asyncio.ensure_future(self._run())

    # ---- the tasks -------------------------------------------------------------------------------

    async def _run(self) -> None:
        reading = asyncio.ensure_future(self._read())
        try:
            await self._write()  # until close() or abort(), and what was kept is in the stream's buffer
            reading.cancel()
            await self._wait_for_peer()
        except (ConnectionError, OSError) as exc:  # ChannelReset, BrokenPipeError
            self._error = self._error or exc
            self._channel.reset()
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            self._closing = True
            self._kept.clear()
            self._kept_size = 0
            self._protocol.connection_lost(self._error)

    async def _read(self) -> None:
        try:
            while True:
                if not self._may_read.is_set():
                    await self._may_read.wait()
                if self._closing:
                    return
                data = await self._channel.read()
                if not data:
                    break
                self._protocol.data_received(data)
            if not self._protocol.eof_received():
                self.close()
        except Exception as exc:  # the stream failed, or the protocol did: end the transport with it
            self._error = exc
            self.abort()

    async def _write(self) -> None:
        while True:
            while not self._kept:
                if self._closing:
                    self._channel.close()
                    return
                self._has_kept.clear()
                await self._has_kept.wait()
            data = self._kept[0]  # left in the deque while it goes: a write meanwhile must queue behind it
            await self._channel.write(data)
            self._kept.popleft()
            self._kept_size -= len(data)
            self._maybe_resume()

    async def _wait_for_peer(self) -> None:
        """Until the peer closed its half too (what it still sends is dropped), at most ``linger`` seconds."""
        try:
            async with asyncio.timeout(self._linger):
                while await self._channel.read():
                    pass
        except TimeoutError:
            self._channel.reset()
        except ConnectionError:
            pass  # reset meanwhile: ended all the same

    async def wait_closed(self) -> None:
        """Until the protocol has been told ``connection_lost``."""
        await asyncio.shield(self._done)

    # ---- asyncio.WriteTransport ----------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or not data:
            return
        if not self._kept:
            try:
                taken = self._channel.write_nowait(data)
            except (ConnectionError, OSError) as exc:
                self._error = self._error or exc
                self.abort()
                return
            if taken == len(data):
                return
            data = memoryview(data)[taken:]
        self._keep(data)


class StreamTunnel:
    """What asyncssh's ``tunnel=`` takes (``create_connection(factory, host, port)``, as ``loop.create_connection``):
    the connection's protocol runs on ``channel`` through a ``ChannelTransport``; ``transport`` once made."""

    def __init__(self, channel: Channel, **transport_options: Any) -> None:
        self.channel = channel
        self.transport_options = transport_options
        self.transport: ChannelTransport | None = None

    async def create_connection(
        self, protocol_factory: Callable[[], asyncio.BaseProtocol], host: object = None, port: object = None
    ) -> tuple[ChannelTransport, asyncio.BaseProtocol]:
        protocol = protocol_factory()
        extra = {"peername": ("relay-stream", self.channel.stream_id)}
        self.transport = ChannelTransport(self.channel, protocol, extra=extra, **self.transport_options)
        return self.transport, protocol


__all__ = ["ChannelTransport", "QueuedTransport", "StreamTunnel"]
