"""Prepaid credit: top-ups into the ledger, balances and burn rates.

**The payment integration point.** Money comes in through ``top_up``: an admin's
``POST /api/v1/account/credits``, or a payment provider's webhook handler calling it with
the provider's own payment id as ``reference``. ``reference`` makes the top-up idempotent
(``topup:{account}:{reference}``): a payment notified twice is credited once. There is no
card processing here.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from billing import ledger
from billing.ledger import Leg
from master.models import Account, LedgerTransaction
from shared.errors import NotFound, ValidationFailed

MAX_REFERENCE = 128


async def top_up(session: AsyncSession, account_id: str, amount: object, *, reference: str, at: datetime) -> tuple[bool, str]:
    """Credit a renter's prepaid balance from cash; returns ``(posted, key)`` (False: this reference was credited before)."""
    value = ledger.cents(amount, what="amount")
    if not reference or len(reference) > MAX_REFERENCE or not reference.isprintable():
        raise ValidationFailed(f"reference must be 1 to {MAX_REFERENCE} printable characters (the payment's id)", code="invalid_reference")
    account = await session.get(Account, account_id)
    if account is None:
        raise NotFound(f"no account {account_id!r}", code="account_not_found")
    if account.role != "renter":
        raise ValidationFailed(f"account {account_id} is a {account.role}; only renters hold prepaid credit", code="not_a_renter")
    key = f"topup:{account_id}:{reference}"
    earlier = await session.scalar(select(LedgerTransaction.memo).where(LedgerTransaction.key == key))
    if earlier is not None:
        if earlier != _memo(value):
            raise ValidationFailed(f"reference {reference!r} was already used for another amount ({earlier})", code="reference_reused")
        return False, key
    posted = await ledger.post(
        session, key=key, kind="top_up", at=at, memo=_memo(value),
        legs=[Leg(ledger.CASH, value), Leg(ledger.renter_credit(account_id), -value)],
    )  # fmt: skip
    return posted, key


def _memo(value: Decimal) -> str:
    return f"top-up of {value:f} USD"


async def credit_view(session: AsyncSession, account: Account, *, burn_per_hour: Decimal, now: datetime) -> dict[str, Any]:
    """A renter's balance, burn rate, how long the balance lasts at that rate, and its monthly spend cap."""
    from billing.enforce import month_spent

    balance = await ledger.balance(session, ledger.renter_credit(account.id))
    hours = (balance / burn_per_hour) if burn_per_hour > 0 and balance > 0 else None
    return {
        "balance": ledger.money(balance),
        "burn_rate_per_hour": ledger.money(burn_per_hour),
        "hours_left": float(round(hours, 2)) if hours is not None else None,
        "monthly_spend_cap": f"{account.monthly_spend_cap:.2f}" if account.monthly_spend_cap is not None else None,
        "spent_this_month": ledger.money(await month_spent(session, account.id, now)),
    }


async def set_spend_cap(session: AsyncSession, account_id: str, cap: object | None) -> Account:
    """Set (or, with None, remove) a renter's monthly spend cap, in whole cents."""
    account = await session.get(Account, account_id, with_for_update=True)
    if account is None:
        raise NotFound(f"no account {account_id!r}", code="account_not_found")
    if account.role != "renter":
        raise ValidationFailed("only renters have a spend cap", code="not_a_renter")
    account.monthly_spend_cap = None if cap is None else ledger.cents(cap, what="monthly_spend_cap")
    return account
