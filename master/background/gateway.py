"""The gateway's second: every master process samples its services' requests in flight once a second, writes the
rows of each ``service_stats_bucket_s`` bucket that ended (``service_stats``, one per service and process) and
closes replica pools left idle. No lease: each process writes its own figures.
"""

from __future__ import annotations

import asyncio
import logging

from master.context import Master
from master.services.gateway import gateway_of

log = logging.getLogger(__name__)


async def gateway_stats_loop(master: Master, *, every: float = 1.0) -> None:
    """Tick the master's gateway every ``every`` seconds until cancelled (``Gateway.tick``).

    A failing tick is logged and the next one tries again. Cancelling is safe: rows not written yet are kept
    by the gateway, which writes them when the app closes it.
    """
    while True:
        try:
            await gateway_of(master).tick()
        except Exception:
            log.exception("the gateway's tick failed; trying again in %g s", every)
        await asyncio.sleep(every)
