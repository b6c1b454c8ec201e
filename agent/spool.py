"""The agent's on-disk spool: every sequenced message until the relay acknowledges it.

A SQLite file in the agent's data dir (WAL, one row per message), so nothing that was
not acknowledged is lost when the agent, its host or its connection dies. Bounded by
message count and bytes. When full, room is made by evicting, oldest first, what is
cheapest to lose: superseded heartbeats, then telemetry (counted, and the counts are
reported to the master in heartbeats). Hellos, command results, GPU events, network
reports and workload events are never evicted.

Durability is a group commit off the event loop: each change commits to the WAL at once on the
loop (``synchronous=NORMAL``: a write into the page cache, which survives the agent's process
dying), and ``await sync()`` makes everything committed so far survive a power loss too, by one
fsync of the WAL file in a thread shared by every caller that arrived meanwhile. The agent awaits
``sync()`` before it hands a frame to the relay, so whatever the relay saw is on disk.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from shared.outbound import EVICTABLE


class SqliteSpool:
    """The durable ``shared.outbound.FrameStore``: survives agent restarts.

    Each ``add`` commits to the WAL (``synchronous=NORMAL``: no fsync on the event loop);
    ``await sync()`` fsyncs the WAL in a thread, one fsync for every change made before it
    started (a group commit), and the agent awaits it before the frame is handed to the
    relay. An ``ack`` is not fsync'd on its own: after a power loss an acknowledged frame
    may come back and be replayed, which is harmless because the master de-duplicates by
    ``(host, seq)``.
    """

    def __init__(self, path: Path, *, max_messages: int = 100_000, max_bytes: int = 256 << 20) -> None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # The agent's alone: SQLite gives the -wal and -shm files the database file's mode.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        os.chmod(path, 0o600)
        self.path = path
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # SQLite fsyncs the WAL only at checkpoints (its own, every ~1,000 pages); ``sync`` does the rest.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS frames (seq INTEGER PRIMARY KEY, kind TEXT NOT NULL, frame TEXT NOT NULL)"
        )
        self._db.execute("CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)")
        self._count, self._bytes = self._db.execute("SELECT count(*), coalesce(sum(length(frame)), 0) FROM frames").fetchone()
        # The WAL exists from the first read on: an fsync of it makes every commit written to it durable.
        self._wal = os.open(f"{path}-wal", os.O_RDONLY | os.O_CLOEXEC)
        self._written = 0  # changes committed to the WAL so far
        self._synced = 0  # of those, how many an fsync has covered
        self._syncing: asyncio.Future[int] | None = None

    async def sync(self) -> None:
        """Return once every change made before the call is on disk (fsync'd). Callers that arrive
        while an fsync runs share the next one. Cancelling is safe: the fsync runs on, and the
        frames stay in the spool either way."""
        target = self._written
        while self._synced < target:
            running = self._syncing
            if running is None or running.done():
                running = self._syncing = asyncio.get_running_loop().run_in_executor(None, self._fsync, self._written)
            covered = await asyncio.shield(running)
            self._synced = max(self._synced, covered)
            if self._syncing is running:
                self._syncing = None

    def _fsync(self, covers: int) -> int:
        os.fsync(self._wal)
        return covers

    @property
    def unsynced(self) -> int:
        """Changes committed to the WAL but not yet fsync'd."""
        return self._written - self._synced

    def add(self, seq: int, kind: str, frame: str) -> None:
        with self._transaction():
            while (self._count >= self.max_messages or self._bytes + len(frame) > self.max_bytes) and self._evict_one():
                pass
            self._db.execute("INSERT OR REPLACE INTO frames (seq, kind, frame) VALUES (?, ?, ?)", (seq, kind, frame))
        self._written += 1
        self._count += 1
        self._bytes += len(frame)

    def _evict_one(self) -> bool:
        for kind in EVICTABLE:
            row = self._db.execute(
                "SELECT seq, length(frame) FROM frames WHERE kind = ? ORDER BY seq LIMIT 1", (kind,)
            ).fetchone()
            if row is not None:
                self._db.execute("DELETE FROM frames WHERE seq = ?", (row[0],))
                self._db.execute(
                    "INSERT INTO counters (name, value) VALUES (?, 1) ON CONFLICT(name) DO UPDATE SET value = value + 1",
                    (f"evicted_{kind}",),
                )
                self._count -= 1
                self._bytes -= row[1]
                return True
        return False

    def _transaction(self) -> _Committer:
        self._db.execute("BEGIN IMMEDIATE")
        return _Committer(self._db)

    def ack(self, seq: int) -> bool:
        row = self._db.execute("SELECT length(frame) FROM frames WHERE seq = ?", (seq,)).fetchone()
        if row is None:
            return False
        self._db.execute("DELETE FROM frames WHERE seq = ?", (seq,))
        self._written += 1
        self._count -= 1
        self._bytes -= row[0]
        return True

    def discard_kind(self, kind: str) -> int:
        with self._transaction():
            removed = self._db.execute("DELETE FROM frames WHERE kind = ?", (kind,)).rowcount
        self._written += 1
        self._count, self._bytes = self._db.execute("SELECT count(*), coalesce(sum(length(frame)), 0) FROM frames").fetchone()
        return int(removed)

    def pending(self) -> Iterator[tuple[int, str]]:
        return iter(self._db.execute("SELECT seq, frame FROM frames ORDER BY seq").fetchall())

    def __len__(self) -> int:
        return int(self._count)

    @property
    def size_bytes(self) -> int:
        return int(self._bytes)

    @property
    def evicted(self) -> dict[str, int]:
        rows = self._db.execute("SELECT name, value FROM counters WHERE name LIKE 'evicted_%'").fetchall()
        return {name.removeprefix("evicted_"): int(value) for name, value in rows}

    def close(self) -> None:
        """Fsync what is left and close (SQLite checkpoints the WAL into the file and removes it)."""
        if self._wal < 0:
            return  # closed already
        if self._written > self._synced:
            os.fsync(self._wal)
        os.close(self._wal)
        self._wal = -1
        self._db.close()


class _Committer:
    """``with``: COMMIT on success, ROLLBACK on error (sqlite3 in autocommit mode)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> sqlite3.Connection:
        return self._db

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._db.execute("ROLLBACK" if exc_type else "COMMIT")
