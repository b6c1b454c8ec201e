"""Billing routes: prepaid credit top-ups and the ledger's trial balance (``billing/``).

A renter's balance and burn rate are on ``GET /account``.
"""

from __future__ import annotations

from aiohttp import web

from billing import ledger, payouts
from billing import views as money
from master.api.base import PAGING, QueryParam, Route, listing, page, parse_body, str_query
from master.api.keys import MASTER
from master.api.middleware import principal
from master.api.schemas import CreditTopUp, SpendCapPut


async def post_credits(request: web.Request) -> web.Response:
    """An admin (or a payment integration acting as one) tops up a renter's prepaid credit."""
    body = await parse_body(request, CreditTopUp)
    view, posted = await money.top_up(request.app[MASTER], body.account_id, body.amount, reference=body.reference)
    return web.json_response(view, status=201 if posted else 200)


async def put_spend_cap(request: web.Request) -> web.Response:
    """A renter caps what its rentals may charge per calendar month (null removes the cap)."""
    body = await parse_body(request, SpendCapPut)
    return web.json_response(await money.set_spend_cap(request.app[MASTER], principal(request).account_id, body.monthly_spend_cap))


async def get_payouts(request: web.Request) -> web.Response:
    limit, offset = page(request)
    async with request.app[MASTER].db.session() as session:
        items, total = await payouts.list_payouts(session, principal(request), provider_id=str_query(request, "provider_id"), limit=limit, offset=offset)
    return listing(items, total, limit, offset)


async def get_trial_balance(request: web.Request) -> web.Response:
    async with request.app[MASTER].db.session() as session:
        return web.json_response(await ledger.trial_balance(session))


ROUTES: tuple[Route, ...] = (
    Route("POST", "/account/credits", post_credits, "Top up a renter's prepaid credit (admins; the payment integration point).",
          roles=("admin",), body=CreditTopUp, success=201, also_success=(200,), errors=(404, 422)),
    Route("PUT", "/account/spend-cap", put_spend_cap, "Set your monthly spend cap (USD; null: none): rentals are refused or stopped before going past it.",
          roles=("renter",), body=SpendCapPut, errors=(422,), scope="billing"),
    Route("GET", "/payouts", get_payouts, "Payouts to providers, newest first: a provider's own; admins all or ?provider_id=.",
          roles=("provider",), query=(QueryParam("provider_id", "string", "Admins: one provider's payouts."), *PAGING), scope="billing"),
    Route("GET", "/admin/ledger/trial-balance", get_trial_balance, "Every ledger account's debits, credits and balance; balanced when they match.",
          roles=("admin",)),
)  # fmt: skip
