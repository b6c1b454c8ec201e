"""One SQLAlchemy statement cache for every engine of a test process, instead of one per engine.

SQLAlchemy compiles a statement once per engine: its compiled-statement cache lives on the engine (``SELECT``s) and,
for the unit of work's ``INSERT``/``UPDATE``/``DELETE``, on each mapper under the key of the engine's dialect object.
A master in production opens one engine and compiles each statement once in its life. A test process opens a new one
for every test (a ``Database`` per master), so every test compiled again the 20–40 statements it runs: about 1 ms
each, a tenth of the CPU of the in-process API tests (tests/test_offers.py, 2026-11-29: 2,830 compilations, 3.2 s of
26 s). ``share_statement_caches`` makes the engines of this process share what they compile:

- every connection reads and writes one process-wide cache (the ``compiled_cache`` execution option, set as each
  connection opens), and
- the dialect objects of one driver compare equal when they compile alike (the same class and server version), so
  that the keys of both caches, which hold the dialect, match across engines.

Sound here, and only here: a compiled statement depends on its dialect's class, its options and what it learnt from
the server, and in a test process every engine of a driver comes from ``master.db.Database`` with the same options.
Not for the product, where a process has one engine anyway.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import event, util
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg
from sqlalchemy.dialects.sqlite.aiosqlite import SQLiteDialect_aiosqlite
from sqlalchemy.engine import Connection, Dialect, Engine

SHARED_DIALECTS: tuple[type[Dialect], ...] = (SQLiteDialect_aiosqlite, PGDialect_asyncpg)
"""The drivers ``master.db.Database`` uses (``normalise_url``)."""

CACHE_SIZE = 5000
"""Compiled statements kept (least recently used dropped first): the suite's distinct statements on both drivers
are about 2,000; SQLAlchemy's own per-engine default is 500."""

_cache: util.LRUCache[Any, Any] = util.LRUCache(CACHE_SIZE)


def _compiles_alike(self: Dialect, other: object) -> bool:
    """Whether ``other`` compiles every statement as ``self`` does: the same driver, options and server version."""
    return type(self) is type(other) and _what_compiles(self) == _what_compiles(other)


def _what_compiles(dialect: Dialect) -> tuple[Any, ...]:
    """What a dialect's compilation depends on beyond its class: what it reads from the server as it first connects."""
    return dialect.server_version_info, dialect.max_identifier_length, dialect.label_length


def _class_hash(self: Dialect) -> int:
    return hash(type(self))


def _use_shared_cache(connection: Connection) -> None:
    connection.execution_options(compiled_cache=_cache)  # in place: a Connection's options are its own


def share_statement_caches() -> None:
    """Make every engine of this process compile into, and look up in, one cache (idempotent)."""
    for dialect in SHARED_DIALECTS:
        dialect.__eq__ = _compiles_alike  # type: ignore[method-assign,assignment]
        dialect.__hash__ = _class_hash  # type: ignore[method-assign,assignment]
    if not event.contains(Engine, "engine_connect", _use_shared_cache):
        event.listen(Engine, "engine_connect", _use_shared_cache)
