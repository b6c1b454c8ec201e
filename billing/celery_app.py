"""The Celery app that runs billing's jobs in production: Redis as the broker, a beat schedule.

Production runs ``gpumarket worker --beat`` exactly once (a worker with the scheduler in it)
and any number of ``gpumarket worker``, with ``billing_in_process = false`` on the masters
(otherwise the masters run the same jobs too: harmless, the jobs are idempotent, but wasted).
The tasks are thin wrappers over ``billing.jobs.JOBS`` (``billing/tasks.py``); the schedule
has one entry per job at its ``every(settings)`` period, so a job added to ``JOBS`` is
scheduled and served without touching this file.

The whole configuration is ``celery_config(settings)``, one commented dict: nothing is read
from Celery's environment variables or a ``celeryconfig`` module.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from billing.jobs import JOBS
from billing.tasks import TASK_PREFIX, database_url, register_tasks, task_name
from shared.errors import ConfigError
from shared.settings import MasterSettings

__all__ = ["TASK_PREFIX", "beat_schedule", "celery_config", "make_celery", "queue_name"]

# Seconds a task may stay delivered but unacknowledged before Redis hands it to another worker
# (Redis has no consumer liveness; this is how a task of a vanished worker comes back). It must
# exceed the longest job run, or a slow job would also be started elsewhere (harmless, wasted).
VISIBILITY_TIMEOUT_S = 3600


def queue_name(settings: MasterSettings) -> str:
    """The one queue billing tasks travel on (under the bus prefix: deployments sharing a Redis stay apart)."""
    return f"{settings.bus_prefix}billing"


def beat_schedule(settings: MasterSettings) -> dict[str, dict[str, Any]]:
    """One beat entry ``billing-<job>`` per ``JOBS`` item, every ``job.every(settings)`` seconds."""
    schedule: dict[str, dict[str, Any]] = {}
    for name, job in JOBS.items():
        every = job.every(settings)
        schedule[f"billing-{name}"] = {
            "task": task_name(name),
            "schedule": every,
            # A tick no worker started within one period is dropped: the next tick does the same
            # work, so a backlog built while the workers were down is not run over and over.
            "options": {"queue": queue_name(settings), "expires": every},
        }
    return schedule


def celery_config(settings: MasterSettings) -> dict[str, Any]:
    """Every Celery setting the billing app uses, explained."""
    return {
        # Broker: the masters' Redis. Every key Celery writes there (the queue, unacked
        # deliveries, bindings, remote control) is under "<bus_prefix>celery:".
        "broker_url": settings.redis_url,
        "broker_transport_options": {
            "global_keyprefix": f"{settings.bus_prefix}celery:",
            "visibility_timeout": VISIBILITY_TIMEOUT_S,
        },
        "broker_connection_retry_on_startup": True,  # a worker started before Redis waits for it
        # Only JSON crosses the broker (no pickle: a message can never run code in a worker).
        "task_serializer": "json",
        "result_serializer": "json",
        "event_serializer": "json",
        "accept_content": ["json"],
        # No result backend: a task's return value (the job's summary) is only logged.
        "task_ignore_result": True,
        # At least once: a task is acknowledged after it ran, and one whose worker process died
        # is delivered again. Jobs are idempotent, so a second delivery is harmless.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # A worker process reserves one task at a time: a slow pass does not hold others back.
        "worker_prefetch_multiplier": 1,
        # On a lost broker connection the running tasks are cancelled, as their messages will be
        # redelivered anyway (rather than run on beside their redelivery).
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        # Every task goes to the billing queue; workers consume only it.
        "task_default_queue": queue_name(settings),
        # Time: UTC everywhere, the jobs' ``now`` included.
        "timezone": "UTC",
        "enable_utc": True,
        "beat_schedule": beat_schedule(settings),
    }


def make_celery(settings: MasterSettings) -> Celery:
    """The billing Celery app for ``settings`` (``ConfigError`` naming what to set when the broker or database is missing)."""
    if not settings.redis_url:
        raise ConfigError("billing workers need the broker: set GPUMARKET_REDIS_URL (the Redis the masters use)")
    database_url(settings)  # the same check, before anything starts
    app = Celery("gpumarket-billing", set_as_current=False)
    app.conf.update(celery_config(settings))
    register_tasks(app, settings)
    return app
