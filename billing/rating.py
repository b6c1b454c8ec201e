"""Metering and rating: what a rental's served seconds cost, posted to the ledger as it runs.

**Billable time** runs from ``started_at`` (the agent confirmed the workload started) to the
first of ``stopped_at`` (confirmed stopped, or the preemption) and ``host_lost_at`` (the last
time its host was heard from), less every interval its host spent ``offline`` (read from the
host's state changes): a host that blips and comes back within the grace period does not
bill the blip. Whole seconds, counted from the start.

**Price.** ``price_per_gpu_hour`` recorded at placement (a later listing change does not touch
a running rental) × GPUs × ``gpu_milli``/1000, per second. **Duration discounts** per tier
(``RatingPolicy.discounts``: from ``hours`` of served time on, ``pct`` off) apply to the
seconds past each threshold. **Minimum period**: a rental that ends having served less than
``min_period_s`` is charged up to it — unless it was preempted (the platform cut it short);
if its host was lost, the minimum is charged and credited back at once as a downtime credit,
so the invoice line shows both and the reason.

**Exactness.** Every posting is the difference of cumulative amounts (``cost(0→b) −
cost(0→a)``, each quantized), so however the periods fall the total is the cost of the whole
served time rounded once. The platform fee is ``fee_rate`` of the charge the same way; the
provider earns the rest: charge = earning + fee, exactly, in every posting.

**Idempotency.** A pass locks the rental (``SKIP LOCKED``: a second worker skips it), posts
``rental:{id}:usage:{period_start}`` and moves ``rated_until`` in the same transaction. A
redelivered task finds ``rated_until`` already moved; a clock behind ``rated_until`` rates
nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from billing import ledger
from billing.ledger import Leg
from master.models import Gpu, Host, HostEvent, Rental

log = logging.getLogger(__name__)

SECONDS_PER_HOUR = Decimal(3600)
OFFLINE_STATES = frozenset({"offline"})


@dataclass(frozen=True)
class Discount:
    hours: Decimal  # served time from which it applies
    pct: Decimal  # 0..100


@dataclass(frozen=True)
class RatingPolicy:
    min_period_s: int = 60
    fee_rate: Decimal = Decimal("0.15")
    discounts: dict[str, tuple[Discount, ...]] = field(default_factory=dict)  # tier → bands, ascending

    @classmethod
    def from_settings(cls, settings: Any) -> RatingPolicy:
        bands = {
            tier: tuple(sorted((Discount(Decimal(str(h)), Decimal(str(p))) for h, p in entries), key=lambda d: d.hours))
            for tier, entries in (settings.billing_discounts or {}).items()
        }
        return cls(min_period_s=settings.billing_min_period_s, fee_rate=settings.platform_fee_rate, discounts=bands)


def per_second(rental: Rental) -> Decimal:
    """USD per served second, unrounded."""
    price = rental.price_per_gpu_hour or Decimal(0)
    return price * rental.gpu_count * rental.gpu_milli / 1000 / SECONDS_PER_HOUR


def cumulative_cost(rate: Decimal, seconds: int, bands: Sequence[Discount]) -> Decimal:
    """What the first ``seconds`` served cost at ``rate`` per second with the discount bands, unrounded."""
    total = Decimal(0)
    edges = [(Decimal(0), Decimal(0)), *((band.hours * SECONDS_PER_HOUR, band.pct) for band in bands)]
    for position, (start, pct) in enumerate(edges):
        end = edges[position + 1][0] if position + 1 < len(edges) else None
        if seconds <= start:
            break
        span = (min(Decimal(seconds), end) if end is not None else Decimal(seconds)) - start
        total += span * rate * (100 - pct) / 100
    return total


def billable_end(rental: Rental) -> datetime | None:
    ends = [moment for moment in (rental.stopped_at, rental.host_lost_at) if moment is not None]
    return min(ends) if ends else None


async def offline_intervals(session: AsyncSession, host_id: str, start: datetime, end: datetime) -> list[tuple[datetime, datetime]]:
    """When the host was offline between ``start`` and ``end``, from its state changes."""
    events = (
        await session.execute(
            select(HostEvent.at, HostEvent.from_state, HostEvent.to_state)
            .where(HostEvent.host_id == host_id, HostEvent.at < end, or_(HostEvent.to_state.in_(OFFLINE_STATES), HostEvent.from_state.in_(OFFLINE_STATES)))
            .order_by(HostEvent.at, HostEvent.id)
        )
    ).all()
    intervals: list[tuple[datetime, datetime]] = []
    went: datetime | None = None
    for at, _from, to in events:
        if to in OFFLINE_STATES:
            went = went or at
        elif went is not None:
            intervals.append((went, at))
            went = None
    if went is not None:
        intervals.append((went, end))
    return [(max(a, start), min(b, end)) for a, b in intervals if b > start and a < end]


def served_seconds(start: datetime, upto: datetime, offline: Sequence[tuple[datetime, datetime]]) -> int:
    span = (upto - start) - sum((b - a for a, b in offline), timedelta(0))
    return max(0, int(span.total_seconds()))


@dataclass(frozen=True)
class Rated:
    rental_id: str
    seconds: int
    charge: Decimal
    posted: list[str]


async def rate_rental(session: AsyncSession, rental: Rental, *, now: datetime, policy: RatingPolicy) -> Rated | None:
    """Post the rental's usage since ``rated_until`` (and, once it ended, its minimum period). Caller holds the row lock."""
    if rental.started_at is None or rental.host_id is None:
        return None
    end = billable_end(rental)
    upto = min(now, end) if end is not None else now
    since = rental.rated_until or rental.started_at
    ended = end is not None and upto == end
    if upto <= since and not ended:
        return None  # nothing new, or a clock behind the last pass
    host = await session.get(Host, rental.host_id)
    provider = host.owner_id if host is not None else None
    if provider is None:
        return None
    tier = await session.scalar(select(Gpu.tier).where(Gpu.uuid.in_(list(rental.gpu_uuids) or [""])).limit(1))
    bands = policy.discounts.get(tier or "", ())
    rate = per_second(rental)
    offline = await offline_intervals(session, rental.host_id, rental.started_at, max(upto, rental.started_at))
    target = served_seconds(rental.started_at, max(upto, rental.started_at), offline)
    posted: list[str] = []
    charged = Decimal(0)
    if target > rental.billed_seconds:
        key = f"rental:{rental.id}:usage:{since.isoformat()}"
        amount = await _post_span(session, rental, provider, key, "usage", rental.billed_seconds, target, rate, bands, policy,
                                  at=now, period=(since, upto), memo=f"{target - rental.billed_seconds}s of {rental.gpu_count} × {rental.gpu_model}")  # fmt: skip
        if amount is not None:
            posted.append(key)
            charged += amount
    elif ended and target < rental.billed_seconds:
        # Rated past the end while it ran (the agent's stop time came later and says earlier): give the rest back.
        key = f"rental:{rental.id}:overrun"
        amount = await _post_span(session, rental, provider, key, "correction", target, rental.billed_seconds, rate, bands, policy,
                                  at=now, period=(upto, since), memo=f"{rental.billed_seconds - target}s rated past the end", sign=-1)  # fmt: skip
        if amount is not None:
            posted.append(key)
            charged -= amount
        rental.billed_seconds = target
    rental.rated_until = upto if ended else max(upto, since)
    rental.billed_seconds = max(rental.billed_seconds, target)
    if ended and rental.state != "preempted" and rental.billed_seconds < policy.min_period_s:
        key = f"rental:{rental.id}:minimum"
        amount = await _post_span(session, rental, provider, key, "minimum", rental.billed_seconds, policy.min_period_s, rate,
                                  bands, policy, at=now, period=(since, upto),
                                  memo=f"minimum billing period {policy.min_period_s}s: {policy.min_period_s - rental.billed_seconds}s not used")  # fmt: skip
        if amount is not None:
            posted.append(key)
            charged += amount
            if rental.host_lost_at is not None:
                credit_key = f"rental:{rental.id}:downtime-credit"
                reason = (f"host {rental.host_id} lost at {rental.host_lost_at:%Y-%m-%dT%H:%M:%SZ}: the minimum period "
                          "charged was not served")  # fmt: skip
                credit = await _post_span(session, rental, provider, credit_key, "downtime_credit", rental.billed_seconds,
                                          policy.min_period_s, rate, bands, policy, at=now, period=(since, upto), memo=reason, sign=-1)  # fmt: skip
                if credit is not None:
                    posted.append(credit_key)
                    charged -= credit
    return Rated(rental.id, target, charged, posted)


async def _post_span(
    session: AsyncSession, rental: Rental, provider: str, key: str, kind: str, first: int, last: int, rate: Decimal,
    bands: Sequence[Discount], policy: RatingPolicy, *, at: datetime, period: tuple[datetime, datetime], memo: str, sign: int = 1,
) -> Decimal | None:
    """Post the cost of served seconds ``first → last`` (``sign`` −1: credit it back); returns the charge, None if posted before."""
    before, after = cumulative_cost(rate, first, bands), cumulative_cost(rate, last, bands)
    charge = ledger.quantize(after) - ledger.quantize(before)
    fee = ledger.quantize(after * policy.fee_rate) - ledger.quantize(before * policy.fee_rate)
    earning = charge - fee
    legs = [
        Leg(ledger.renter_credit(rental.renter_id), sign * charge),
        Leg(ledger.provider_payable(provider), -sign * earning),
        Leg(ledger.FEES, -sign * fee),
    ]
    if not await ledger.post(session, key=key, kind=kind, legs=legs, at=at, memo=memo, rental_id=rental.id, period=period):
        return None
    return charge


async def rate_open_rentals(db: Any, *, now: datetime, policy: RatingPolicy, batch: int = 500) -> list[Rated]:
    """One rating pass: every rental that ran and is not fully rated, each in its own transaction."""
    async with db.session() as session:
        ids = (
            await session.scalars(
                select(Rental.id).where(
                    Rental.started_at.is_not(None),
                    or_(Rental.rated_until.is_(None), Rental.stopped_at.is_(None), Rental.rated_until != Rental.stopped_at),
                ).order_by(Rental.id).limit(batch)
            )
        ).all()  # fmt: skip
    results = []
    for rental_id in ids:
        async with db.session() as session:
            rental = await session.scalar(select(Rental).where(Rental.id == rental_id).with_for_update(skip_locked=True))
            if rental is None:
                continue  # another worker is rating it
            rated = await rate_rental(session, rental, now=now, policy=policy)
            if rated is not None:
                results.append(rated)
    return results
