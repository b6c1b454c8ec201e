"""Self-serve credit (``billing/payments``, ``POST /api/v1/account/credit``, Stripe's webhook), on SQLite and PostgreSQL.

The demo provider credits at once; Stripe Checkout is exercised through the real ``stripe`` package against a
local fake of its API (``tests/stripefake.py``), and its webhook with payloads signed as Stripe signs them.
Every test that refuses something checks the balance did not move and the books still balance.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from billing import ledger
from master.app import close_master, open_master
from shared.bus import InProcessBus
from shared.errors import ConfigError
from tests.apiclient import Api, assert_error, serve_api
from tests.factories import create_principal, master_settings
from tests.stripefake import StripeFake, completed_event, sign, stripe_fake

WEBHOOK_SECRET = "whsec_test_0123456789abcdef"
SECRET_KEY = "sk_test_gpumarket"
WEBHOOK = "/payments/stripe/webhook"


@asynccontextmanager
async def market(tmp_path: Path, database_url: str, **settings: Any) -> AsyncIterator[Api]:
    master = await open_master(master_settings(tmp_path, database_url=database_url, **settings), bus=InProcessBus())
    try:
        async with serve_api(master) as api:
            yield api
    finally:
        await close_master(master)


@pytest.fixture
async def demo(tmp_path: Path, database_url: str) -> AsyncIterator[Api]:
    async with market(tmp_path, database_url, payments="demo") as api:
        yield api


@pytest.fixture
async def fake() -> AsyncIterator[StripeFake]:
    async with stripe_fake() as fake:
        yield fake


@pytest.fixture
async def stripe_api(tmp_path: Path, database_url: str, fake: StripeFake) -> AsyncIterator[Api]:
    async with market(tmp_path, database_url, payments="stripe", stripe_secret_key=SECRET_KEY,
                      stripe_webhook_secret=WEBHOOK_SECRET, stripe_api_base=fake.url) as api:  # fmt: skip
        yield api


async def balance(api: Api) -> Decimal:
    async with api.master.db.session() as session:
        assert (await ledger.trial_balance(session))["balanced"]
        return await ledger.balance(session, ledger.renter_credit(api.renter.account_id))


async def post_webhook(api: Api, payload: bytes, signature: str | None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"} | ({"Stripe-Signature": signature} if signature is not None else {})
    return await api.call("POST", WEBHOOK, None, data=payload, headers=headers)


class TestDemoProvider:
    async def test_credits_at_once_and_says_it_is_a_demo(self, demo: Api) -> None:
        """A renter's top-up is 201 with the new balance, provider demo and the demo notice; GET /account agrees."""
        status, body = await demo.as_renter("POST", "/account/credit", json={"amount": "25.00"})
        assert status == 201, body
        assert (body["provider"], body["demo"], body["credited"], body["amount"]) == ("demo", True, True, "25.00")
        assert body["message"] == "demo payment: no card charged" and body["checkout_url"] is None
        assert Decimal(body["balance"]) == Decimal("25.00") == await balance(demo)
        status, again = await demo.as_renter("POST", "/account/credit", json={"amount": 5})  # a JSON integer is exact
        assert status == 201 and Decimal(again["balance"]) == Decimal("30.00") == await balance(demo)
        status, account = await demo.as_renter("GET", "/account")
        assert Decimal(account["credit"]["balance"]) == Decimal("30.00")

    async def test_an_idempotency_key_credits_once(self, demo: Api) -> None:
        """The same Idempotency-Key is the same top-up (200, credited once); with another amount it is 422 and credits nothing."""
        headers = {"Idempotency-Key": "retry-me"}
        status, first = await demo.as_renter("POST", "/account/credit", json={"amount": "25.00"}, headers=headers)
        assert status == 201, first
        status, again = await demo.as_renter("POST", "/account/credit", json={"amount": "25"}, headers=headers)
        assert status == 200 and again["topup_id"] == first["topup_id"] and again["balance"] == first["balance"]
        status, other = await demo.as_renter("POST", "/account/credit", json={"amount": "30.00"}, headers=headers)
        assert_error(status, other, 422, "reference_reused")
        assert await balance(demo) == Decimal("25.00")
        status, body = await demo.as_renter("POST", "/account/credit", json={"amount": "25.00"}, headers={"Idempotency-Key": "x" * 256})
        assert_error(status, body, 422, "invalid_idempotency_key")
        assert await balance(demo) == Decimal("25.00")

    @pytest.mark.parametrize("amount", ["4.99", "10000.01", "0", "25.001", "1,000", "+5", "-5", "5e1", " 25", "", "abc", 25.5, None])
    async def test_a_bad_amount_is_422_and_credits_nothing(self, demo: Api, amount: object) -> None:
        """Below the minimum, above the maximum, finer than a cent, or outside the strict grammar: 422, balance unchanged."""
        status, body = await demo.as_renter("POST", "/account/credit", json={"amount": amount})
        assert status == 422, body
        assert body["code"] in ("invalid_amount", "validation_failed"), body
        assert await balance(demo) == 0

    async def test_the_bounds_themselves_are_accepted(self, demo: Api) -> None:
        """5.00 and 10000.00 are the smallest and the largest top-up."""
        for amount in ("5", "10000.00"):
            status, body = await demo.as_renter("POST", "/account/credit", json={"amount": amount})
            assert status == 201, body
        assert await balance(demo) == Decimal("10005.00")

    async def test_only_renters_add_credit(self, demo: Api) -> None:
        """A provider is 403; an admin (who passes role checks) holds no credit: 422; nothing is posted."""
        status, body = await demo.as_provider("POST", "/account/credit", json={"amount": "25.00"})
        assert status == 403, body
        _, admin_key = await create_principal(demo.master, "admin-1", "admin")
        status, body = await demo.call("POST", "/account/credit", admin_key, json={"amount": "25.00"})
        assert_error(status, body, 422, "not_a_renter")
        status, body = await demo.call("POST", "/account/credit", None, json={"amount": "25.00"})
        assert status == 401, body
        async with demo.master.db.session() as session:
            trial = await ledger.trial_balance(session)
        assert trial["balanced"] and all(Decimal(a["debits"]) == 0 for a in trial["accounts"]), trial

    async def test_the_webhook_is_not_served_without_stripe(self, demo: Api) -> None:
        payload = completed_event({"id": "cs_1", "amount_total": 2500, "currency": "usd", "client_reference_id": demo.renter.account_id})
        status, body = await post_webhook(demo, payload, sign(payload, WEBHOOK_SECRET))
        assert_error(status, body, 404, "stripe_not_configured")
        assert await balance(demo) == 0


async def test_payments_off_refuses_and_credits_nothing(tmp_path: Path, database_url: str) -> None:
    """The default (payments off): 409 payments_disabled, the balance unchanged."""
    async with market(tmp_path, database_url) as api:
        status, body = await api.as_renter("POST", "/account/credit", json={"amount": "25.00"})
        assert_error(status, body, 409, "payments_disabled")
        assert await balance(api) == 0


class TestSettings:
    @pytest.mark.parametrize("given", [{"payments": "stripe"}, {"payments": "stripe", "stripe_secret_key": SECRET_KEY},
                                       {"topup_minimum": "20", "topup_maximum": "10"}, {"payments": "paypal"}])  # fmt: skip
    def test_incomplete_payment_settings_are_refused(self, tmp_path: Path, given: dict[str, str]) -> None:
        with pytest.raises(ConfigError):
            master_settings(tmp_path, **given)


class TestStripeCheckout:
    async def test_creates_a_checkout_session_and_credits_nothing_yet(self, stripe_api: Api, fake: StripeFake) -> None:
        """201 with Stripe's checkout URL; Stripe got the amount in cents, the account and top-up id, URLs back to the console."""
        status, body = await stripe_api.as_renter("POST", "/account/credit", json={"amount": "25.50"}, headers={"Idempotency-Key": "k1"})
        assert status == 201, body
        (sent,) = fake.sent
        assert body["checkout_url"] == sent.session["url"] and body["payment_id"] == sent.session["id"]
        assert (body["provider"], body["demo"], body["credited"], "message" in body) == ("stripe", False, False, False)
        assert await balance(stripe_api) == 0
        form, account = sent.form, stripe_api.renter.account_id
        assert sent.headers["Authorization"] == f"Bearer {SECRET_KEY}"
        assert form["mode"] == "payment" and form["client_reference_id"] == account
        assert form["line_items[0][price_data][unit_amount]"] == "2550" and form["line_items[0][price_data][currency]"] == "usd"
        assert form["line_items[0][quantity]"] == "1"
        assert form["metadata[account_id]"] == account and form["metadata[topup_id]"] == body["topup_id"]
        assert form["success_url"].startswith(str(stripe_api.client.make_url("/#/billing?credit=paid")))
        assert form["cancel_url"].startswith(str(stripe_api.client.make_url("/#/billing?credit=cancelled")))
        assert sent.headers["Idempotency-Key"] == f"gpumarket-{body['topup_id']}"
        status, again = await stripe_api.as_renter("POST", "/account/credit", json={"amount": "25.50"}, headers={"Idempotency-Key": "k1"})
        assert status == 201 and again["payment_id"] == body["payment_id"] and len(fake.sent) == 2

    async def test_a_provider_refusal_is_502_and_credits_nothing(self, stripe_api: Api, fake: StripeFake) -> None:
        fake.refuse = "Your account cannot currently make live charges."
        status, body = await stripe_api.as_renter("POST", "/account/credit", json={"amount": "25.00"})
        assert_error(status, body, 502, "payment_provider_error")
        assert "nothing was charged" in body["message"]
        assert await balance(stripe_api) == 0

    async def test_a_bad_amount_never_reaches_stripe(self, stripe_api: Api, fake: StripeFake) -> None:
        status, body = await stripe_api.as_renter("POST", "/account/credit", json={"amount": "1.00"})
        assert_error(status, body, 422, "invalid_amount")
        assert fake.sent == []

    async def test_the_paid_session_is_credited_once_however_often_it_is_notified(self, stripe_api: Api, fake: StripeFake) -> None:
        """The webhook credits the session's amount to its account; a replay and the session's second event credit nothing."""
        _, body = await stripe_api.as_renter("POST", "/account/credit", json={"amount": "25.00"})
        session = fake.sent[0].session
        payload = completed_event(session, event_id="evt_1")
        status, first = await post_webhook(stripe_api, payload, sign(payload, WEBHOOK_SECRET))
        assert status == 200 and first == {"received": True, "credited": True,
                                           "posting": f"topup:{stripe_api.renter.account_id}:stripe:{session['id']}"}  # fmt: skip
        assert await balance(stripe_api) == Decimal("25.00")
        status, replay = await post_webhook(stripe_api, payload, sign(payload, WEBHOOK_SECRET))
        assert status == 200 and replay["credited"] is False
        second = completed_event(session, event_id="evt_2", kind="checkout.session.async_payment_succeeded")
        status, other = await post_webhook(stripe_api, second, sign(second, WEBHOOK_SECRET))
        assert status == 200 and other["credited"] is False
        assert await balance(stripe_api) == Decimal("25.00")
        assert body["topup_id"] == session["metadata"]["topup_id"]

    async def test_an_unpaid_session_or_another_event_credits_nothing(self, stripe_api: Api, fake: StripeFake) -> None:
        await stripe_api.as_renter("POST", "/account/credit", json={"amount": "25.00"})
        session = fake.sent[0].session
        for payload in (completed_event(session, payment_status="unpaid"), completed_event(session, kind="checkout.session.expired")):
            status, body = await post_webhook(stripe_api, payload, sign(payload, WEBHOOK_SECRET))
            assert status == 200 and body["credited"] is False, body
        assert await balance(stripe_api) == 0

    @pytest.mark.parametrize("forge", [
        lambda p: sign(p, "whsec_someone_else"),  # the wrong secret
        lambda p: sign(p, WEBHOOK_SECRET, at=1_700_000_000),  # a stale timestamp: a replay of an old, genuine event
        lambda p: sign(p + b" ", WEBHOOK_SECRET),  # signed over another body
        lambda p: "t=1,v1=00",
        lambda p: None,  # no Stripe-Signature header
    ])  # fmt: skip
    async def test_a_bad_signature_is_400_and_credits_nothing(
        self, stripe_api: Api, fake: StripeFake, forge: Callable[[bytes], str | None]
    ) -> None:
        await stripe_api.as_renter("POST", "/account/credit", json={"amount": "25.00"})
        payload = completed_event(fake.sent[0].session)
        status, body = await post_webhook(stripe_api, payload, forge(payload))
        assert_error(status, body, 400, "invalid_signature")
        assert await balance(stripe_api) == 0

    async def test_a_signed_body_that_is_no_checkout_payment_is_400(self, stripe_api: Api) -> None:
        """Signed but not JSON, or a paid session in another currency: 400, nothing credited."""
        for payload in (b"not json", completed_event({"id": "cs_x", "amount_total": 100, "currency": "eur",
                                                      "client_reference_id": stripe_api.renter.account_id})):  # fmt: skip
            status, body = await post_webhook(stripe_api, payload, sign(payload, WEBHOOK_SECRET))
            assert_error(status, body, 400, "invalid_event")
        assert await balance(stripe_api) == 0
