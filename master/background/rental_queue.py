"""The rental queue: queued rentals placed oldest first (a queued cluster whole, ``cluster_queue``), those past
``queue_until`` failed; placements a dead
master left half-done repaired (``rental_queue.repair_interrupted_placements``, so within ``queue_interval`` of a
master's start); broken members of ``replace`` clusters replaced (``cluster_policy``); and ended rentals' kept
/workspace released once their ``workspace_until`` passed.

One master at a time, under the ``rental-queue`` lease, every ``queue_interval``. The pass
itself is ``master.services.queue.process_queue``.
"""

from __future__ import annotations

from master.background import leases
from master.context import Master
from master.services import clusters, rentals
from master.services import queue as rental_queue

QUEUE_LEASE = "rental-queue"


async def queue_loop(master: Master) -> None:
    """Place queued rentals every ``queue_interval`` under the ``rental-queue`` lease. Cancel to stop.

    Cancelling is safe: each rental is placed (or failed) in its own transaction, so it is either
    placed or still queued for the next pass; commands of a placement not yet published are sent
    by the command resender.
    """

    async def work() -> None:
        await rental_queue.repair_interrupted_placements(master)
        await rental_queue.process_queue(master)
        await clusters.replace_broken_members(master)
        await rentals.release_expired_workspaces(master)

    await leases.run_leased(master, QUEUE_LEASE, every=master.settings.queue_interval, work=work)
