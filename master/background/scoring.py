"""Host scoring: every host's reliability and its GPUs' tiers, re-computed every ``reliability_interval``.

One master at a time, under the ``host-scoring`` lease. The pass itself is
``master.services.market.reliability.rescore_all``.
"""

from __future__ import annotations

import logging

from master.background import leases
from master.context import Master
from master.services import market

log = logging.getLogger(__name__)

SCORING_LEASE = "host-scoring"


async def scoring_loop(master: Master, *, every: float | None = None) -> None:
    """Re-score every host each ``reliability_interval`` while this master holds the lease. Cancel to stop.

    Several masters may run it; the ``host-scoring`` lease lets one score at a time. Cancelling
    is safe: every chunk of hosts written stays written, the rest waits for the next pass.
    """

    async def work() -> None:
        n = await market.rescore_all(master)
        log.info("re-scored %d host(s)", n)

    await leases.run_leased(master, SCORING_LEASE, every=every or master.settings.reliability_interval, work=work)
