"""Shipping workload output to the master: a cursor per rental, bounded chunks, whole characters.

For each rental whose log the agent ships, a cursor (``log_cursors.json`` in the agent's
data dir, rewritten atomically) says how far it got; ``ship`` reads what is new through the
workload manager in chunks of ``LOG_READ_BYTES`` and hands each to ``send`` as a
``workload_logs`` body. A rental whose workload ended is forgotten once drained.

Delivery is at least once: the cursors are saved after the chunks are in the spool, in a thread
(the fsync off the event loop), so a crash can leave them behind what was sent, never ahead. The
agent then ships again from the older offset, in a chunk that may reach further than the one sent
before; the master keeps the longer chunk at an offset (``master.telemetry.hosts``), so nothing is
lost or shown twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from agent.runtimes.manager import WorkloadManager
from agent.state import atomic_write
from shared import protocol
from shared.errors import GpumarketError

log = logging.getLogger(__name__)

LOG_READ_BYTES = 16 << 10  # ≤ MAX_LOG_CHUNK even if every byte needs a 3-byte replacement character


@dataclass
class LogCursor:
    offset: int = 0
    exited: bool = False


class LogShipper:
    """Ships new output of every known workload through ``send`` (which writes it to the spool)."""

    def __init__(self, state_dir: Path, workloads: WorkloadManager, send: Callable[[protocol.WorkloadLogsBody], Awaitable[None]]) -> None:
        self.path = state_dir / "log_cursors.json"
        self.workloads = workloads
        self.send = send
        self.cursors: dict[str, LogCursor] = self._load()
        self._save_lock = threading.Lock()  # one writer of the file (and its temporary) at a time
        self._versions = 0  # snapshots taken
        self._written = 0  # the newest snapshot on disk: an older one finishing later is not written over it

    def follow(self, rental_id: str, *, save: bool = False) -> None:
        """Ship this rental's log from where we got to (the start, for a new one)."""
        self.cursors.setdefault(rental_id, LogCursor())
        if save:
            self._save()

    def exited(self, rental_id: str) -> None:
        """The workload ended: ship what is left, then forget the rental."""
        if rental_id in self.cursors:
            self.cursors[rental_id].exited = True

    def _load(self) -> dict[str, LogCursor]:
        try:
            raw = json.loads(self.path.read_text())
            return {k: LogCursor(offset=int(v["offset"]), exited=bool(v["exited"])) for k, v in raw.items()}
        except FileNotFoundError:
            return {}
        except (ValueError, KeyError, TypeError):
            log.warning("%s is damaged; workload logs will be shipped again from the start", self.path)
            return {}

    def _snapshot(self) -> tuple[int, bytes]:
        self._versions += 1
        data = {k: {"offset": c.offset, "exited": c.exited} for k, c in self.cursors.items()}
        return self._versions, json.dumps(data).encode()

    def _write(self, version: int, data: bytes) -> None:
        with self._save_lock:
            if version > self._written:
                atomic_write(self.path, data)
                self._written = version

    def _save(self) -> None:
        self._write(*self._snapshot())

    async def save(self) -> None:
        """Write the cursors as they are now, in a thread. Cancelling is safe: the write finishes
        there, and a cursor left behind only ships some output again."""
        await asyncio.to_thread(self._write, *self._snapshot())

    async def ship(self) -> int:
        """Write new output of every known workload to the spool; returns bytes shipped."""
        shipped, forgotten = 0, False
        for rental_id, cursor in list(self.cursors.items()):
            while True:
                try:
                    chunk, next_offset = self.workloads.read_log(rental_id, offset=cursor.offset, limit=LOG_READ_BYTES)
                except GpumarketError:
                    chunk, next_offset = b"", cursor.offset
                if not chunk:
                    if cursor.exited:
                        del self.cursors[rental_id]  # drained: nothing more will come
                        forgotten = True
                    break
                # The log is capped: if older bytes were dropped, the chunk starts after our cursor.
                start = next_offset - len(chunk)
                if len(chunk) == LOG_READ_BYTES:
                    chunk = complete_utf8(chunk)
                body = protocol.WorkloadLogsBody(
                    rental_id=rental_id, offset=start, length=len(chunk), data=chunk.decode(errors="replace")
                )
                await self.send(body)
                cursor.offset = start + len(chunk)
                shipped += len(chunk)
        if shipped or forgotten:  # nothing new: no write (it was an fsync every interval, idle or not)
            await self.save()
        return shipped


def complete_utf8(chunk: bytes) -> bytes:
    """Drop a multi-byte character cut off at the end of ``chunk`` (it is read again next time)."""
    for back in range(1, min(4, len(chunk)) + 1):
        byte = chunk[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: the start of the last character
            width = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return chunk if width <= back else chunk[:-back]
    return chunk
