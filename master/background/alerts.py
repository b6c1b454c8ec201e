"""The alert loop: evaluate the rules, then deliver the webhook's notifications, every ``alert_interval``.

One master at a time, under the ``alert-evaluator`` lease. The passes themselves are
``master.services.alerts.rules.evaluate`` and ``master.services.alerts.delivery.deliver_due``.
The webhook's HTTP client session is a resource of the app (a ``cleanup_ctx``), handed in.
"""

from __future__ import annotations

import contextlib
import logging

import aiohttp

from master.background import leases
from master.context import Master
from master.services import alerts

log = logging.getLogger(__name__)

ALERT_LEASE = "alert-evaluator"


def webhook_session() -> aiohttp.ClientSession:
    """The HTTP client session that posts alert notifications (one per master process)."""
    return aiohttp.ClientSession(headers={"User-Agent": "gpumarket-alerts"})


async def alert_loop(master: Master, *, http: aiohttp.ClientSession | None = None, every: float | None = None) -> None:
    """Evaluate the rules and deliver the webhook every ``alert_interval`` seconds. Cancel to stop.

    Several masters may run it; the ``alert-evaluator`` lease lets one work at a time. ``http``
    serves every delivery (without one, the loop opens its own for its whole life). Cancelling
    is safe: an evaluation rolls back, and notifications being posted are retried later under
    the same idempotency key.
    """
    interval = every or master.settings.alert_interval
    async with contextlib.AsyncExitStack() as owned:
        session = http if http is not None else await owned.enter_async_context(webhook_session())

        async def tick() -> None:
            result = await alerts.evaluate(master)
            if result.changed:
                log.info("alerts: %d raised, %d escalated, %d resolved, %d still firing",
                         result.raised, result.escalated, result.resolved, result.updated)
            await alerts.deliver_due(master, session)

        await leases.run_leased(master, ALERT_LEASE, every=interval, work=tick)
