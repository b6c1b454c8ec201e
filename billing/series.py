"""Money over time for the console's charts: a renter's spend, a provider's earnings, the marketplace's GMV.

Read-only, computed from the ledger each time like the invoices (``billing/invoices.py``), with
the same rule for *when*: a posting counts on the UTC day of its ``created_at`` (when it was
made), so usage served at 23:59:50 and rated at 00:00:20 is the next day's, and a rental rated
on both sides of midnight is split between the two days — together its whole cost, exactly.

A window of ``days`` days ends with today (UTC): ``[today − (days − 1), tomorrow)``; every day in
it is listed, with zero where nothing was posted. Sums run in SQL over integer millionths
(``billing.ledger.micros_sum``), exact on PostgreSQL and SQLite, grouped by day and rental.

* **spend** (a renter): what the renter's credit was charged — every posting on
  ``renter:<id>:credit`` but top-ups (usage, minimum periods, downtime credits as negative
  amounts, corrections) — per day and per rental.
* **earnings** (a provider): what the provider's payable was credited — every posting but
  payouts — per day and per host (the rental's host).
* **GMV** (admins): what all renters were charged per day, and the platform's fee of it.

``marketplace`` adds the fleet's occupancy and hosts online (``master.services.platform.fleet``)
to the GMV. This module reads the ledger and the models; it must not import ``master.api``.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from billing import ledger
from billing.ledger import from_micros, micros_sum
from master.models import Host, LedgerEntry, LedgerTransaction, Rental
from master.services import platform
from master.services.platform import Window

MAX_DAYS = platform.MAX_DAYS
ZERO = Decimal(0)


def utc_day(column: Any, dialect: str) -> ColumnElement[str]:
    """``YYYY-MM-DD`` of a UTC timestamp column, in SQL.

    PostgreSQL keeps ``timestamptz``: its day is taken in UTC whatever the session's time zone.
    SQLite keeps the UTC time as text (``models.UTCDateTime`` converts to UTC before binding),
    whose first ten characters are the day.
    """
    if dialect == "postgresql":
        return func.to_char(func.timezone("UTC", column), "YYYY-MM-DD")
    return func.substr(column, 1, 10)


async def _by_day_and_rental(
    session: AsyncSession, window: Window, *, account: Any, excluded_kind: str, fee_leg: bool = False
) -> list[tuple[str, str | None, Decimal]]:
    """(day, rental id, Σ amount) of the entries on ``account`` (a code, or a condition) in the window."""
    day = utc_day(LedgerTransaction.created_at, session.get_bind().dialect.name)
    where = LedgerEntry.account == account if isinstance(account, str) else account
    query = (
        select(day, LedgerTransaction.rental_id, micros_sum(LedgerEntry.amount))
        .select_from(LedgerTransaction)
        .join(LedgerEntry, LedgerEntry.transaction_id == LedgerTransaction.id)
        .where(where, LedgerTransaction.kind != excluded_kind)
        .where(LedgerTransaction.created_at >= window.start, LedgerTransaction.created_at < window.end)
        .group_by(day, LedgerTransaction.rental_id)
    )
    return [
        (str(d), rental_id, from_micros(micros))
        for d, rental_id, micros in (await session.execute(query)).all()
    ]


def _daily(window: Window, rows: list[tuple[str, Any, Decimal]], sign: int) -> dict[str, Decimal]:
    totals = dict.fromkeys(window.labels(), ZERO)
    for day, _, amount in rows:
        totals[day] = totals.get(day, ZERO) + sign * amount
    return totals


def _points(totals: dict[str, Decimal]) -> list[dict[str, str]]:
    return [{"day": day, "amount": ledger.money(amount)} for day, amount in totals.items()]


def _frame(window: Window) -> dict[str, Any]:
    return {"from": window.start.isoformat(), "to": window.end.isoformat(), "currency": "USD"}


async def spend(session: AsyncSession, account_id: str, *, days: int, now: datetime) -> dict[str, Any]:
    """The renter's charges per UTC day and per rental over the last ``days`` days (amounts as strings)."""
    window = Window.ending(now, days)
    rows = await _by_day_and_rental(
        session, window, account=ledger.renter_credit(account_id), excluded_kind="top_up"
    )
    per_rental: dict[str | None, Decimal] = {}
    for _, rental_id, amount in rows:
        per_rental[rental_id] = per_rental.get(rental_id, ZERO) + amount
    facts = {
        row.id: row
        for row in (
            await session.execute(
                select(Rental.id, Rental.gpu_model, Rental.gpu_count, Rental.gpu_milli, Rental.started_at, Rental.stopped_at)
                .where(Rental.id.in_([r for r in per_rental if r is not None]))
            )
        ).all()
    }  # fmt: skip
    rentals = []
    for rental_id, amount in sorted(per_rental.items(), key=lambda item: (-item[1], item[0] or "")):
        fact = facts.get(rental_id) if rental_id else None
        rentals.append({
            "rental_id": rental_id,
            "gpu_model": fact.gpu_model if fact else None,
            "gpu_count": fact.gpu_count if fact else None,
            "gpu_milli": fact.gpu_milli if fact else None,
            "started_at": fact.started_at.isoformat() if fact and fact.started_at else None,
            "stopped_at": fact.stopped_at.isoformat() if fact and fact.stopped_at else None,
            "amount": ledger.money(amount),
        })  # fmt: skip
    daily = _daily(window, rows, +1)
    return {
        **_frame(window),
        "days": _points(daily),
        "rentals": rentals,
        "total": ledger.money(sum(daily.values(), ZERO)),
    }


async def earnings(session: AsyncSession, account_id: str, *, days: int, now: datetime) -> dict[str, Any]:
    """The provider's earnings per UTC day, in total and per host, over the last ``days`` days."""
    window = Window.ending(now, days)
    rows = await _by_day_and_rental(
        session, window, account=ledger.provider_payable(account_id), excluded_kind="payout"
    )
    rental_ids = {rental_id for _, rental_id, _ in rows if rental_id is not None}
    host_of: dict[str, str | None] = {}
    names: dict[str, str] = {}
    if rental_ids:
        for rental_id, host_id, name in (
            await session.execute(
                select(Rental.id, Rental.host_id, Host.name)
                .outerjoin(Host, Host.id == Rental.host_id)
                .where(Rental.id.in_(rental_ids))
            )
        ).all():
            host_of[rental_id] = host_id
            if host_id:
                names[host_id] = name or host_id
    labels = window.labels()
    per_host: dict[str | None, dict[str, Decimal]] = {}
    for day, of_rental, amount in rows:
        of_host = per_host.setdefault(
            host_of.get(of_rental) if of_rental else None, dict.fromkeys(labels, ZERO)
        )
        of_host[day] = of_host.get(day, ZERO) - amount
    hosts: list[dict[str, Any]] = [
        {"host_id": host_id, "name": names.get(host_id, host_id) if host_id else None,
         "amount": ledger.money(sum(series.values(), ZERO)), "days": _points(series)}
        for host_id, series in per_host.items()
    ]  # fmt: skip
    hosts.sort(key=lambda one: (-Decimal(str(one["amount"])), str(one["host_id"] or "")))
    daily = _daily(window, rows, -1)
    return {
        **_frame(window),
        "days": _points(daily),
        "hosts": hosts,
        "total": ledger.money(sum(daily.values(), ZERO)),
    }


async def gmv(session: AsyncSession, *, days: int, now: datetime) -> dict[str, Any]:
    """Per UTC day: what renters were charged (GMV, top-ups excluded) and the platform's fees from it."""
    window = Window.ending(now, days)
    charged = await _by_day_and_rental(
        session, window, account=LedgerEntry.account.like("renter:%"), excluded_kind="top_up"
    )
    fees = await _by_day_and_rental(session, window, account=ledger.FEES, excluded_kind="payout")
    gmv_daily, fee_daily = _daily(window, charged, +1), _daily(window, fees, -1)
    return {
        **_frame(window),
        "days": [
            {"day": day, "gmv": ledger.money(gmv_daily[day]), "fees": ledger.money(fee_daily[day])}
            for day in window.labels()
        ],
        "total_gmv": ledger.money(sum(gmv_daily.values(), ZERO)),
        "total_fees": ledger.money(sum(fee_daily.values(), ZERO)),
    }


async def marketplace(session: AsyncSession, *, days: int, now: datetime) -> dict[str, Any]:
    """The admin's view per UTC day: GMV and fees (the ledger), GPU occupancy and hosts online (the fleet)."""
    window = Window.ending(now, days)
    money = await gmv(session, days=days, now=now)
    occupancy = await platform.fleet_occupancy(session, window)
    online = await platform.hosts_online(session, window)
    for point, share, (mean, most) in zip(money["days"], occupancy, online, strict=True):
        point["occupancy"] = share
        point["hosts_online"] = mean
        point["hosts_online_max"] = most
    return money
