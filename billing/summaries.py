"""Money figures the API's views show beside rentals and hosts, read from the ledger.

What a rental has charged its renter so far (usage and minimums, less downtime credits: the
renter-side legs of the postings that name the rental) and what each host has earned its
provider (the provider-side legs of its rentals' postings). Exact on SQLite and PostgreSQL
(sums in integer millionths, ``ledger.micros_sum``). Unrated time — since the last rating
pass — is not in them yet.
"""

from __future__ import annotations

from collections.abc import Collection
from decimal import Decimal
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from billing import ledger
from billing.ledger import from_micros, micros_sum
from master.models import LedgerEntry, LedgerTransaction, Payout, Rental

RENTER_LEGS = "renter:%:credit"
PROVIDER_LEGS = "provider:%:payable"


async def charged_by_rental(session: AsyncSession, rental_ids: Collection[str]) -> dict[str, Decimal]:
    """What each rental has charged its renter so far, by rental id (absent: nothing yet)."""
    if not rental_ids:
        return {}
    rows = await session.execute(
        select(LedgerTransaction.rental_id, micros_sum(LedgerEntry.amount))
        .join(LedgerEntry, LedgerEntry.transaction_id == LedgerTransaction.id)
        .where(LedgerTransaction.rental_id.in_(list(rental_ids)), LedgerEntry.account.like(RENTER_LEGS))
        .group_by(LedgerTransaction.rental_id)
    )
    # The renter's credit is a liability: a charge debits it (a positive amount).
    return {rental_id: from_micros(total) for rental_id, total in rows.all()}


async def earned_by_host(session: AsyncSession, host_ids: Collection[str]) -> dict[str, Decimal]:
    """What each host's rentals have earned its provider so far (after the platform's fee), by host id."""
    if not host_ids:
        return {}
    rows = await session.execute(
        select(Rental.host_id, micros_sum(LedgerEntry.amount))
        .select_from(LedgerTransaction)
        .join(LedgerEntry, LedgerEntry.transaction_id == LedgerTransaction.id)
        .join(Rental, Rental.id == LedgerTransaction.rental_id)
        .where(Rental.host_id.in_(list(host_ids)), LedgerEntry.account.like(PROVIDER_LEGS))
        .group_by(Rental.host_id)
    )
    # The provider's payable is a liability too: earnings credit it (negative amounts).
    return {host_id: -from_micros(total) for host_id, total in rows.all() if host_id is not None}


async def provider_earnings(session: AsyncSession, provider_id: str) -> dict[str, Any]:
    """A provider's money: what the platform owes it now (paid out in the next batch above the minimum),
    what it has been paid, and so what it has earned in all."""
    payable = await ledger.balance(session, ledger.provider_payable(provider_id))
    payouts, paid = (
        await session.execute(select(func.count(), micros_sum(Payout.amount)).where(Payout.provider_id == provider_id))
    ).one()
    paid_out = from_micros(paid)
    return {
        "payable": ledger.money(payable),
        "paid_out": ledger.money(paid_out),
        "earned_total": ledger.money(payable + paid_out),
        "payouts": int(payouts),
    }
