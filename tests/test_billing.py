"""Billing: the ledger, prepaid credit, and rating rentals against a reference calculation.

On SQLite and PostgreSQL. Every test ends with the trial balance checked: debits = credits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import select, update

from billing import ledger
from billing.enforce import enforcement_pass
from billing.ledger import LedgerError, Leg
from billing.payouts import payout_pass
from billing.rating import Discount, RatingPolicy, cumulative_cost, rate_open_rentals, rate_rental
from master.models import Gpu, HostEvent, LedgerEntry, LedgerTransaction, Rental
from master.services.lifecycle import rentals as rentalstate
from master.services.market import FailureCode, record_failure
from shared.ids import new_id
from tests.apiclient import Api, assert_error
from tests.factories import create_principal

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
POLICY = RatingPolicy(min_period_s=60, fee_rate=Decimal("0.15"))


@pytest.fixture
async def books(api: Api) -> AsyncIterator[Api]:
    """The api, with the ledger's balance asserted after the test."""
    yield api
    async with api.master.db.session() as session:
        assert (await ledger.trial_balance(session))["balanced"]


def reference(price: str, seconds: int, *, gpus: int = 1, milli: int = 1000, bands: tuple[tuple[int, int], ...] = ()) -> Decimal:
    """The cost of ``seconds`` served, worked out independently of billing/rating.py: hour by hour bands."""
    per_second = Decimal(price) * gpus * milli / 1000 / 3600
    total = Decimal(0)
    for second in range(seconds):
        pct = max((p for h, p in bands if second >= h * 3600), default=0)
        total += per_second * (100 - pct) / 100
    return total.quantize(Decimal("0.000001"))


async def make_rental(api: Api, host_id: str, *, price: str, start: datetime, end: datetime | None, state: str = "stopped",
                      gpus: int = 1, milli: int = 1000, host_lost: bool = False, kind: str = "on_demand",
                      failure: FailureCode | None = None) -> str:  # fmt: skip
    async with api.master.db.session() as session:
        uuids = list((await session.scalars(select(Gpu.uuid).where(Gpu.host_id == host_id).order_by(Gpu.index).limit(gpus))).all())
        rental = Rental(
            id=new_id("r"), renter_id=api.renter.account_id,
            host_id=host_id, gpu_model="NVIDIA GeForce RTX 4090", gpu_count=gpus, gpu_uuids=uuids, state=state, kind=kind,
            gpu_milli=milli, price_per_gpu_hour=Decimal(price), started_at=start, stopped_at=end,
            host_lost_at=end if host_lost else None, created_at=start,
        )  # fmt: skip
        if failure is not None:
            record_failure(rental, failure, failure.value)
        session.add(rental)
    return rental.id


async def charges(api: Api, rental_id: str) -> dict[str, Decimal]:
    """What the rental's postings did to the renter, the provider and the platform, by kind and in total."""
    async with api.master.db.session() as session:
        rows = (
            await session.execute(
                select(LedgerTransaction.kind, LedgerEntry.account, LedgerEntry.amount)
                .join(LedgerEntry, LedgerEntry.transaction_id == LedgerTransaction.id)
                .where(LedgerTransaction.rental_id == rental_id)
            )
        ).all()
    out: dict[str, Decimal] = {}
    for kind, account, amount in rows:
        if account.startswith("renter:"):
            out[kind] = out.get(kind, Decimal(0)) + amount
            out["renter"] = out.get("renter", Decimal(0)) + amount
        elif account.startswith("provider:"):
            out["provider"] = out.get("provider", Decimal(0)) - amount
        else:
            out["fees"] = out.get("fees", Decimal(0)) - amount
    return out


class TestLedger:
    async def test_a_posting_must_balance_and_fit_the_quantum(self, books: Api) -> None:
        """Unbalanced legs and amounts finer than a millionth are refused; nothing is written."""
        async with books.master.db.session() as session:
            with pytest.raises(LedgerError, match="does not balance"):
                await ledger.post(session, key="k1", kind="top_up", at=T0, legs=[Leg(ledger.CASH, Decimal("1.00")), Leg(ledger.FEES, Decimal("-0.99"))])
            with pytest.raises(LedgerError, match="quantum"):
                await ledger.post(session, key="k2", kind="top_up", at=T0, legs=[Leg(ledger.CASH, Decimal("0.0000001")), Leg(ledger.FEES, Decimal("-0.0000001"))])
            with pytest.raises(LedgerError, match="no ledger account"):
                await ledger.post(session, key="k3", kind="top_up", at=T0, legs=[Leg("bank:x", Decimal("1")), Leg(ledger.FEES, Decimal("-1"))])
            assert await session.scalar(select(LedgerTransaction.id)) is None

    async def test_a_key_is_posted_once(self, books: Api) -> None:
        """The same key twice — sequentially or concurrently — posts once."""
        legs = [Leg(ledger.CASH, Decimal("5.00")), Leg(ledger.renter_credit(books.renter.account_id), Decimal("-5.00"))]

        async def post() -> bool:
            async with books.master.db.session() as session:
                return await ledger.post(session, key="topup:x:1", kind="top_up", at=T0, legs=legs)

        results = await asyncio.gather(post(), post(), post())
        assert sorted(results) == [False, False, True]
        assert not await post()
        async with books.master.db.session() as session:
            assert await ledger.balance(session, ledger.renter_credit(books.renter.account_id)) == Decimal("5.00")
            assert await ledger.balance(session, ledger.CASH) == Decimal("5.00")


class TestCredits:
    async def test_top_up_and_balance(self, books: Api) -> None:
        """An admin tops up a renter; the same reference again credits nothing; GET /account shows balance and burn rate."""
        _, admin_key = await create_principal(books.master, "admin-1", "admin")
        body = {"account_id": books.renter.account_id, "amount": "25.00", "reference": "pay-1"}
        status, first = await books.call("POST", "/account/credits", admin_key, json=body)
        assert (status, first["credited"], first["balance"]) == (201, True, "25.000000"), first
        status, again = await books.call("POST", "/account/credits", admin_key, json=body)
        assert (status, again["credited"], again["balance"]) == (200, False, "25.000000")
        await books.host(1)
        await books.as_renter("POST", "/rentals", json={"gpu_count": 1})
        _, account = await books.as_renter("GET", "/account")
        assert account["credit"]["balance"] == "25.000000"
        assert account["credit"]["burn_rate_per_hour"] == "0.400000"  # one prosumer GPU at its tier default
        assert account["credit"]["hours_left"] == 62.5
        status, trial = await books.call("GET", "/admin/ledger/trial-balance", admin_key)
        assert status == 200 and trial["balanced"] is True
        assert {a["account"]: a["balance"] for a in trial["accounts"]} == {
            "platform:cash": "25.000000", f"renter:{books.renter.account_id}:credit": "25.000000",
        }  # fmt: skip

    @pytest.mark.parametrize(
        ("amount", "reference", "code"),
        [("-5.00", "p", "invalid_amount"), ("0", "p", "invalid_amount"), ("abc", "p", "invalid_amount"),
         ("25.001", "p", "invalid_amount"), ("NaN", "p", "invalid_amount"), ("2000000", "p", "invalid_amount"),
         ("5.00", "bad\nref", "invalid_reference")],
    )  # fmt: skip
    async def test_bad_top_ups_are_422_and_post_nothing(self, books: Api, amount: str, reference: str, code: str) -> None:
        """Negative, zero, non-numeric, sub-cent or huge amounts are refused with a clear error."""
        _, admin_key = await create_principal(books.master, "admin-1", "admin")
        body = {"account_id": books.renter.account_id, "amount": amount, "reference": reference}
        status, answer = await books.call("POST", "/account/credits", admin_key, json=body)
        assert_error(status, answer, 422, code)
        async with books.master.db.session() as session:
            assert await session.scalar(select(LedgerTransaction.id)) is None

    async def test_who_may_top_up_and_whom(self, books: Api) -> None:
        """Renters cannot top themselves up; unknown accounts are 404; providers hold no credit; a reused reference with another amount is 422."""
        _, admin_key = await create_principal(books.master, "admin-1", "admin")
        body: dict[str, Any] = {"account_id": books.renter.account_id, "amount": "5.00", "reference": "p1"}
        status, _ = await books.as_renter("POST", "/account/credits", json=body)
        assert status == 403
        status, answer = await books.call("POST", "/account/credits", admin_key, json={**body, "account_id": "acct-nope"})
        assert_error(status, answer, 404, "account_not_found")
        status, answer = await books.call("POST", "/account/credits", admin_key, json={**body, "account_id": books.provider.account_id})
        assert_error(status, answer, 422, "not_a_renter")
        await books.call("POST", "/account/credits", admin_key, json=body)
        status, answer = await books.call("POST", "/account/credits", admin_key, json={**body, "amount": "6.00"})
        assert_error(status, answer, 422, "reference_reused")
        status, _ = await books.as_renter("GET", "/admin/ledger/trial-balance")
        assert status == 403


class TestRating:
    async def test_reference_calculation(self, books: Api) -> None:
        """Charges for a set of rentals equal an independent second-by-second calculation, to the millionth;
        renter charge = provider earning + platform fee for each."""
        host_id, _ = await books.host(4)
        hour = timedelta(hours=1)
        cases = {
            await make_rental(books, host_id, price="0.50", start=T0, end=T0 + hour, gpus=2): reference("0.50", 3600, gpus=2),
            await make_rental(books, host_id, price="0.37", start=T0, end=T0 + timedelta(seconds=1234)): reference("0.37", 1234),
            await make_rental(books, host_id, price="0.36", start=T0, end=T0 + timedelta(seconds=20)): reference("0.36", 60),  # minimum
            await make_rental(books, host_id, price="0.80", start=T0, end=T0 + hour, milli=250): reference("0.80", 3600, milli=250),
            await make_rental(books, host_id, price="0.36", start=T0, end=T0 + timedelta(seconds=20), state="preempted",
                              kind="interruptible"): reference("0.36", 20),  # preempted: no minimum
        }  # fmt: skip
        await rate_open_rentals(books.master.db, now=T0 + 2 * hour, policy=POLICY)
        for rental_id, expected in cases.items():
            got = await charges(books, rental_id)
            assert got["renter"] == expected, rental_id
            assert got["provider"] + got["fees"] == expected
            assert abs(got["fees"] - expected * Decimal("0.15")) <= Decimal("0.000001")  # the fee is rounded once

    async def test_rating_in_pieces_equals_rating_once(self, books: Api) -> None:
        """A running rental rated every few minutes is charged exactly what one pass at the end charges."""
        host_id, _ = await books.host(2)
        pieces = await make_rental(books, host_id, price="0.123457", start=T0, end=None, state="running")
        once = await make_rental(books, host_id, price="0.123457", start=T0 + timedelta(microseconds=1), end=None, state="running")
        async with books.master.db.session() as session:
            await session.execute(update(Rental).where(Rental.id == once).values(started_at=T0))
        for minutes in (1, 7, 13, 29, 30):
            async with books.master.db.session() as session:
                row = await session.get(Rental, pieces)
                assert row is not None
                await rate_rental(session, row, now=T0 + timedelta(minutes=minutes, seconds=0.7), policy=POLICY)
        async with books.master.db.session() as session:
            row = await session.get(Rental, once)
            assert row is not None
            await rate_rental(session, row, now=T0 + timedelta(minutes=30, seconds=0.7), policy=POLICY)
        assert (await charges(books, pieces))["renter"] == (await charges(books, once))["renter"] == reference("0.123457", 1800)

    async def test_discounts_apply_past_their_hours(self, books: Api) -> None:
        """A tier's duration discount takes its percentage off every second past the threshold."""
        host_id, _ = await books.host(1)
        rental_id = await make_rental(books, host_id, price="1.00", start=T0, end=T0 + timedelta(hours=3))
        policy = RatingPolicy(min_period_s=60, fee_rate=Decimal("0.15"),
                              discounts={"prosumer": (Discount(Decimal(1), Decimal(5)), Discount(Decimal(2), Decimal(10)))})  # fmt: skip
        await rate_open_rentals(books.master.db, now=T0 + timedelta(hours=4), policy=policy)
        assert (await charges(books, rental_id))["renter"] == Decimal("2.850000") == reference("1.00", 3 * 3600, bands=((1, 5), (2, 10)))
        assert cumulative_cost(Decimal(1), 0, ()) == 0

    async def test_offline_time_is_not_billed(self, books: Api) -> None:
        """Ten minutes offline inside an hour's rental bill fifty minutes."""
        host_id, _ = await books.host(1)
        rental_id = await make_rental(books, host_id, price="0.60", start=T0, end=T0 + timedelta(hours=1))
        async with books.master.db.session() as session:
            session.add_all([
                HostEvent(host_id=host_id, at=T0 + timedelta(minutes=20), from_state="rented", to_state="offline", cause="t", actor="t"),
                HostEvent(host_id=host_id, at=T0 + timedelta(minutes=30), from_state="offline", to_state="rented", cause="t", actor="t"),
            ])  # fmt: skip
        await rate_open_rentals(books.master.db, now=T0 + timedelta(hours=2), policy=POLICY)
        assert (await charges(books, rental_id))["renter"] == reference("0.60", 50 * 60)

    async def test_host_failure_credits_the_unserved_minimum(self, books: Api) -> None:
        """A rental whose host is lost after 20 s is charged the minimum and credited the unserved 40 s, with the reason."""
        host_id, _ = await books.host(1)
        rental_id = await make_rental(books, host_id, price="0.36", start=T0, end=T0 + timedelta(seconds=20), state="failed", host_lost=True)
        await rate_open_rentals(books.master.db, now=T0 + timedelta(minutes=5), policy=POLICY)
        got = await charges(books, rental_id)
        assert got["renter"] == reference("0.36", 20)
        assert got["minimum"] == reference("0.36", 60) - reference("0.36", 20) == -got["downtime_credit"]
        async with books.master.db.session() as session:
            memo = await session.scalar(select(LedgerTransaction.memo).where(LedgerTransaction.kind == "downtime_credit"))
        assert memo is not None and f"host {host_id} lost" in memo

    @pytest.mark.parametrize(
        ("failure", "minimum", "credited"),
        [(FailureCode.WORKLOAD_EXITED, True, False), (FailureCode.IMAGE_NOT_FOUND, True, False),
         (FailureCode.WORKLOAD_LOST, True, True), (FailureCode.GPU_NOT_FOUND, True, True),
         (FailureCode.PLACEMENT_INTERRUPTED, False, False), (FailureCode.GPU_IN_USE, False, False)],
    )  # fmt: skip
    async def test_the_minimum_follows_whose_failure_it_was(
        self, books: Api, failure: FailureCode, minimum: bool, credited: bool
    ) -> None:
        """A failure after 20 s served: the renter's is charged the minimum, the provider's charged and credited back
        (with the code in the memo), the platform's charged no minimum; the 20 s served are charged in every case."""
        host_id, _ = await books.host(1)
        rental_id = await make_rental(books, host_id, price="0.36", start=T0, end=T0 + timedelta(seconds=20), state="failed",
                                      failure=failure)  # fmt: skip
        await rate_open_rentals(books.master.db, now=T0 + timedelta(minutes=5), policy=POLICY)
        got = await charges(books, rental_id)
        assert got["usage"] == reference("0.36", 20)
        assert got.get("minimum", Decimal(0)) == (reference("0.36", 60) - reference("0.36", 20) if minimum else Decimal(0))
        assert got.get("downtime_credit", Decimal(0)) == (-got["minimum"] if credited else Decimal(0))
        if credited:
            async with books.master.db.session() as session:
                memo = await session.scalar(select(LedgerTransaction.memo).where(LedgerTransaction.rental_id == rental_id,
                                                                                 LedgerTransaction.kind == "downtime_credit"))  # fmt: skip
            assert memo is not None and failure.value in memo and "the host's failure" in memo

    async def test_redelivery_concurrency_and_a_clock_going_back_post_nothing_twice(self, books: Api) -> None:
        """Two passes at once, a repeated pass and a pass with an earlier clock leave the same postings."""
        host_id, _ = await books.host(1)
        rental_id = await make_rental(books, host_id, price="0.50", start=T0, end=None, state="running")
        now = T0 + timedelta(minutes=10)
        await asyncio.gather(*(rate_open_rentals(books.master.db, now=now, policy=POLICY) for _ in range(3)))
        await rate_open_rentals(books.master.db, now=now, policy=POLICY)
        await rate_open_rentals(books.master.db, now=now - timedelta(minutes=3), policy=POLICY)
        assert (await charges(books, rental_id))["renter"] == reference("0.50", 600)
        async with books.master.db.session() as session:
            row = await session.get(Rental, rental_id)
            assert row is not None and row.rated_until == now and row.billed_seconds == 600

    async def test_a_price_change_does_not_touch_a_running_rental(self, books: Api) -> None:
        """A provider repricing its host mid-rental changes new rentals only."""
        host_id, _ = await books.host(2)
        await books.as_provider("PUT", f"/hosts/{host_id}/listing", json={"price_per_gpu_hour": "0.50"})
        _, rental = await books.as_renter("POST", "/rentals", json={"gpu_count": 1})
        await books.agent_reports(rental["id"], "start_workload")
        await books.as_provider("PUT", f"/hosts/{host_id}/listing", json={"price_per_gpu_hour": "1.50"})
        async with books.master.db.session() as session:
            await session.execute(update(Rental).where(Rental.id == rental["id"]).values(started_at=T0))
        await rate_open_rentals(books.master.db, now=T0 + timedelta(hours=1), policy=POLICY)
        assert (await charges(books, rental["id"]))["renter"] == Decimal("0.500000")
        _, second = await books.as_renter("POST", "/rentals", json={"gpu_count": 1})
        assert second["price_per_gpu_hour"] == "1.500000"
        assert rentalstate.ACTIVE_STATES

    async def test_a_runaway_bid_is_charged_at_most_on_demand_and_the_provider_paid_accordingly(self, books: Api) -> None:
        """Regression (issue 21): a bid far above the GPU's on-demand price was charged as bid, and most of it paid
        out; an interruptible hour is now charged at most the on-demand price, and the provider earns its share of that."""
        host_id, _ = await books.host(1)
        await books.as_provider("PUT", f"/hosts/{host_id}/listing", json={"price_per_gpu_hour": "0.50"})
        status, rental = await books.as_renter("POST", "/rentals", json={"gpu_count": 1, "kind": "interruptible", "bid": "900"})
        assert status == 201, rental
        assert (rental["bid_per_gpu_hour"], rental["price_per_gpu_hour"]) == ("900.000000", "0.500000")
        await books.agent_reports(rental["id"], "start_workload")
        async with books.master.db.session() as session:
            await session.execute(update(Rental).where(Rental.id == rental["id"]).values(started_at=T0))
        await rate_open_rentals(books.master.db, now=T0 + timedelta(hours=1), policy=POLICY)
        charged = await charges(books, rental["id"])
        assert charged["renter"] == Decimal("0.500000")  # one hour on demand, not 900
        assert (charged["provider"], charged["fees"]) == (Decimal("0.425000"), Decimal("0.075000"))
        async with books.master.db.session() as session:
            assert await ledger.balance(session, ledger.provider_payable(books.provider.account_id)) == Decimal("0.425000")


class TestCreditEnforcement:
    async def top_up(self, api: Api, amount: str, reference: str = "p1") -> None:
        _, admin_key = await create_principal(api.master, f"admin-{reference}", "admin")
        body = {"account_id": api.renter.account_id, "amount": amount, "reference": reference}
        status, answer = await api.call("POST", "/account/credits", admin_key, json=body)
        assert status == 201, answer

    async def test_no_credit_no_rental(self, books: Api) -> None:
        """With require_credit, a renter who cannot pay the minimum period is refused with 402; a top-up fixes it."""
        books.master.settings.require_credit = True
        await books.host(1)
        status, body = await books.as_renter("POST", "/rentals", json={"gpu_count": 1})
        assert_error(status, body, 402, "insufficient_credit")
        assert "top up" in body["message"]
        await self.top_up(books, "0.01")
        status, body = await books.as_renter("POST", "/rentals", json={"gpu_count": 1})  # 0.40/h × 60 s = 0.0067
        assert status == 201, body

    async def test_a_renter_out_of_credit_is_stopped_before_zero(self, books: Api) -> None:
        """When the credit would not last the stop margin, every active rental of the renter is stopped, with the reason."""
        host_id, _ = await books.host(2)
        await self.top_up(books, "0.10")
        now = datetime.now(UTC)
        first = await make_rental(books, host_id, price="0.40", start=now - timedelta(minutes=14), end=None, state="running")
        second = await make_rental(books, host_id, price="0.40", start=now - timedelta(minutes=1), end=None, state="running", gpus=1)
        # 0.10 - 0.40/h × 15 min = 0.00: out of credit.
        result = await enforcement_pass(books.master.db, books.master.settings, now)
        assert sorted(result["stopped"]) == sorted([first, second])
        for rental_id in (first, second):
            status, body = await books.as_renter("GET", f"/rentals/{rental_id}")
            assert (status, body["state"]) == (200, "stopping")
            assert body["events"][-1]["cause"].startswith("out of credit")
            [stop] = await books.commands(rental_id, "stop_workload")
            assert stop.state == "pending" and stop.args["reason"] == "the renter's prepaid credit ran out"
        again = await enforcement_pass(books.master.db, books.master.settings, now)
        assert (again["stopped"], again["warned"]) == ([], [])

    async def test_low_credit_warns_once(self, books: Api) -> None:
        """Credit for less than credit_warning_s puts one warning event on each active rental."""
        host_id, _ = await books.host(1)
        await self.top_up(books, "0.10")
        now = datetime.now(UTC)
        rental_id = await make_rental(books, host_id, price="0.40", start=now, end=None, state="running")
        # 0.10 at 0.40/h lasts 15 min: past the 120 s stop margin, inside the 30 min warning.
        assert (await enforcement_pass(books.master.db, books.master.settings, now))["warned"] == [rental_id]
        assert (await enforcement_pass(books.master.db, books.master.settings, now))["warned"] == []
        _, body = await books.as_renter("GET", f"/rentals/{rental_id}")
        warnings = [e for e in body["events"] if e["cause"].startswith("low credit")]
        assert len(warnings) == 1 and "about 15 min" in warnings[0]["cause"]
        assert body["state"] == "running"


class TestPayouts:
    async def earn(self, api: Api, amount: str, key: str) -> None:
        """The provider earns ``amount`` from the renter's credit (as a rated usage posting would)."""
        async with api.master.db.session() as session:
            await ledger.post(session, key=key, kind="usage", at=T0, legs=[
                Leg(ledger.renter_credit(api.renter.account_id), Decimal(amount)),
                Leg(ledger.provider_payable(api.provider.account_id), -Decimal(amount)),
            ])  # fmt: skip

    async def test_payout_batch_pays_whole_cents_once_and_exports_csv(self, books: Api, tmp_path: Any) -> None:
        """A provider above the minimum is paid its balance rounded down to the cent, once per batch, into a CSV file."""
        books.master.settings.payout_dir = tmp_path / "out"
        await self.earn(books, "12.345678", "u1")
        now = datetime(2026, 11, 2, 3, 0, tzinfo=UTC)
        first = await payout_pass(books.master.db, books.master.settings, now)
        again = await payout_pass(books.master.db, books.master.settings, now + timedelta(minutes=5))  # same daily batch
        assert len(first["paid"]) == 1 and again["paid"] == [] and again["exported"] is None
        async with books.master.db.session() as session:
            assert await ledger.balance(session, ledger.provider_payable(books.provider.account_id)) == Decimal("0.005678")
            assert await ledger.balance(session, ledger.CASH) == Decimal("-12.34")
        lines = (tmp_path / "out" / f"payouts-{first['batch']}.csv").read_text().splitlines()
        assert lines[0] == "payout_id,provider_id,provider_name,amount,currency,created_at"
        assert lines[1].split(",")[1:5] == [books.provider.account_id, "provider-1", "12.34", "USD"]
        status, listed = await books.as_provider("GET", "/payouts")
        assert status == 200 and [(p["amount"], p["state"]) for p in listed["items"]] == [("12.34", "exported")]
        status, _ = await books.as_renter("GET", "/payouts")
        assert status == 403

    async def test_below_the_minimum_waits(self, books: Api) -> None:
        """A payable balance under payout_minimum is not paid; it is once it grows past it, in a later batch."""
        await self.earn(books, "9.99", "u1")
        now = datetime(2026, 11, 2, 3, 0, tzinfo=UTC)
        books.master.settings.payout_dir = books.master.settings.data_dir / "payouts"
        assert (await payout_pass(books.master.db, books.master.settings, now))["paid"] == []
        await self.earn(books, "0.01", "u2")
        assert len((await payout_pass(books.master.db, books.master.settings, now + timedelta(days=1)))["paid"]) == 1
        _, admin_key = await create_principal(books.master, "admin-1", "admin")
        status, listed = await books.call("GET", f"/payouts?provider_id={books.provider.account_id}", admin_key)
        assert status == 200 and listed["total"] == 1 and listed["items"][0]["amount"] == "10.00"


class TestSpendCap:
    async def test_a_renter_sets_its_cap_and_it_refuses_then_stops(self, books: Api) -> None:
        """A monthly spend cap refuses rentals that could go past it (402 spend_cap_reached) and stops running ones before it."""
        books.master.settings.require_credit = True
        host_id, _ = await books.host(2)
        await TestCreditEnforcement().top_up(books, "100.00")
        for bad in ("-1", "abc", "1.001"):
            status, body = await books.as_renter("PUT", "/account/spend-cap", json={"monthly_spend_cap": bad})
            assert_error(status, body, 422, "invalid_amount")
        status, body = await books.as_provider("PUT", "/account/spend-cap", json={"monthly_spend_cap": "5.00"})
        assert status == 403
        status, body = await books.as_renter("PUT", "/account/spend-cap", json={"monthly_spend_cap": "0.01"})
        assert (status, body["monthly_spend_cap"]) == (200, "0.01"), body
        status, body = await books.as_renter("POST", "/rentals", json={"gpu_count": 1})  # 0.40/h: the minimum is 0.0067
        assert status == 201, body
        status, body = await books.as_renter("POST", "/rentals", json={"gpu_count": 1})
        assert_error(status, body, 402, "spend_cap_reached")
        _, account = await books.as_renter("GET", "/account")
        assert account["credit"]["monthly_spend_cap"] == "0.01" and account["credit"]["balance"] == "100.000000"

        now = datetime.now(UTC)
        running = await make_rental(books, host_id, price="0.40", start=now - timedelta(minutes=5), end=None, state="running")
        result = await enforcement_pass(books.master.db, books.master.settings, now)
        assert running in result["stopped"]
        _, body = await books.as_renter("GET", f"/rentals/{running}")
        assert body["events"][-1]["cause"].startswith("monthly spend cap reached")
        status, body = await books.as_renter("PUT", "/account/spend-cap", json={"monthly_spend_cap": None})
        assert (status, body["monthly_spend_cap"]) == (200, None)
