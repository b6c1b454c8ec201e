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

At placement, ``has_credit_for`` refuses a rental whose renter cannot pay for its minimum
billing period (402 ``insufficient_credit``) when ``require_credit`` is on.

Stop commands are written as pending rows; the master's command resender delivers them (a
Celery worker has no bus).
"""

from __future__ import annotations

import logging
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from billing import ledger
from billing.rating import per_second
from master.db import Database
from master.models import Rental, RentalEvent
from master.services import commands
from shared.errors import ClientError
from shared.settings import MasterSettings

log = logging.getLogger(__name__)

LOW_CREDIT = "low credit"
PLACED_ACTIVE = ("pending", "starting", "running")


class InsufficientCredit(ClientError):
    code = "insufficient_credit"
    http_status = 402


async def projected_balance(session: AsyncSession, renter_id: str, rentals: list[Rental], now: datetime) -> tuple[Decimal, Decimal]:
    """The renter's balance less unrated usage up to ``now``, and its burn rate per second."""
    balance = await ledger.balance(session, ledger.renter_credit(renter_id))
    burn = Decimal(0)
    for rental in rentals:
        rate = per_second(rental)
        burn += rate
        since = rental.rated_until or rental.started_at
        if since is not None and now > since:
            balance -= rate * int((now - since).total_seconds())
    return balance, burn


async def has_credit_for(session: AsyncSession, renter_id: str, price_per_gpu_hour: Decimal, gpus: Decimal, *, min_period_s: int) -> None:
    """Refuse a rental the renter cannot pay the minimum billing period of (on top of what runs)."""
    active = list((await session.scalars(select(Rental).where(Rental.renter_id == renter_id, Rental.state.in_(PLACED_ACTIVE), Rental.host_id.is_not(None)))).all())
    balance = await ledger.balance(session, ledger.renter_credit(renter_id))
    burn = sum((per_second(r) for r in active), Decimal(0))
    needed = (price_per_gpu_hour * gpus / 3600 + burn) * max(min_period_s, 1)
    if balance < needed:
        raise InsufficientCredit(
            f"your prepaid credit is {ledger.money(balance)} USD; this rental needs at least {ledger.money(ledger.quantize(needed))} "
            "(its minimum billing period on top of what you run): top up your credit first"
        )


async def enforcement_pass(db: Database, settings: MasterSettings, now: datetime) -> dict[str, Any]:
    """Stop the rentals of renters out of credit; warn those running low. Returns what it did."""
    stopped: list[str] = []
    warned: list[str] = []
    async with db.session() as session:
        renters = (await session.scalars(select(Rental.renter_id).where(Rental.state.in_(PLACED_ACTIVE), Rental.host_id.is_not(None)).distinct())).all()
    for renter_id in renters:
        async with db.session() as session:
            active = list(
                (
                    await session.scalars(
                        select(Rental).where(Rental.renter_id == renter_id, Rental.state.in_(PLACED_ACTIVE), Rental.host_id.is_not(None))
                        .order_by(Rental.id).with_for_update(skip_locked=True)
                    )
                ).all()
            )  # fmt: skip
            if not active:
                continue
            balance, burn = await projected_balance(session, renter_id, active, now)
            if burn <= 0:
                continue
            if balance <= burn * Decimal(str(settings.credit_stop_margin_s)):
                for rental in active:
                    await _stop(session, rental, balance, now)
                    stopped.append(rental.id)
            elif balance <= burn * Decimal(str(settings.credit_warning_s)):
                minutes = int(balance / burn / 60)
                for rental in active:
                    if await _warn(session, rental, balance, minutes):
                        warned.append(rental.id)
    if stopped:
        log.warning("stopped %d rentals out of credit: %s", len(stopped), ", ".join(stopped))
    return {"stopped": stopped, "warned": warned}


async def _stop(session: AsyncSession, rental: Rental, balance: Decimal, now: datetime) -> None:
    assert rental.host_id is not None
    cause = f"out of credit: {ledger.money(balance)} USD left; stopped before the balance goes below zero (top up to rent again)"
    commands.new_command(
        session, host_id=rental.host_id, kind="stop_workload", rental_id=rental.id,
        args={"rental_id": rental.id, "reason": "the renter's prepaid credit ran out"},
    )  # fmt: skip
    session.add(RentalEvent(rental_id=rental.id, from_state=rental.state, to_state="stopping", cause=cause, at=now))
    rental.state = "stopping"


async def _warn(session: AsyncSession, rental: Rental, balance: Decimal, minutes: int) -> bool:
    earlier = await session.scalar(
        select(RentalEvent.id).where(RentalEvent.rental_id == rental.id, RentalEvent.cause.startswith(LOW_CREDIT)).limit(1)
    )
    if earlier is not None:
        return False
    session.add(RentalEvent(
        rental_id=rental.id, from_state=rental.state, to_state=rental.state,
        cause=f"{LOW_CREDIT}: {ledger.money(balance)} USD left, about {minutes} min at your current rate; top up to keep running",
    ))  # fmt: skip
    return True
