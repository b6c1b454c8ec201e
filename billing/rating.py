"""Metering and rating: what a rental's served seconds cost, posted to the ledger as it runs.

**Billable time** runs from ``started_at`` (the agent confirmed the workload started) to the
first of ``stopped_at`` (confirmed stopped, or the preemption) and ``host_lost_at`` (the last
time its host was heard from), less every interval its host spent ``offline`` (read from the
host's state changes): a host that blips and comes back within the grace period does not
bill the blip. Whole seconds, counted from the start. **A cluster's member** (``cluster_id``)
also leaves out every interval the host of another member of its cluster spent ``offline`` while
that member was in it (from its start to its end, or, for a member lost with its host, to when the
master failed it): a cluster with a silent node cannot run, so its whole meter pauses.

**Price.** ``price_per_gpu_hour`` recorded at placement (a later listing change does not touch
a running rental) × GPUs × ``gpu_milli``/1000, per second. **Duration discounts** per tier
(``RatingPolicy.discounts``: from ``hours`` of served time on, ``pct`` off) apply to the
seconds past each threshold. **Minimum period**: a rental that ends having served less than
``min_period_s`` is charged up to it — unless it was preempted or failed for the platform's reason
(``failure_owner`` ``platform``: the platform cut it short); if its host was lost (or, for a cluster's
member, the host of any member of its cluster) or it failed for the provider's reason (``failure_owner``
``provider``: ``master.services.market.failures``), the minimum is charged and credited back at once as a
downtime credit, so the invoice line shows both and the reason. A failure that is the renter's is charged
like any ended rental: its served seconds and the minimum.

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
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from billing import ledger
from billing.ledger import Leg
from master.models import Gpu, Host, HostEvent, Rental, RentalEvent
from master.services.lifecycle.rentals import RentalState
from master.services.market import Owner

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


def per_hour(rental: Rental) -> Decimal:
    """USD per served hour of the whole rental (every GPU, or its share of one), unrounded."""
    price = rental.price_per_gpu_hour or Decimal(0)
    return price * rental.gpu_count * rental.gpu_milli / 1000


def per_second(rental: Rental) -> Decimal:
    """USD per served second, unrounded."""
    return per_hour(rental) / SECONDS_PER_HOUR


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


def _intervals(events: Sequence[tuple[datetime, str | None, str]], start: datetime, end: datetime) -> list[tuple[datetime, datetime]]:
    """Offline intervals within ``start``–``end`` from one host's state changes (oldest first)."""
    intervals: list[tuple[datetime, datetime]] = []
    went: datetime | None = None
    for at, _from, to in events:
        if at >= end:
            break
        if to in OFFLINE_STATES:
            went = went or at
        elif went is not None:
            intervals.append((went, at))
            went = None
    if went is not None:
        intervals.append((went, end))
    return [(max(a, start), min(b, end)) for a, b in intervals if b > start and a < end]


async def _offline_events(session: AsyncSession, host_ids: Collection[str], before: datetime) -> dict[str, list[tuple[datetime, str | None, str]]]:
    """Every host's changes into or out of ``offline`` before ``before``, oldest first."""
    rows = (
        await session.execute(
            select(HostEvent.host_id, HostEvent.at, HostEvent.from_state, HostEvent.to_state)
            .where(HostEvent.host_id.in_(list(host_ids)), HostEvent.at < before,
                   or_(HostEvent.to_state.in_(OFFLINE_STATES), HostEvent.from_state.in_(OFFLINE_STATES)))
            .order_by(HostEvent.at, HostEvent.id)
        )
    ).all()  # fmt: skip
    events: dict[str, list[tuple[datetime, str | None, str]]] = {}
    for host_id, at, from_state, to_state in rows:
        events.setdefault(host_id, []).append((at, from_state, to_state))
    return events


async def offline_intervals(session: AsyncSession, host_id: str, start: datetime, end: datetime) -> list[tuple[datetime, datetime]]:
    """When the host was offline between ``start`` and ``end``, from its state changes."""
    return _intervals((await _offline_events(session, [host_id], end)).get(host_id, []), start, end)


def _merged(intervals: Sequence[tuple[datetime, datetime]]) -> list[tuple[datetime, datetime]]:
    """The same time as ``intervals``, overlaps joined (so none is subtracted twice)."""
    out: list[tuple[datetime, datetime]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


@dataclass(frozen=True)
class _Member:
    """A cluster member as the meter of the others reads it: its host, while it was in the cluster, its host lost."""

    rental_id: str
    host_id: str
    since: datetime
    until: datetime | None  # None: still in it
    host_lost_at: datetime | None


def served_seconds(start: datetime, upto: datetime, offline: Sequence[tuple[datetime, datetime]]) -> int:
    span = (upto - start) - sum((b - a for a, b in offline), timedelta(0))
    return max(0, int(span.total_seconds()))


@dataclass(frozen=True)
class Rated:
    rental_id: str
    seconds: int
    charge: Decimal
    posted: list[str]


@dataclass
class _Context:
    """What rating a batch of rentals reads besides the rentals: owners, tiers, offline events."""

    owners: dict[str, str]  # host → provider account
    tiers: dict[str, str | None]  # GPU uuid → tier
    events: dict[str, list[tuple[datetime, str | None, str]]]
    clusters: dict[str, list[_Member]] = field(default_factory=dict)  # cluster id → its members that ran

    @classmethod
    async def load(cls, session: AsyncSession, rentals: Sequence[Rental], now: datetime) -> _Context:
        clusters = await _cluster_members(session, sorted({r.cluster_id for r in rentals if r.cluster_id is not None}))
        hosts = sorted({r.host_id for r in rentals if r.host_id is not None} | {m.host_id for ms in clusters.values() for m in ms})
        uuids = sorted({str(r.gpu_uuids[0]) for r in rentals if r.gpu_uuids})
        owners = {host: owner for host, owner in (await session.execute(select(Host.id, Host.owner_id).where(Host.id.in_(hosts)))).all()}
        tiers: dict[str, str | None] = {}
        if uuids:
            tiers = {uuid: tier for uuid, tier in (await session.execute(select(Gpu.uuid, Gpu.tier).where(Gpu.uuid.in_(uuids)))).all()}
        events = await _offline_events(session, hosts, now) if hosts else {}
        return cls(owners, tiers, events, clusters)

    def paused(self, rental: Rental, start: datetime, stop: datetime) -> list[tuple[datetime, datetime]]:
        """When the rental's meter stood still between ``start`` and ``stop``: its host offline, or (a cluster's member)
        the host of another member offline while that member was in the cluster."""
        assert rental.host_id is not None
        intervals = _intervals(self.events.get(rental.host_id, []), start, stop)
        for member in self.clusters.get(rental.cluster_id or "", ()):
            if member.rental_id == rental.id:
                continue
            since, until = max(start, member.since), min(stop, member.until or stop)
            if since < until:
                intervals += _intervals(self.events.get(member.host_id, []), since, until)
        return _merged(intervals)

    def cluster_host_lost(self, rental: Rental, upto: datetime) -> _Member | None:
        """Another member of the rental's cluster whose host was lost before ``upto``, if any."""
        for member in self.clusters.get(rental.cluster_id or "", ()):
            if member.rental_id != rental.id and member.host_lost_at is not None and member.host_lost_at <= upto:
                return member
        return None


async def _cluster_members(session: AsyncSession, cluster_ids: Sequence[str]) -> dict[str, list[_Member]]:
    """Every member of the clusters that ran, with the time it was in its cluster."""
    if not cluster_ids:
        return {}
    rows = (
        await session.execute(
            select(Rental.id, Rental.cluster_id, Rental.host_id, Rental.started_at, Rental.stopped_at, Rental.host_lost_at)
            .where(Rental.cluster_id.in_(list(cluster_ids)), Rental.started_at.is_not(None), Rental.host_id.is_not(None))
        )
    ).all()
    lost = [row.id for row in rows if row.host_lost_at is not None]
    failed_at: dict[str, datetime] = {}
    if lost:  # a member lost with its host ended (for the others) when the master failed it, not at its last heartbeat
        events = await session.execute(
            select(RentalEvent.rental_id, func.min(RentalEvent.at))
            .where(RentalEvent.rental_id.in_(lost), RentalEvent.to_state == RentalState.FAILED.value)
            .group_by(RentalEvent.rental_id)
        )
        failed_at = {rental_id: at for rental_id, at in events.all()}
    found: dict[str, list[_Member]] = {}
    for row in rows:
        until = row.stopped_at if row.host_lost_at is None else failed_at.get(row.id)
        found.setdefault(row.cluster_id, []).append(_Member(row.id, row.host_id, row.started_at, until, row.host_lost_at))
    return found


def _plan(rental: Rental, context: _Context, *, now: datetime, policy: RatingPolicy) -> tuple[list[Posting], Decimal] | None:
    """The postings that bring the rental's billing up to ``now`` (and their net charge); moves ``rated_until``/``billed_seconds``."""
    if rental.started_at is None or rental.host_id is None:
        return None
    provider = context.owners.get(rental.host_id)
    if provider is None:
        return None
    end = billable_end(rental)
    upto = min(now, end) if end is not None else now
    since = rental.rated_until or rental.started_at
    ended = end is not None and upto == end
    if upto <= since and not ended:
        return None  # nothing new, or a clock behind the last pass
    tier = context.tiers.get(str(rental.gpu_uuids[0])) if rental.gpu_uuids else None
    priced = _Pricing(rental, provider, per_second(rental), policy.discounts.get(tier or "", ()), policy, now)
    stop = max(upto, rental.started_at)
    target = served_seconds(rental.started_at, stop, context.paused(rental, rental.started_at, stop))
    postings: list[Posting] = []
    if target > rental.billed_seconds:
        postings.append(priced.span(f"rental:{rental.id}:usage:{since.isoformat()}", "usage", rental.billed_seconds, target,
                                    (since, upto), f"{target - rental.billed_seconds}s of {rental.gpu_count} × {rental.gpu_model}"))  # fmt: skip
    elif ended and target < rental.billed_seconds:
        # Rated past the end while it ran (the agent's stop time came later and says earlier): give the rest back.
        postings.append(priced.span(f"rental:{rental.id}:overrun", "correction", target, rental.billed_seconds, (upto, since),
                                    f"{rental.billed_seconds - target}s rated past the end", sign=-1))  # fmt: skip
        rental.billed_seconds = target
    rental.rated_until = upto if ended else max(upto, since)
    rental.billed_seconds = max(rental.billed_seconds, target)
    # The minimum period follows whose failure ended the rental (master.services.market.failures): the platform's
    # charges none (the platform cut it short, as a preemption does); the provider's is charged and credited back.
    platform_failed = rental.failure_owner == Owner.PLATFORM
    if ended and rental.state != RentalState.PREEMPTED and not platform_failed and rental.billed_seconds < policy.min_period_s:
        postings.append(priced.span(f"rental:{rental.id}:minimum", "minimum", rental.billed_seconds, policy.min_period_s, (since, upto),
                                    f"minimum billing period {policy.min_period_s}s: {policy.min_period_s - rental.billed_seconds}s not used"))  # fmt: skip
        lost_member = context.cluster_host_lost(rental, upto)
        reason = None
        if rental.host_lost_at is not None:
            reason = (f"host {rental.host_id} lost at {rental.host_lost_at:%Y-%m-%dT%H:%M:%SZ}: the minimum period "
                      "charged was not served")  # fmt: skip
        elif lost_member is not None and lost_member.host_lost_at is not None:
            reason = (f"host {lost_member.host_id} of cluster {rental.cluster_id} lost at "
                      f"{lost_member.host_lost_at:%Y-%m-%dT%H:%M:%SZ}: the minimum period charged was not served")  # fmt: skip
        elif rental.failure_owner == Owner.PROVIDER:
            reason = (f"{rental.failure_code or 'a failure'} on host {rental.host_id}, the host's failure: the minimum "
                      "period charged was not served")  # fmt: skip
        if reason is not None:
            postings.append(priced.span(f"rental:{rental.id}:downtime-credit", "downtime_credit", rental.billed_seconds,
                                        policy.min_period_s, (since, upto), reason, sign=-1))  # fmt: skip
    return postings, sum((p.charge for p in postings), Decimal(0))


@dataclass(frozen=True)
class Posting:
    key: str
    kind: str
    legs: list[Leg]
    memo: str
    rental_id: str
    period: tuple[datetime, datetime]
    charge: Decimal  # what it does to the renter (negative: a credit)


@dataclass(frozen=True)
class _Pricing:
    rental: Rental
    provider: str
    rate: Decimal
    bands: Sequence[Discount]
    policy: RatingPolicy
    at: datetime

    def span(self, key: str, kind: str, first: int, last: int, period: tuple[datetime, datetime], memo: str, *, sign: int = 1) -> Posting:
        """The posting for served seconds ``first → last`` (``sign`` −1: crediting them back)."""
        before, after = cumulative_cost(self.rate, first, self.bands), cumulative_cost(self.rate, last, self.bands)
        charge = ledger.quantize(after) - ledger.quantize(before)
        fee = ledger.quantize(after * self.policy.fee_rate) - ledger.quantize(before * self.policy.fee_rate)
        legs = [
            Leg(ledger.renter_credit(self.rental.renter_id), sign * charge),
            Leg(ledger.provider_payable(self.provider), -sign * (charge - fee)),
            Leg(ledger.FEES, -sign * fee),
        ]
        return Posting(key, kind, legs, memo, self.rental.id, period, sign * charge)


async def _post_all(session: AsyncSession, postings: Sequence[Posting], *, at: datetime) -> set[str]:
    return await ledger.post_many(
        session,
        [ledger.Draft(key=p.key, kind=p.kind, legs=p.legs, memo=p.memo, rental_id=p.rental_id, period=p.period) for p in postings],
        at=at,
    )


async def rate_rental(session: AsyncSession, rental: Rental, *, now: datetime, policy: RatingPolicy) -> Rated | None:
    """Post the rental's usage since ``rated_until`` (and, once it ended, its minimum period). Caller holds the row lock."""
    planned = _plan(rental, await _Context.load(session, [rental], now), now=now, policy=policy)
    if planned is None:
        return None
    postings, _ = planned
    posted = await _post_all(session, postings, at=now)
    return Rated(rental.id, rental.billed_seconds, sum((p.charge for p in postings if p.key in posted), Decimal(0)),
                 [p.key for p in postings if p.key in posted])  # fmt: skip


async def rate_open_rentals(db: Any, *, now: datetime, policy: RatingPolicy, batch: int = 500) -> list[Rated]:
    """One rating pass over every rental that ran and is not fully rated, ``batch`` rentals per transaction.

    Each batch's rentals are locked ``SKIP LOCKED`` (a concurrent pass takes others); what
    rating reads besides them is loaded in three queries for the whole batch; the postings
    go in with bulk INSERTs that skip keys already posted.
    """
    results: list[Rated] = []
    after = ""
    while True:
        async with db.session() as session:
            rentals = (
                await session.scalars(
                    select(Rental).where(
                        Rental.id > after, Rental.started_at.is_not(None),
                        or_(Rental.rated_until.is_(None), Rental.stopped_at.is_(None), Rental.rated_until != Rental.stopped_at),
                    ).order_by(Rental.id).limit(batch).with_for_update(skip_locked=True)
                )
            ).all()  # fmt: skip
            if not rentals:
                return results
            after = rentals[-1].id
            context = await _Context.load(session, rentals, now)
            plans: list[tuple[Rental, list[Posting]]] = []
            for rental in rentals:
                planned = _plan(rental, context, now=now, policy=policy)
                if planned is not None:
                    plans.append((rental, planned[0]))
            posted = await _post_all(session, [p for _, postings in plans for p in postings], at=now)
        results.extend(
            Rated(rental.id, rental.billed_seconds, sum((p.charge for p in postings if p.key in posted), Decimal(0)),
                  [p.key for p in postings if p.key in posted])
            for rental, postings in plans
        )  # fmt: skip
