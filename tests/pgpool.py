"""A pool of migrated PostgreSQL databases per test process (``tests/conftest.py``'s ``migrated_postgres_url``).

A test's database used to be a fresh copy of a migrated template (``CREATE DATABASE … TEMPLATE``), dropped after the
test: about 0.17 s of server CPU to copy and 0.05 s to drop, for each of ~650 PostgreSQL-parametrized tests on a suite
that is CPU-bound. Deleting every row of a copy costs 1–2 ms, so a database is reused instead: after its test, the
sessions still connected to it are terminated (their advisory locks and open transactions die with them), every table
but ``alembic_version`` is emptied with the foreign-key and summary triggers off, the rows the migrations seeded are
copied back and every sequence is set back to the template's value. A fresh copy and a reset one then hold the same
rows and hand out the same ids. A database whose schema no longer is the template's (a test altered a table, say),
or whose reset failed, is dropped instead of reused. Each reuse renames the database, so a test's URL is its own: a
process left over from the test before cannot reconnect to the next test's database.
"""

from __future__ import annotations

import io
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import asyncpg

CONNECT_TIMEOUT_S = 10
COMMAND_TIMEOUT_S = 30
"""The reset's statements: each takes milliseconds; a lock held by a session that would not die must not hang the test."""

TERMINATE_WAIT_MS = 5000
"""How long ``pg_terminate_backend`` waits for each session to exit (it normally takes a few milliseconds)."""

SCHEMA = r"""
SELECT md5(string_agg(line, E'\n' ORDER BY line)) FROM (
    SELECT format('relation %s %s', c.oid::regclass, c.relkind) AS line
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname NOT LIKE 'pg\_%' AND n.nspname <> 'information_schema'
    UNION ALL SELECT format('column %s.%s %s %s %s', a.attrelid::regclass, a.attname, format_type(a.atttypid, a.atttypmod),
                            a.attnotnull, pg_get_expr(d.adbin, d.adrelid))
        FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE n.nspname NOT LIKE 'pg\_%' AND n.nspname <> 'information_schema' AND a.attnum > 0 AND NOT a.attisdropped
    UNION ALL SELECT format('constraint %s %s %s', conrelid::regclass, conname, pg_get_constraintdef(oid)) FROM pg_constraint
        WHERE connamespace NOT IN ('pg_catalog'::regnamespace, 'information_schema'::regnamespace)
    UNION ALL SELECT format('index %s', pg_get_indexdef(i.indexrelid)) FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
        WHERE c.relnamespace NOT IN ('pg_catalog'::regnamespace, 'information_schema'::regnamespace, 'pg_toast'::regnamespace)
    UNION ALL SELECT format('trigger %s %s', pg_get_triggerdef(oid), tgenabled) FROM pg_trigger WHERE NOT tgisinternal
    UNION ALL SELECT format('function %s %s', p.oid::regprocedure, md5(p.prosrc)) FROM pg_proc p
        WHERE p.pronamespace NOT IN ('pg_catalog'::regnamespace, 'information_schema'::regnamespace)
    UNION ALL SELECT format('version %s', version_num) FROM alembic_version
) AS catalog
"""
"""A digest of the schema (relations, columns, constraints, indexes, triggers and whether they are enabled, functions)
and of the migration head: one query, about 10 ms on a new session, which is what a reset checks its database against."""


class NotLikeTemplate(Exception):
    """A database's schema or migration head differs from the template's: it cannot be reset, only dropped."""


@dataclass(frozen=True)
class TemplateState:
    """What a fresh copy of the template holds besides its schema, recorded once per session."""

    schema: str
    """The template's ``SCHEMA`` digest."""
    emptied: str
    """The statements that empty every table but ``alembic_version``, the triggers off (``session_replication_role``)."""
    rows: dict[str, bytes]
    """The tables the migrations seeded (``templates``, say), each as binary COPY data."""
    sequences: list[tuple[str, int, bool]]
    """Each sequence's name (quoted, schema-qualified), ``last_value`` and ``is_called``."""


async def record(connection: asyncpg.Connection) -> TemplateState:
    """The state of the database ``connection`` is on (the template, just migrated)."""
    tables = await connection.fetch("SELECT tablename, format('%I', tablename) AS quoted FROM pg_tables "
                                    "WHERE schemaname = 'public' AND tablename <> 'alembic_version' ORDER BY tablename")
    rows = {}
    for table in tables:
        if await connection.fetchval(f"SELECT EXISTS (SELECT FROM {table['quoted']})"):
            data = io.BytesIO()
            await connection.copy_from_table(table["tablename"], output=data, format="binary")
            rows[table["tablename"]] = data.getvalue()
    sequences = []
    for name in await connection.fetch("SELECT format('%I.%I', schemaname, sequencename) FROM pg_sequences ORDER BY 1"):
        last_value, is_called = await connection.fetchrow(f"SELECT last_value, is_called FROM {name[0]}")
        sequences.append((name[0], last_value, is_called))
    return TemplateState(
        schema=await connection.fetchval(SCHEMA),
        emptied="SET LOCAL session_replication_role = replica; " + " ".join(f"DELETE FROM {table['quoted']};" for table in tables),
        rows=rows,
        sequences=sequences,
    )


async def reset(url: str, state: TemplateState) -> None:
    """Make the database at ``url`` hold what a fresh copy of the template holds; ``NotLikeTemplate`` or the database's
    error where it cannot."""
    connection = await asyncpg.connect(url, timeout=CONNECT_TIMEOUT_S, command_timeout=COMMAND_TIMEOUT_S)
    try:
        # Whether each one died is not asked here: the rename after the reset fails while any session is still on it.
        await connection.execute("SELECT pg_terminate_backend(pid, $1) FROM pg_stat_activity "
                                 "WHERE datname = current_database() AND pid <> pg_backend_pid()", TERMINATE_WAIT_MS)
        if await connection.fetchval(SCHEMA) != state.schema:
            raise NotLikeTemplate(url)
        async with connection.transaction():
            await connection.execute(state.emptied)
            for table, data in state.rows.items():
                await connection.copy_to_table(table, source=io.BytesIO(data), format="binary")
            if state.sequences:
                calls = ", ".join(f"setval(${3 * i + 1}::regclass, ${3 * i + 2}, ${3 * i + 3})" for i in range(len(state.sequences)))
                await connection.execute(f"SELECT {calls}", *(value for sequence in state.sequences for value in sequence))
    finally:
        await connection.close()


def database_url(url: str, name: str) -> str:
    """``url`` with its database replaced by ``name``."""
    return f"{url.rsplit('/', 1)[0]}/{name}"


def new_name() -> str:
    return f"gm_test_{secrets.token_hex(6)}"


class PostgresPool:
    """The migrated databases of one test process: ``take`` one for a test, ``put_back`` after it, ``close`` at the end.

    ``admin`` connects to the server's maintenance database, as a superuser (a reset turns triggers off)."""

    def __init__(self, admin_url: str, admin: Callable[[], Awaitable[asyncpg.Connection]], template: str,
                 state: TemplateState) -> None:
        self.admin_url = admin_url
        self.admin = admin
        self.template = template
        self.state = state
        self.idle: list[str] = []
        """The databases ready for a test, by name; the last one put back is the first taken."""

    async def create(self) -> str:
        """A new copy of the template (not from the pool); its URL."""
        name = new_name()
        admin = await self.admin()
        try:
            await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
        finally:
            await admin.close()
        return database_url(self.admin_url, name)

    async def take(self) -> str:
        """A database as fresh as a copy of the template, from the pool or copied now; its URL."""
        return database_url(self.admin_url, self.idle.pop()) if self.idle else await self.create()

    async def put_back(self, url: str) -> None:
        """Reset the database at ``url`` and keep it, under a new name, for the next ``take``; drop it where it cannot be
        reset."""
        name = url.rsplit("/", 1)[1]
        renamed = new_name()
        try:
            await reset(url, self.state)
            admin = await self.admin()
            try:
                await admin.execute(f'ALTER DATABASE "{name}" RENAME TO "{renamed}"')
            finally:
                await admin.close()
        except (NotLikeTemplate, asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError):
            await self.drop(name)
        else:
            self.idle.append(renamed)

    async def drop(self, name: str) -> None:
        admin = await self.admin()
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()

    async def close(self) -> None:
        """Drop the databases in the pool (those in a test's hands are put back or dropped by their fixture first)."""
        while self.idle:
            await self.drop(self.idle.pop())
