"""Telemetry maintenance: roll-ups, then retention, every ``rollup_interval``.

One master at a time, under the ``telemetry-maintenance`` lease (the roll-up's read-modify-write
of the buckets relies on it). The passes themselves are ``master.telemetry.rollups.rollup`` and
``master.telemetry.rollups.expire``.
"""

from __future__ import annotations

from master.background import leases
from master.context import Master
from master.telemetry import rollups

MAINTENANCE_LEASE = "telemetry-maintenance"


async def maintenance_loop(master: Master) -> None:
    """Roll up and expire telemetry every ``rollup_interval`` under a lease. Cancel to stop.

    Cancelling is safe: every chunk folded or deleted is its own transaction, so what was done
    stays done and the rest waits for the next pass; the lease is released on the way out.
    """

    async def work() -> None:
        await rollups.rollup(master)
        await rollups.expire(master)

    await leases.run_leased(master, MAINTENANCE_LEASE, every=master.settings.rollup_interval, work=work)
