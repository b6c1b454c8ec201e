"""Money figures the API's views show beside rentals and hosts, read from the ledger.

What a rental has charged its renter so far (usage and minimums, less downtime credits: the
renter-side legs of the postings that name the rental), what a volume's storage has charged,
and what each host has earned its provider (the provider-side legs of its rentals' and its
volumes' postings). Exact on SQLite and PostgreSQL
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
from master.models import LedgerEntry, LedgerTransaction, Payout, Rental, Volume

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


async def charged_by_volume(session: AsyncSession, volume_ids: Collection[str]) -> dict[str, Decimal]:
    """What each volume's storage has charged its renter so far, by volume id (absent: nothing yet)."""
    if not volume_ids:
        return {}
    rows = await session.execute(
        select(LedgerTransaction.volume_id, micros_sum(LedgerEntry.amount))
        .join(LedgerEntry, LedgerEntry.transaction_id == LedgerTransaction.id)
        .where(LedgerTransaction.volume_id.in_(list(volume_ids)), LedgerEntry.account.like(RENTER_LEGS))
        .group_by(LedgerTransaction.volume_id)
    )
    return {volume_id: from_micros(total) for volume_id, total in rows.all()}


async def storage_per_hour(session: AsyncSession, account_id: str) -> Decimal:
    """What the account's volumes being billed (ready, deletion not asked) cost per hour."""
    rows = await session.execute(
        select(Volume.size_gib, Volume.price_per_gib_hour)
        .where(Volume.account_id == account_id, Volume.ready_at.is_not(None), Volume.deleted_at.is_(None))
    )  # fmt: skip
    return sum((Decimal(price) * size for size, price in rows.all()), Decimal(0))


async def earned_by_host(session: AsyncSession, host_ids: Collection[str]) -> dict[str, Decimal]:
    """What each host's rentals and volumes have earned its provider so far (after the platform's fee), by host id."""
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
    storage = await session.execute(
        select(Volume.host_id, micros_sum(LedgerEntry.amount))
        .select_from(LedgerTransaction)
        .join(LedgerEntry, LedgerEntry.transaction_id == LedgerTransaction.id)
        .join(Volume, Volume.id == LedgerTransaction.volume_id)
        .where(Volume.host_id.in_(list(host_ids)), LedgerEntry.account.like(PROVIDER_LEGS))
        .group_by(Volume.host_id)
    )
    # The provider's payable is a liability too: earnings credit it (negative amounts).
    earned: dict[str, Decimal] = {}
    for host_id, total in [*rows.all(), *storage.all()]:
        if host_id is not None:
            earned[host_id] = earned.get(host_id, Decimal(0)) - from_micros(total)
    return earned


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
