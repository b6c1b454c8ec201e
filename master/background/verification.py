"""GPU verification's pass (docs/verification.md, "The flow"): challenges that got no answer fail, idle hosts are
re-checked at random times, and listings' ``verified`` follow their GPUs' ages, every ``verification_interval``.

One master at a time, under the ``gpu-verification`` lease. The pass itself is
``master.services.hosts.verification.verification_pass``.
"""

from __future__ import annotations

import logging

from master.background import leases
from master.context import Master
from master.services import hosts

log = logging.getLogger(__name__)


async def verification_loop(master: Master, *, every: float | None = None) -> None:
    """Run the verification pass each ``verification_interval`` while this master holds the lease. Cancel to stop.

    Cancelling is safe: a challenge and its command are written in one transaction and published after it; one left
    unpublished goes out with the command resender.
    """

    async def work() -> None:
        issued = await hosts.verification_pass(master)
        if issued:
            log.info("issued %d idle GPU challenge(s)", issued)

    await leases.run_leased(master, hosts.VERIFICATION_LEASE, every=every or master.settings.verification_interval, work=work)
