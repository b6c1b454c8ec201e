"""Monthly invoices (renters) and statements (providers), computed from the ledger; nothing is stored.

A posting belongs to the calendar month (UTC) of its ``created_at``: ``[first day 00:00,
next month's first day 00:00)``. An **invoice** (``inv-YYYY-MM-<account>``) reads the renter's
``renter:<account>:credit``: per rental what each kind of posting charged (usage, the minimum
period, downtime credits with their reason, corrections), the month's top-ups as payments,
and the opening and closing balance. A **statement** (``stm-YYYY-MM-<account>``) reads the
provider's ``provider:<account>:payable``: per rental what it earned and the platform fee
taken from the same postings, the payouts, and the opening and closing payable. Both list volumes'
storage apart, a line per volume (``storage``, ``billing/invoice_storage.py``), counted in their totals. The printable
page of a document is ``billing/invoice_html.py``.

Every figure is a sum of ledger entries, so a document agrees with the ledger by
construction: total paid − total charged is exactly the Σ of the account's entries in the
month, and the closing balance is exactly the account's balance at the month's end.
Sums run in the database over integer millionths (see ``_micros``), exact on SQLite too, so
a rental rated every 30 s for a month (86,400 usage postings) is one row, not 86,400.

This module reads ``billing.ledger`` and the models; it must not import ``master.api``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from billing import ledger
from billing.invoice_storage import storage_month, storage_view
from billing.ledger import from_micros as _from_micros
from billing.ledger import micros_sum as _micros
from billing.volumes import STORAGE
from master.models import Account, LedgerEntry, LedgerTransaction, Rental
from master.services.accounts import Principal
from shared.errors import BadRequest, NotFound

CURRENCY = "USD"
# The kinds of posting an invoice or statement line shows a column for, in this order; any
# other kind that appears on the account (a future one) gets its own entry in ``amounts``.
CHARGE_KINDS = ("usage", "minimum", "downtime_credit", "correction")
LABELS = {
    "usage": "Usage", "minimum": "Minimum billing period", "downtime_credit": "Downtime credit",
    "correction": "Correction", "top_up": "Top-up", "payout": "Payout",
}  # fmt: skip
# Months an id may name: wide enough for any real invoice, narrow enough that every month's
# start and end are valid datetimes.
FIRST_YEAR, LAST_YEAR = 1970, 9998

_MONTH = re.compile(r"(\d{4})-(\d{2})")
_DOCUMENT_ID = re.compile(r"(inv|stm)-(\d{4})-(\d{2})-([A-Za-z0-9_-]{1,40})")
_DOCUMENTS = {"inv": ("invoice", "renter"), "stm": ("statement", "provider")}


@dataclass(frozen=True, order=True)
class Month:
    """A calendar month in UTC."""

    year: int
    month: int

    @classmethod
    def parse(cls, text: str) -> Month:
        """``"2026-11"``; BadRequest ``invalid_month`` for anything else."""
        match = _MONTH.fullmatch(text)
        month = cls._checked(int(match.group(1)), int(match.group(2))) if match else None
        if month is None:
            raise BadRequest(f"month must be YYYY-MM between {FIRST_YEAR}-01 and {LAST_YEAR}-12, got {text[:40]!r}",
                             code="invalid_month")  # fmt: skip
        return month

    @classmethod
    def of(cls, moment: datetime) -> Month:
        moment = moment.astimezone(UTC)
        return cls(moment.year, moment.month)

    @classmethod
    def _checked(cls, year: int, month: int) -> Month | None:
        return cls(year, month) if FIRST_YEAR <= year <= LAST_YEAR and 1 <= month <= 12 else None

    def __str__(self) -> str:
        return f"{self.year:04d}-{self.month:02d}"

    @property
    def start(self) -> datetime:
        return datetime(self.year, self.month, 1, tzinfo=UTC)

    @property
    def end(self) -> datetime:
        """The next month's first instant (exclusive)."""
        return datetime(self.year + self.month // 12, self.month % 12 + 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class DocumentId:
    """``inv-YYYY-MM-<account>`` (a renter's invoice) or ``stm-YYYY-MM-<account>`` (a provider's statement)."""

    prefix: str  # inv | stm
    month: Month
    account_id: str

    @classmethod
    def parse(cls, text: str) -> DocumentId:
        match = _DOCUMENT_ID.fullmatch(text)
        month = Month._checked(int(match.group(2)), int(match.group(3))) if match else None
        if match is None or month is None:
            raise BadRequest(
                f"{text[:80]!r} is not an invoice id (inv-YYYY-MM-<account>) or a statement id (stm-YYYY-MM-<account>) "
                f"with a month between {FIRST_YEAR}-01 and {LAST_YEAR}-12",
                code="invalid_invoice_id",
            )
        return cls(match.group(1), month, match.group(4))

    @property
    def kind(self) -> str:
        return _DOCUMENTS[self.prefix][0]

    def __str__(self) -> str:
        return f"{self.prefix}-{self.month}-{self.account_id}"


# --- Exact sums ----------------------------------------------------------------------------


def _in_month(month: Month) -> ColumnElement[bool]:
    return and_(LedgerTransaction.created_at >= month.start, LedgerTransaction.created_at < month.end)


def _on(account: str) -> Select[Any]:
    """The account's entries joined to their postings (add columns and filters)."""
    return (
        select()
        .select_from(LedgerTransaction)
        .join(LedgerEntry, LedgerEntry.transaction_id == LedgerTransaction.id)
        .where(LedgerEntry.account == account)
    )


async def _debits_minus_credits_before(session: AsyncSession, account: str, moment: datetime) -> Decimal:
    return _from_micros(await session.scalar(_on(account).add_columns(_micros(LedgerEntry.amount))
                                             .where(LedgerTransaction.created_at < moment)))  # fmt: skip


# --- Reading one month of an account ---------------------------------------------------------


@dataclass
class _Line:
    """One rental's part of a document, added up as the month's postings are read."""

    rental_id: str | None
    amounts: dict[str, Decimal] = field(default_factory=lambda: dict.fromkeys(CHARGE_KINDS, Decimal(0)))
    fees: Decimal = Decimal(0)  # statements: the platform's fee on the same postings
    postings: int = 0
    details: list[dict[str, Any]] = field(default_factory=list)  # every posting but usage, with its memo

    def add(self, kind: str, amount: Decimal, fee: Decimal, count: int) -> None:
        self.amounts[kind] = self.amounts.get(kind, Decimal(0)) + amount
        self.fees += fee
        self.postings += count

    @property
    def total(self) -> Decimal:
        return sum(self.amounts.values(), Decimal(0))


@dataclass
class _Month:
    """What one account's postings in one month add up to (amounts as the owner reads them)."""

    lines: dict[str | None, _Line]
    movements: list[dict[str, Any]]  # top-ups (invoices) or payouts (statements), one by one
    moved: Decimal  # Σ of the movements


async def _read_month(session: AsyncSession, account: str, month: Month, *, movement: str, sign: int) -> _Month:
    """The account's postings in ``month``: usage summed per rental in SQL, every other posting row by row.

    ``sign`` turns an entry into the amount as its owner reads it: +1 for the renter (a debit
    to the credit is a charge), −1 for the provider (a credit to the payable is an earning).
    ``movement`` is the kind listed apart: ``top_up`` (a payment: −amount) or ``payout`` (+amount).
    """
    fee = aliased(LedgerEntry)
    with_fee = _on(account).outerjoin(fee, and_(fee.transaction_id == LedgerTransaction.id, fee.account == ledger.FEES))
    # Grouped by kind rather than filtered on it: the month and the account are what narrow the
    # search, and a plan driven by the account's entries stays fast even on stale statistics.
    sums = (
        await session.execute(
            with_fee.add_columns(LedgerTransaction.rental_id, LedgerTransaction.kind, func.count(LedgerTransaction.id),
                                 _micros(LedgerEntry.amount), _micros(fee.amount))
            .where(_in_month(month))
            .group_by(LedgerTransaction.rental_id, LedgerTransaction.kind)
        )
    ).all()  # fmt: skip
    others = (
        await session.execute(
            with_fee.add_columns(LedgerTransaction.created_at, LedgerTransaction.kind, LedgerTransaction.memo,
                                 LedgerTransaction.rental_id, LedgerTransaction.key, LedgerEntry.amount, fee.amount)
            .where(_in_month(month), LedgerTransaction.kind.not_in(("usage", STORAGE)))  # storage: invoice_storage.py
            .order_by(LedgerTransaction.created_at, LedgerTransaction.id)
        )
    ).all()  # fmt: skip
    lines: dict[str | None, _Line] = {}
    for rental_id, kind, count, amount, fee_amount in sums:
        if kind != "usage":
            continue  # read row by row below, with their memos
        lines.setdefault(rental_id, _Line(rental_id)).add("usage", sign * _from_micros(amount), -_from_micros(fee_amount), count)
    movements, moved = [], Decimal(0)
    for at, kind, memo, rental_id, key, amount, fee_amount in others:
        if kind == movement:
            value = -amount if movement == "top_up" else amount
            movements.append({"at": at.isoformat(), "kind": kind, "memo": memo, "amount": ledger.money(value), "posting": key})
            moved += value
            continue
        line = lines.setdefault(rental_id, _Line(rental_id))
        line.add(kind, sign * amount, -(fee_amount or Decimal(0)), 1)
        line.details.append({"at": at.isoformat(), "kind": kind, "label": LABELS.get(kind, kind), "memo": memo,
                             "amount": ledger.money(sign * amount), "posting": key})  # fmt: skip
    return _Month(lines, movements, moved)


@dataclass(frozen=True)
class _RentalFacts:
    """What a line shows of its rental (not the whole row: its workload and spec can be large)."""

    id: str
    gpu_model: str | None
    gpu_count: int
    gpu_milli: int
    kind: str
    state: str
    price_per_gpu_hour: Decimal | None
    started_at: datetime | None
    stopped_at: datetime | None
    billed_seconds: int
    cluster_id: str | None
    node_rank: int | None
    service_id: str | None


_RENTAL_COLUMNS = (Rental.id, Rental.gpu_model, Rental.gpu_count, Rental.gpu_milli, Rental.kind, Rental.state,
                   Rental.price_per_gpu_hour, Rental.started_at, Rental.stopped_at, Rental.billed_seconds,
                   Rental.cluster_id, Rental.node_rank, Rental.service_id)  # fmt: skip


async def _rentals(session: AsyncSession, account: str, month: Month) -> tuple[dict[str, _RentalFacts], set[str]]:
    """The rentals with postings on the account in the month, and those of them that also have postings in another month."""
    in_month = _on(account).add_columns(LedgerTransaction.rental_id).where(_in_month(month), LedgerTransaction.rental_id.is_not(None))
    rows = (await session.execute(select(*_RENTAL_COLUMNS).where(Rental.id.in_(in_month)))).all()
    rentals = {row.id: _RentalFacts(**row._asdict()) for row in rows}
    spanning = (
        await session.scalars(
            _on(account).add_columns(LedgerTransaction.rental_id).distinct()
            .where(LedgerTransaction.rental_id.in_(in_month), ~_in_month(month))
        )
    ).all()  # fmt: skip
    return rentals, {rental_id for rental_id in spanning if rental_id is not None}


def _line_view(line: _Line, rental: _RentalFacts | None, *, whole_rental: bool, statement: bool) -> dict[str, Any]:
    view: dict[str, Any] = {
        "rental_id": line.rental_id,
        "cluster_id": rental.cluster_id if rental else None,  # a cluster's member: its lines sit together
        "node_rank": rental.node_rank if rental else None,
        "service_id": rental.service_id if rental else None,  # a service's replica
        "gpu_model": rental.gpu_model if rental else None,
        "gpu_count": rental.gpu_count if rental else None,
        "gpu_milli": rental.gpu_milli if rental else None,
        "rental_kind": rental.kind if rental else None,
        "state": rental.state if rental else None,
        "price_per_gpu_hour": ledger.money(rental.price_per_gpu_hour) if rental and rental.price_per_gpu_hour is not None else None,
        "started_at": rental.started_at.isoformat() if rental and rental.started_at else None,
        "stopped_at": rental.stopped_at.isoformat() if rental and rental.stopped_at else None,
        # The served seconds charged as usage: known when every posting of the rental is in this month.
        "seconds_billed": rental.billed_seconds if rental and whole_rental else None,
        "postings": line.postings,
        "amounts": {kind: ledger.money(amount) for kind, amount in line.amounts.items()},
        "details": line.details,
    }
    if statement:
        view["earned"] = ledger.money(line.total)
        view["platform_fee"] = ledger.money(line.fees)
        view["charged"] = ledger.money(line.total + line.fees)
    else:
        view["total"] = ledger.money(line.total)
    return view


async def _lines(session: AsyncSession, account: str, month: Month, read: _Month, *, statement: bool) -> list[dict[str, Any]]:
    """The month's lines, oldest start first; a cluster's members together (at its first member's start), by rank."""
    rentals, spanning = await _rentals(session, account, month)

    def started(rental_id: str | None) -> str:
        rental = rentals.get(rental_id or "")
        return rental.started_at.isoformat() if rental and rental.started_at else "~"

    group_start: dict[str, str] = {}
    for line in read.lines.values():
        rental = rentals.get(line.rental_id or "")
        if rental is not None and rental.cluster_id is not None:
            group_start[rental.cluster_id] = min(group_start.get(rental.cluster_id, "~"), started(line.rental_id))

    def order(line: _Line) -> tuple[str, str, int, str]:
        rental = rentals.get(line.rental_id or "")
        if rental is not None and rental.cluster_id is not None:
            return group_start[rental.cluster_id], rental.cluster_id, rental.node_rank or 0, started(line.rental_id) + rental.id
        return started(line.rental_id), line.rental_id or "~", 0, ""

    return [
        _line_view(line, rentals.get(line.rental_id or ""), whole_rental=line.rental_id not in spanning, statement=statement)
        for line in sorted(read.lines.values(), key=order)
    ]


def _groups(lines: list[dict[str, Any]], key: str, *, total: str) -> list[dict[str, Any]]:
    """The lines of each cluster (``key`` "cluster_id") or service (``key`` "service_id") summed (``total``: the lines'
    amount field), in the lines' order."""
    found: dict[str, dict[str, Any]] = {}
    for line in lines:
        if line[key] is None:
            continue
        group = found.setdefault(line[key], {key: line[key], "rental_ids": [], total: Decimal(0)})
        group["rental_ids"].append(line["rental_id"])
        group[total] += Decimal(line[total])
    return [{**group, total: ledger.money(group[total])} for group in found.values()]


def _totals(read: _Month) -> dict[str, Decimal]:
    totals = dict.fromkeys(CHARGE_KINDS, Decimal(0))
    for line in read.lines.values():
        for kind, amount in line.amounts.items():
            totals[kind] = totals.get(kind, Decimal(0)) + amount
    return totals


async def _account(session: AsyncSession, doc: DocumentId) -> Account:
    account = await session.get(Account, doc.account_id)
    wanted = _DOCUMENTS[doc.prefix][1]
    if account is None or account.role != wanted:
        raise NotFound(f"no {doc.kind} {doc}: it names no {wanted} account", code="invoice_not_found")
    return account


def _header(doc: DocumentId, account: Account) -> dict[str, Any]:
    return {
        "id": str(doc), "kind": doc.kind, "account_id": account.id, "account_name": account.name, "currency": CURRENCY,
        "month": str(doc.month), "period": {"start": doc.month.start.isoformat(), "end": doc.month.end.isoformat()},
    }  # fmt: skip


# --- The documents ---------------------------------------------------------------------------


async def invoice(session: AsyncSession, account_id: str, month: Month | str) -> dict[str, Any]:
    """The renter's invoice for ``month`` (``"YYYY-MM"``); NotFound ``invoice_not_found`` if no such renter.

    Amounts are strings with six places; charges are positive, credits (downtime) negative.
    ``total_paid − total_charged`` is the Σ of the renter's credit entries in the month, and
    ``closing_balance`` its balance at the month's end.
    """
    doc = DocumentId("inv", month if isinstance(month, Month) else Month.parse(month), account_id)
    account = await _account(session, doc)
    code = ledger.renter_credit(account.id)
    opening = ledger.balance_of(code, await _debits_minus_credits_before(session, code, doc.month.start))
    read = await _read_month(session, code, doc.month, movement="top_up", sign=1)
    totals = _totals(read)
    storage = await storage_month(session, code, doc.month.start, doc.month.end, statement=False)
    charged = sum(totals.values(), Decimal(0)) + storage.amount
    return {
        **_header(doc, account),
        "opening_balance": ledger.money(opening),
        "payments": read.movements, "total_paid": ledger.money(read.moved),
        "lines": (lines := await _lines(session, code, doc.month, read, statement=False)),
        "clusters": _groups(lines, "cluster_id", total="total"),
        "services": _groups(lines, "service_id", total="total"),
        "storage": storage_view(storage, statement=False),
        "totals": {kind: ledger.money(amount) for kind, amount in totals.items()},
        "total_charged": ledger.money(charged),
        "closing_balance": ledger.money(opening + read.moved - charged),
    }  # fmt: skip


async def statement(session: AsyncSession, account_id: str, month: Month | str) -> dict[str, Any]:
    """The provider's statement for ``month``; NotFound ``invoice_not_found`` if no such provider.

    Per rental: ``charged`` (what the renter paid for it) = ``earned`` + ``platform_fee``,
    from the same postings. ``total_earned − total_paid_out`` is −Σ of the provider's payable
    entries in the month, and ``closing_payable`` its balance at the month's end.
    """
    doc = DocumentId("stm", month if isinstance(month, Month) else Month.parse(month), account_id)
    account = await _account(session, doc)
    code = ledger.provider_payable(account.id)
    opening = ledger.balance_of(code, await _debits_minus_credits_before(session, code, doc.month.start))
    read = await _read_month(session, code, doc.month, movement="payout", sign=-1)
    totals = _totals(read)
    storage = await storage_month(session, code, doc.month.start, doc.month.end, statement=True)
    earned = sum(totals.values(), Decimal(0)) + storage.amount
    fees = sum((line.fees for line in read.lines.values()), Decimal(0)) + storage.fee
    return {
        **_header(doc, account),
        "opening_payable": ledger.money(opening),
        "lines": await _lines(session, code, doc.month, read, statement=True),
        "storage": storage_view(storage, statement=True),
        "totals": {kind: ledger.money(amount) for kind, amount in totals.items()},
        "total_charged": ledger.money(earned + fees), "total_platform_fee": ledger.money(fees), "total_earned": ledger.money(earned),
        "payouts": read.movements, "total_paid_out": ledger.money(read.moved),
        "closing_payable": ledger.money(opening + earned - read.moved),
    }  # fmt: skip


async def document(session: AsyncSession, principal: Principal, document_id: str) -> dict[str, Any]:
    """The invoice or statement ``document_id`` names, if the caller may read it.

    BadRequest ``invalid_invoice_id`` for a malformed id. Renters and providers read their
    own; another account's document is NotFound ``invoice_not_found``, exactly like one
    that does not exist, so ids cannot be probed. Admins read any.
    """
    doc = DocumentId.parse(document_id)
    if principal.role != "admin" and principal.account_id != doc.account_id:
        raise NotFound(f"no {doc.kind} {doc} on your account", code="invoice_not_found")
    if doc.prefix == "inv":
        return await invoice(session, doc.account_id, doc.month)
    return await statement(session, doc.account_id, doc.month)


async def list_invoices(session: AsyncSession, principal: Principal, *, account_id: str | None = None) -> list[dict[str, Any]]:
    """The months with postings on the caller's account, newest first: invoices for renters, statements for providers.

    Admins name the account (``account_id``; BadRequest ``missing_account_id`` without it).
    Anyone else naming an account but their own gets NotFound ``account_not_found``.
    """
    if principal.role == "admin":
        if account_id is None:
            raise BadRequest("admins name the account whose invoices to list: ?account_id=<account>", code="missing_account_id")
        target = account_id
    else:
        target = principal.account_id
    account = await session.get(Account, target)
    if account is None or (principal.role != "admin" and account_id not in (None, principal.account_id)):
        raise NotFound(f"no account {target[:40]!r} you may read", code="account_not_found")
    prefix = next((prefix for prefix, (_, role) in _DOCUMENTS.items() if role == account.role), None)
    if prefix is None:
        return []
    code = ledger.renter_credit(account.id) if prefix == "inv" else ledger.provider_payable(account.id)
    months = await _months_with_postings(session, code)
    return [{"id": str(doc), "kind": doc.kind, "month": str(doc.month)}
            for doc in (DocumentId(prefix, month, account.id) for month in reversed(months))]  # fmt: skip


async def _months_with_postings(session: AsyncSession, account: str) -> list[Month]:
    """Oldest first; one indexed query per month that has postings (a month without any is skipped over)."""
    months: list[Month] = []
    since: datetime | None = None
    while True:
        query = _on(account).add_columns(func.min(LedgerTransaction.created_at))
        first = await session.scalar(query.where(LedgerTransaction.created_at >= since) if since else query)
        if first is None:
            return months
        months.append(Month.of(first))
        since = months[-1].end
