"""Billing's jobs as Celery tasks: one thin wrapper per ``billing.jobs.JOBS`` entry.

A task ``gpumarket.billing.<job>`` takes no arguments: it runs its job over the database at
the current time (``datetime.now(UTC)``) and returns the job's dict (only logged: results are
ignored). Everything a job needs comes from the ``MasterSettings`` the worker was started with.

**One database per worker process.** The prefork pool runs one task at a time in each child
process. A child opens its ``Database`` (and the event loop its connections belong to, an
``asyncio.Runner``) on its first task, checks once that the schema is migrated, and reuses
both for every later task; ``worker_process_shutdown`` closes them. The state is keyed by
process id, so a forked child never touches its parent's connections.

**Workers do not migrate.** ``gpumarket migrate`` or the masters own the schema. A worker whose
database has no gpumarket schema, or one at another revision than this code's, refuses to
run the job and says what to do (``SchemaNotReady``).

**At least once.** Celery may deliver a task twice (``acks_late``; a worker that dies mid-task
gets its task redelivered). The jobs are idempotent — ledger postings have keys derived from
what they post, rentals are claimed ``FOR UPDATE SKIP LOCKED`` — so a second delivery, or two
workers running the same job at once, posts nothing twice.
"""

from __future__ import annotations

import asyncio
import logging
import os
from datetime import UTC, datetime
from typing import Any

from celery import Celery
from celery.signals import worker_process_shutdown, worker_shutdown

from billing.jobs import JOBS, Job
from master.db import Database, check_schema
from shared.errors import ConfigError
from shared.settings import MasterSettings

log = logging.getLogger(__name__)

TASK_PREFIX = "gpumarket.billing."

# Connections one worker process keeps to the database: a job uses one session at a time.
WORKER_POOL_SIZE = 2


def task_name(job_name: str) -> str:
    return TASK_PREFIX + job_name


def database_url(settings: MasterSettings) -> str:
    """The masters' database; workers have no default (a SQLite file of their own would be nobody's books)."""
    if not settings.database_url:
        raise ConfigError("billing workers need the database: set GPUMARKET_DATABASE_URL (the masters' PostgreSQL)")
    return settings.database_url


async def check_database(settings: MasterSettings) -> None:
    """What ``gpumarket worker`` checks before it starts: the database is set, reachable and migrated."""
    db = Database(database_url(settings), pool_size=1)
    try:
        await check_schema(db, who="billing workers")
    finally:
        await db.close()


class _ProcessDatabase:
    """This worker process's event loop and database, made on its first task and reused after."""

    def __init__(self, url: str) -> None:
        self.pid = os.getpid()
        self.runner = asyncio.Runner()
        self.db = Database(url, pool_size=WORKER_POOL_SIZE)
        self.checked = False

    def run(self, settings: MasterSettings, job: Job) -> dict[str, Any]:
        return self.runner.run(self._run(settings, job))

    async def _run(self, settings: MasterSettings, job: Job) -> dict[str, Any]:
        if not self.checked:
            await check_schema(self.db, who="billing workers")
            self.checked = True
        return await job.run(self.db, settings, datetime.now(UTC))

    def close(self) -> None:
        try:
            self.runner.run(self.db.close())
        finally:
            self.runner.close()


_databases: dict[str, _ProcessDatabase] = {}  # database URL → this process's; see close_process_databases


def _process_database(url: str) -> _ProcessDatabase:
    state = _databases.get(url)
    if state is None or state.pid != os.getpid():  # a forked child drops (never closes) its parent's
        state = _databases[url] = _ProcessDatabase(url)
    return state


def close_process_databases(**_: Any) -> None:
    """Close this process's databases and event loops (connected to Celery's process shutdown signals)."""
    pid = os.getpid()
    for url, state in list(_databases.items()):
        del _databases[url]
        if state.pid == pid:
            try:
                state.close()
            except Exception:
                log.exception("closing the billing database failed")


def run_job(settings: MasterSettings, job: Job) -> dict[str, Any]:
    """Run ``job`` once now on this process's database (what each task does)."""
    url = database_url(settings)
    state = _process_database(url)
    try:
        return state.run(settings, job)
    except BaseException as exc:
        if not isinstance(exc, Exception):  # interrupted mid-run: the loop may hold half-done work; start afresh
            _databases.pop(url, None)
        raise


def register_tasks(app: Celery, settings: MasterSettings) -> None:
    """Register one task per ``JOBS`` entry on ``app``, each running its job with ``settings``."""
    for job in JOBS.values():
        app.task(name=task_name(job.name), shared=False, ignore_result=True)(_wrapper(settings, job))
    worker_process_shutdown.connect(close_process_databases, weak=False, dispatch_uid="gpumarket-billing-close")
    worker_shutdown.connect(close_process_databases, weak=False, dispatch_uid="gpumarket-billing-close-main")


def _wrapper(settings: MasterSettings, job: Job) -> Any:
    def task() -> dict[str, Any]:
        return run_job(settings, job)

    task.__name__ = task.__qualname__ = f"billing_{job.name}"
    task.__doc__ = f"Run billing's {job.name!r} job once, now."
    return task
