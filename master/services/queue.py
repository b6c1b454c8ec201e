"""The rental queue: queued rentals (``pending`` with no host) placed in fair-share order, or failed past
``queue_until`` — a queued cluster's members as one unit, one turn for the whole cluster (``master.services.clusters``' queue); and
placements a dead master left half-done, repaired.

**Order.** On-demand before interruptible; within each, the account holding the fewest GPUs per unit of its
``fair_share_weight`` first, ties by age; within an account, oldest first (``master/scheduler/fairshare.py``,
docs/placement.md "Fair queues"). With one account, or equal weights and nothing held, that is oldest first.

**Interrupted placements.** A placement writes the claim, the rental's host and state, its events and its
start command in one transaction (``rentals.try_place``), so a master killed mid-placement leaves
nothing behind. A rental ``pending`` on a host, or holding GPUs, without a start command can only come from an
older master (on SQLite its claim was committed on its own before the start command was written) or a bug.
``repair_interrupted_placements`` fails each one with an event that says so and releases its GPUs. It is not put
back in the queue: its request was cut off, the renter may already have asked again (without an
``Idempotency-Key``: a second rental), and a failed rental with its reason is what a retry with the same key
finds. It was never started, so nothing was charged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import exists, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import Master
from master.models import Account, Command, Gpu, GpuAllocation, Rental
from master.scheduler import MILLI
from master.scheduler.fairshare import FairQueue, QueuedItem
from master.services import clusters, commands
from master.services.lifecycle.rentals import ACTIVE_STATES, RentalState, advance
from master.services.market import FailureCode, record_failure
from master.services.rentals import RentalRequest, release, try_place
from shared import protocol
from shared.errors import ClientError

log = logging.getLogger(__name__)

# Queued rentals one queue pass tries to place.
QUEUE_BATCH = 200
# Interrupted placements one pass repairs.
REPAIR_BATCH = 200
INTERRUPTED = "placement interrupted"
_START = protocol.StartWorkload.model_fields["kind"].default


def is_queued(rental: Rental) -> bool:
    return rental.state == RentalState.PENDING and rental.host_id is None


def wanted(rental: Rental) -> str:
    """What the rental waits for, as a renter asked for it: ``2 × A100 80GB``, ``a 1g.10gb MIG slice of …``."""
    model = rental.gpu_model or "GPU(s) matching your request"
    if rental.mig_profile:
        return f"a {rental.mig_profile} MIG slice of {rental.gpu_model or 'a GPU matching your request'}"
    if rental.gpu_milli and rental.gpu_milli < MILLI:
        return f"{rental.gpu_milli / 10:g}% of {rental.gpu_model or 'a GPU matching your request'}"
    return f"{rental.gpu_count} × {model}"


def queue_message(rental: Rental, position: int, length: int) -> str:
    """What a queued rental's renter reads: what it waits for, where it stands, when it gives up."""
    until = f"; gives up at {rental.queue_until:%Y-%m-%d %H:%M} UTC" if rental.queue_until is not None else ""
    verb = "are" if rental.gpu_count > 1 else "is"
    return f"queued: will start when {wanted(rental)} {verb} free; position {position} of {length}{until}"


async def queue_standing(session: AsyncSession, rentals: Sequence[Rental]) -> dict[str, dict[str, Any]]:
    """For each queued one of ``rentals``, by id: its ``position`` in the queue (1: the oldest), the queue's
    ``length``, and the ``message`` that says both. The queue is everyone's, by age (ties by id), a queued cluster
    counting once, at its first member's place. ``process_queue`` tries on-demand rentals first and then the
    accounts holding least per weight (fair share), so a position is where the rental stands by age, not a promise."""
    queued = [rental for rental in rentals if is_queued(rental)]
    if not queued:
        return {}
    length = await clusters.queue_length(session)
    standing = {}
    for rental in queued:
        first = rental
        if rental.cluster_id is not None:  # a member stands where its cluster does
            first = await session.scalar(
                select(Rental).where(Rental.cluster_id == rental.cluster_id, Rental.state == RentalState.PENDING.value,
                                     Rental.host_id.is_(None)).order_by(Rental.created_at, Rental.id).limit(1)
            ) or rental  # fmt: skip
        position = await clusters.position(session, first.created_at, first.id, cluster_id=rental.cluster_id)
        length = max(length, position)  # one queued since the count: never "position 6 of 5"
        message = queue_message(rental, position, length)
        if rental.cluster_id is not None:
            message = message.replace("queued: ", f"queued as node {rental.node_rank} of cluster {rental.cluster_id}, placed with "
                                      "every other node or not at all: ", 1)  # fmt: skip
        standing[rental.id] = {"position": position, "length": length, "message": message}
    return standing


async def repair_interrupted_placements(master: Master, *, limit: int = REPAIR_BATCH) -> list[str]:
    """Fail rentals left ``pending`` on a host or holding GPUs with no start command, releasing their GPUs; returns their ids.

    Each is repaired in its own serialised transaction, its row locked (a concurrent pass skips it). A placement in
    progress is never taken for one: it commits whole, so until then none of it is visible here.
    """
    now = master.clock.now()
    holds = exists().where(GpuAllocation.rental_id == Rental.id, GpuAllocation.released_at.is_(None))
    claims = exists().where(Gpu.rental_id == Rental.id)
    started = exists().where(Command.rental_id == Rental.id, Command.kind == _START)
    async with master.db.session() as session:
        found = (
            await session.scalars(
                select(Rental.id).where(Rental.state == RentalState.PENDING, or_(Rental.host_id.is_not(None), holds, claims), ~started)
                .order_by(Rental.created_at).limit(limit)
            )
        ).all()  # fmt: skip
    repaired = []
    for rental_id in found:
        async with master.db.serialised_session() as session:
            rental = await session.scalar(
                select(Rental).where(Rental.id == rental_id, Rental.state == RentalState.PENDING, ~started).with_for_update(skip_locked=True)
            )
            if rental is None:
                continue
            released = await release(session, rental.id, at=now)
            where = f" on host {rental.host_id}" if rental.host_id is not None else ""
            cause = (f"{INTERRUPTED}: the master placing it{where} stopped before its start command was written; "
                     f"{released} GPU allocation(s) released, nothing charged; rent again")  # fmt: skip
            if advance(session, rental, RentalState.FAILED, cause, at=now):
                record_failure(rental, FailureCode.PLACEMENT_INTERRUPTED, INTERRUPTED)
                rental.stopped_at = now
                repaired.append(rental.id)
    if repaired:
        log.warning("failed %d rental(s) left pending by an interrupted placement: %s", len(repaired), ", ".join(repaired))
    return repaired


async def process_queue(master: Master) -> int:
    """Expire queued rentals and clusters past their ``queue_until``, then place what can be placed in fair-share
    order (``fairshare.FairQueue`` over the oldest ``QUEUE_BATCH`` queued rentals, each account's GPUs held now
    and its weight), a queued cluster as one item of its renter's, taking one turn (``clusters.place_queued``);
    one that does not fit is passed over, not waited for. Returns how many rentals and clusters were placed."""
    now = master.clock.now()
    async with master.db.session() as session:
        expired = (
            await session.scalars(
                select(Rental)
                .where(Rental.state == RentalState.PENDING, Rental.host_id.is_(None), Rental.queue_until <= now)
                .order_by(Rental.created_at, Rental.id)
                .with_for_update(skip_locked=True)
            )
        ).all()
        given_up: set[str] = set()
        for gone in expired:
            if gone.cluster_id is not None:  # the whole cluster gives up, every member with it
                if gone.cluster_id not in given_up:
                    given_up.add(gone.cluster_id)
                    await clusters.expire(session, gone, now=now)
                continue
            waited = (now - gone.created_at).total_seconds()
            if advance(session, gone, RentalState.FAILED, f"not placed within its queue timeout ({waited:.0f}s queued)"):
                record_failure(gone, FailureCode.QUEUE_TIMEOUT, "queue timeout")
                gone.stopped_at = now
        queue = await _fair_queue(session)
    placed = 0
    for item in queue:
        if item.key.startswith(_CLUSTER):
            command_ids = await clusters.place_queued(master, item.key.removeprefix(_CLUSTER), now=now)
        else:
            command_ids = await _place_queued_rental(master, item.key, now=now)
        if command_ids:
            placed += 1
            queue.placed(item)
            await commands.publish(master, command_ids)
    return placed


_CLUSTER = "cluster:"  # a cluster's item key: its id, apart from the rental ids


async def _fair_queue(session: AsyncSession) -> FairQueue:
    """The oldest ``QUEUE_BATCH`` queued rentals as fair-queue items (a cluster's members as one), with their accounts'
    GPU milli held now (active placed rentals, counted as quotas count them) and weights: three queries."""
    queued = (
        await session.execute(
            select(Rental.id, Rental.cluster_id, Rental.renter_id, Rental.kind, Rental.created_at, Rental.gpu_count, Rental.gpu_milli)
            .where(Rental.state == RentalState.PENDING, Rental.host_id.is_(None))
            .order_by(Rental.created_at, Rental.id).limit(QUEUE_BATCH)
        )
    ).all()  # fmt: skip
    items: dict[str, QueuedItem] = {}
    for rental_id, cluster_id, renter_id, kind, created_at, count, milli in queued:
        key = rental_id if cluster_id is None else _CLUSTER + cluster_id
        first = items.get(key)  # a cluster's first (oldest) member gives it its age; its GPUs are all of theirs
        items[key] = QueuedItem(key, renter_id, kind, created_at, rental_id, count * milli) if first is None else \
            QueuedItem(key, renter_id, first.kind, first.created_at, first.tie, first.milli + count * milli)  # fmt: skip
    accounts = {item.account_id for item in items.values()}
    held: dict[str, int] = {}
    weights: dict[str, int] = {}
    if accounts:
        held = {
            renter_id: int(total or 0)
            for renter_id, total in await session.execute(
                select(Rental.renter_id, func.sum(Rental.gpu_count * Rental.gpu_milli))
                .where(Rental.renter_id.in_(accounts), Rental.state.in_(ACTIVE_STATES), Rental.host_id.is_not(None))
                .group_by(Rental.renter_id)
            )
        }  # fmt: skip
        weights = {
            account_id: weight
            for account_id, weight in await session.execute(select(Account.id, Account.fair_share_weight).where(Account.id.in_(accounts)))
        }
    return FairQueue(items.values(), held=held, weights=weights)


async def _place_queued_rental(master: Master, rental_id: str, *, now: datetime) -> list[str]:
    command_ids: list[str] = []
    async with master.db.serialised_session() as session:
        rental = await session.scalar(select(Rental).where(Rental.id == rental_id).with_for_update(skip_locked=True))
        if rental is None or rental.state != RentalState.PENDING or rental.host_id is not None:
            return []
        try:
            command_ids, _reason = await try_place(master, session, rental, RentalRequest.from_rental(rental), now=now)
        except ClientError as exc:  # the offer is gone, the quota shrank below one GPU...
            if advance(session, rental, RentalState.FAILED, f"cannot be placed from the queue: {exc}"):
                record_failure(rental, FailureCode.PLACEMENT_FAILED, str(exc))
                rental.stopped_at = now
    return command_ids
