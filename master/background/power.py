"""Off-peak power limits: each opted-in host's policy sent to its agent when it changes, and the energy saved folded
into days, every ``power_interval``.

One master at a time, under the ``power-policy`` lease. The pass itself is ``master.services.hosts.power.power_pass``.
"""

from __future__ import annotations

import logging

from master.background import leases
from master.context import Master
from master.services import hosts

log = logging.getLogger(__name__)


async def power_loop(master: Master, *, every: float | None = None) -> None:
    """Run the power-policy pass each ``power_interval`` while this master holds the lease. Cancel to stop.

    Cancelling is safe: a command and the policy's record of it are written in one transaction and published after
    it; one left unpublished goes out with the command resender.
    """

    async def work() -> None:
        sent = await hosts.power_pass(master)
        if sent:
            log.info("sent %d host power polic%s", sent, "y" if sent == 1 else "ies")

    await leases.run_leased(master, hosts.POWER_LEASE, every=every or master.settings.power_interval, work=work)
