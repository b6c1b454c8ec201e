"""Billing routes: prepaid credit top-ups and the ledger's trial balance (``billing/``).

A renter's balance and burn rate are on ``GET /account``.
"""

from __future__ import annotations

from decimal import Decimal

from aiohttp import web

from billing import credits, ledger, payouts
from master.api.base import PAGING, QueryParam, Route, listing, page, parse_body, str_query
from master.api.keys import MASTER
from master.api.middleware import principal
from master.api.schemas import CreditTopUp, SpendCapPut


async def post_credits(request: web.Request) -> web.Response:
    """An admin (or a payment integration acting as one) tops up a renter's prepaid credit."""
    who = principal(request)
    who.require("admin")
    body = await parse_body(request, CreditTopUp)
    master = request.app[MASTER]
    async with master.db.session() as session:
        posted, key = await credits.top_up(session, body.account_id, body.amount, reference=body.reference, at=master.clock.now())
    async with master.db.session() as session:
        balance = await ledger.balance(session, ledger.renter_credit(body.account_id))
    return web.json_response(
        {"account_id": body.account_id, "posting": key, "credited": posted, "balance": ledger.money(balance)},
        status=201 if posted else 200,
    )


async def put_spend_cap(request: web.Request) -> web.Response:
    """A renter caps what its rentals may charge per calendar month (null removes the cap)."""
    who = principal(request)
    who.require("renter")
    body = await parse_body(request, SpendCapPut)
    master = request.app[MASTER]
    async with master.db.session() as session:
        account = await credits.set_spend_cap(session, who.account_id, body.monthly_spend_cap)
        view = await credits.credit_view(session, account, burn_per_hour=Decimal(0), now=master.clock.now())
    return web.json_response({"monthly_spend_cap": view["monthly_spend_cap"], "spent_this_month": view["spent_this_month"]})


async def get_payouts(request: web.Request) -> web.Response:
    who = principal(request)
    who.require("provider")
    limit, offset = page(request)
    async with request.app[MASTER].db.session() as session:
        items, total = await payouts.list_payouts(session, who, provider_id=str_query(request, "provider_id"), limit=limit, offset=offset)
    return listing(items, total, limit, offset)


async def get_trial_balance(request: web.Request) -> web.Response:
    principal(request).require("admin")
    async with request.app[MASTER].db.session() as session:
        return web.json_response(await ledger.trial_balance(session))


ROUTES: tuple[Route, ...] = (
    Route("POST", "/account/credits", post_credits, "Top up a renter's prepaid credit (admins; the payment integration point).",
          roles=("admin",), body=CreditTopUp, success=201, also_success=(200,), errors=(404, 422)),
    Route("PUT", "/account/spend-cap", put_spend_cap, "Set your monthly spend cap (USD; null: none): rentals are refused or stopped before going past it.",
          roles=("renter",), body=SpendCapPut, errors=(422,)),
    Route("GET", "/payouts", get_payouts, "Payouts to providers, newest first: a provider's own; admins all or ?provider_id=.",
          roles=("provider",), query=(QueryParam("provider_id", "string", "Admins: one provider's payouts."), *PAGING)),
    Route("GET", "/admin/ledger/trial-balance", get_trial_balance, "Every ledger account's debits, credits and balance; balanced when they match.",
          roles=("admin",)),
)  # fmt: skip
