"""The revocation publisher: revoked certificate serials, from the database to the relay registry.

Every master runs it (no lease): publishing the same serials twice is harmless. It makes a
registry that lost its data (a Redis restart) whole again within one period. The pass itself is
``master.services.hosts.enrollment.publish_revocations``.
"""

from __future__ import annotations

import asyncio
import logging

from master.context import Master
from master.services import hosts

log = logging.getLogger(__name__)


async def revocation_publisher(master: Master, *, every: float = 30.0) -> None:
    """Re-publish revoked certificate serials from the database to the registry. Cancel to stop.

    A failing pass is logged and retried next interval. Cancelling is safe: the database stays
    the record, and the next publisher writes every serial again.
    """
    while True:
        try:
            await hosts.publish_revocations(master)
        except Exception:
            log.exception("publishing revocations failed; retrying next interval")
        await asyncio.sleep(every)
