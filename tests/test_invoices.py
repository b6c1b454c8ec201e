"""Invoices and statements against an independent calculation and the ledger; month boundaries; access; HTML.

On SQLite and PostgreSQL. Every test ends with the trial balance checked: debits = credits.
The reference month is November 2026: rentals of every kind, rated in two passes, a payout
in between, a top-up in October for an opening balance, and a second renter on the same host.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import ROUND_DOWN, ROUND_HALF_EVEN, Decimal
from typing import Any

import pytest
from sqlalchemy import select, update

from billing import credits, invoice_html, invoices, ledger
from billing.payouts import payout_pass
from billing.rating import rate_open_rentals
from master.models import Account, LedgerEntry, LedgerTransaction, Rental
from master.services.accounts.core import Principal
from shared.errors import BadRequest, NotFound
from tests.apiclient import Api, assert_error
from tests.factories import create_principal
from tests.test_billing import POLICY, make_rental, reference

OCT = datetime(2026, 10, 1, tzinfo=UTC)
NOV = datetime(2026, 11, 1, tzinfo=UTC)
DEC = datetime(2026, 12, 1, tzinfo=UTC)
CENT = Decimal("0.01")
ZERO = Decimal(0)


@pytest.fixture(autouse=True)
async def balanced_books(api: Api) -> AsyncIterator[None]:
    """Every test here ends with the ledger balanced."""
    yield
    async with api.master.db.session() as session:
        assert (await ledger.trial_balance(session))["balanced"]


@dataclass
class Expected:
    """One rental's charges worked out independently of billing/ (second by second, tests.test_billing.reference)."""

    usage: Decimal
    minimum: Decimal = ZERO
    downtime_credit: Decimal = ZERO
    correction: Decimal = ZERO
    seconds: int | None = None

    @property
    def total(self) -> Decimal:
        return self.usage + self.minimum + self.downtime_credit + self.correction


@dataclass
class November:
    host_id: str
    renter: dict[str, Expected]  # rental id → what renter-1 is charged
    other_renter: Principal
    other_key: str
    other: dict[str, Expected]  # rental id → what renter-2 is charged
    admin_key: str
    paid_out: Decimal


async def top_up(api: Api, account_id: str, amount: str, reference: str, at: datetime) -> None:
    async with api.master.db.session() as session:
        await credits.top_up(session, account_id, amount, reference=reference, at=at)


async def a_month_of_rentals(api: Api) -> November:
    """The reference month: every kind of rental, rated in two passes around a payout."""
    host_id, _ = await api.host(4)
    _, admin_key = await create_principal(api.master, "admin-1", "admin")
    other, other_key = await create_principal(api.master, "renter-2", "renter")
    await top_up(api, api.renter.account_id, "5.00", "oct-1", OCT + timedelta(days=14))  # the opening balance
    await top_up(api, api.renter.account_id, "50.00", "nov-1", NOV + timedelta(hours=1))
    t = NOV + timedelta(days=3)
    short = timedelta(seconds=20)
    minimum = reference("0.36", 60) - reference("0.36", 20)
    renter = {
        await make_rental(api, host_id, price="0.50", start=t, end=t + timedelta(hours=2), gpus=2):
            Expected(reference("0.50", 7200, gpus=2), seconds=7200),
        await make_rental(api, host_id, price="0.36", start=t, end=t + short):
            Expected(reference("0.36", 20), minimum=minimum, seconds=20),
        await make_rental(api, host_id, price="0.36", start=t, end=t + short, state="preempted", kind="interruptible"):
            Expected(reference("0.36", 20), seconds=20),  # preempted: no minimum
        await make_rental(api, host_id, price="0.36", start=t, end=t + short, state="failed", host_lost=True):
            Expected(reference("0.36", 20), minimum=minimum, downtime_credit=-minimum, seconds=20),
        await make_rental(api, host_id, price="0.80", start=t, end=t + timedelta(hours=1), milli=250):
            Expected(reference("0.80", 3600, milli=250), seconds=3600),  # a quarter of a GPU
    }  # fmt: skip
    # Rated for an hour while it ran; the agent's stop then says it ended after 30 minutes.
    overrun = await make_rental(api, host_id, price="0.42", start=t, end=None, state="running")
    renter[overrun] = Expected(reference("0.42", 3600), correction=reference("0.42", 1800) - reference("0.42", 3600), seconds=1800)
    theirs = await make_rental(api, host_id, price="1.10", start=t, end=t + timedelta(minutes=90))
    async with api.master.db.session() as session:
        await session.execute(update(Rental).where(Rental.id == theirs).values(renter_id=other.account_id))
    await rate_open_rentals(api.master.db, now=t + timedelta(hours=1), policy=POLICY)
    async with api.master.db.session() as session:
        payable = await ledger.balance(session, ledger.provider_payable(api.provider.account_id))
        await session.execute(update(Rental).where(Rental.id == overrun).values(stopped_at=t + timedelta(minutes=30), state="stopped"))
    api.master.settings.payout_minimum = Decimal("0.50")
    payout = await payout_pass(api.master.db, api.master.settings, t + timedelta(hours=1, minutes=5))
    assert len(payout["paid"]) == 1
    await rate_open_rentals(api.master.db, now=DEC - timedelta(seconds=1), policy=POLICY)
    return November(host_id, renter, other, other_key, {theirs: Expected(reference("1.10", 5400), seconds=5400)}, admin_key,
                    payable.quantize(CENT, rounding=ROUND_DOWN))  # fmt: skip


async def entries(api: Api, account: str) -> list[tuple[datetime, str, str | None, int, Decimal]]:
    """Every entry on ``account``: (posted at, kind, rental, posting id, amount), read plainly (no sums in SQL)."""
    async with api.master.db.session() as session:
        rows = (
            await session.execute(
                select(LedgerTransaction.created_at, LedgerTransaction.kind, LedgerTransaction.rental_id, LedgerTransaction.id,
                       LedgerEntry.amount)
                .join(LedgerEntry, LedgerEntry.transaction_id == LedgerTransaction.id).where(LedgerEntry.account == account)
            )
        ).all()  # fmt: skip
    return [(at, kind, rental_id, transaction_id, amount) for at, kind, rental_id, transaction_id, amount in rows]


def in_month(at: datetime, start: datetime, end: datetime) -> bool:
    return start <= at < end


async def fees_by_rental(api: Api, start: datetime, end: datetime) -> dict[str | None, Decimal]:
    """The platform's fee per rental in the month, from the ledger (fees are credits: −amount)."""
    out: dict[str | None, Decimal] = {}
    for at, _, rental_id, _, amount in await entries(api, ledger.FEES):
        if in_month(at, start, end):
            out[rental_id] = out.get(rental_id, ZERO) - amount
    return out


def cents(amount: Decimal | str) -> str:
    return f"{Decimal(amount).quantize(CENT, rounding=ROUND_HALF_EVEN):,.2f}"


class TestInvoice:
    async def test_lines_and_totals_equal_the_reference_and_the_ledger(self, api: Api) -> None:
        """Each rental's usage, minimum, downtime credit and correction equal the independent calculation to the
        millionth; the totals equal the renter's ledger entries in the month and the closing balance its balance."""
        month = await a_month_of_rentals(api)
        status, invoice = await api.as_renter("GET", f"/invoices/inv-2026-11-{api.renter.account_id}")
        assert status == 200, invoice
        assert (invoice["kind"], invoice["month"], invoice["currency"]) == ("invoice", "2026-11", "USD")
        lines = {line["rental_id"]: line for line in invoice["lines"]}
        assert set(lines) == set(month.renter)
        for rental_id, expected in month.renter.items():
            line = lines[rental_id]
            assert {kind: Decimal(amount) for kind, amount in line["amounts"].items()} == {
                "usage": expected.usage, "minimum": expected.minimum, "downtime_credit": expected.downtime_credit,
                "correction": expected.correction,
            }, rental_id  # fmt: skip
            assert Decimal(line["total"]) == expected.total
            assert line["seconds_billed"] == expected.seconds
        charged = sum((e.total for e in month.renter.values()), ZERO)
        assert Decimal(invoice["total_charged"]) == charged
        assert {kind: Decimal(v) for kind, v in invoice["totals"].items()} == {
            kind: sum((getattr(e, kind) for e in month.renter.values()), ZERO)
            for kind in ("usage", "minimum", "downtime_credit", "correction")
        }
        assert (invoice["opening_balance"], invoice["total_paid"]) == ("5.000000", "50.000000")
        assert [p["amount"] for p in invoice["payments"]] == ["50.000000"]
        assert Decimal(invoice["closing_balance"]) == Decimal("55") - charged

        code = ledger.renter_credit(api.renter.account_id)
        posted = await entries(api, code)
        in_november = sum((amount for at, _, _, _, amount in posted if in_month(at, NOV, DEC)), ZERO)
        assert Decimal(invoice["total_paid"]) - Decimal(invoice["total_charged"]) == -in_november
        assert Decimal(invoice["opening_balance"]) == -sum((amount for at, _, _, _, amount in posted if at < NOV), ZERO)
        async with api.master.db.session() as session:
            assert Decimal(invoice["closing_balance"]) == await ledger.balance(session, code)
        for rental_id, line in lines.items():  # each line is its rental's entries, and nothing else
            assert Decimal(line["total"]) == sum((amount for at, _, r, _, amount in posted if r == rental_id and in_month(at, NOV, DEC)), ZERO)

    async def test_the_downtime_credit_and_the_minimum_say_why(self, api: Api) -> None:
        """A lost host's line carries the minimum and its downtime credit as details with their memos; usage is summed."""
        month = await a_month_of_rentals(api)
        _, invoice = await api.as_renter("GET", f"/invoices/inv-2026-11-{api.renter.account_id}")
        lost = next(line for line in invoice["lines"] if Decimal(line["amounts"]["downtime_credit"]) != 0)
        details = {d["kind"]: d for d in lost["details"]}
        assert set(details) == {"minimum", "downtime_credit"}
        assert f"host {month.host_id} lost" in details["downtime_credit"]["memo"]
        assert details["downtime_credit"]["label"] == "Downtime credit"
        assert "minimum billing period" in details["minimum"]["memo"]
        assert Decimal(details["minimum"]["amount"]) == -Decimal(details["downtime_credit"]["amount"]) > 0
        overrun = next(line for line in invoice["lines"] if Decimal(line["amounts"]["correction"]) != 0)
        assert [d["kind"] for d in overrun["details"]] == ["correction"] and "past the end" in overrun["details"][0]["memo"]
        assert overrun["postings"] == 2  # an hour of usage in the first pass, the correction in the second

    async def test_a_month_without_postings_is_empty_and_carries_the_balance(self, api: Api) -> None:
        """January has no postings: no lines, nothing charged, and the opening balance is December's closing."""
        await a_month_of_rentals(api)
        async with api.master.db.session() as session:
            november = await invoices.invoice(session, api.renter.account_id, "2026-11")
            january = await invoices.invoice(session, api.renter.account_id, invoices.Month(2027, 1))
        assert (january["lines"], january["payments"], january["total_charged"]) == ([], [], "0.000000")
        assert january["opening_balance"] == january["closing_balance"] == november["closing_balance"]


class TestStatement:
    async def test_earnings_plus_the_platform_fee_equal_the_renters_charges(self, api: Api) -> None:
        """Per rental and in total, earned + platform fee = what the renters were charged; the fees are the ledger's."""
        month = await a_month_of_rentals(api)
        status, statement = await api.as_provider("GET", f"/invoices/stm-2026-11-{api.provider.account_id}")
        assert status == 200, statement
        everyone = {**month.renter, **month.other}
        fees = await fees_by_rental(api, NOV, DEC)
        lines = {line["rental_id"]: line for line in statement["lines"]}
        assert set(lines) == set(everyone)
        for rental_id, line in lines.items():
            assert Decimal(line["charged"]) == everyone[rental_id].total, rental_id
            assert Decimal(line["earned"]) + Decimal(line["platform_fee"]) == Decimal(line["charged"])
            assert Decimal(line["platform_fee"]) == fees[rental_id]
            # The fee is 15 % of each posting's charge, rounded once per posting.
            assert abs(Decimal(line["platform_fee"]) - Decimal(line["charged"]) * Decimal("0.15")) <= line["postings"] * ledger.QUANTUM
        _, invoice = await api.as_renter("GET", f"/invoices/inv-2026-11-{api.renter.account_id}")
        _, theirs = await api.call("GET", f"/invoices/inv-2026-11-{month.other_renter.account_id}", month.other_key)
        renters_charged = Decimal(invoice["total_charged"]) + Decimal(theirs["total_charged"])
        assert renters_charged == sum((e.total for e in everyone.values()), ZERO)
        assert Decimal(statement["total_earned"]) + Decimal(statement["total_platform_fee"]) == renters_charged
        assert Decimal(statement["total_charged"]) == renters_charged
        assert Decimal(statement["total_platform_fee"]) == sum(fees.values(), ZERO)

    async def test_payouts_and_the_payable_balance(self, api: Api) -> None:
        """The month's payout is listed; closing payable = opening + earned − paid out = the ledger's payable balance."""
        month = await a_month_of_rentals(api)
        _, statement = await api.as_provider("GET", f"/invoices/stm-2026-11-{api.provider.account_id}")
        assert [Decimal(p["amount"]) for p in statement["payouts"]] == [month.paid_out] and month.paid_out > 0
        assert Decimal(statement["total_paid_out"]) == month.paid_out
        assert statement["opening_payable"] == "0.000000"
        closing = Decimal(statement["closing_payable"])
        assert closing == Decimal(statement["total_earned"]) - month.paid_out
        code = ledger.provider_payable(api.provider.account_id)
        async with api.master.db.session() as session:
            assert closing == await ledger.balance(session, code)
        in_november = sum((amount for at, _, _, _, amount in await entries(api, code) if in_month(at, NOV, DEC)), ZERO)
        assert Decimal(statement["total_earned"]) - Decimal(statement["total_paid_out"]) == -in_november


class TestMonths:
    async def test_a_posting_on_the_last_instant_belongs_to_its_month(self, api: Api) -> None:
        """Months are UTC: a top-up at 23:59:59.999999 on 30 November is November's, one at midnight December's;
        a rental rated on both sides of midnight is split between the two invoices and adds up to its whole cost."""
        host_id, _ = await api.host(1)
        await top_up(api, api.renter.account_id, "1.00", "last", DEC - timedelta(microseconds=1))
        await top_up(api, api.renter.account_id, "2.00", "first", DEC)
        await make_rental(api, host_id, price="0.36", start=DEC - timedelta(hours=1), end=None, state="running")
        await rate_open_rentals(api.master.db, now=DEC - timedelta(seconds=1), policy=POLICY)
        await rate_open_rentals(api.master.db, now=DEC + timedelta(hours=1), policy=POLICY)
        _, november = await api.as_renter("GET", f"/invoices/inv-2026-11-{api.renter.account_id}")
        _, december = await api.as_renter("GET", f"/invoices/inv-2026-12-{api.renter.account_id}")
        assert (november["total_paid"], december["total_paid"]) == ("1.000000", "2.000000")
        assert Decimal(november["total_charged"]) == reference("0.36", 3599)
        assert Decimal(november["total_charged"]) + Decimal(december["total_charged"]) == reference("0.36", 7200)
        assert december["opening_balance"] == november["closing_balance"]
        assert november["lines"][0]["seconds_billed"] is None  # its postings span two months
        status, listed = await api.as_renter("GET", "/invoices")
        assert status == 200
        assert [item["id"] for item in listed["items"]] == [f"inv-2026-12-{api.renter.account_id}", f"inv-2026-11-{api.renter.account_id}"]
        assert listed["items"][0]["html_url"].endswith("?format=html")

    async def test_lists_skip_months_without_postings(self, api: Api) -> None:
        """The list holds the months with postings only (October and November here, not the months between or after)."""
        month = await a_month_of_rentals(api)
        _, listed = await api.as_renter("GET", "/invoices")
        assert [item["month"] for item in listed["items"]] == ["2026-11", "2026-10"]
        _, statements = await api.as_provider("GET", "/invoices")
        assert [(item["id"], item["kind"]) for item in statements["items"]] == [(f"stm-2026-11-{api.provider.account_id}", "statement")]
        _, theirs = await api.call("GET", "/invoices", month.admin_key, params={"account_id": month.other_renter.account_id})
        assert [item["id"] for item in theirs["items"]] == [f"inv-2026-11-{month.other_renter.account_id}"]


class TestAccess:
    async def test_another_renters_invoice_is_404_like_a_missing_one(self, api: Api) -> None:
        """A renter cannot read, or learn of, another renter's invoice; a provider cannot read a renter's; admins read any."""
        month = await a_month_of_rentals(api)
        mine = f"inv-2026-11-{api.renter.account_id}"
        status, body = await api.call("GET", f"/invoices/{mine}", month.other_key)
        assert_error(status, body, 404, "invoice_not_found")
        status, missing = await api.call("GET", "/invoices/inv-2026-11-acct-0000000000000000", month.other_key)
        assert_error(status, missing, 404, "invoice_not_found")
        status, body = await api.as_provider("GET", f"/invoices/{mine}")
        assert_error(status, body, 404, "invoice_not_found")
        status, body = await api.call("GET", f"/invoices/{mine}?format=html", month.other_key)
        assert_error(status, body, 404, "invoice_not_found")
        status, body = await api.call("GET", f"/invoices/{mine}", month.admin_key)
        assert (status, body["id"]) == (200, mine)

    async def test_a_document_of_the_wrong_kind_is_404(self, api: Api) -> None:
        """A renter has no statement and a provider no invoice."""
        status, body = await api.as_renter("GET", f"/invoices/stm-2026-11-{api.renter.account_id}")
        assert_error(status, body, 404, "invoice_not_found")
        status, body = await api.as_provider("GET", f"/invoices/inv-2026-11-{api.provider.account_id}")
        assert_error(status, body, 404, "invoice_not_found")

    async def test_listing_someone_elses_months(self, api: Api) -> None:
        """Renters cannot list another account (404); admins must name one (400); an unknown one is 404."""
        _, admin_key = await create_principal(api.master, "admin-1", "admin")
        status, body = await api.as_renter("GET", "/invoices", params={"account_id": api.provider.account_id})
        assert_error(status, body, 404, "account_not_found")
        status, body = await api.call("GET", "/invoices", admin_key)
        assert_error(status, body, 400, "missing_account_id")
        status, body = await api.call("GET", "/invoices", admin_key, params={"account_id": "acct-nope"})
        assert_error(status, body, 404, "account_not_found")
        status, body = await api.as_renter("GET", "/invoices", params={"account_id": api.renter.account_id})
        assert (status, body) == (200, {"items": [], "total": 0})

    @pytest.mark.parametrize(
        "bad", ["nonsense", "inv-2026-13-acct-1", "inv-2026-00-acct-1", "inv-26-11-acct-1", "inv-0000-01-acct-1", "inv-9999-12-acct-1",
                "inv-2026-11-", "bill-2026-11-acct-1", "inv-2026-11-acct.1", "inv-2026-11-" + "a" * 41],
    )  # fmt: skip
    async def test_malformed_ids_are_400(self, api: Api, bad: str) -> None:
        """An id that is not inv-/stm-YYYY-MM-<account> with a real month is 400 with a code, never a 500."""
        status, body = await api.as_renter("GET", f"/invoices/{bad}")
        assert_error(status, body, 400, "invalid_invoice_id")

    async def test_bad_format_and_bad_month(self, api: Api) -> None:
        """?format= other than json or html is 400; the service refuses a month that is not YYYY-MM."""
        status, body = await api.as_renter("GET", f"/invoices/inv-2026-11-{api.renter.account_id}?format=pdf")
        assert_error(status, body, 400, "invalid_query")
        async with api.master.db.session() as session:
            for bad in ("2026-13", "2026-1", "November", "0000-01"):
                with pytest.raises(BadRequest) as refused:
                    await invoices.invoice(session, api.renter.account_id, bad)
                assert refused.value.code == "invalid_month"
            with pytest.raises(NotFound):
                await invoices.statement(session, api.renter.account_id, "2026-11")


class TestHtml:
    async def get_html(self, api: Api, document_id: str, key: str) -> tuple[Any, str]:
        async with api.client.get(f"/api/v1/invoices/{document_id}", params={"format": "html"},
                                  headers={"Authorization": f"Bearer {key}"}) as response:  # fmt: skip
            assert response.status == 200, await response.text()
            assert response.content_type == "text/html"
            return response.headers, await response.text()

    async def test_the_page_shows_the_totals_in_cents_and_escapes_what_it_shows(self, api: Api) -> None:
        """The printable invoice shows every total in cents and escapes a hostile GPU model and account name."""
        month = await a_month_of_rentals(api)
        async with api.master.db.session() as session:
            await session.execute(update(Rental).values(gpu_model="<script>alert('x')</script>"))
            await session.execute(update(Account).where(Account.id == api.renter.account_id).values(name='Evil & "Co" <b>'))
        headers, page = await self.get_html(api, f"inv-2026-11-{api.renter.account_id}", api.renter_key)
        assert "<script>" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
        assert "<b>" not in page and "Evil &amp; &quot;Co&quot; &lt;b&gt;" in page
        charged = sum((e.total for e in month.renter.values()), ZERO)
        for amount in (Decimal("5"), Decimal("50"), charged, Decimal("55") - charged):
            assert f"{cents(amount)} USD" in page, amount
        for expected in month.renter.values():
            assert f">{cents(expected.total)}<" in page
        assert "@media print" in page and "<link" not in page and "src=" not in page
        assert "default-src 'none'" in headers["Content-Security-Policy"]

    async def test_the_statement_page_shows_the_fee(self, api: Api) -> None:
        """The printable statement shows the renters' charges, the platform fee, the earnings and the payout, in cents."""
        month = await a_month_of_rentals(api)
        _, statement = await api.as_provider("GET", f"/invoices/stm-2026-11-{api.provider.account_id}")
        _, page = await self.get_html(api, statement["id"], api.provider_key)
        for field in ("total_charged", "total_platform_fee", "total_earned", "total_paid_out", "closing_payable"):
            assert f"{cents(statement[field])} USD" in page, field
        assert "Platform fee" in page and cents(month.paid_out) in page

    def test_cents_never_show_minus_zero(self) -> None:
        """A credit of less than half a cent shows as 0.00, not -0.00; halves round to even."""
        assert invoice_html.format_cents("-0.004") == "0.00"
        assert (invoice_html.format_cents("0.005"), invoice_html.format_cents("0.015"), invoice_html.format_cents("1234.5")) == ("0.00", "0.02", "1,234.50")
