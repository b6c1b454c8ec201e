"""Invoices and statements: lines and totals against a reference calculation and the ledger, month boundaries, access."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from sqlalchemy import update

from billing import ledger
from billing.invoices import month_total
from billing.rating import rate_open_rentals
from master.models import Rental
from tests.apiclient import Api, assert_error
from tests.factories import create_principal
from tests.test_billing import POLICY, make_rental, reference

NOV = datetime(2026, 11, 1, tzinfo=UTC)
DEC = datetime(2026, 12, 1, tzinfo=UTC)


async def month_of_rentals(api: Api) -> tuple[str, dict[str, Decimal]]:
    """A host and a month of rentals of every kind, rated at the end of November; returns the host and the expected charges."""
    host_id, _ = await api.host(4)
    _, admin_key = await create_principal(api.master, "admin-1", "admin")
    async with api.master.db.session() as session:
        await ledger.post(session, key="topup:x:1", kind="top_up", at=NOV + timedelta(hours=1), legs=[
            ledger.Leg(ledger.CASH, Decimal("50.00")), ledger.Leg(ledger.renter_credit(api.renter.account_id), Decimal("-50.00"))])  # fmt: skip
    t = NOV + timedelta(days=3)
    expected = {
        await make_rental(api, host_id, price="0.50", start=t, end=t + timedelta(hours=2), gpus=2): reference("0.50", 7200, gpus=2),
        await make_rental(api, host_id, price="0.36", start=t, end=t + timedelta(seconds=20)): reference("0.36", 60),
        await make_rental(api, host_id, price="0.36", start=t, end=t + timedelta(seconds=20), state="preempted",
                          kind="interruptible"): reference("0.36", 20),
        await make_rental(api, host_id, price="0.36", start=t, end=t + timedelta(seconds=20), state="failed",
                          host_lost=True): reference("0.36", 20),
        await make_rental(api, host_id, price="0.80", start=t, end=t + timedelta(hours=1), milli=250): reference("0.80", 3600, milli=250),
    }  # fmt: skip
    await rate_open_rentals(api.master.db, now=DEC - timedelta(seconds=1), policy=POLICY)
    assert admin_key
    return host_id, expected


@pytest.fixture(autouse=True)
async def balanced_books(api: Api) -> AsyncIterator[None]:
    """Every test here ends with the ledger balanced."""
    yield
    async with api.master.db.session() as session:
        assert (await ledger.trial_balance(session))["balanced"]


class TestInvoices:
    async def test_invoice_lines_match_the_reference_and_the_ledger(self, api: Api) -> None:
        """Each rental's line total equals the independent calculation; the invoice's totals equal the ledger's month."""
        _, expected = await month_of_rentals(api)
        status, listed = await api.as_renter("GET", "/invoices")
        invoice_id = f"inv-2026-11-{api.renter.account_id}"
        assert (status, [d["id"] for d in listed["items"]]) == (200, [invoice_id])
        status, invoice = await api.as_renter("GET", f"/invoices/{invoice_id}")
        assert status == 200, invoice
        lines = {line["rental_id"]: Decimal(line["total"]) for line in invoice["lines"]}
        assert lines == expected
        assert Decimal(invoice["total_charged"]) == sum(expected.values())
        assert (invoice["opening_balance"], invoice["paid"]) == ("0.000000", "50.000000")
        assert Decimal(invoice["closing_balance"]) == Decimal("50") - sum(expected.values())
        async with api.master.db.session() as session:
            in_ledger = await month_total(session, ledger.renter_credit(api.renter.account_id), NOV, DEC)
            balance = await ledger.balance(session, ledger.renter_credit(api.renter.account_id))
        assert -in_ledger == Decimal(invoice["paid"]) - Decimal(invoice["total_charged"])
        assert Decimal(invoice["closing_balance"]) == balance
        lost = next(line for line in invoice["lines"] if any(p["kind"] == "downtime credit" for p in line["postings"]))
        assert any("lost" in p["memo"] for p in lost["postings"])

    async def test_statement_earnings_plus_fees_equal_the_charges(self, api: Api) -> None:
        """The provider's statement: earned + the platform's fees = what the renters were charged, exactly."""
        _, expected = await month_of_rentals(api)
        status, statement = await api.as_provider("GET", f"/invoices/stm-2026-11-{api.provider.account_id}")
        assert status == 200, statement
        async with api.master.db.session() as session:
            fees = -await month_total(session, ledger.FEES, NOV, DEC)
        assert Decimal(statement["total_earned"]) + fees == sum(expected.values())
        assert statement["closing_payable"] == statement["total_earned"]

    async def test_a_posting_on_the_last_second_belongs_to_its_month(self, api: Api) -> None:
        """Month boundaries are UTC: 23:59:59 on 30 November is November's, midnight is December's."""
        host_id, _ = await api.host(1)
        rental_id = await make_rental(api, host_id, price="0.36", start=DEC - timedelta(hours=1), end=None, state="running")
        await rate_open_rentals(api.master.db, now=DEC - timedelta(seconds=1), policy=POLICY)
        await rate_open_rentals(api.master.db, now=DEC + timedelta(hours=1), policy=POLICY)
        _, november = await api.as_renter("GET", f"/invoices/inv-2026-11-{api.renter.account_id}")
        _, december = await api.as_renter("GET", f"/invoices/inv-2026-12-{api.renter.account_id}")
        assert Decimal(november["total_charged"]) == reference("0.36", 3599)
        assert Decimal(november["total_charged"]) + Decimal(december["total_charged"]) == reference("0.36", 7200)
        assert december["opening_balance"] == november["closing_balance"]
        assert rental_id

    async def test_access_and_bad_ids(self, api: Api) -> None:
        """Another renter's invoice is 404 like a missing one; malformed ids are 400; a statement id for a renter is 404."""
        await month_of_rentals(api)
        _, other_key = await create_principal(api.master, "renter-2", "renter")
        status, body = await api.call("GET", f"/invoices/inv-2026-11-{api.renter.account_id}", other_key)
        assert_error(status, body, 404, "invoice_not_found")
        status, body = await api.as_renter("GET", f"/invoices/stm-2026-11-{api.renter.account_id}")
        assert_error(status, body, 404, "invoice_not_found")
        for bad in ("inv-2026-13-x", "nonsense", "inv-26-11-x"):
            status, body = await api.as_renter("GET", f"/invoices/{bad}")
            assert_error(status, body, 400, "invalid_invoice_id")
        status, body = await api.as_renter("GET", f"/invoices/inv-2026-11-{api.renter.account_id}?format=pdf")
        assert_error(status, body, 400, "invalid_query")

    async def test_html_is_printable_and_escapes_what_it_shows(self, api: Api) -> None:
        """The HTML rendering shows the totals and escapes a hostile GPU model name."""
        _, expected = await month_of_rentals(api)
        async with api.master.db.session() as session:
            await session.execute(update(Rental).values(gpu_model="<script>alert(1)</script>"))
        async with api.client.get(f"/api/v1/invoices/inv-2026-11-{api.renter.account_id}?format=html",
                                  headers={"Authorization": f"Bearer {api.renter_key}"}) as response:  # fmt: skip
            assert response.status == 200 and response.content_type == "text/html"
            page = await response.text()
        assert "<script>" not in page and "&lt;script&gt;" in page
        total = sum(expected.values(), Decimal(0)).quantize(Decimal("0.01"))
        assert f"{total:,.2f} USD" in page and "@media print" in page
