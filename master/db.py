"""The database: engine, sessions and migrations (SQLite by default, PostgreSQL in production)."""

from __future__ import annotations

import asyncio
import functools
import logging
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import event, inspect, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from shared.errors import ConfigError

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
MIGRATION_LOCK_KEY = 0x67706D6D6967  # "gpmmig": the PostgreSQL advisory lock migrations hold
# Execution option of the engine behind ``Database.serialised_session``: how its SQLite transactions begin.
_SQLITE_BEGIN = "gpumarket_sqlite_begin"


def normalise_url(url: str) -> str:
    """Pick the async driver for a plain database URL (``postgresql://`` → asyncpg)."""
    try:
        parsed = make_url(url)
    except Exception as exc:
        raise ConfigError(f"GPUMARKET_DATABASE_URL {url!r} is not a database URL: {exc}") from None
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return str(parsed.set(drivername="sqlite+aiosqlite"))
    if backend == "postgresql":
        return parsed.set(drivername="postgresql+asyncpg").render_as_string(hide_password=False)
    raise ConfigError(f"database {backend!r} is not supported; use PostgreSQL (postgresql://…) or SQLite (sqlite:///FILE)")


def sqlite_url(path: Path) -> str:
    return f"sqlite+aiosqlite:///{path}"


class Database:
    """Owns the async engine; ``session()`` yields a session in a transaction, ``serialised_session()`` one that
    reads and writes as one step on SQLite as well (for placement: quotas, credit and the claim)."""

    def __init__(self, url: str, *, pool_size: int = 10, echo: bool = False) -> None:
        self.url = normalise_url(url)
        kwargs: dict[str, Any] = {"echo": echo}
        self.is_sqlite = self.url.startswith("sqlite")
        if self.is_sqlite:
            kwargs["connect_args"] = {"timeout": 30, "factory": RollingBackConnection}
        else:
            kwargs.update(pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)
        self.engine: AsyncEngine = create_async_engine(self.url, **kwargs)
        if self.is_sqlite:
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)
            event.listen(self.engine.sync_engine, "begin", _sqlite_begin)
        self.sessionmaker = async_sessionmaker(self.engine, expire_on_commit=False)
        self._serialised = async_sessionmaker(self.engine.execution_options(**{_SQLITE_BEGIN: "IMMEDIATE"}), expire_on_commit=False)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        """A session inside one transaction, committed on success, rolled back on error."""
        async with self.sessionmaker() as session, session.begin():
            yield session

    @asynccontextmanager
    async def serialised_session(self) -> AsyncIterator[AsyncSession]:
        """Like ``session()``, for a transaction that must read and then write with nothing in between (placement).

        On PostgreSQL it is an ordinary session: the caller locks what it reads (``SELECT … FOR UPDATE``).
        SQLite ignores ``FOR UPDATE``, and Python's sqlite3 (legacy transaction control) begins a transaction
        only at the first INSERT/UPDATE/DELETE: the reads before it see no lock, and a ``SAVEPOINT`` issued
        first opens a transaction of its own that its ``RELEASE`` commits, half a placement. Here the
        transaction begins with ``BEGIN IMMEDIATE`` instead: it takes SQLite's one write lock before its first
        read (waiting up to ``busy_timeout`` for another writer), so it is serialised with every other write
        and its savepoints are nested in it. Cancelling is safe: the transaction is rolled back.
        """
        async with self._serialised() as session, session.begin():
            yield session

    async def migrate(self) -> None:
        """Bring the schema to the newest Alembic revision (safe to run on every start)."""
        async with self.engine.begin() as conn:
            if not self.is_sqlite:
                # Masters and migration jobs started together take turns: the second finds the schema
                # at head and does nothing (without the lock it would fail creating what the first made).
                await conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            await conn.run_sync(_upgrade)

    async def close(self) -> None:
        await self.engine.dispose()


class RollingBackConnection(sqlite3.Connection):
    """A SQLite connection that rolls its transaction back when it is closed.

    A call cancelled in the middle of a transaction (a request whose client went away, a loop stopped at shutdown)
    has SQLAlchemy close the connection with the cancelled call's statement not yet finalized: Python's
    ``sqlite3`` then leaves the connection a "zombie" (``sqlite3_close_v2``) that keeps its transaction, and with it
    SQLite's one write lock, until the garbage collector frees that statement's cursor, which can take minutes.
    Every writer meanwhile waits out its ``busy_timeout`` and fails with "database is locked" (found when
    `gpumarket up` took over 45 s to stop). A rollback ends the transaction whatever statements are pending.
    """

    def close(self) -> None:
        try:
            if self.in_transaction:
                self.rollback()
        finally:
            super().close()


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _sqlite_begin(conn: Connection) -> None:
    """Begin ``serialised_session()``'s transactions with ``BEGIN IMMEDIATE`` (others keep sqlite3's implicit BEGIN)."""
    if conn.get_execution_options().get(_SQLITE_BEGIN) == "IMMEDIATE":
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def alembic_config(connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def _upgrade(connection: Connection) -> None:
    """Alembic's upgrade to head, unless the schema is there already (every master start asks; loading the
    migration scripts to find that out took a tenth of a test's setup in the suite)."""
    if current_revisions(connection) == head_revisions():
        return
    command.upgrade(alembic_config(connection), "head")


class SchemaNotReady(ConfigError):
    """The database is not at this code's newest migration, and this process does not migrate."""

    code = "schema_not_ready"


@functools.cache
def _scripts() -> ScriptDirectory:
    """This code's migration scripts, read once per process (they do not change while it runs)."""
    return ScriptDirectory.from_config(alembic_config())


def head_revisions() -> set[str]:
    """The newest Alembic revision(s) of this code."""
    return set(_scripts().get_heads())


def current_revisions(conn: Connection) -> set[str]:
    """The Alembic revisions the database is at (none: never migrated). Read directly: alembic's context logs noise."""
    if not inspect(conn).has_table("alembic_version"):
        return set()
    return set(conn.execute(text("SELECT version_num FROM alembic_version")).scalars())


async def check_schema(db: Database, *, who: str) -> None:
    """Raise ``SchemaNotReady`` unless the database is at this code's newest migration; ``ConfigError`` if unreachable.

    ``who`` names the processes that do not migrate (\"billing workers\", \"this master\") in the message.
    """
    where = db.engine.url.render_as_string(hide_password=True)
    try:
        async with db.engine.connect() as conn:
            revisions = await conn.run_sync(current_revisions)
    except Exception as exc:
        raise ConfigError(f"{who} cannot reach the database at {where}: {exc}; check GPUMARKET_DATABASE_URL") from exc
    scripts = _scripts()
    heads = head_revisions()
    if not revisions:
        raise SchemaNotReady(
            f"the database at {where} has no gpumarket schema and {who} do not migrate: run `gpumarket migrate` "
            "(or start a master with migrate_on_start) on this database first, or check GPUMARKET_DATABASE_URL"
        )
    if revisions != heads:
        known = all(scripts.get_revision(revision) is not None for revision in revisions)
        fix = ("run `gpumarket migrate` of this version first" if known
               else "it is newer than this code: upgrade to the version that migrated it")  # fmt: skip
        raise SchemaNotReady(
            f"the database at {where} is at schema revision {', '.join(sorted(revisions))}, {who} need "
            f"{', '.join(sorted(heads))}: {fix}"
        )


async def open_database(url: str, *, migrate: bool, who: str) -> Database:
    """The database at ``url``, migrated (``migrate``) or its schema checked; closed again if that fails.

    ``who`` names the processes that do not migrate, for ``check_schema``'s message. Any other failure to
    reach or migrate it is a ``ConfigError`` naming the URL.
    """
    db = Database(url)
    try:
        if migrate:
            await db.migrate()
        else:
            await check_schema(db, who=who)
    except ConfigError:
        await db.close()
        raise
    except Exception as exc:
        await db.close()
        raise ConfigError(f"cannot open the database at {db.engine.url!r}: {exc}; check GPUMARKET_DATABASE_URL") from exc
    return db


async def migrate_or_wait(url: str, *, check_only: bool, wait_s: float, poll_s: float = 2.0) -> tuple[set[str], set[str]]:
    """``gpumarket migrate``: bring the schema at ``url`` to head (or, with ``check_only``, wait until it is).

    Retries for up to ``wait_s`` seconds while the database cannot be reached (a deployment starts
    the migration job and the database together) or, with ``check_only``, is not at head yet.
    Returns (revisions before, revisions after). Raises ``ConfigError``/``SchemaNotReady`` when
    the time is up. Safe to run from several processes at once on PostgreSQL: the upgrade runs in
    one transaction holding Alembic's version table.
    """
    db = Database(url, pool_size=1)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                if check_only:
                    await check_schema(db, who="processes waiting for `gpumarket migrate`")
                    async with db.engine.connect() as conn:  # read after the check: a job may have migrated meanwhile
                        now = await conn.run_sync(current_revisions)
                    return now, now
                async with db.engine.connect() as conn:
                    before = await conn.run_sync(current_revisions)
                await db.migrate()
                async with db.engine.connect() as conn:
                    return before, await conn.run_sync(current_revisions)
            except Exception as exc:
                if time.monotonic() >= deadline:
                    if isinstance(exc, ConfigError):
                        raise
                    where = db.engine.url.render_as_string(hide_password=True)
                    raise ConfigError(f"cannot migrate the database at {where}: {exc}; check GPUMARKET_DATABASE_URL") from exc
                log.info("database not ready (%s); retrying", exc)
                await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
    finally:
        await db.close()
