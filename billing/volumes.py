"""Storage: what a volume costs to keep, posted to the ledger per second as it is kept (docs/volumes.md#billing).

**Billable time** runs from ``ready_at`` (the agent made it) to ``deleted_at`` (deletion asked: the renter, an
admin or the credit grace's end; the agent's delay is not billed) or now, whether a rental mounts it or not. Whole
seconds, counted from ``ready_at``. A volume that never became ready (``failed``, or deleted while ``creating``)
costs nothing.

**Price.** ``price_per_gib_hour`` kept on the volume (the host's storage price when it was made: a later change of
the listing does not touch it) × ``size_gib``, per second. No minimum period, no duration discount.

**Postings** (kind ``storage``, key ``volume:{id}:storage:{period_start}``, naming the volume in ``volume_id``): the
renter's credit is debited, the host's provider credited its earning and ``platform:fees`` the platform's fee
(``platform_fee_rate``), charge = earning + fee exactly, as for rentals. Each posting is the difference of cumulative,
once-rounded amounts (``cost(0→b) − cost(0→a)``), so however the passes fall the total is the whole kept time's cost
rounded once.

**Idempotency.** A pass locks the volumes it rates (``FOR UPDATE SKIP LOCKED``: a concurrent pass takes others),
posts and moves ``rated_until`` in the same transaction; ``rated_until`` stays on the whole-second grid from
``ready_at`` (so the seconds already billed are read back from it exactly) until the volume is deleted, when it
becomes ``deleted_at``: fully rated, never looked at again. A redelivered task finds ``rated_until`` moved; a clock
behind it rates nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from billing import ledger
from billing.ledger import Draft, Leg
from master.models import Host, Volume

log = logging.getLogger(__name__)

STORAGE = "storage"  # the postings' kind
SECONDS_PER_HOUR = Decimal(3600)


def per_hour(volume: Volume) -> Decimal:
    """USD per hour of keeping the volume (its whole size), unrounded."""
    return volume.price_per_gib_hour * volume.size_gib


def per_second(volume: Volume) -> Decimal:
    return per_hour(volume) / SECONDS_PER_HOUR


def kept_seconds(volume: Volume, upto: datetime) -> int:
    """Whole seconds from ``ready_at`` to ``upto`` (0 before it, or for a volume never ready)."""
    if volume.ready_at is None or upto <= volume.ready_at:
        return 0
    return int((upto - volume.ready_at).total_seconds())


def billing(volume: Volume) -> bool:
    """Whether the volume is being billed now: ready, its deletion not asked."""
    return volume.ready_at is not None and volume.deleted_at is None


def unrated_storage(volumes: Sequence[Volume], now: datetime) -> tuple[Decimal, Decimal]:
    """What the volumes being billed have run up since their last rating, and their burn rate per second."""
    return ledger.accrued(((per_second(v), v.rated_until or v.ready_at) for v in volumes if billing(v)), now)


@dataclass(frozen=True)
class StorageRated:
    volume_id: str
    seconds: int  # billed so far in all
    charge: Decimal  # posted now
    posted: list[str]


def _plan(volume: Volume, provider: str, *, now: datetime, fee_rate: Decimal) -> Draft | None:
    """The posting that brings the volume's storage up to ``now`` (None: nothing to post); moves ``rated_until``."""
    if volume.ready_at is None:
        return None
    end = volume.deleted_at
    upto = min(now, end) if end is not None else now
    since = volume.rated_until or volume.ready_at
    ended = end is not None and upto == end
    if upto <= since and not (ended and volume.rated_until != end):
        return None  # nothing new, or a clock behind the last pass
    # Fewer seconds than before only when a pass rated past the deletion (its clock ahead of the deleting
    # request's): the difference is given back, in a posting of the same kind.
    before, after = kept_seconds(volume, since), kept_seconds(volume, upto)
    rated = volume.rated_until = (
        end if ended and end is not None else volume.ready_at + timedelta(seconds=after)
    )
    if after == before:
        return None
    rate = per_second(volume)
    charge = ledger.quantize(rate * after) - ledger.quantize(rate * before)
    fee = ledger.quantize(rate * after * fee_rate) - ledger.quantize(rate * before * fee_rate)
    legs = [
        Leg(ledger.renter_credit(volume.account_id), charge),
        Leg(ledger.provider_payable(provider), -(charge - fee)),
        Leg(ledger.FEES, -fee),
    ]
    terms = f"{volume.size_gib} GiB at {ledger.money(volume.price_per_gib_hour)} USD/GiB-hour"
    memo = (
        f"{after - before}s of {terms}"
        if after > before
        else f"{before - after}s of {terms} rated past the deletion, given back"
    )
    return Draft(key=f"volume:{volume.id}:storage:{since.isoformat()}", kind=STORAGE, legs=legs, memo=memo,
                 period=(min(since, rated), max(since, rated)), volume_id=volume.id)  # fmt: skip


async def _providers(session: AsyncSession, host_ids: Collection[str]) -> dict[str, str]:
    rows = await session.execute(select(Host.id, Host.owner_id).where(Host.id.in_(sorted(set(host_ids)))))
    return {host_id: owner for host_id, owner in rows.all()}


async def rate_open_volumes(
    db: Any, *, now: datetime, fee_rate: Decimal, batch: int = 500
) -> list[StorageRated]:
    """One rating pass over every volume that was ready and is not fully rated, ``batch`` volumes per transaction.

    Each batch's volumes are locked ``SKIP LOCKED`` (a concurrent pass takes others), their hosts' providers read in
    one query, and the postings written with one bulk INSERT that skips keys already posted.
    """
    results: list[StorageRated] = []
    after = ""
    while True:
        async with db.session() as session:
            volumes = (
                await session.scalars(
                    select(Volume).where(
                        Volume.id > after, Volume.ready_at.is_not(None),
                        or_(Volume.deleted_at.is_(None), Volume.rated_until.is_(None), Volume.rated_until != Volume.deleted_at),
                    ).order_by(Volume.id).limit(batch).with_for_update(skip_locked=True)
                )
            ).all()  # fmt: skip
            if not volumes:
                return results
            after = volumes[-1].id
            providers = await _providers(session, [v.host_id for v in volumes])
            drafts: list[tuple[Volume, Draft]] = []
            for volume in volumes:
                provider = providers.get(volume.host_id)
                if provider is None:
                    continue
                draft = _plan(volume, provider, now=now, fee_rate=fee_rate)
                if draft is not None:
                    drafts.append((volume, draft))
            posted = await ledger.post_many(session, [d for _, d in drafts], at=now)
        results.extend(
            StorageRated(volume.id, kept_seconds(volume, volume.rated_until or now),
                         draft.legs[0].amount if draft.key in posted else Decimal(0), [draft.key] if draft.key in posted else [])
            for volume, draft in drafts
        )  # fmt: skip
