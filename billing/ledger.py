"""The double-entry ledger: balanced, append-only, idempotent postings in exact decimals.

Accounts (``ledger_accounts``), by code:

=============================  =========  ==============================================
``renter:<account>:credit``    liability  prepaid credit the platform owes the renter
``provider:<account>:payable`` liability  earnings the platform owes the provider
``platform:fees``              revenue    the platform's fee on every charge
``platform:cash``              asset      money received (top-ups) less money paid out
=============================  =========  ==============================================

A posting (``ledger_transactions`` + ``ledger_entries``) is a set of legs whose amounts sum
to exactly zero: a positive amount debits an account, a negative one credits it. Amounts are
``Decimal`` with six places (``QUANTUM``, a millionth of a dollar: per-second usage is finer
than a cent); money that enters or leaves (top-ups, payouts) is in whole cents
(``CURRENCY_QUANTUM``). Every posting has a ``key`` saying what it records
(``rental:{id}:usage:{period_start}``, ``topup:{account}:{reference}``); the key is unique,
so posting the same thing twice — a redelivered task, two workers, a retried request —
posts it once. Nothing is ever updated or deleted: corrections are new postings.

Balances: a liability's or revenue's balance is what was credited less what was debited
(``-Σ amount``); an asset's is ``Σ amount``. The trial balance sums every entry: zero, always.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from sqlalchemy import BigInteger, ColumnElement, cast, func, insert, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import LedgerAccount, LedgerEntry, LedgerTransaction
from shared.errors import ValidationFailed
from shared.money import CENT_PLACES, amount_problem

QUANTUM = Decimal("0.000001")
CURRENCY_QUANTUM = Decimal("0.01")
MAX_MOVE = Decimal("1000000")  # the most one top-up or spend cap may say, USD
CASH = "platform:cash"
FEES = "platform:fees"
KINDS = {"credit": "liability", "payable": "liability", "fees": "revenue", "cash": "asset"}


class LedgerError(ValidationFailed):
    code = "ledger_error"


def renter_credit(account_id: str) -> str:
    return f"renter:{account_id}:credit"


def provider_payable(account_id: str) -> str:
    return f"provider:{account_id}:payable"


def quantize(amount: Decimal) -> Decimal:
    """``amount`` to the ledger's quantum, half to even (the rounding of every computed amount)."""
    return amount.quantize(QUANTUM, rounding=ROUND_HALF_EVEN)


def accrued(streams: Iterable[tuple[Decimal, datetime | None]], now: datetime) -> tuple[Decimal, Decimal]:
    """What charge streams (a rate per second, from when it was last rated) have run up by ``now`` in whole seconds,
    and their rates' sum: a renter's unrated rentals and volumes, as enforcement reads them."""
    unrated = burn = Decimal(0)
    for rate, since in streams:
        burn += rate
        if since is not None and now > since:
            unrated += rate * int((now - since).total_seconds())
    return unrated, burn


def money(amount: Decimal) -> str:
    return f"{amount.quantize(QUANTUM):f}"


def cents(raw: object, *, what: str) -> Decimal:
    """A positive amount of real money in whole cents, at most 1,000,000.00, as ``shared/money.py``'s grammar
    reads it (a string like "25.00", a JSON integer, or a Decimal); LedgerError (``invalid_amount``) says what to write."""
    problem, amount = amount_problem(raw, places=CENT_PLACES, maximum=MAX_MOVE, positive=True)
    if amount is None:
        raise LedgerError(f"{what} {problem}", code="invalid_amount", details={"problems": [{"field": what, "problem": problem}]})
    return amount.quantize(CURRENCY_QUANTUM)  # "25" and "25.00" are one amount (and one top-up memo)


@dataclass(frozen=True)
class Leg:
    account: str
    amount: Decimal  # > 0 debit, < 0 credit


def _kind(code: str) -> tuple[str, str | None]:
    """The account's kind and owner, from its code."""
    parts = code.split(":")
    if code in (CASH, FEES):
        return KINDS[parts[1]], None
    if len(parts) == 3 and parts[0] in ("renter", "provider") and parts[2] in ("credit", "payable"):
        return KINDS[parts[2]], parts[1]
    raise LedgerError(f"no ledger account {code!r}")


def _insert(session: AsyncSession, table: Any) -> Any:
    """INSERT … ON CONFLICT for the session's database (PostgreSQL or SQLite)."""
    if session.get_bind().dialect.name == "postgresql":
        return pg_insert(table)
    return sqlite_insert(table)


async def _ensure_accounts(session: AsyncSession, codes: Collection[str]) -> None:
    known = set((await session.scalars(select(LedgerAccount.code).where(LedgerAccount.code.in_(list(codes))))).all())
    missing = []
    for code in sorted(set(codes) - known):
        kind, owner = _kind(code)
        missing.append({"code": code, "kind": kind, "owner_id": owner, "created_at": datetime.now(UTC)})
    if missing:  # a concurrent posting may create some first: skip those
        await session.execute(_insert(session, LedgerAccount).on_conflict_do_nothing(index_elements=["code"]), missing)


@dataclass(frozen=True)
class Draft:
    """A posting to make: see ``post``."""

    key: str
    kind: str
    legs: Sequence[Leg]
    memo: str = ""
    rental_id: str | None = None
    period: tuple[datetime, datetime] | None = None
    volume_id: str | None = None


def _checked(draft: Draft) -> list[Leg]:
    legs = [leg for leg in draft.legs if leg.amount != 0]
    for leg in legs:
        if leg.amount != leg.amount.quantize(QUANTUM):
            raise LedgerError(f"posting {draft.key}: {leg.amount} on {leg.account} is finer than the ledger's quantum {QUANTUM}")
        _kind(leg.account)
    if sum((leg.amount for leg in legs), Decimal(0)) != 0:
        raise LedgerError(f"posting {draft.key} does not balance: {', '.join(f'{leg.account} {leg.amount}' for leg in legs)}")
    return legs


async def post_many(session: AsyncSession, drafts: Sequence[Draft], *, at: datetime) -> set[str]:
    """Record balanced postings, each once; returns the keys posted now (a key posted before is skipped).

    Bulk: one query for the keys already there, one INSERT of the accounts missing, one of the
    transactions (ON CONFLICT (key) DO NOTHING, so a concurrent writer of the same key wins
    cleanly), one of their entries. Legs of zero are dropped; a draft with no legs left is
    not posted. Every draft is checked before anything is written.
    """
    checked = [(draft, legs) for draft in drafts if (legs := _checked(draft))]
    if not checked:
        return set()
    keys = [draft.key for draft, _ in checked]
    if len(set(keys)) != len(keys):
        raise LedgerError("two postings in one batch share a key")
    present = set((await session.scalars(select(LedgerTransaction.key).where(LedgerTransaction.key.in_(keys)))).all())
    fresh = [(draft, legs) for draft, legs in checked if draft.key not in present]
    if not fresh:
        return set()
    await _ensure_accounts(session, {leg.account for _, legs in fresh for leg in legs})
    rows = [
        {"key": draft.key, "kind": draft.kind, "memo": draft.memo, "rental_id": draft.rental_id, "volume_id": draft.volume_id,
         "created_at": at,
         "period_start": draft.period[0] if draft.period else None, "period_end": draft.period[1] if draft.period else None}
        for draft, _ in fresh
    ]  # fmt: skip
    inserted = (
        await session.execute(
            _insert(session, LedgerTransaction).on_conflict_do_nothing(index_elements=["key"])
            .returning(LedgerTransaction.id, LedgerTransaction.key),
            rows,
        )
    ).all()  # fmt: skip
    ids = {key: transaction_id for transaction_id, key in inserted}
    entries = [
        {"transaction_id": ids[draft.key], "account": leg.account, "amount": leg.amount}
        for draft, legs in fresh if draft.key in ids for leg in legs
    ]  # fmt: skip
    if entries:
        await session.execute(insert(LedgerEntry), entries)
    return set(ids)


async def post(
    session: AsyncSession,
    *,
    key: str,
    kind: str,
    legs: Sequence[Leg],
    at: datetime,
    memo: str = "",
    rental_id: str | None = None,
    period: tuple[datetime, datetime] | None = None,
) -> bool:
    """Record one balanced posting once; returns False if ``key`` was posted before (nothing changes)."""
    posted = await post_many(session, [Draft(key, kind, legs, memo, rental_id, period)], at=at)
    return key in posted


def balance_of(code: str, debits_minus_credits: Decimal) -> Decimal:
    """The balance as its owner reads it: credit-normal for liabilities and revenue, debit-normal for assets."""
    kind, _ = _kind(code)
    return debits_minus_credits if kind == "asset" else -debits_minus_credits


def micros_sum(amount: Any) -> ColumnElement[Any]:
    """Σ ``amount`` in integer millionths of a dollar, exact on PostgreSQL and on SQLite alike.

    SQLite keeps NUMERIC as binary floats and sums them as floats, which drifts. But every
    ledger amount has exactly six places (``QUANTUM``), so ``round(amount × 10⁶)`` is
    the exact integer it stands for (a double holds it to well under ½ up to ~9·10⁹ USD), and
    a sum of integers is exact. Read the result with ``from_micros``.
    """
    return func.sum(cast(func.round(amount * 1_000_000), BigInteger))


def from_micros(value: Any) -> Decimal:
    return Decimal(int(value or 0)).scaleb(-6)


def _exact_sums(session: AsyncSession) -> bool:
    """Whether the database sums NUMERIC exactly (PostgreSQL); SQLite sums as floats, so Python adds there."""
    return session.get_bind().dialect.name == "postgresql"


async def balance(session: AsyncSession, code: str) -> Decimal:
    if _exact_sums(session):
        total = await session.scalar(select(func.coalesce(func.sum(LedgerEntry.amount), 0)).where(LedgerEntry.account == code))
        return balance_of(code, Decimal(total or 0))
    amounts = (await session.scalars(select(LedgerEntry.amount).where(LedgerEntry.account == code))).all()
    return balance_of(code, sum(amounts, Decimal(0)))


async def trial_balance(session: AsyncSession) -> dict[str, Any]:
    """Every account's debits, credits and balance; ``balanced`` when debits equal credits."""
    if not _exact_sums(session):
        return _summarise(
            list((await session.execute(select(LedgerAccount.code, LedgerAccount.kind).order_by(LedgerAccount.code))).all()),
            list((await session.execute(select(LedgerEntry.account, LedgerEntry.amount))).all()),
        )
    rows = (
        await session.execute(
            select(
                LedgerAccount.code, LedgerAccount.kind,
                func.coalesce(func.sum(func.abs(LedgerEntry.amount) + LedgerEntry.amount), 0),
                func.coalesce(func.sum(func.abs(LedgerEntry.amount) - LedgerEntry.amount), 0),
            )
            .outerjoin(LedgerEntry, LedgerEntry.account == LedgerAccount.code)
            .group_by(LedgerAccount.code, LedgerAccount.kind)
            .order_by(LedgerAccount.code)
        )
    ).all()  # fmt: skip
    return _trial_view([tuple(row) for row in rows])


def _trial_view(rows: Sequence[Any]) -> dict[str, Any]:
    accounts = []
    debits_total = credits_total = Decimal(0)
    for code, kind, twice_debits, twice_credits in rows:
        debits, credits = Decimal(twice_debits) / 2, Decimal(twice_credits) / 2
        debits_total += debits
        credits_total += credits
        accounts.append(
            {"account": code, "kind": kind, "debits": money(debits), "credits": money(credits),
             "balance": money(balance_of(code, debits - credits))}
        )  # fmt: skip
    return {
        "accounts": accounts, "debits": money(debits_total), "credits": money(credits_total),
        "balanced": debits_total == credits_total,
    }  # fmt: skip


def _summarise(accounts: list[Any], entries: list[Any]) -> dict[str, Any]:
    """The trial balance added up in Python (exact Decimal), from (code, kind) and (account, amount) rows."""
    sums: dict[str, list[Decimal]] = {code: [Decimal(0), Decimal(0)] for code, _ in accounts}
    for account, amount in entries:
        sums[account][0 if amount > 0 else 1] += abs(amount)
    rows = [(code, kind, 2 * sums[code][0], 2 * sums[code][1]) for code, kind in accounts]
    return _trial_view(rows)
