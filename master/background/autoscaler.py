"""The autoscaler: every service's replicas health-checked, counted against its rule, rented or stopped.

One master at a time, under the ``autoscaler`` lease, every ``autoscale_interval``, and at once when this
master's gateway wakes a service at zero replicas (``Master.nudge``). The pass is
``master.services.endpoints.autoscale.autoscale_pass``; health checks go through this master's gateway
(``master.services.gateway.probe``), the same path requests take.
"""

from __future__ import annotations

import functools

from master.background import leases
from master.context import AUTOSCALER_LEASE, Master
from master.services import endpoints, gateway


async def autoscaler_loop(master: Master) -> None:
    """Scale every service every ``autoscale_interval`` under the ``autoscaler`` lease. Cancel to stop.

    Cancelling is safe: each replica is rented or stopped through the rental's own calls, each in
    its own transaction; what a pass left undone the next one (on any master) does, from the
    database's counts.
    """
    memory = endpoints.AutoscalerMemory()
    probe = functools.partial(gateway.probe, master)

    async def work() -> None:
        await endpoints.autoscale_pass(master, probe, memory)

    await leases.run_leased(master, AUTOSCALER_LEASE, every=master.settings.autoscale_interval, work=work)
