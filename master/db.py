"""The database: engine, sessions and migrations (SQLite by default, PostgreSQL in production)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import event
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from shared.errors import ConfigError

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


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
    """Owns the async engine; ``session()`` yields a session in a transaction."""

    def __init__(self, url: str, *, pool_size: int = 10, echo: bool = False) -> None:
        self.url = normalise_url(url)
        kwargs: dict[str, Any] = {"echo": echo}
        self.is_sqlite = self.url.startswith("sqlite")
        if self.is_sqlite:
            kwargs["connect_args"] = {"timeout": 30}
        else:
            kwargs.update(pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)
        self.engine: AsyncEngine = create_async_engine(self.url, **kwargs)
        if self.is_sqlite:
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)
        self.sessionmaker = async_sessionmaker(self.engine, expire_on_commit=False)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        """A session inside one transaction, committed on success, rolled back on error."""
        async with self.sessionmaker() as session, session.begin():
            yield session

    async def migrate(self) -> None:
        """Bring the schema to the newest Alembic revision (safe to run on every start)."""
        async with self.engine.begin() as conn:
            await conn.run_sync(_upgrade)

    async def close(self) -> None:
        await self.engine.dispose()


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def alembic_config(connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def _upgrade(connection: Connection) -> None:
    command.upgrade(alembic_config(connection), "head")
