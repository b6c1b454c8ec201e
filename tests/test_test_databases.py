"""The suite's pooled PostgreSQL databases (``tests/pgpool.py``): one reused after a test holds what a fresh copy of the
template holds, rows and sequences, and one whose schema a test changed is dropped, not reused."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest

from tests.pgpool import PostgresPool

pytestmark = pytest.mark.postgres

LOCK_KEY = 424242


@asynccontextmanager
async def connected(url: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(url, timeout=10)
    try:
        yield connection
    finally:
        await connection.close()


async def contents(url: str) -> dict[str, Any]:
    """Every table's rows (as text, sorted) and every sequence's position: what a test can see of a database's data."""
    async with connected(url) as db:
        tables = [row[0] for row in await db.fetch("SELECT format('%I', tablename) FROM pg_tables WHERE schemaname = 'public'")]
        sequences = [row[0] for row in await db.fetch("SELECT format('%I', sequencename) FROM pg_sequences WHERE schemaname = 'public'")]
        assert len(tables) > 30 and len(sequences) > 10, (tables, sequences)
        found: dict[str, Any] = {table: sorted(row[0] for row in await db.fetch(f"SELECT t::text FROM {table} AS t")) for table in tables}
        for sequence in sequences:
            found[sequence] = tuple(await db.fetchrow(f"SELECT last_value, is_called FROM {sequence}"))
        return found


async def oid(admin: asyncpg.Connection, url: str) -> int | None:
    value: int | None = await admin.fetchval("SELECT oid FROM pg_database WHERE datname = $1", url.rsplit("/", 1)[1])
    return value


async def write_everywhere(url: str) -> None:
    """What a test leaves behind: rows in several tables (one filled by a sequence), a sequence moved on by itself, the
    seeded ``templates`` rows deleted, changed and added to."""
    async with connected(url) as db:
        await db.execute("""
            INSERT INTO accounts (id, name, role, created_at) VALUES ('a1', 'provider', 'provider', now());
            INSERT INTO hosts (id, owner_id, name, state, state_changed_at, facts, last_seq, latest_telemetry_seq, created_at)
                VALUES ('h1', 'a1', 'box', 'online', now(), '{}', 0, 0, now());
            INSERT INTO host_events (host_id, at, to_state, cause, actor) VALUES ('h1', now(), 'online', 'hello', 'agent'),
                                                                               ('h1', now(), 'offline', 'silence', 'master');
            SELECT nextval('telemetry_id_seq'), nextval('telemetry_id_seq');
            DELETE FROM templates WHERE name = 'base';
            UPDATE templates SET description = 'changed' WHERE name = 'pytorch';
            INSERT INTO templates (name, description, workload, created_at, updated_at)
                VALUES ('mine', 'added by a test', '{}', now(), now());
        """)
        assert await db.fetchval("SELECT max(id) FROM host_events") == 2


class TestReuse:
    async def test_a_reused_database_holds_what_a_fresh_copy_holds(self, _postgres_pool: PostgresPool) -> None:
        """Rows written, seeded rows deleted and changed, sequences moved on, and a session still connected, holding an
        advisory lock and a row lock in an open transaction: after ``put_back`` the next ``take`` gets the same database
        (under a new name) with the rows and sequence positions of a new copy of the template, the lock free."""
        pool = _postgres_pool
        first = await pool.take()
        fresh = await pool.create()
        try:
            expected = await contents(fresh)
            assert expected == await contents(first)
            assert len(expected["templates"]) == 4 and expected["accounts"] == [] and expected["host_events_id_seq"] == (1, False)
            await write_everywhere(first)
            assert await contents(first) != expected
            leftover = await asyncpg.connect(first, timeout=10)
            await leftover.execute("SELECT pg_advisory_lock($1)", LOCK_KEY)
            await leftover.execute("BEGIN; UPDATE templates SET description = 'held' WHERE name = 'jupyter'")
            async with connected(pool.admin_url) as admin:
                number = await oid(admin, first)

            await pool.put_back(first)
            again = await pool.take()
            try:
                async with connected(pool.admin_url) as admin:
                    assert again != first and await oid(admin, first) is None and await oid(admin, again) == number
                assert await contents(again) == expected
                assert not await _answers(leftover)
                leftover.terminate()
                async with connected(again) as db:
                    assert await db.fetchval("SELECT pg_try_advisory_lock($1)", LOCK_KEY)
                    await db.execute("INSERT INTO accounts (id, name, role, created_at) VALUES ('a1', 'provider', 'provider', now());"
                                     "INSERT INTO hosts (id, owner_id, name, state, state_changed_at, facts, last_seq, "
                                     "latest_telemetry_seq, created_at) VALUES ('h1', 'a1', 'box', 'online', now(), '{}', 0, 0, now())")
                    assert await db.fetchval("INSERT INTO host_events (host_id, at, to_state, cause, actor) "
                                             "VALUES ('h1', now(), 'online', 'hello', 'agent') RETURNING id") == 1
            finally:
                await pool.put_back(again)
        finally:
            await pool.drop(fresh.rsplit("/", 1)[1])

    async def test_a_database_whose_schema_changed_is_dropped(self, _postgres_pool: PostgresPool) -> None:
        """A column added (by a test's ALTER TABLE, say): the database is dropped, not put back, and the next
        ``take`` is another one."""
        pool = _postgres_pool
        url = await pool.take()
        async with connected(pool.admin_url) as admin:
            number = await oid(admin, url)
            async with connected(url) as db:
                await db.execute("ALTER TABLE accounts ADD COLUMN nickname text")
            await pool.put_back(url)
            assert await admin.fetchval("SELECT count(*) FROM pg_database WHERE oid = $1", number) == 0
            assert url.rsplit("/", 1)[1] not in pool.idle
            other = await pool.take()
            try:
                assert await oid(admin, other) != number
                async with connected(other) as db:
                    assert await db.fetchval("SELECT count(*) FROM information_schema.columns WHERE column_name = 'nickname'") == 0
            finally:
                await pool.put_back(other)


async def _answers(connection: asyncpg.Connection) -> bool:
    """Whether a session still answers (a terminated one raises on its next query)."""
    try:
        await connection.fetchval("SELECT 1")
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
        return False
    return True
