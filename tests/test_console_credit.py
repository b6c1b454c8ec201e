"""The Billing page's "Add credit" form in Debian's Chromium, against `gpumarket up` (the demo payment provider).

Reuses the browser module's fixtures, helpers and marketplace (``tests/test_console_browser.py``'s `gpumarket up`,
shared by the console's browser modules that run one after the other).
"""

from __future__ import annotations

from decimal import Decimal

import pytest
from playwright.async_api import Browser, Route, expect

from tests import test_console_browser as browser_module
from tests.test_console_browser import WAIT_MS, Market, _console

pytestmark = pytest.mark.slow


# The browser module's marketplace, shared as in test_console_layout.
market = browser_module.market


async def test_add_credit_with_a_preset_see_the_demo_balance_refuse_a_bad_amount_and_go_to_a_checkout(
    browser: Browser, market: Market
) -> None:
    """A preset fills the amount; the demo credits it and the page shows the new balance and that no card was charged;
    a bad amount is refused at the form (nothing posted); a checkout_url answer sends the browser there."""
    console = await _console(browser, market)
    page = console.page
    await console.sign_in("renter")
    await console.go("#/billing")
    before = Decimal((await console.api("renter", "/account"))["credit"]["balance"])

    form = page.locator("form.credit-form")
    await form.get_by_role("button", name="$25.00").click()
    await expect(form.get_by_label("Amount (USD)")).to_have_value("25.00")
    await form.get_by_role("button", name="Add credit").click()
    result = page.locator("#credit-result")
    await expect(result).to_contain_text("demo payment: no card charged", timeout=WAIT_MS)
    after = Decimal((await console.api("renter", "/account"))["credit"]["balance"])
    assert after == before + Decimal("25.00")
    await expect(result.locator(".credit-balance")).to_have_text(f"${after:,.2f}")
    await expect(page.locator("#balance")).to_have_text(f"${after:,.2f}")  # the Credit card above shows it too
    await console.shot("billing-add-credit")

    await form.get_by_label("Amount (USD)").fill("12.345")
    await form.get_by_role("button", name="Add credit").click()
    await expect(form.locator(".error")).to_contain_text("at most 2 decimals")
    await form.get_by_label("Amount (USD)").fill("1.00")  # below the marketplace's minimum: the API's refusal
    await form.get_by_role("button", name="Add credit").click()
    await expect(form.locator(".error")).to_contain_text("from 5.00 to 10000.00")
    assert Decimal((await console.api("renter", "/account"))["credit"]["balance"]) == after

    # A Stripe marketplace answers a checkout_url: the page goes there (the answer stands in for one, here).
    checkout = f"{market.base}/static/index.html?stripe-checkout"
    sent: list[dict[str, str]] = []

    async def as_stripe(route: Route) -> None:
        sent.append(route.request.headers)
        await route.fulfill(status=201, json={"provider": "stripe", "demo": False, "credited": False, "amount": "40.00",
                                              "checkout_url": checkout, "balance": f"{after}"})  # fmt: skip

    await page.route("**/api/v1/account/credit", as_stripe)
    await form.get_by_label("Amount (USD)").fill("40.00")
    await form.get_by_role("button", name="Add credit").click()
    await page.wait_for_url(checkout, timeout=WAIT_MS)
    assert sent[0].get("idempotency-key") and sent[0].get("x-csrf-token")
    assert console.problems == []
