"""Stripe Checkout: a top-up is a Checkout Session the renter pays on Stripe's page; its webhook credits it.

``StripePayments.start`` creates the session (one line item of the amount in cents, USD; the account
in ``client_reference_id`` and, with the top-up id, in ``metadata``; success and cancel URLs back to
the console's billing page) with the top-up id as Stripe's idempotency key, and returns its URL.
Nothing is credited then.

``paid_from_webhook`` reads ``POST /api/v1/payments/stripe/webhook``: the raw body's signature is
checked with ``stripe.Webhook.construct_event`` (HMAC-SHA256 of ``"{t}.{body}"`` with the endpoint's
secret, the timestamp at most ``tolerance`` seconds old); ``checkout.session.completed`` and
``checkout.session.async_payment_succeeded`` with ``payment_status`` ``paid`` are a payment, credited
under ``stripe:<session id>`` — so a replayed event, or the two events of one session, credit once.
"""

from __future__ import annotations

import logging
from decimal import Decimal
from typing import Any

import stripe

from billing.payments.base import Paid, PaymentFailed, Started, TopUp
from shared.errors import BadRequest, ValidationFailed

log = logging.getLogger(__name__)

CURRENCY = "usd"
PAID_EVENTS = frozenset({"checkout.session.completed", "checkout.session.async_payment_succeeded"})
SIGNATURE_TOLERANCE_S = 300  # Stripe's own default: a signed event older than this is refused (replay)


class StripePayments:
    """Stripe Checkout through the official ``stripe`` package (its aiohttp client: no thread, no blocking)."""

    name = "stripe"
    demo = False

    def __init__(self, secret_key: str, *, api_base: str | None = None, timeout: float = 20.0, max_network_retries: int = 2) -> None:
        self.http = stripe.AIOHTTPClient(timeout=timeout)
        self.client = stripe.StripeClient(
            secret_key, http_client=self.http, max_network_retries=max_network_retries,
            base_addresses={"api": api_base.rstrip("/")} if api_base else {},
        )  # fmt: skip

    async def close(self) -> None:
        await self.http.close_async()  # type: ignore[no-untyped-call]  # untyped in the package

    async def start(self, topup: TopUp) -> Started:
        """Create the Checkout Session. Cancelling it is safe: a retry sends the same idempotency key, so Stripe
        answers with the session it made (nothing is credited until the webhook says it was paid)."""
        cents = int(topup.amount * 100)
        metadata = {"account_id": topup.account_id, "topup_id": topup.id}
        params: dict[str, Any] = {
            "mode": "payment",
            "client_reference_id": topup.account_id,
            "metadata": metadata,
            "payment_intent_data": {"metadata": metadata},
            "line_items": [{
                "quantity": 1,
                "price_data": {"currency": CURRENCY, "unit_amount": cents,
                               "product_data": {"name": f"gpumarket credit for {topup.account_name}"}},
            }],
            "success_url": f"{topup.return_url}?credit=paid&topup={topup.id}",
            "cancel_url": f"{topup.return_url}?credit=cancelled&topup={topup.id}",
        }  # fmt: skip
        try:
            session = await self.client.v1.checkout.sessions.create_async(
                params,  # type: ignore[arg-type]  # a plain dict of the documented parameters
                options={"idempotency_key": f"gpumarket-{topup.id}"},
            )
        except stripe.IdempotencyError:
            raise ValidationFailed(
                "this Idempotency-Key was used for another amount; use a new key for a new top-up", code="idempotency_key_reused"
            ) from None
        except stripe.StripeError as exc:
            log.warning("stripe refused checkout session for top-up %s: %s", topup.id, exc)
            raise PaymentFailed(f"the payment provider could not start the payment ({exc.user_message or type(exc).__name__}); "
                                "nothing was charged, try again") from None  # fmt: skip
        if not session.url:
            raise PaymentFailed("the payment provider answered without a checkout page; nothing was charged, try again")
        return Started(checkout_url=session.url, payment_id=session.id)


def paid_from_webhook(payload: bytes, signature: str | None, secret: str, *, tolerance: int = SIGNATURE_TOLERANCE_S) -> Paid | None:
    """The payment a signed Stripe event reports, or ``None`` for an event that pays nothing (acknowledged, ignored).

    A missing or wrong signature, a stale timestamp or a body that is no event is 400 ``invalid_signature``
    / ``invalid_event``: Stripe retries it, and nothing is credited."""
    if not signature:
        raise BadRequest("missing Stripe-Signature header", code="invalid_signature")
    try:
        event = stripe.Webhook.construct_event(payload, signature, secret, tolerance=tolerance)
    except stripe.SignatureVerificationError as exc:
        raise BadRequest(f"the Stripe signature does not verify: {exc.user_message or exc}", code="invalid_signature") from None
    except ValueError:
        raise BadRequest("the body is not a Stripe event (JSON)", code="invalid_event") from None
    body = event.to_dict()
    if body.get("type") not in PAID_EVENTS:
        return None
    data = body.get("data")
    session = data.get("object") if isinstance(data, dict) else None
    if not isinstance(session, dict):
        raise BadRequest("the event carries no checkout session", code="invalid_event")
    if session.get("payment_status") != "paid":
        return None  # completed but not paid yet (a bank debit): async_payment_succeeded follows
    metadata: dict[str, Any] = session["metadata"] if isinstance(session.get("metadata"), dict) else {}
    account_id = session.get("client_reference_id") or metadata.get("account_id")
    amount_total, currency, session_id = session.get("amount_total"), session.get("currency"), session.get("id")
    if not account_id or not isinstance(session_id, str) or not isinstance(amount_total, int) or amount_total <= 0:
        raise BadRequest(f"checkout session {session_id!r} lacks its account, id or amount", code="invalid_event")
    if currency != CURRENCY:
        raise BadRequest(f"checkout session {session_id} is in {currency!r}; credit is in {CURRENCY}", code="invalid_event")
    return Paid(account_id=str(account_id), amount=Decimal(amount_total) / 100, reference=f"stripe:{session_id}",
                topup_id=metadata.get("topup_id"))  # fmt: skip
