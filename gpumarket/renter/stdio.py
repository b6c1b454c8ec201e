"""This process's stdin and stdout as bounded, binary-safe async byte streams (for ``gpumarket tunnel``).

Pipes, sockets and terminals go through the event loop (``connect_read_pipe`` /
``connect_write_pipe``), so a read returns as soon as any bytes are there and a write goes out
at once: a keystroke is never held back. Both sides are bounded: the reader pauses reading
past ``2 * limit`` buffered bytes, a write waits while more than ``high_water`` bytes wait for
the reader of stdout. Regular files and ``/dev/null``, which the loop cannot watch, are read
and written in a worker thread instead (they never block for long).

``aclose`` flushes what is left, then gives stdout's reader its EOF (``/dev/null`` takes the
place of fd 1) and puts the descriptors' blocking mode back as it found it.

``loop_kind`` says which event loop the process may run on: uvloop (``"auto"``) when stdin and stdout are both
pipes or sockets (what ssh gives its ProxyCommand), asyncio's own otherwise: uvloop 0.23 aborts (SIGABRT) when
stdout is a regular file written from a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from typing import Protocol, cast


def loop_kind(*, stdin_fd: int = 0, stdout_fd: int = 1) -> str:
    """``"auto"`` (uvloop where it imports) when both descriptors are pipes or sockets, else ``"asyncio"``."""
    for fd in (stdin_fd, stdout_fd):
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            return "asyncio"
        if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            return "asyncio"
    return "auto"


class Source(Protocol):
    async def read(self) -> bytes:
        """Up to one chunk of bytes, as soon as there are any; ``b""`` at EOF."""
        ...


class Sink(Protocol):
    async def write(self, data: bytes) -> None:
        """Write all of ``data``; returns once the buffer is under its bound. ``BrokenPipeError``
        when the reader has gone."""
        ...

    async def aclose(self) -> None:
        """Flush what is buffered (the file stays open: ``Stdio.aclose`` gives the EOF)."""
        ...


class _PipeSource:
    def __init__(self, reader: asyncio.StreamReader, *, chunk: int) -> None:
        self._reader, self._chunk = reader, chunk

    async def read(self) -> bytes:
        return await self._reader.read(self._chunk)


class _ThreadSource:
    def __init__(self, fd: int, *, chunk: int) -> None:
        self._fd, self._chunk = fd, chunk

    async def read(self) -> bytes:
        return await asyncio.to_thread(os.read, self._fd, self._chunk)


class _PipeSink(asyncio.Protocol):
    """A write pipe's protocol with flow control: ``write`` waits while the transport is paused."""

    def __init__(self) -> None:
        self._transport: asyncio.WriteTransport | None = None
        self._resumed: asyncio.Future[None] | None = None
        self._lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A write pipe's transport; uvloop's is not registered as an ``asyncio.WriteTransport``, so no isinstance.
        self._transport = cast(asyncio.WriteTransport, transport)

    def pause_writing(self) -> None:
        if self._resumed is None:
            self._resumed = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._resumed is not None and not self._resumed.done():
            self._resumed.set_result(None)
        self._resumed = None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._lost.done():
            self._lost.set_result(None)
        self.resume_writing()

    async def write(self, data: bytes) -> None:
        assert self._transport is not None
        if self._lost.done() or self._transport.is_closing():
            raise BrokenPipeError("stdout is closed")
        self._transport.write(data)
        if self._resumed is not None:
            await self._resumed
        if self._lost.done():
            raise BrokenPipeError("stdout is closed")

    async def aclose(self) -> None:
        assert self._transport is not None
        self._transport.close()  # after what is buffered has gone out
        await self._lost


class _ThreadSink:
    def __init__(self, fd: int) -> None:
        self._fd = fd

    async def write(self, data: bytes) -> None:
        await asyncio.to_thread(_write_all, self._fd, data)

    async def aclose(self) -> None:
        pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _give_eof(fd: int) -> None:
    """Close ``fd``'s file for its reader while keeping the number taken (by ``/dev/null``)."""
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)


class Stdio:
    """Opens stdin/stdout as a ``Source`` and a ``Sink``; ``aclose`` flushes stdout, restores the
    blocking modes and closes stdout for its reader."""

    def __init__(self, *, stdin_fd: int = 0, stdout_fd: int = 1, chunk: int = 64 * 1024, high_water: int = 256 * 1024) -> None:
        self.stdin_fd, self.stdout_fd = stdin_fd, stdout_fd
        self.chunk, self.high_water = chunk, high_water
        self._blocking = {fd: os.get_blocking(fd) for fd in (stdin_fd, stdout_fd)}
        self._transports: list[asyncio.BaseTransport] = []
        self._sink: Sink | None = None

    async def open(self) -> tuple[Source, Sink]:
        loop = asyncio.get_running_loop()
        source: Source
        sink: Sink
        try:
            reader = asyncio.StreamReader(limit=self.chunk)
            pipe = open(self.stdin_fd, "rb", buffering=0, closefd=False)  # the transport closes it (not the fd)
            transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
            self._transports.append(transport)
            source = _PipeSource(reader, chunk=self.chunk)
        except (ValueError, OSError):  # a regular file or /dev/null: epoll cannot watch them
            source = _ThreadSource(self.stdin_fd, chunk=self.chunk)
        try:
            protocol = _PipeSink()
            pipe = open(self.stdout_fd, "wb", buffering=0, closefd=False)  # the transport closes it (not the fd)
            out, _ = await loop.connect_write_pipe(lambda: protocol, pipe)
            out.set_write_buffer_limits(high=self.high_water)
            sink = protocol
        except (ValueError, OSError):
            sink = _ThreadSink(self.stdout_fd)
        self._sink = sink
        return source, sink

    async def aclose(self) -> None:
        """Safe to call once, whether ``open`` ran or not."""
        if self._sink is not None:
            with contextlib.suppress(OSError):
                await self._sink.aclose()
        for transport in self._transports:
            transport.close()
        for fd, blocking in self._blocking.items():
            with contextlib.suppress(OSError):
                os.set_blocking(fd, blocking)
        _give_eof(self.stdout_fd)
