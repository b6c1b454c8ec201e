"""Monthly invoices (renters) and statements (providers), read from the ledger.

A posting belongs to the calendar month (UTC) of its ``created_at``. An invoice lists, per
rental, what each of its postings did to the renter's credit (usage, minimum period,
downtime credits with their reason, corrections), the month's top-ups as payments, and the
opening and closing balance; a statement lists per rental what the provider earned, the
payouts, and the opening and closing payable balance. Nothing is stored: every figure is
the sum of ledger entries, so an invoice's totals equal the ledger's by construction
(amounts are added in Python, exactly). Ids: ``inv-YYYY-MM-<account>`` and
``stm-YYYY-MM-<account>``.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from billing import ledger
from master.models import Account, LedgerEntry, LedgerTransaction, Rental
from master.services.accounts import Principal
from shared.errors import BadRequest, NotFound

_ID = re.compile(r"(inv|stm)-(\d{4})-(\d{2})-([A-Za-z0-9_-]{1,40})")
CHARGE_LABELS = {"usage": "usage", "minimum": "minimum billing period", "downtime_credit": "downtime credit", "correction": "correction"}


@dataclass(frozen=True)
class DocumentId:
    kind: str  # inv | stm
    year: int
    month: int
    account_id: str

    @classmethod
    def parse(cls, text: str) -> DocumentId:
        match = _ID.fullmatch(text)
        if match is None or not 1 <= int(match.group(3)) <= 12:
            raise BadRequest(f"{text[:80]!r} is not an invoice id (inv-YYYY-MM-<account>) or statement id (stm-YYYY-MM-<account>)",
                             code="invalid_invoice_id")  # fmt: skip
        return cls(match.group(1), int(match.group(2)), int(match.group(3)), match.group(4))

    def __str__(self) -> str:
        return f"{self.kind}-{self.year:04d}-{self.month:02d}-{self.account_id}"

    @property
    def start(self) -> datetime:
        return datetime(self.year, self.month, 1, tzinfo=UTC)

    @property
    def end(self) -> datetime:
        return datetime(self.year + self.month // 12, self.month % 12 + 1, 1, tzinfo=UTC)


async def _entries(session: AsyncSession, account: str, until: datetime) -> list[Any]:
    return list(
        (
            await session.execute(
                select(LedgerTransaction.created_at, LedgerTransaction.kind, LedgerTransaction.memo, LedgerTransaction.rental_id,
                       LedgerTransaction.key, LedgerEntry.amount)
                .join(LedgerEntry, LedgerEntry.transaction_id == LedgerTransaction.id)
                .where(LedgerEntry.account == account, LedgerTransaction.created_at < until)
                .order_by(LedgerTransaction.created_at, LedgerTransaction.id)
            )
        ).all()
    )  # fmt: skip


async def _owned(session: AsyncSession, principal: Principal, doc: DocumentId) -> Account:
    account = await session.get(Account, doc.account_id)
    if account is None or (principal.role != "admin" and principal.account_id != account.id):
        raise NotFound(f"no invoice or statement {doc}", code="invoice_not_found")
    wanted = "renter" if doc.kind == "inv" else "provider"
    if account.role != wanted:
        raise NotFound(f"no {'invoice' if doc.kind == 'inv' else 'statement'} {doc}: account {account.id} is a {account.role}",
                       code="invoice_not_found")  # fmt: skip
    return account


async def document(session: AsyncSession, principal: Principal, text: str) -> dict[str, Any]:
    """The invoice or statement ``text`` names, if the caller may read it (else 404, as for one that does not exist)."""
    doc = DocumentId.parse(text)
    account = await _owned(session, principal, doc)
    if doc.kind == "inv":
        return await _invoice(session, account, doc)
    return await _statement(session, account, doc)


async def _rentals(session: AsyncSession, ids: Sequence[str]) -> dict[str, Rental]:
    if not ids:
        return {}
    return {r.id: r for r in (await session.scalars(select(Rental).where(Rental.id.in_(list(ids))))).all()}


def _line(rental: Rental | None, rental_id: str) -> dict[str, Any]:
    return {
        "rental_id": rental_id,
        "gpu_model": rental.gpu_model if rental else None,
        "gpu_count": rental.gpu_count if rental else None,
        "gpu_milli": rental.gpu_milli if rental else None,
        "kind": rental.kind if rental else None,
        "price_per_gpu_hour": ledger.money(rental.price_per_gpu_hour) if rental and rental.price_per_gpu_hour is not None else None,
        "started_at": rental.started_at.isoformat() if rental and rental.started_at else None,
        "stopped_at": rental.stopped_at.isoformat() if rental and rental.stopped_at else None,
        "seconds_billed": rental.billed_seconds if rental else None,
        "postings": [],
        "total": Decimal(0),
    }


async def _invoice(session: AsyncSession, account: Account, doc: DocumentId) -> dict[str, Any]:
    rows = await _entries(session, ledger.renter_credit(account.id), doc.end)
    opening = -sum((r.amount for r in rows if r.created_at < doc.start), Decimal(0))  # credit balance before the month
    month = [r for r in rows if r.created_at >= doc.start]
    rentals = await _rentals(session, sorted({r.rental_id for r in month if r.rental_id}))
    lines: dict[str, dict[str, Any]] = {}
    payments, charged = [], Decimal(0)
    for row in month:
        if row.kind == "top_up":
            payments.append({"at": row.created_at.isoformat(), "amount": ledger.money(-row.amount), "posting": row.key})
            continue
        rental_id = row.rental_id or "-"
        line = lines.setdefault(rental_id, _line(rentals.get(rental_id), rental_id))
        line["postings"].append({"at": row.created_at.isoformat(), "kind": CHARGE_LABELS.get(row.kind, row.kind), "memo": row.memo,
                                 "amount": ledger.money(row.amount), "posting": row.key})  # fmt: skip
        line["total"] += row.amount
        charged += row.amount
    paid = -sum((r.amount for r in month if r.kind == "top_up"), Decimal(0))
    for line in lines.values():
        line["total"] = ledger.money(line["total"])
    return {
        "id": str(doc), "kind": "invoice", "account_id": account.id, "account_name": account.name, "currency": "USD",
        "period": {"start": doc.start.isoformat(), "end": doc.end.isoformat()},
        "opening_balance": ledger.money(opening), "payments": payments, "paid": ledger.money(paid),
        "lines": sorted(lines.values(), key=lambda line: line["rental_id"]), "total_charged": ledger.money(charged),
        "closing_balance": ledger.money(opening + paid - charged),
    }  # fmt: skip


async def _statement(session: AsyncSession, account: Account, doc: DocumentId) -> dict[str, Any]:
    rows = await _entries(session, ledger.provider_payable(account.id), doc.end)
    opening = -sum((r.amount for r in rows if r.created_at < doc.start), Decimal(0))
    month = [r for r in rows if r.created_at >= doc.start]
    rentals = await _rentals(session, sorted({r.rental_id for r in month if r.rental_id}))
    lines: dict[str, dict[str, Any]] = {}
    payouts, earned = [], Decimal(0)
    for row in month:
        if row.kind == "payout":
            payouts.append({"at": row.created_at.isoformat(), "amount": ledger.money(row.amount), "posting": row.key})
            continue
        rental_id = row.rental_id or "-"
        line = lines.setdefault(rental_id, _line(rentals.get(rental_id), rental_id))
        line["postings"].append({"at": row.created_at.isoformat(), "kind": CHARGE_LABELS.get(row.kind, row.kind), "memo": row.memo,
                                 "amount": ledger.money(-row.amount), "posting": row.key})  # fmt: skip
        line["total"] -= row.amount
        earned -= row.amount
    paid_out = sum((r.amount for r in month if r.kind == "payout"), Decimal(0))
    for line in lines.values():
        line["total"] = ledger.money(line["total"])
    return {
        "id": str(doc), "kind": "statement", "account_id": account.id, "account_name": account.name, "currency": "USD",
        "period": {"start": doc.start.isoformat(), "end": doc.end.isoformat()},
        "opening_payable": ledger.money(opening), "lines": sorted(lines.values(), key=lambda line: line["rental_id"]),
        "total_earned": ledger.money(earned), "payouts": payouts, "paid_out": ledger.money(paid_out),
        "closing_payable": ledger.money(opening + earned - paid_out),
    }  # fmt: skip


async def list_documents(session: AsyncSession, principal: Principal, *, account_id: str | None) -> list[dict[str, Any]]:
    """The months with postings on the caller's account (admins: ``account_id``'s), newest first."""
    target = account_id if principal.role == "admin" and account_id else principal.account_id
    account = await session.get(Account, target)
    if account is None:
        raise NotFound(f"no account {target!r}", code="account_not_found")
    if account.role not in ("renter", "provider"):
        return []
    code = ledger.renter_credit(account.id) if account.role == "renter" else ledger.provider_payable(account.id)
    stamps = (
        await session.scalars(
            select(LedgerTransaction.created_at).join(LedgerEntry, LedgerEntry.transaction_id == LedgerTransaction.id)
            .where(LedgerEntry.account == code).distinct()
        )
    ).all()  # fmt: skip
    months = sorted({(t.year, t.month) for t in stamps}, reverse=True)
    kind = "inv" if account.role == "renter" else "stm"
    return [{"id": str(DocumentId(kind, y, m, account.id)), "month": f"{y:04d}-{m:02d}",
             "kind": "invoice" if kind == "inv" else "statement"} for y, m in months]  # fmt: skip


def render_html(doc: dict[str, Any]) -> str:
    """A self-contained, printable page (inline CSS); every text from the data is escaped."""
    e = html.escape
    title = f"{'Invoice' if doc['kind'] == 'invoice' else 'Statement'} {doc['id']}"

    def usd(amount: str) -> str:
        return e(f"{Decimal(amount).quantize(Decimal('0.01')):,.2f} USD")

    rows = []
    for line in doc["lines"]:
        what = f"{line['gpu_count']} × {line['gpu_model']}" if line["gpu_model"] else "—"
        if line.get("gpu_milli") and line["gpu_milli"] < 1000:
            what += f" ({line['gpu_milli']}/1000 of a GPU)"
        rows.append(f"<tr class='rental'><td>{e(line['rental_id'])}</td><td>{e(what)}</td>"
                    f"<td>{e(line['price_per_gpu_hour'] or '')}</td><td>{e(str(line['seconds_billed'] or ''))}</td>"
                    f"<td class='num'>{usd(line['total'])}</td></tr>")  # fmt: skip
        for posting in line["postings"]:
            rows.append(f"<tr class='posting'><td></td><td colspan='3'>{e(posting['kind'])}: {e(posting['memo'])}</td>"
                        f"<td class='num'>{usd(posting['amount'])}</td></tr>")  # fmt: skip
    if doc["kind"] == "invoice":
        summary = [("Opening balance", doc["opening_balance"]), ("Payments", doc["paid"]), ("Charged", doc["total_charged"]),
                   ("Closing balance", doc["closing_balance"])]  # fmt: skip
    else:
        summary = [("Opening payable", doc["opening_payable"]), ("Earned", doc["total_earned"]), ("Paid out", doc["paid_out"]),
                   ("Closing payable", doc["closing_payable"])]  # fmt: skip
    totals = "".join(f"<tr><th>{e(label)}</th><td class='num'>{usd(value)}</td></tr>" for label, value in summary)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 2rem auto; max-width: 60rem; color: #111; }}
h1 {{ font-size: 1.4rem; }} table {{ border-collapse: collapse; width: 100%; margin: 1rem 0; }}
th, td {{ padding: .3rem .5rem; border-bottom: 1px solid #ddd; text-align: left; }}
td.num {{ text-align: right; font-variant-numeric: tabular-nums; }} tr.posting td {{ color: #555; font-size: .9em; }}
@media print {{ body {{ margin: 0; }} }}
</style></head>
<body>
<h1>{e(title)}</h1>
<p>{e(doc['account_name'])} ({e(doc['account_id'])}) · {e(doc['period']['start'][:10])} to {e(doc['period']['end'][:10])} (UTC) · gpumarket</p>
<table><thead><tr><th>Rental</th><th>GPUs</th><th>USD / GPU-hour</th><th>Seconds</th><th class="num">Amount</th></tr></thead>
<tbody>{''.join(rows) or "<tr><td colspan='5'>No rentals this month.</td></tr>"}</tbody></table>
<table class="totals">{totals}</table>
</body></html>
"""


async def month_total(session: AsyncSession, account: str, start: datetime, end: datetime) -> Decimal:
    """Σ of the account's entries in [start, end) — what an invoice's or statement's totals must agree with."""
    amounts = (
        await session.scalars(
            select(LedgerEntry.amount).join(LedgerTransaction, LedgerTransaction.id == LedgerEntry.transaction_id)
            .where(LedgerEntry.account == account, LedgerTransaction.created_at >= start, LedgerTransaction.created_at < end)
        )
    ).all()  # fmt: skip
    return sum(amounts, Decimal(0))


