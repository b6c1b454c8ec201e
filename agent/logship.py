"""Shipping workload output to the master: a cursor per rental, bounded chunks, whole characters.

For each rental whose log the agent ships, a cursor (``log_cursors.json`` in the agent's
data dir, rewritten atomically) says how far it got; ``ship`` reads what is new through the
workload manager in chunks of ``LOG_READ_BYTES`` and hands each to ``send`` as a
``workload_logs`` body. A rental whose workload ended is forgotten once drained.
"""

from __future__ import annotations

import json
import logging
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

    def _save(self) -> None:
        data = {k: {"offset": c.offset, "exited": c.exited} for k, c in self.cursors.items()}
        atomic_write(self.path, json.dumps(data).encode())

    async def ship(self) -> int:
        """Write new output of every known workload to the spool; returns bytes shipped."""
        shipped = 0
        for rental_id, cursor in list(self.cursors.items()):
            while True:
                try:
                    chunk, next_offset = self.workloads.read_log(rental_id, offset=cursor.offset, limit=LOG_READ_BYTES)
                except GpumarketError:
                    chunk, next_offset = b"", cursor.offset
                if not chunk:
                    if cursor.exited:
                        del self.cursors[rental_id]  # drained: nothing more will come
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
        if shipped or not self.cursors:
            self._save()
        return shipped


def complete_utf8(chunk: bytes) -> bytes:
    """Drop a multi-byte character cut off at the end of ``chunk`` (it is read again next time)."""
    for back in range(1, min(4, len(chunk)) + 1):
        byte = chunk[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: the start of the last character
            width = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return chunk if width <= back else chunk[:-back]
    return chunk
