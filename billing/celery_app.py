"""Billing's jobs as Celery tasks, with Redis as the broker and a beat schedule.

Production runs ``gpumarket worker --beat`` once (a worker with the scheduler in it) and any
number of ``gpumarket worker``, with ``billing_in_process = false`` on the masters. Each task
is a thin wrapper over a job of ``billing/jobs.py`` (``JOBS``): it opens the database, runs
the job with the current time and closes it. The jobs are idempotent (ledger keys, row locks
with SKIP LOCKED), so Celery's at-least-once delivery — ``acks_late`` with
``reject_on_worker_lost``: a task whose worker died is delivered again — never counts
anything twice. Only JSON crosses the broker. Workers do not migrate the database: the
masters do.

Config, explicitly: broker ``redis_url``; queue ``<bus_prefix>billing``; JSON only;
``task_acks_late``; ``task_reject_on_worker_lost``; ``worker_prefetch_multiplier = 1`` (a slow
pass does not hold others back); results ignored; UTC; the beat entry of each job at its
``every(settings)`` period.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from celery import Celery

from billing.jobs import JOBS, Job
from master.db import Database
from shared.errors import ConfigError
from shared.settings import MasterSettings

TASK_PREFIX = "gpumarket.billing."


def queue_name(settings: MasterSettings) -> str:
    return f"{settings.bus_prefix}billing"


def make_celery(settings: MasterSettings) -> Celery:
    if not settings.redis_url:
        raise ConfigError("billing workers need the broker: set GPUMARKET_REDIS_URL (the Redis the masters use)")
    if not settings.database_url:
        raise ConfigError("billing workers need the database: set GPUMARKET_DATABASE_URL (the masters' PostgreSQL)")
    app = Celery("gpumarket", broker=settings.redis_url, set_as_current=False)
    queue = queue_name(settings)
    app.conf.update(
        task_serializer="json", accept_content=["json"], result_serializer="json", task_ignore_result=True,
        task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
        timezone="UTC", enable_utc=True, broker_connection_retry_on_startup=True,
        task_default_queue=queue,
        beat_schedule={f"billing-{name}": {"task": TASK_PREFIX + name, "schedule": job.every(settings), "options": {"queue": queue}}
                       for name, job in JOBS.items()},
    )  # fmt: skip
    for name, job in JOBS.items():
        app.task(name=TASK_PREFIX + name, shared=False)(_task(settings, job))
    return app


def _task(settings: MasterSettings, job: Job) -> Any:
    def run_job() -> dict[str, Any]:
        return asyncio.run(run_once(settings, job))

    run_job.__name__ = f"billing_{job.name}"
    return run_job


async def run_once(settings: MasterSettings, job: Job) -> dict[str, Any]:
    """Open the database, run ``job`` at the current time, close it."""
    assert settings.database_url is not None
    db = Database(settings.database_url)
    try:
        return await job.run(db, settings, datetime.now(UTC))
    finally:
        await db.close()
