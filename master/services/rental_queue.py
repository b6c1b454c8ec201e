"""The rental queue: queued rentals (``pending`` with no host) placed oldest first, or failed past ``queue_until``."""

from __future__ import annotations

import logging

from sqlalchemy import select

from master.context import Master
from master.models import Rental
from master.services import commands
from master.services.rental_placement import try_place
from master.services.rental_request import RentalRequest
from master.services.rentalstate import RentalState, advance
from shared.errors import ClientError

log = logging.getLogger(__name__)

# Queued rentals one queue pass tries to place.
QUEUE_BATCH = 200


async def process_queue(master: Master) -> int:
    """Expire queued rentals past their ``queue_until``, then place what can be placed, oldest first; returns how many."""
    now = master.clock.now()
    async with master.db.session() as session:
        expired = (
            await session.scalars(
                select(Rental)
                .where(Rental.state == RentalState.PENDING, Rental.host_id.is_(None), Rental.queue_until <= now)
                .with_for_update(skip_locked=True)
            )
        ).all()
        for gone in expired:
            waited = (now - gone.created_at).total_seconds()
            if advance(session, gone, RentalState.FAILED, f"not placed within its queue timeout ({waited:.0f}s queued)"):
                gone.failure_reason, gone.stopped_at = "queue timeout", now
        queued = (
            await session.scalars(
                select(Rental.id).where(Rental.state == RentalState.PENDING, Rental.host_id.is_(None)).order_by(Rental.created_at).limit(QUEUE_BATCH)
            )
        ).all()
    placed = 0
    for rental_id in queued:
        command_ids: list[str] = []
        async with master.db.serialised_session() as session:
            rental = await session.scalar(select(Rental).where(Rental.id == rental_id).with_for_update(skip_locked=True))
            if rental is None or rental.state != RentalState.PENDING or rental.host_id is not None:
                continue
            try:
                command_ids, _reason = await try_place(master, session, rental, RentalRequest.from_rental(rental), now=now)
            except ClientError as exc:  # the offer is gone, the quota shrank below one GPU...
                if advance(session, rental, RentalState.FAILED, f"cannot be placed from the queue: {exc}"):
                    rental.failure_reason, rental.stopped_at = str(exc), now
        if command_ids:
            placed += 1
            await commands.publish(master, command_ids)
    return placed
