"""Billing's periodic work: plain async functions over the database, and their schedule.

Each job takes ``(db, settings, now)`` — no bus, no HTTP — so the same function runs in a
master process (embedded mode and standalone masters: ``master.background.billing``, one master
at a time under a lease) or in a Celery worker (``billing/tasks.py``: thin wrappers). Commands a job
creates (stopping a rental) are written as pending rows; the master's command resender
delivers them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from billing.enforce import enforcement_pass
from billing.payouts import payout_pass
from billing.rating import RatingPolicy, rate_open_rentals
from billing.volumes import rate_open_volumes
from master.db import Database
from shared.settings import MasterSettings

log = logging.getLogger(__name__)


async def rating_pass(db: Database, settings: MasterSettings, now: datetime) -> dict[str, Any]:
    """Post every running or newly ended rental's usage, and every kept volume's storage, up to ``now``."""
    rated = await rate_open_rentals(db, now=now, policy=RatingPolicy.from_settings(settings))
    stored = await rate_open_volumes(db, now=now, fee_rate=settings.platform_fee_rate)
    posted = sum(len(r.posted) for r in rated) + sum(len(v.posted) for v in stored)
    if posted:
        log.info("rating pass: %d postings over %d rentals and %d volumes", posted, len(rated), len(stored))
    return {"rentals": len(rated), "volumes": len(stored), "postings": posted}


@dataclass(frozen=True)
class Job:
    name: str
    run: Callable[[Database, MasterSettings, datetime], Awaitable[dict[str, Any]]]
    every: Callable[[MasterSettings], float]  # seconds between runs


JOBS: dict[str, Job] = {
    "rate": Job("rate", rating_pass, lambda s: s.billing_interval),
    "enforce": Job("enforce", enforcement_pass, lambda s: s.billing_interval),
    "payouts": Job("payouts", lambda db, settings, now: payout_pass(db, settings, now), lambda s: s.payout_interval),
}
