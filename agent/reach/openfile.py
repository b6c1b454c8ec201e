"""A file the agent's SFTP server (``agent.reach.sftp``) has open: reads served from the page cache on the event loop
when they can be, writes done behind the session's back, in order, in a thread.

Why: asyncssh serves one SFTP request after the other, so a request that waits for a thread waits alone: each write's
hand-off to a thread and back (and the interpreter lock's, which a loaded machine makes milliseconds) is paid in full
before the next request is read. Here ``write`` queues the bytes and answers at once; one task per file writes what is
queued in a thread, contiguous writes together (one ``pwritev``), while the session goes on. At most ``max_pending``
bytes (and ``max_writes`` writes) wait; a write beyond that waits for room (the SSH channel's window then holds the
client back).

A write that fails fails the file: its error (``ENOSPC``, ``EDQUOT``, ``EIO``) is raised by the next ``write``,
``flush`` or ``close`` — so the client hears of it at the latest when it closes the file, which OpenSSH's scp and sftp
and asyncssh's client check — and every later write is refused. Anything that reads the file's bytes or size through
the session (``read``, ``fstat``, a ``stat`` of its path, ...) calls ``flush`` first.

Reads: ``preadv`` with ``RWF_NOWAIT`` answers from the page cache without waiting for the disk, or says it would;
only then does the read go to a thread. (No file system here supports ``RWF_NOWAIT`` for buffered writes.)
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections import deque
from typing import Final

_NOWAIT: Final = getattr(os, "RWF_NOWAIT", None)  # Linux ≥ 4.14
MAX_BATCH: Final = 64  # writes joined in one pwritev (under the kernel's IOV_MAX, 1024)


class OpenFile:
    """An open descriptor (owned: ``close`` it) with write-behind (see the module)."""

    def __init__(self, fd: int, *, max_pending: int = 8 << 20, max_writes: int = 256) -> None:
        self.fd = fd
        self.max_pending, self.max_writes = max_pending, max_writes  # bytes and writes queued at most
        self._queue: deque[tuple[int, bytes]] = deque()
        self._pending = 0  # bytes queued or being written
        self._writer: asyncio.Task[None] | None = None
        self._room = asyncio.Event()
        self._error: OSError | None = None
        self._reported = False  # whether the error was raised once already

    @property
    def writing(self) -> bool:
        return self._writer is not None

    async def read(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` (short near the end, or when only some are in the page cache)."""
        await self.flush()
        cached = read_cached(self.fd, size, offset)
        return cached if cached is not None else await asyncio.to_thread(os.pread, self.fd, size, offset)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        """``lseek``: asyncssh's ``ranges@asyncssh.com`` (its client's ``get``) finds a file's data with ``SEEK_DATA``
        and ``SEEK_HOLE``. Answers from what is written (a get reads a file nobody writes through this handle)."""
        return os.lseek(self.fd, offset, whence)

    async def write(self, offset: int, data: bytes) -> None:
        """Queue ``data`` for ``offset``; returns once it is queued (see the module). Raises the error of an earlier
        write. Cancelling is safe: the bytes are then not queued."""
        self._raise()
        while self._pending >= self.max_pending or len(self._queue) >= self.max_writes:
            self._room.clear()
            await self._room.wait()
            self._raise()
        self._queue.append((offset, data))
        self._pending += len(data)
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_queued(), name=f"sftp-write-{self.fd}")

    async def flush(self) -> None:
        """Wait until every queued write is done; raise the first failed one's error. Cancelling is safe: the
        writes go on."""
        if self._writer is not None:
            await asyncio.shield(self._writer)
        self._raise()

    async def settled(self) -> None:
        """Wait until every queued write is done, raising nothing (a look at the file through its path)."""
        if self._writer is not None:
            await asyncio.shield(self._writer)

    async def close(self) -> None:
        """Flush, then close the descriptor; raise a failed write's error unless an earlier call raised it. Cancelling
        is safe: the descriptor closes once the queued writes are done."""
        try:
            await self.settled()
            if not self._reported:
                self._raise()
        finally:
            fd, self.fd = self.fd, -1
            if fd >= 0:
                if self._writer is None:
                    os.close(fd)
                else:
                    self._writer.add_done_callback(lambda _: os.close(fd))

    def _raise(self) -> None:
        if self._error is not None:
            self._reported = True
            raise self._error

    async def _write_queued(self) -> None:
        try:
            while self._queue and self._error is None:
                offset, first = self._queue[0]
                batch, end = [first], offset + len(first)
                for next_offset, data in itertools.islice(self._queue, 1, MAX_BATCH):
                    if next_offset != end:
                        break
                    batch.append(data)
                    end += len(data)
                try:
                    await asyncio.to_thread(write_at, self.fd, batch, offset)
                except OSError as exc:
                    self._error = exc
                    self._queue.clear()
                    self._pending = 0
                    break
                for data in batch:
                    self._queue.popleft()
                    self._pending -= len(data)
                self._room.set()
        finally:
            self._writer = None
            self._room.set()


def write_at(fd: int, chunks: list[bytes], offset: int) -> None:
    """Write ``chunks`` one after the other from ``offset``, all of them (``pwritev`` may write less). Blocking."""
    views = [memoryview(chunk) for chunk in chunks if chunk]
    while views:
        written = os.pwritev(fd, views, offset)
        offset += written
        while views and written >= len(views[0]):
            written -= len(views.pop(0))
        if views and written:
            views[0] = views[0][written:]


def read_cached(fd: int, size: int, offset: int) -> bytes | None:
    """Up to ``size`` bytes at ``offset`` when the page cache holds them, read on the caller's thread; None when the
    read would wait for the disk (or the file system cannot say so): read in a thread then. A read partly in the
    cache comes back short, which SFTP allows (the client asks for the rest)."""
    if _NOWAIT is None:
        return None
    buffer = bytearray(size)
    try:
        got = os.preadv(fd, [buffer], offset, _NOWAIT)
    except OSError:  # EAGAIN: not in the cache; EOPNOTSUPP: this file system cannot read without waiting
        return None
    del buffer[got:]
    return bytes(buffer)
