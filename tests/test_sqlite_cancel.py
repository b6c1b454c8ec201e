"""A cancelled call never leaves SQLite's write lock behind (``master.db.RollingBackConnection``).

Found when `gpumarket up` took over 45 s to stop: its loops, cancelled at shutdown in the middle of a transaction,
left connections that Python's ``sqlite3`` had closed as "zombies" (a statement of the cancelled call not yet
finalized), each keeping its transaction and the database's one write lock until the garbage collector freed the
statement's cursor. Every other writer then waited out its 30 s ``busy_timeout`` and failed with "database is locked".
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from master.db import Database, RollingBackConnection
from tests.helpers import eventually


def can_write(path: Path) -> bool:
    """Whether another connection can take the write lock right now (no waiting)."""
    other = sqlite3.connect(path, timeout=0)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError as exc:
        assert "locked" in str(exc)
        return False
    finally:
        other.close()


@pytest.fixture
def no_gc() -> Iterator[None]:
    """The collector off: what it would free by chance (a zombie connection's cursor) stays, as it may for minutes in
    a busy process."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_closing_with_a_statement_pending_rolls_back_and_frees_the_lock(tmp_path: Path, no_gc: None) -> None:
    path = tmp_path / "t.db"
    setup = sqlite3.connect(path)
    setup.execute("PRAGMA journal_mode=WAL")
    setup.execute("CREATE TABLE t (x INTEGER)")
    setup.execute("INSERT INTO t VALUES (1), (2)")
    setup.commit()
    setup.close()

    connection = sqlite3.connect(path, factory=RollingBackConnection)
    writing = connection.cursor()
    writing.execute("INSERT INTO t VALUES (3)")  # the write lock is taken
    reading = connection.cursor()
    reading.execute("SELECT x FROM t")
    assert reading.fetchone() is not None  # a statement stepped and not finalized, as a cancelled call leaves one
    connection.close()

    assert can_write(path)
    check = sqlite3.connect(path)
    assert check.execute("SELECT count(*) FROM t").fetchone() == (2,)  # rolled back, not committed
    check.close()
    del writing, reading


@pytest.mark.parametrize("serialised", [False, True], ids=["session", "serialised_session"])
async def test_transactions_cancelled_anywhere_leave_the_database_writable(tmp_path: Path, serialised: bool, no_gc: None) -> None:
    """Tasks in a transaction of a few statements, cancelled at 50 different moments, 300 times: after each, another
    connection can write (before the fix, a few in every 300 left the lock held until a collection)."""
    path = tmp_path / "t.db"
    db = Database(f"sqlite:///{path}")
    try:
        async with db.session() as session:
            await session.execute(text("CREATE TABLE t (x INTEGER)"))

        async def transaction() -> None:
            async with db.serialised_session() if serialised else db.session() as session:
                await session.execute(text("INSERT INTO t VALUES (1)"))
                await session.execute(text("SELECT count(*) FROM t"))
                await session.execute(text("INSERT INTO t VALUES (2)"))

        for attempt in range(300):
            task = asyncio.create_task(transaction())
            await asyncio.sleep((attempt % 50) * 0.0002)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):  # or it had finished before the cancel
                await task

            async def writable() -> bool:
                return can_write(path)

            await eventually(writable, timeout=5, what=f"the write lock to be free after attempt {attempt}")
    finally:
        await db.close()
