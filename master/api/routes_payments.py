"""Self-serve credit: a renter's top-up through the payment provider, and Stripe's webhook (``billing/payments``).

``POST /account/credit`` hands the top-up to the provider ``MasterSettings.payments`` names (demo:
credited now; Stripe: a Checkout URL). ``POST /payments/stripe/webhook`` is public — Stripe signs its
body instead — and reads the raw body, since the signature is over its exact bytes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from billing.payments import base as payments
from billing.payments.base import PaymentProvider
from billing.payments.select import provider_for
from billing.payments.stripe import paid_from_webhook
from master.api.base import Route, parse_body
from master.api.keys import MASTER
from master.api.middleware import principal
from master.api.schemas import Cents
from shared.errors import NotFound


class CreditAdd(BaseModel):
    model_config = ConfigDict(extra="forbid")

    amount: Cents = Field(description='USD to add, whole cents as a string, e.g. "25.00" (within the marketplace\'s top-up bounds).')


@dataclass
class Payments:
    provider: PaymentProvider | None  # None: payments are off


PAYMENTS = web.AppKey("payments", Payments)


async def payments_ctx(app: web.Application) -> AsyncIterator[None]:
    """The payment provider of the settings, opened with the app and closed after it."""
    provider = provider_for(app[MASTER].settings)
    app[PAYMENTS] = Payments(provider)
    yield
    if provider is not None:
        await provider.close()


def _billing_page(request: web.Request) -> str:
    base = request.app[MASTER].settings.public_url or f"{request.scheme}://{request.host}"
    return f"{base.rstrip('/')}/#/billing"


async def post_credit(request: web.Request) -> web.Response:
    """A renter adds credit: 201 with the new balance (demo) or the checkout URL (Stripe); 200 for a repeated Idempotency-Key."""
    body = await parse_body(request, CreditAdd)
    view, created = await payments.add_credit(
        request.app[MASTER], request.app[PAYMENTS].provider, principal(request).account_id, body.amount,
        idempotency_key=request.headers.get("Idempotency-Key"), return_url=_billing_page(request),
    )  # fmt: skip
    return web.json_response(view, status=201 if created else 200)


async def post_stripe_webhook(request: web.Request) -> web.Response:
    """Stripe's notification: a verified, paid checkout session is credited once (a replay: ``credited`` false)."""
    settings = request.app[MASTER].settings
    if settings.payments != "stripe" or settings.stripe_webhook_secret is None:
        raise NotFound("this marketplace does not take Stripe payments", code="stripe_not_configured")
    paid = paid_from_webhook(await request.read(), request.headers.get("Stripe-Signature"),
                             settings.stripe_webhook_secret.get_secret_value())  # fmt: skip
    if paid is None:
        return web.json_response({"received": True, "credited": False, "posting": None})
    posted, key = await payments.credit_paid(request.app[MASTER], paid)
    return web.json_response({"received": True, "credited": posted, "posting": key})


ROUTES: tuple[Route, ...] = (
    Route("POST", "/account/credit", post_credit, "Add prepaid credit yourself through the payment provider: demo credits at once "
          "(no card charged), Stripe answers a checkout_url to pay at (credited by its webhook). 200: a repeated Idempotency-Key.",
          roles=("renter",), body=CreditAdd, success=201, also_success=(200,), headers=("Idempotency-Key",), errors=(409, 422, 502), scope="billing"),
    Route("POST", "/payments/stripe/webhook", post_stripe_webhook, "Stripe's webhook (signed with Stripe-Signature; no API key): "
          "a paid checkout session is credited once.", public=True, headers=("Stripe-Signature",), errors=(404, 422)),
)  # fmt: skip
