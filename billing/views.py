"""What the API shows with money in it: the master's objects joined with the ledger.

An account with its quota, credit and (providers) earnings; hosts with what they earned;
rentals with their price per hour and what they have charged; a credit top-up with the new
balance; a spend cap with what this month has spent. Each function is what one handler of
``master/api`` calls: it opens its own transaction(s) and returns the JSON-ready view.

Imports ``billing``'s own modules, ``master.services``, ``master.models`` and ``master.context``;
never ``master.api``.
"""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from billing import credits, ledger, rating, summaries
from billing import volumes as volume_billing
from master.context import Master
from master.models import Account, Rental, RentalEvent, Volume
from master.services import hosts, rentals
from master.services import queue as rental_queue
from master.services.accounts import Principal
from master.services.rentals import RentalRequest, quota_view

# ---- the account -----------------------------------------------------------------------------


async def account_view(master: Master, who: Principal) -> dict[str, Any]:
    """The calling account with its quotas (and what it uses of them), its credit, and (not renters) its earnings. In a
    team's context, the team's (``kind`` team), with the caller's ``person_id`` and ``team_role``."""
    async with master.db.session() as session:
        account = await session.get(Account, who.account_id)
        assert account is not None
        storage = await summaries.storage_per_hour(session, account.id)  # volumes cost too (billing/volumes.py)
        view = {
            "id": account.id, "name": account.name, "role": account.role, "created_at": account.created_at.isoformat(),
            "kind": account.kind, "person_id": who.person_id, "team_role": who.team_role,
            "quota": (quota := await quota_view(master, session, account)),
            "fair_share_weight": account.fair_share_weight,
            "credit": await credits.credit_view(session, account, burn_per_hour=Decimal(quota["spend_per_hour"]) + storage,
                                                now=master.clock.now()) | {"storage_per_hour": ledger.money(storage)},
        }  # fmt: skip
        if account.role != "renter":
            view["earnings"] = await summaries.provider_earnings(session, account.id)
        return view


async def top_up(master: Master, account_id: str, amount: str | int, *, reference: str) -> tuple[dict[str, Any], bool]:
    """Credit a renter's prepaid account once per ``reference``; the posting and the new balance, and whether it was credited now."""
    async with master.db.session() as session:
        posted, key = await credits.top_up(session, account_id, amount, reference=reference, at=master.clock.now())
    async with master.db.session() as session:
        balance = await ledger.balance(session, ledger.renter_credit(account_id))
    return {"account_id": account_id, "posting": key, "credited": posted, "balance": ledger.money(balance)}, posted


async def set_spend_cap(master: Master, account_id: str, cap: str | int | None) -> dict[str, Any]:
    """Cap what the renter's rentals may charge per calendar month (``None``: no cap); the cap and this month's spend."""
    async with master.db.session() as session:
        account = await credits.set_spend_cap(session, account_id, cap)
        view = await credits.credit_view(session, account, burn_per_hour=Decimal(0), now=master.clock.now())
    return {"monthly_spend_cap": view["monthly_spend_cap"], "spent_this_month": view["spent_this_month"]}


async def volume_money(session: AsyncSession, rows: Sequence[Volume]) -> dict[str, dict[str, str]]:
    """Per volume id, its ``price_per_hour`` (its whole size) and what its storage has ``charged`` so far: what a
    volume's view shows beside its state (``GET /volumes``)."""
    charged = await summaries.charged_by_volume(session, [v.id for v in rows])
    return {v.id: {"price_per_hour": ledger.money(ledger.quantize(volume_billing.per_hour(v))),
                   "charged": ledger.money(charged.get(v.id, Decimal(0)))} for v in rows}  # fmt: skip


# ---- hosts -----------------------------------------------------------------------------------


async def _with_earnings(session: AsyncSession, who: Principal, views: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each host's earnings for its provider (and admins); renters see null."""
    earned = await summaries.earned_by_host(session, [v["id"] for v in views]) if who.role != "renter" else {}
    for view in views:
        view["earned"] = ledger.money(earned.get(view["id"], Decimal(0))) if who.role != "renter" else None
    return views


async def host_page(master: Master, who: Principal, *, limit: int, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Hosts the caller can see, with their earnings; and how many there are."""
    async with master.db.session() as session:
        items, total = await hosts.list_hosts(session, who, limit=limit, offset=offset, now=master.clock.now())
        return await _with_earnings(session, who, items), total


async def host_detail(master: Master, who: Principal, host_id: str) -> dict[str, Any]:
    """One host the caller can see, with its earnings."""
    async with master.db.session() as session:
        view = await hosts.get_host(session, who, host_id, now=master.clock.now())
        return (await _with_earnings(session, who, [view]))[0]


# ---- rentals ---------------------------------------------------------------------------------


async def rental_views(
    session: AsyncSession, rows: Sequence[Rental], events: Sequence[RentalEvent] | None = None
) -> list[dict[str, Any]]:
    """Rental views with their money: what the whole rental costs per hour and what it has charged so far."""
    charged = await summaries.charged_by_rental(session, [r.id for r in rows])
    standing = await rental_queue.queue_standing(session, rows)
    views = []
    for rental in rows:
        view = rentals.rental_view(rental, events)
        view["queue"] = standing.get(rental.id)  # queued: position, length and what happens next
        view["price_per_hour"] = ledger.money(rating.per_hour(rental)) if rental.price_per_gpu_hour is not None else None
        view["charged"] = ledger.money(charged.get(rental.id, Decimal(0)))
        view["cluster_id"], view["node_rank"] = rental.cluster_id, rental.node_rank  # a cluster's member: one line each, grouped
        views.append(view)
    return views


async def _view_of(master: Master, rental: Rental) -> dict[str, Any]:
    async with master.db.session() as session:
        return (await rental_views(session, [rental]))[0]


async def rental_page(master: Master, who: Principal, *, limit: int, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The caller's rentals (admins: all), newest first, with their money; and how many there are."""
    async with master.db.session() as session:
        rows, total = await rentals.list_rentals(session, who, limit=limit, offset=offset)
        return await rental_views(session, rows), total


async def rental_detail(master: Master, who: Principal, rental_id: str) -> dict[str, Any]:
    """One of the caller's rentals with its state history and its money."""
    async with master.db.session() as session:
        rental = await rentals.get_rental(session, who, rental_id)
        events = await rentals.rental_events(session, rental.id)
        return (await rental_views(session, [rental], events))[0]


async def create_rental(
    master: Master, who: Principal, request: RentalRequest, *, idempotency_key: str | None
) -> tuple[dict[str, Any], bool]:
    """Rent (``rentals.create_rental``); the rental's view and whether it was created now (not a repeat of the key)."""
    rental, created = await rentals.create_rental(master, who, request, idempotency_key=idempotency_key)
    return await _view_of(master, rental), created


async def stop_rental(master: Master, who: Principal, rental_id: str) -> dict[str, Any]:
    """Ask for the rental to stop (``rentals.stop_rental``); its view."""
    rental = await rentals.stop_rental(master, who, rental_id)
    return await _view_of(master, rental)
