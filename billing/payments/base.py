"""The payment-provider seam and the top-up flow every provider shares.

A top-up request (``add_credit``) is checked (a renter; an amount of the strict grammar, whole cents,
within ``topup_minimum``..``topup_maximum``), given an id — derived from the caller's Idempotency-Key,
so a retried request is the same top-up — and handed to the provider. A provider that has been paid at
once (the demo) returns the payment's reference and the top-up is credited now; one that needs the
renter at a checkout page (Stripe) returns its URL, and is credited later by ``credit_paid`` from its
webhook. Credit is posted only by ``billing.credits.top_up`` with ``<provider>:<payment id>`` as its
reference, so whatever is notified twice is credited once.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Protocol

from billing import credits, ledger
from master.context import Master
from master.models import Account
from shared.errors import ClientError, Conflict, NotFound, ValidationFailed

MAX_IDEMPOTENCY_KEY = 255


class PaymentFailed(ClientError):
    """The payment provider refused or could not be reached: nothing was charged or credited; try again."""

    code = "payment_provider_error"
    http_status = 502


@dataclass(frozen=True)
class TopUp:
    """One renter's request to add ``amount`` USD, as the provider sees it."""

    id: str  # tu_<hex>: the same Idempotency-Key of the same account is the same top-up
    account_id: str
    account_name: str
    amount: Decimal  # whole cents, within the bounds
    return_url: str  # the console's billing page; a checkout sends the renter back here


@dataclass(frozen=True)
class Started:
    """What a provider made of a top-up: paid now (``paid_reference``), or a page to pay at (``checkout_url``)."""

    paid_reference: str | None = None  # "demo:tu_…": credit now under this reference
    checkout_url: str | None = None  # send the renter here; the webhook credits later
    payment_id: str | None = None  # the provider's id of the checkout (Stripe: cs_…)


class PaymentProvider(Protocol):
    name: str  # "demo" | "stripe": in the API's answer
    demo: bool  # no real money moves (the API and the console say so)

    async def start(self, topup: TopUp) -> Started:
        """Begin taking the payment; raises ``PaymentFailed`` when the provider refuses (nothing is credited)."""

    async def close(self) -> None:
        """Release its connections (the app's shutdown)."""


@dataclass(frozen=True)
class Paid:
    """A provider's confirmed payment, read from its signed notification: credit ``amount`` once per ``reference``."""

    account_id: str
    amount: Decimal
    reference: str  # "stripe:cs_…": one checkout session is credited once however often it is notified
    topup_id: str | None = None


def topup_id(account_id: str, idempotency_key: str | None) -> str:
    """``tu_`` + 24 hex digits: a hash of the account and the key (a retry is the same top-up), else random."""
    if idempotency_key is None:
        return f"tu_{secrets.token_hex(12)}"
    if not 1 <= len(idempotency_key) <= MAX_IDEMPOTENCY_KEY:
        raise ValidationFailed(f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} characters", code="invalid_idempotency_key")
    digest = hashlib.sha256(f"{account_id}\0{idempotency_key}".encode()).hexdigest()
    return f"tu_{digest[:24]}"


def topup_amount(raw: object, *, minimum: Decimal, maximum: Decimal) -> Decimal:
    """A top-up amount: the strict grammar, whole cents, within the bounds (422 ``invalid_amount`` otherwise)."""
    value = ledger.cents(raw, what="amount")
    if not minimum <= value <= maximum:
        raise ValidationFailed(
            f"amount must be from {minimum:.2f} to {maximum:.2f} USD, got {value:.2f}", code="invalid_amount",
            details={"minimum": f"{minimum:.2f}", "maximum": f"{maximum:.2f}"},
        )  # fmt: skip
    return value


async def add_credit(
    master: Master, provider: PaymentProvider | None, account_id: str, raw_amount: object, *,
    idempotency_key: str | None, return_url: str,
) -> tuple[dict[str, Any], bool]:  # fmt: skip
    """A renter adds credit: credited now (demo) or a checkout URL (Stripe). The view, and whether it is new.

    Refusals (payments off, a bad amount, not a renter, the provider failing) change nothing. Cancelling it
    while the provider is asked is safe: nothing is credited before the provider answers, and a retry with
    the same Idempotency-Key is the same top-up (the provider's idempotency key too)."""
    settings = master.settings
    if provider is None:
        raise Conflict(
            "this marketplace takes no payments (GPUMARKET_PAYMENTS is off): ask an admin to credit your account",
            code="payments_disabled",
        )
    amount = topup_amount(raw_amount, minimum=settings.topup_minimum, maximum=settings.topup_maximum)
    async with master.db.session() as session:
        account = await session.get(Account, account_id)
        if account is None:
            raise NotFound(f"no account {account_id!r}", code="account_not_found")
        if account.role != "renter":
            raise ValidationFailed(f"account {account_id} is a {account.role}; only renters hold prepaid credit", code="not_a_renter")
        name = account.name
    topup = TopUp(id=topup_id(account_id, idempotency_key), account_id=account_id, account_name=name, amount=amount,
                  return_url=return_url)  # fmt: skip
    started = await provider.start(topup)
    view: dict[str, Any] = {"topup_id": topup.id, "provider": provider.name, "demo": provider.demo, "amount": f"{amount:.2f}"}
    created = True
    if started.paid_reference is not None:
        async with master.db.session() as session:
            created, key = await credits.top_up(session, account_id, amount, reference=started.paid_reference, at=master.clock.now())
        view.update(credited=True, posting=key, checkout_url=None)
    else:
        view.update(credited=False, posting=None, checkout_url=started.checkout_url, payment_id=started.payment_id)
    if provider.demo:
        view["message"] = "demo payment: no card charged"
    async with master.db.session() as session:
        view["balance"] = ledger.money(await ledger.balance(session, ledger.renter_credit(account_id)))
    return view, created


async def credit_paid(master: Master, paid: Paid) -> tuple[bool, str]:
    """Credit a provider's confirmed payment once per its reference; ``(posted now, posting key)``."""
    async with master.db.session() as session:
        return await credits.top_up(session, paid.account_id, paid.amount, reference=paid.reference, at=master.clock.now())
