"""Storage on invoices and statements: a line per volume with postings in the month (billing/invoices.py).

A volume's storage postings (kind ``storage``, ``ledger_transactions.volume_id``) are summed per volume in the
database, in integer millionths as every other figure of a document (exact on SQLite too), with the fee legs of the
same postings for a statement. A line says which volume (id, name, its host), its size in GiB, its price per
GiB-hour, the hours of it billed in the month (``seconds`` / 3600: its postings are contiguous, each from the last
one's end, so the month's are the span from the first's start to the last's end, the deletion at most) and the
amount. Every amount is a sum of ledger entries, so the document's totals agree with the ledger by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import and_, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from billing import ledger
from billing.ledger import from_micros, micros_sum
from billing.volumes import STORAGE
from master.models import LedgerEntry, LedgerTransaction, Volume

HOUR_PLACES = Decimal("0.000001")


@dataclass(frozen=True)
class StorageMonth:
    """The month's storage lines of one account, and their sums (as the owner reads them)."""

    lines: list[dict[str, Any]]
    amount: Decimal  # invoice: charged; statement: earned
    fee: Decimal  # statement: the platform's fee on the same postings (0 on invoices)


def _seconds(volume: Volume, start: datetime | None, end: datetime | None) -> int:
    if volume.ready_at is None or start is None or end is None:
        return 0
    if volume.deleted_at is not None:
        end = min(end, volume.deleted_at)  # a correction's period runs back from a pass past the deletion
    kept = [max(0, int((moment - volume.ready_at).total_seconds())) for moment in (start, end)]
    return max(0, kept[1] - kept[0])


async def storage_month(
    session: AsyncSession, account: str, start: datetime, end: datetime, *, statement: bool
) -> StorageMonth:
    """The storage lines of ``account`` (a renter's credit, or a provider's payable when ``statement``) posted in
    ``[start, end)`` (a month)."""
    fee = aliased(LedgerEntry)
    rows = (
        await session.execute(
            select(LedgerTransaction.volume_id, func.count(LedgerTransaction.id), micros_sum(LedgerEntry.amount),
                   micros_sum(fee.amount), func.min(LedgerTransaction.period_start), func.max(LedgerTransaction.period_end))
            .select_from(LedgerTransaction)
            .join(LedgerEntry, LedgerEntry.transaction_id == LedgerTransaction.id)
            .outerjoin(fee, and_(fee.transaction_id == LedgerTransaction.id, fee.account == ledger.FEES))
            .where(LedgerEntry.account == account, LedgerTransaction.kind == STORAGE,
                   LedgerTransaction.created_at >= start, LedgerTransaction.created_at < end)
            .group_by(LedgerTransaction.volume_id)
        )
    ).all()  # fmt: skip
    ids = [row[0] for row in rows if row[0] is not None]
    volumes = (
        {v.id: v for v in (await session.scalars(select(Volume).where(Volume.id.in_(ids)))).all()}
        if ids
        else {}
    )
    sign = (
        -1 if statement else 1
    )  # a charge debits the renter's credit; an earning credits the provider's payable
    lines: list[dict[str, Any]] = []
    total = fees = Decimal(0)
    for volume_id, postings, amount, fee_amount, first, last in rows:
        volume = volumes.get(volume_id)
        value, taken = sign * from_micros(amount), -from_micros(fee_amount)
        seconds = _seconds(volume, first, last) if volume is not None else 0
        line: dict[str, Any] = {
            "volume_id": volume_id, "name": volume.name if volume else None, "host_id": volume.host_id if volume else None,
            "size_gib": volume.size_gib if volume else None, "state": volume.state if volume else None,
            "price_per_gib_hour": ledger.money(volume.price_per_gib_hour) if volume else None,
            "from": first.isoformat() if first else None, "to": last.isoformat() if last else None,
            "seconds": seconds, "hours": f"{(Decimal(seconds) / 3600).quantize(HOUR_PLACES):f}", "postings": int(postings),
        }  # fmt: skip
        if statement:
            line |= {
                "charged": ledger.money(value + taken),
                "platform_fee": ledger.money(taken),
                "earned": ledger.money(value),
            }
        else:
            line["amount"] = ledger.money(value)
        lines.append(line)
        total, fees = total + value, fees + taken
    lines.sort(key=lambda line: (line["from"] or "", line["volume_id"] or ""))
    return StorageMonth(lines, total, fees if statement else Decimal(0))


def storage_view(read: StorageMonth, *, statement: bool) -> dict[str, Any]:
    """The document's ``storage``: its lines and their sums."""
    if statement:
        return {"lines": read.lines, "charged": ledger.money(read.amount + read.fee), "platform_fee": ledger.money(read.fee),
                "earned": ledger.money(read.amount)}  # fmt: skip
    return {"lines": read.lines, "total": ledger.money(read.amount)}


def storage_rows(doc: dict[str, Any], cents: Any) -> tuple[tuple[str, ...], list[list[str]]]:
    """The printable page's storage table: its heads and its rows' cells (amounts through ``cents``)."""
    statement = doc["kind"] == "statement"
    head = (
        "Volume",
        "GiB",
        "USD / GiB-hour",
        "Hours",
        *(("Charged to renter", "Platform fee", "Earned") if statement else ("Amount",)),
    )
    rows = []
    for line in doc["storage"]["lines"]:
        label = f"{line['name']} ({line['volume_id']})" if line["name"] else str(line["volume_id"])
        amounts = [line["charged"], line["platform_fee"], line["earned"]] if statement else [line["amount"]]
        rows.append(
            [
                label,
                str(line["size_gib"] or ""),
                line["price_per_gib_hour"] or "",
                line["hours"],
                *(cents(a) for a in amounts),
            ]
        )
    return head, rows
