"""Billing's periodic work as plain async functions over a ``Master``.

The master runs them in-process under a lease (one master at a time); Celery tasks (to come:
``gpumarket worker``) are to be thin wrappers over the same functions.
"""

from __future__ import annotations

import logging

from billing.rating import Rated, RatingPolicy, rate_open_rentals
from master.context import Master

log = logging.getLogger(__name__)


async def rating_pass(master: Master) -> list[Rated]:
    """Post every running or newly ended rental's usage up to now."""
    rated = await rate_open_rentals(master.db, now=master.clock.now(), policy=RatingPolicy.from_settings(master.settings))
    posted = sum(len(r.posted) for r in rated)
    if posted:
        log.info("rating pass: %d postings over %d rentals", posted, len(rated))
    return rated


async def rating_loop(master: Master) -> None:
    """``rating_pass`` every ``billing_interval`` under the ``billing-rating`` lease."""
    from master.services.leases import run_leased

    async def work() -> None:
        await rating_pass(master)

    await run_leased(master, "billing-rating", every=master.settings.billing_interval, work=work)
