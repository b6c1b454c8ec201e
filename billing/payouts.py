"""Provider payouts: batched on a schedule, above a minimum, posted to the ledger, exported.

A payout pass (every ``payout_interval``) takes every provider whose payable balance is at
least ``payout_minimum``, pays out the balance rounded down to the cent (the rest stays
payable), and posts it: debit ``provider:<id>:payable``, credit ``platform:cash``. The batch
is the pass's slot on the schedule (``floor(now / payout_interval)``), and the ledger key
``payout:<provider>:<batch>`` makes a repeated or concurrent pass in the same slot pay nothing
twice. The payouts are then handed to the ``PayoutProvider`` — the bank integration point;
here ``CsvPayoutExporter`` writes one CSV file per batch for an operator to upload — and
marked ``exported`` with where they went.
"""

from __future__ import annotations

import csv
import io
import logging
from collections.abc import Sequence
from datetime import datetime
from decimal import ROUND_DOWN
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from billing import ledger
from billing.ledger import Leg
from master.db import Database
from master.models import Account, LedgerAccount, Payout
from master.services.accounts import Principal
from shared.files import atomic_write
from shared.ids import new_id
from shared.settings import MasterSettings

log = logging.getLogger(__name__)


class PayoutProvider(Protocol):
    """Sends a batch of payouts to the bank (or wherever); returns a reference to what it did."""

    def export(self, batch: str, payouts: Sequence[Payout], names: dict[str, str]) -> str: ...


class CsvPayoutExporter:
    """Writes ``payouts-<batch>.csv`` (payout id, provider id and name, amount, currency) into a folder."""

    FIELDS = ("payout_id", "provider_id", "provider_name", "amount", "currency", "created_at")

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def export(self, batch: str, payouts: Sequence[Payout], names: dict[str, str]) -> str:
        self.folder.mkdir(parents=True, exist_ok=True)
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(self.FIELDS)
        for payout in sorted(payouts, key=lambda p: p.id):
            writer.writerow((payout.id, payout.provider_id, names.get(payout.provider_id, ""), f"{payout.amount:.2f}",
                             payout.currency, payout.created_at.isoformat()))  # fmt: skip
        path = self.folder / f"payouts-{batch}.csv"
        atomic_write(path, buffer.getvalue().encode(), mode=0o600)
        return str(path)


def batch_of(now: datetime, interval_s: float) -> str:
    return str(int(now.timestamp() // interval_s))


async def payout_pass(db: Database, settings: MasterSettings, now: datetime, *, exporter: PayoutProvider | None = None) -> dict[str, Any]:
    """Pay every provider at or above the minimum; export this batch's payouts not exported yet."""
    batch = batch_of(now, settings.payout_interval)
    minimum = settings.payout_minimum
    async with db.session() as session:
        providers = (await session.scalars(select(LedgerAccount.owner_id).where(LedgerAccount.code.like("provider:%:payable")))).all()
    paid = []
    for provider_id in providers:
        if provider_id is None:
            continue
        async with db.session() as session:
            code = ledger.provider_payable(provider_id)
            amount = (await ledger.balance(session, code)).quantize(ledger.CURRENCY_QUANTUM, rounding=ROUND_DOWN)
            if amount < minimum or amount <= 0:
                continue
            key = f"payout:{provider_id}:{batch}"
            posted = await ledger.post(
                session, key=key, kind="payout", at=now, memo=f"payout of {amount:f} USD (batch {batch})",
                legs=[Leg(code, amount), Leg(ledger.CASH, -amount)],
            )  # fmt: skip
            if posted:
                payout = Payout(id=new_id("po"), provider_id=provider_id, amount=amount, batch=batch, ledger_key=key, created_at=now)
                session.add(payout)
                paid.append(payout.id)
    exported = await export_batch(db, settings, batch, now=now, exporter=exporter)
    if paid:
        log.info("payout batch %s: %d payouts", batch, len(paid))
    return {"batch": batch, "paid": paid, "exported": exported}


async def export_batch(db: Database, settings: MasterSettings, batch: str, *, now: datetime, exporter: PayoutProvider | None) -> str | None:
    """Hand the batch's pending payouts to the payout provider (the CSV exporter by default) and mark them exported."""
    exporter = exporter or CsvPayoutExporter(settings.payout_dir or settings.data_dir / "payouts")
    async with db.session() as session:
        pending = list((await session.scalars(select(Payout).where(Payout.batch == batch, Payout.state == "pending").with_for_update())).all())
        if not pending:
            return None
        everyone = list((await session.scalars(select(Payout).where(Payout.batch == batch))).all())
        rows = await session.execute(select(Account.id, Account.name).where(Account.id.in_([p.provider_id for p in everyone])))
        names = {account_id: name for account_id, name in rows.all()}
        reference = exporter.export(batch, everyone, names)  # the whole batch: a re-export replaces the file
        for payout in pending:
            payout.state, payout.export_ref, payout.exported_at = "exported", reference, now
    return reference


async def list_payouts(session: AsyncSession, principal: Principal, *, provider_id: str | None, limit: int, offset: int) -> tuple[list[dict[str, Any]], int]:
    query = select(Payout)
    if principal.role != "admin":
        query = query.where(Payout.provider_id == principal.account_id)
    if provider_id is not None:  # narrows, never widens: a provider naming another provider finds none
        query = query.where(Payout.provider_id == provider_id)
    total = int(await session.scalar(select(func.count()).select_from(query.subquery())) or 0)
    rows = (await session.scalars(query.order_by(Payout.created_at.desc(), Payout.id).limit(limit).offset(offset))).all()
    return [payout_view(p) for p in rows], total


def payout_view(payout: Payout) -> dict[str, Any]:
    return {
        "id": payout.id, "provider_id": payout.provider_id, "amount": f"{payout.amount:.2f}", "currency": payout.currency,
        "batch": payout.batch, "state": payout.state, "created_at": payout.created_at.isoformat(),
        "exported_at": payout.exported_at.isoformat() if payout.exported_at else None,
    }  # fmt: skip
