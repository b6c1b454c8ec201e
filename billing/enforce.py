"""Keeping renters within their prepaid credit.

For every renter with placed, active rentals, a pass projects the balance at ``now``: the
ledger balance less what the rentals have run up since their last rating (``rated_until``,
at their rate). Then:

* projected balance ≤ the burn rate × ``credit_stop_margin_s`` — the credit would run out
  before the next passes could catch it — every active rental of the renter gets a
  ``stop_workload`` command and moves to ``stopping`` (cause: out of credit). The rentals'
  data and logs stay retrievable; billing stops when the agent confirms.
* projected balance ≤ the burn rate × ``credit_warning_s``: each active rental gets one
  warning event (``low credit: …``), shown in its events.

Volumes count like rentals: their storage is in the burn rate, the unrated amount and the month's
spend. A renter out of credit (the first case; with volumes only and no burn, a balance below zero)
has its volumes' credit grace started, and a renter with credit has it cleared; at its end they are
deleted (``billing/volume_grace.py``). ``enforcement_pass`` returns the ``delete_volume`` commands it
wrote, which its caller publishes after the commit (the command resender does otherwise).

At placement, ``has_credit_for`` refuses a rental whose renter cannot pay for its minimum
billing period (402 ``insufficient_credit``) when ``require_credit`` is on; the master's
placement reaches it through ``PrepaidCreditGate``, its ``master.context.CreditGate``.

Stop commands are written as pending rows; the master's command resender delivers them (a
Celery worker has no bus).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from billing import ledger, volume_grace
from billing.rating import per_second
from billing.volumes import STORAGE, unrated_storage
from master.db import Database
from master.models import Account, LedgerEntry, LedgerTransaction, Rental, RentalEvent, Volume
from master.services import accounts, commands, volumes
from master.services.lifecycle.rentals import UNSTOPPED_STATES, RentalState, transition
from shared import protocol
from shared.errors import ClientError
from shared.settings import MasterSettings

log = logging.getLogger(__name__)

LOW_CREDIT = "low credit"


class InsufficientCredit(ClientError):
    code = "insufficient_credit"
    http_status = 402


def unrated_usage(rentals: list[Rental], now: datetime) -> tuple[Decimal, Decimal]:
    """What the rentals have run up since their last rating, and their burn rate per second."""
    return ledger.accrued(((per_second(r), r.rated_until or r.started_at) for r in rentals), now)

CHARGE_KINDS = ("usage", "minimum", "downtime_credit", "correction", STORAGE)


def month_start(now: datetime) -> datetime:
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


async def month_spent(session: AsyncSession, renter_id: str, now: datetime) -> Decimal:
    """What the renter's rentals were charged (net of credits) since the start of ``now``'s month (UTC)."""
    amounts = (
        await session.scalars(
            select(LedgerEntry.amount)
            .join(LedgerTransaction, LedgerTransaction.id == LedgerEntry.transaction_id)
            .where(LedgerEntry.account == ledger.renter_credit(renter_id), LedgerTransaction.kind.in_(CHARGE_KINDS),
                   LedgerTransaction.created_at >= month_start(now))
        )
    ).all()  # fmt: skip
    return sum(amounts, Decimal(0))


async def _room(
    session: AsyncSession, renter_id: str, rentals: list[Rental], now: datetime, kept: list[Volume]
) -> tuple[Decimal, Decimal, str]:
    """How much the renter may still be charged — the lesser of its projected balance and what its monthly cap
    leaves — its burn rate per second (rentals and volumes' storage), and which of the two limits it is."""
    unrated, burn = unrated_usage(rentals, now)
    stored, storage_burn = unrated_storage(kept, now)
    unrated, burn = unrated + stored, burn + storage_burn
    balance = await ledger.balance(session, ledger.renter_credit(renter_id)) - unrated
    cap = await session.scalar(select(Account.monthly_spend_cap).where(Account.id == renter_id))
    if cap is None:
        return balance, burn, "credit"
    left = cap - await month_spent(session, renter_id, now) - unrated
    return (left, burn, "cap") if left < balance else (balance, burn, "credit")


async def _kept_volumes(session: AsyncSession, renter_id: str) -> list[Volume]:
    """The renter's volumes being billed now (ready, deletion not asked)."""
    return list((await session.scalars(select(Volume).where(Volume.account_id == renter_id, Volume.ready_at.is_not(None),
                                                            Volume.deleted_at.is_(None)))).all())  # fmt: skip


async def _needs(session: AsyncSession, renter_id: str, amount: Decimal, *, min_period_s: int, what: str) -> None:
    """Refuse unless the renter can pay ``amount`` more and what it runs and keeps for the minimum billing period."""
    active = list((await session.scalars(select(Rental).where(Rental.renter_id == renter_id, Rental.state.in_(UNSTOPPED_STATES), Rental.host_id.is_not(None)))).all())
    room, burn, limit = await _room(session, renter_id, active, datetime.now(UTC), await _kept_volumes(session, renter_id))
    needed = amount + burn * max(min_period_s, 1)
    if room < needed:
        whose = "the team's" if accounts.teams.is_team(renter_id) else "your"
        needs = f"this {what} needs at least {ledger.money(ledger.quantize(needed))}"
        if limit == "cap":
            raise InsufficientCredit(
                f"{whose} monthly spend cap leaves {ledger.money(room)} USD; {needs}: raise the cap with PUT /api/v1/account/spend-cap",
                code="spend_cap_reached",
            )
        raise InsufficientCredit(f"{whose} prepaid credit is {ledger.money(room)} USD; {needs}: top up your credit first")


async def has_credit_for(session: AsyncSession, renter_id: str, price_per_gpu_hour: Decimal, gpus: Decimal, *, min_period_s: int) -> None:
    """Refuse a rental the renter cannot pay the minimum billing period of (on top of what runs and is kept)."""
    amount = price_per_gpu_hour * gpus / 3600 * max(min_period_s, 1)
    await _needs(session, renter_id, amount, min_period_s=min_period_s,
                 what="rental (its minimum billing period on top of what you run and keep)")  # fmt: skip


async def has_credit_for_volume(
    session: AsyncSession, renter_id: str, size_gib: int, price_per_gib_hour: Decimal, *, min_period_s: int
) -> None:
    """Refuse a volume the renter cannot pay an hour of storage of (on top of the minimum billing period of what it
    runs and keeps): 402 ``insufficient_credit``, or ``spend_cap_reached``."""
    await _needs(session, renter_id, price_per_gib_hour * size_gib, min_period_s=min_period_s,
                 what="volume (an hour of its storage on top of what you run and keep)")  # fmt: skip


class PrepaidCreditGate:
    """The master's ``CreditGate``: the renter's prepaid credit and monthly spend cap, from the ledger."""

    async def has_credit_for(
        self, session: AsyncSession, renter_id: str, price_per_gpu_hour: Decimal, gpus: Decimal, *, min_period_s: int
    ) -> None:
        await has_credit_for(session, renter_id, price_per_gpu_hour, gpus, min_period_s=min_period_s)

    async def has_credit_for_volume(
        self, session: AsyncSession, renter_id: str, size_gib: int, price_per_gib_hour: Decimal, *, min_period_s: int
    ) -> None:
        await has_credit_for_volume(session, renter_id, size_gib, price_per_gib_hour, min_period_s=min_period_s)


async def enforcement_pass(db: Database, settings: MasterSettings, now: datetime) -> dict[str, Any]:
    """Stop the rentals of renters out of credit and start their volumes' grace (deleting those whose grace ended);
    warn those running low; clear the grace of renters with credit again. Returns what it did, with ``commands``: the
    ids of the ``delete_volume`` commands written (to publish; each transaction is committed)."""
    stopped: list[str] = []
    warned: list[str] = []
    grace = volume_grace.GraceChanges()
    async with db.session() as session:
        renters = set((await session.scalars(select(Rental.renter_id).where(Rental.state.in_(UNSTOPPED_STATES), Rental.host_id.is_not(None)).distinct())).all())
        renters |= set((await session.scalars(select(Volume.account_id).where(Volume.state.in_(sorted(volumes.LIVE))).distinct())).all())
    for renter_id in sorted(renters):
        async with db.session() as session:
            active = list(
                (
                    await session.scalars(
                        select(Rental).where(Rental.renter_id == renter_id, Rental.state.in_(UNSTOPPED_STATES), Rental.host_id.is_not(None))
                        .order_by(Rental.id).with_for_update(skip_locked=True)
                    )
                ).all()
            )  # fmt: skip
            live = await volume_grace.live_volumes(session, renter_id)
            if not active and not live:
                continue
            room, burn, limit = await _room(session, renter_id, active, now, live)
            out = room <= burn * Decimal(str(settings.credit_stop_margin_s)) if burn > 0 else room < 0
            if out and burn > 0:
                for rental in active:
                    await _stop(session, rental, room, limit, now)
                    stopped.append(rental.id)
            elif burn > 0 and room <= burn * Decimal(str(settings.credit_warning_s)):
                minutes = int(room / burn / 60)
                for rental in active:
                    if await _warn(session, rental, room, limit, minutes):
                        warned.append(rental.id)
            changes = await volume_grace.apply(session, renter_id, live, out=out, limit=limit, now=now,
                                               grace=timedelta(days=settings.volume_grace_days))  # fmt: skip
        for name in ("started", "cleared", "deleted", "held", "commands"):
            getattr(grace, name).extend(getattr(changes, name))
        if changes.notice is not None:  # committed: the renter hears of it once
            await volume_grace.notify(settings, changes.notice)
    if stopped:
        log.warning("stopped %d rentals out of credit: %s", len(stopped), ", ".join(stopped))
    if grace.started or grace.deleted:
        log.warning("volumes unpaid: %d now in their grace, %d deleted at its end", len(grace.started), len(grace.deleted))
    return {
        "stopped": stopped, "warned": warned, "volumes_unpaid": grace.started, "volumes_paid": grace.cleared,
        "volumes_deleted": grace.deleted, "volumes_held": grace.held, "commands": grace.commands,
    }  # fmt: skip


async def _stop(session: AsyncSession, rental: Rental, room: Decimal, limit: str, now: datetime) -> None:
    assert rental.host_id is not None
    if limit == "cap":
        cause = f"monthly spend cap reached: {ledger.money(room)} USD left under it; stopped before going past it (raise the cap to rent again)"
        reason = "the renter's monthly spend cap was reached"
    else:
        cause = f"out of credit: {ledger.money(room)} USD left; stopped before the balance goes below zero (top up to rent again)"
        reason = "the renter's prepaid credit ran out"
    commands.new_command(
        session, host_id=rental.host_id, rental_id=rental.id, command=protocol.StopWorkload(rental_id=rental.id, reason=reason),
    )  # fmt: skip
    transition(session, rental, RentalState.STOPPING, cause, at=now)  # an unstopped rental, locked: always allowed


async def _warn(session: AsyncSession, rental: Rental, room: Decimal, limit: str, minutes: int) -> bool:
    earlier = await session.scalar(
        select(RentalEvent.id).where(RentalEvent.rental_id == rental.id, RentalEvent.cause.startswith(LOW_CREDIT)).limit(1)
    )
    if earlier is not None:
        return False
    session.add(RentalEvent(
        rental_id=rental.id, from_state=rental.state, to_state=rental.state,
        cause=f"{LOW_CREDIT}: {ledger.money(room)} USD left{' under your monthly spend cap' if limit == 'cap' else ''}, "
              f"about {minutes} min at your current rate; {'raise the cap' if limit == 'cap' else 'top up'} to keep running",
    ))  # fmt: skip
    return True
