"""Volumes' billing (docs/volumes.md#billing): storage per GiB-hour in the ledger, the credit it needs, its grace.

On SQLite and PostgreSQL, with the master's clock passed to every pass (no sleeping). Every test ends with every
posting, and the trial balance, checked to balance.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from pydantic import SecretStr
from sqlalchemy import select

from billing import credits, ledger
from billing.enforce import enforcement_pass, has_credit_for_volume, month_spent
from billing.invoice_html import render_html
from billing.invoices import invoice, statement
from billing.jobs import JOBS, Job
from billing.volumes import rate_open_volumes
from gpumarket.mailsink import MailSink
from master.background.billing import billing_loop
from master.db import Database
from master.models import (
    Account,
    Alert,
    Command,
    LedgerEntry,
    LedgerTransaction,
    Rental,
    Volume,
    VolumeAttachment,
    VolumeEvent,
)
from master.services import volumes
from master.services.alerts import evaluate
from shared.errors import ClientError
from shared.ids import new_id
from shared.settings import MasterSettings
from tests.apiclient import Api
from tests.helpers import eventually

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
FEE = Decimal("0.15")
Q = Decimal("0.000001")


@pytest.fixture
async def books(api: Api) -> AsyncIterator[Api]:
    """The api; afterwards every posting and the trial balance are checked to balance."""
    yield api
    async with api.master.db.session() as session:
        assert (await ledger.trial_balance(session))["balanced"]
        sums: dict[int, Decimal] = {}
        for transaction_id, amount in (
            await session.execute(select(LedgerEntry.transaction_id, LedgerEntry.amount))
        ).all():
            sums[transaction_id] = sums.get(transaction_id, Decimal(0)) + amount
        assert all(total == 0 for total in sums.values()), sums


def cost(price: str, gib: int, seconds: int) -> Decimal:
    """What ``seconds`` of ``gib`` GiB cost at ``price`` per GiB-hour, worked out apart from billing/volumes.py."""
    return (Decimal(price) * gib * seconds / 3600).quantize(Q)


async def make_volume(api: Api, host_id: str, *, gib: int = 100, price: str = "0.000150", ready_at: datetime | None = T0,
                      state: str = "ready", name: str = "data") -> str:  # fmt: skip
    async with api.master.db.session() as session:
        volume = Volume(id=f"vol-{secrets.token_hex(8)}", account_id=api.renter.account_id, name=name, size_gib=gib,
                        host_id=host_id, state=state, price_per_gib_hour=Decimal(price), created_at=ready_at or T0,
                        ready_at=ready_at)  # fmt: skip
        session.add(volume)
    return volume.id


async def volume(api: Api, volume_id: str) -> Volume:
    async with api.master.db.session() as session:
        row = await session.get(Volume, volume_id)
        assert row is not None
        return row


async def storage(api: Api, volume_id: str) -> dict[str, Decimal]:
    """What the volume's postings did to the renter, the provider and the platform, and how many there are."""
    async with api.master.db.session() as session:
        rows = (
            await session.execute(
                select(LedgerTransaction.id, LedgerTransaction.kind, LedgerEntry.account, LedgerEntry.amount)
                .join(LedgerEntry, LedgerEntry.transaction_id == LedgerTransaction.id)
                .where(LedgerTransaction.volume_id == volume_id)
            )
        ).all()
    out = {
        "renter": Decimal(0),
        "provider": Decimal(0),
        "fees": Decimal(0),
        "postings": Decimal(len({r[0] for r in rows})),
    }
    for _, kind, account, amount in rows:
        assert kind == "storage"
        key = (
            "renter"
            if account.startswith("renter:")
            else "provider"
            if account.startswith("provider:")
            else "fees"
        )
        out[key] += amount if key == "renter" else -amount
    return out


async def rate(api: Api, now: datetime) -> None:
    await rate_open_volumes(api.master.db, now=now, fee_rate=FEE)


async def delete(api: Api, volume_id: str, at: datetime) -> None:
    async with api.master.db.session() as session:
        row = await session.get(Volume, volume_id)
        assert row is not None
        volumes.request_deletion(session, row, cause="the renter asked", at=at)


async def top_up(api: Api, amount: str, reference: str) -> None:
    async with api.master.db.session() as session:
        await credits.top_up(session, api.renter.account_id, amount, reference=reference, at=T0)


async def events(api: Api, volume_id: str) -> list[str]:
    async with api.master.db.session() as session:
        rows = await session.scalars(
            select(VolumeEvent.cause).where(VolumeEvent.volume_id == volume_id).order_by(VolumeEvent.id)
        )
        return list(rows.all())


class TestRating:
    async def test_hours_times_gib_times_price_exactly(self, books: Api) -> None:
        """Passes at uneven times post, in all, the kept seconds × GiB × price rounded once; fee and earning add up."""
        host_id, _ = await books.host(1)
        volume_id = await make_volume(books, host_id, gib=250, price="0.000137")
        for offset in (0.4, 1.7, 3599.9, 3600, 7325.25, 9000):
            await rate(books, T0 + timedelta(seconds=offset))
        seconds = 9000
        charged = cost("0.000137", 250, seconds)
        money = await storage(books, volume_id)
        assert money["renter"] == charged
        assert money["fees"] == (Decimal("0.000137") * 250 * seconds / 3600 * FEE).quantize(Q)
        assert money["provider"] + money["fees"] == charged
        row = await volume(books, volume_id)
        assert row.rated_until == T0 + timedelta(seconds=seconds)

    async def test_a_volume_deleted_mid_hour_stops_costing_at_its_deletion(self, books: Api) -> None:
        """Deletion asked at 30 min 10.5 s bills 1,810 s, however late and often the passes come after it."""
        host_id, _ = await books.host(1)
        volume_id = await make_volume(books, host_id, gib=100, price="0.000150")
        await rate(books, T0 + timedelta(minutes=10))
        deleted_at = T0 + timedelta(minutes=30, seconds=10.5)
        await delete(books, volume_id, deleted_at)
        for later in (timedelta(hours=2), timedelta(hours=3), timedelta(days=1)):
            await rate(books, T0 + later)
        money = await storage(books, volume_id)
        assert money["renter"] == cost("0.000150", 100, 1810) and money["postings"] == 2
        assert (await volume(books, volume_id)).rated_until == deleted_at  # fully rated: never selected again

    async def test_rating_twice_posts_once(self, books: Api) -> None:
        """The same pass again, or three at once, posts each second of storage once."""
        host_id, _ = await books.host(1)
        volume_id = await make_volume(books, host_id)
        now = T0 + timedelta(hours=1)
        await asyncio.gather(rate(books, now), rate(books, now), rate(books, now))
        await rate(books, now)
        await rate(books, now - timedelta(minutes=5))  # a clock behind the last pass rates nothing
        money = await storage(books, volume_id)
        assert (money["renter"], money["postings"]) == (cost("0.000150", 100, 3600), Decimal(1))

    async def test_a_pass_past_the_deletion_gives_the_seconds_back(self, books: Api) -> None:
        """A pass whose clock ran ahead of the deleting request's rated past the deletion: the rest is given back."""
        host_id, _ = await books.host(1)
        volume_id = await make_volume(books, host_id)
        await rate(books, T0 + timedelta(seconds=100))
        await delete(books, volume_id, T0 + timedelta(seconds=50.5))
        await rate(books, T0 + timedelta(seconds=200))
        money = await storage(books, volume_id)
        assert (money["renter"], money["postings"]) == (cost("0.000150", 100, 50), Decimal(2))

    async def test_a_volume_never_ready_costs_nothing(self, books: Api) -> None:
        """A volume that failed, or was deleted while being made, posts nothing."""
        host_id, _ = await books.host(1)
        failed = await make_volume(books, host_id, ready_at=None, state="failed", name="a")
        creating = await make_volume(books, host_id, ready_at=None, state="creating", name="b")
        await delete(books, creating, T0 + timedelta(minutes=1))
        await rate(books, T0 + timedelta(hours=5))
        assert (await storage(books, failed))["postings"] == (await storage(books, creating))["postings"] == 0

    async def test_the_billing_pass_rates_rentals_and_volumes(self, books: Api) -> None:
        """billing.jobs' rate job (what the master's loop and the Celery task run) posts storage too."""
        host_id, _ = await books.host(1)
        volume_id = await make_volume(books, host_id)
        result = await JOBS["rate"].run(books.master.db, books.master.settings, T0 + timedelta(hours=2))
        assert (result["volumes"], result["postings"]) == (1, 1)
        assert (await storage(books, volume_id))["renter"] == cost("0.000150", 100, 7200)


class TestCredit:
    async def test_storage_counts_in_burn_spend_and_the_gate(self, books: Api) -> None:
        """The account's burn rate and month's spend include storage; no credit, no volume (402)."""
        host_id, _ = await books.host(1)
        now = datetime.now(UTC)
        session_factory = books.master.db.session
        async with session_factory() as session:
            with pytest.raises(ClientError) as refused:
                await has_credit_for_volume(
                    session, books.renter.account_id, 100, Decimal("0.000150"), min_period_s=60
                )
        assert (refused.value.code, refused.value.http_status) == ("insufficient_credit", 402)
        await top_up(books, "1.00", "pay-1")
        async with session_factory() as session:
            await has_credit_for_volume(
                session, books.renter.account_id, 100, Decimal("0.000150"), min_period_s=60
            )
        await make_volume(books, host_id, gib=1000, price="0.000100", ready_at=now - timedelta(hours=1))
        await rate(books, now)
        _, account = await books.as_renter("GET", "/account")
        assert account["credit"]["storage_per_hour"] == "0.100000"
        assert account["credit"]["burn_rate_per_hour"] == "0.100000"
        async with session_factory() as session:
            assert await month_spent(session, books.renter.account_id, now) == cost("0.000100", 1000, 3600)
            with pytest.raises(ClientError):  # 0.90 left; a volume costing 1.00 an hour is refused
                await has_credit_for_volume(
                    session, books.renter.account_id, 10000, Decimal("0.000100"), min_period_s=60
                )


class TestGrace:
    async def out_of_credit(self, api: Api) -> tuple[str, str]:
        """A volume of 1,000 GiB at 0.10/hour whose renter's 0.50 runs out at T0 + 5 h (rated to 4 h); its host and id."""
        host_id, _ = await api.host(1)
        await top_up(api, "0.50", "pay-1")
        volume_id = await make_volume(api, host_id, gib=1000, price="0.000100")
        await rate(api, T0 + timedelta(hours=4))
        return host_id, volume_id

    async def test_grace_is_set_once_and_cleared_by_a_top_up(self, books: Api) -> None:
        """Out of credit: unpaid_since, delete_after 3 days on, one event, one alert; a top-up clears both."""
        _, volume_id = await self.out_of_credit(books)
        now = T0 + timedelta(hours=5)
        assert (await enforcement_pass(books.master.db, books.master.settings, now - timedelta(hours=1)))[
            "volumes_unpaid"
        ] == []
        first = await enforcement_pass(books.master.db, books.master.settings, now)
        later = await enforcement_pass(books.master.db, books.master.settings, now + timedelta(hours=1))
        assert (first["volumes_unpaid"], later["volumes_unpaid"]) == ([volume_id], [])
        row = await volume(books, volume_id)
        assert (row.unpaid_since, row.delete_after, row.state) == (now, now + timedelta(days=3), "ready")
        [unpaid] = await events(books, volume_id)
        assert (
            unpaid.startswith("unpaid: the account's prepaid credit ran out")
            and "2026-11-04 17:00 UTC" in unpaid
        )
        assert (await evaluate(books.master, now=now)).raised == 1
        assert (await evaluate(books.master, now=now + timedelta(hours=1))).raised == 0
        await top_up(books, "10.00", "pay-2")
        paid = await enforcement_pass(books.master.db, books.master.settings, now + timedelta(hours=2))
        assert paid["volumes_paid"] == [volume_id]
        row = await volume(books, volume_id)
        assert (row.unpaid_since, row.delete_after) == (None, None)
        assert (await events(books, volume_id))[-1].startswith("paid: credit is back")
        assert (await evaluate(books.master, now=now + timedelta(hours=2))).resolved == 1
        async with books.master.db.session() as session:
            [alert] = (await session.scalars(select(Alert).where(Alert.rule == "volume_grace"))).all()
            assert alert.state == "resolved" and alert.details["volume_id"] == volume_id

    async def test_the_volume_is_deleted_when_its_grace_ends(self, books: Api) -> None:
        """Still unpaid at delete_after: deleting (billing stops there), an event saying why, a delete_volume command."""
        host_id, volume_id = await self.out_of_credit(books)
        now = T0 + timedelta(hours=5)
        await enforcement_pass(books.master.db, books.master.settings, now)
        before = await enforcement_pass(
            books.master.db, books.master.settings, now + timedelta(days=3) - timedelta(seconds=1)
        )
        assert before["volumes_deleted"] == []
        end = now + timedelta(days=3)
        result = await enforcement_pass(books.master.db, books.master.settings, end)
        assert result["volumes_deleted"] == [volume_id] and len(result["commands"]) == 1
        row = await volume(books, volume_id)
        assert (row.state, row.deleted_at) == ("deleting", end)
        assert (await events(books, volume_id))[-1].startswith(
            "deleted: the account's prepaid credit ran out on 2026-11-01 17:00 UTC"
        )
        async with books.master.db.session() as session:
            command = await session.get(Command, result["commands"][0])
            assert command is not None and (command.kind, command.host_id, command.args) == (
                "delete_volume",
                host_id,
                {"volume_id": volume_id},
            )
        again = await enforcement_pass(books.master.db, books.master.settings, end + timedelta(hours=1))
        assert (again["volumes_deleted"], again["commands"]) == ([], [])
        await rate(books, end + timedelta(days=1))
        assert (await storage(books, volume_id))["renter"] == cost(
            "0.000100", 1000, int((end - T0).total_seconds())
        )
        assert (await evaluate(books.master, now=end)).raised == 0  # no alert for a volume that is gone

    async def test_the_billing_loop_publishes_the_deletion_at_once(self, books: Api) -> None:
        """The master's enforce loop sends the delete_volume it wrote to the host's relay after the commit."""
        _, volume_id = await self.out_of_credit(books)
        now = T0 + timedelta(hours=5)
        await enforcement_pass(books.master.db, books.master.settings, now)
        end = now + timedelta(days=3)

        async def run(db: Database, settings: MasterSettings, _now: datetime) -> dict[str, Any]:
            return await enforcement_pass(db, settings, end)

        loop = asyncio.create_task(billing_loop(books.master, Job("enforce", run, lambda _: 0.01)))
        try:

            async def sent() -> Command | None:
                async with books.master.db.session() as session:
                    command = await session.scalar(select(Command).where(Command.kind == "delete_volume"))
                    return command if command is not None and command.state == "sent" else None

            command = await eventually(sent, what="the delete_volume command sent")
            assert command.args == {"volume_id": volume_id}
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop

    async def test_a_volume_a_running_rental_mounts_waits_for_the_rental_to_stop(self, books: Api) -> None:
        """Enforcement stops the rental; the volume it mounts is deleted only once that rental has ended."""
        host_id, volume_id = await self.out_of_credit(books)
        now = T0 + timedelta(hours=5)
        rental_id = new_id("r")
        async with books.master.db.session() as session:
            session.add(Rental(id=rental_id, renter_id=books.renter.account_id, host_id=host_id, gpu_model="NVIDIA GeForce RTX 4090",
                               gpu_count=1, gpu_uuids=[], state="running", kind="on_demand", gpu_milli=1000,
                               price_per_gpu_hour=Decimal("0.40"), started_at=now, created_at=now))  # fmt: skip
            await session.flush()
            session.add(
                VolumeAttachment(volume_id=volume_id, rental_id=rental_id, mount="/data", created_at=now)
            )
        first = await enforcement_pass(books.master.db, books.master.settings, now)
        assert first["stopped"] == [rental_id] and first["volumes_unpaid"] == [volume_id]
        end = now + timedelta(days=3)
        held = await enforcement_pass(books.master.db, books.master.settings, end)
        assert (held["volumes_held"], held["volumes_deleted"]) == ([volume_id], [])
        assert (await volume(books, volume_id)).state == "ready"
        async with books.master.db.session() as session:
            rental = await session.get(Rental, rental_id)
            assert rental is not None and rental.state == "stopping"
            rental.state, rental.stopped_at = "stopped", end
        deleted = await enforcement_pass(books.master.db, books.master.settings, end + timedelta(minutes=1))
        assert deleted["volumes_deleted"] == [volume_id]

    async def test_the_renter_is_mailed_once(self, books: Api) -> None:
        """With mail on, the renter hears once which volumes go when; later passes send nothing."""
        sink = await MailSink().start()
        try:
            books.master.settings.smtp_url = SecretStr(sink.url)
            async with books.master.db.session() as session:
                account = await session.get(Account, books.renter.account_id)
                assert account is not None
                account.email = "renter@example.test"
            _, volume_id = await self.out_of_credit(books)
            now = T0 + timedelta(hours=5)
            await enforcement_pass(books.master.db, books.master.settings, now)
            await enforcement_pass(books.master.db, books.master.settings, now + timedelta(hours=1))
            received = await sink.wait_for("renter@example.test")
            assert (
                len(sink.messages) == 1
                and volume_id in received.body
                and "2026-11-04 17:00 UTC" in received.body
            )
        finally:
            await sink.close()


class TestInvoices:
    async def test_storage_has_its_own_lines_and_counts_in_the_totals(self, books: Api) -> None:
        """An invoice lists each volume's GiB, hours and amount; its totals and the statement's agree with the ledger."""
        host_id, _ = await books.host(1)
        await top_up(books, "50.00", "pay-1")
        kept = await make_volume(books, host_id, gib=200, price="0.000125", name="weights")
        gone = await make_volume(books, host_id, gib=50, price="0.000200", name="scratch<b>")
        for hours in (1, 5, 9):
            await rate(books, T0 + timedelta(hours=hours))
        await delete(books, gone, T0 + timedelta(hours=9, minutes=30))
        await rate(books, T0 + timedelta(hours=12))
        async with books.master.db.session() as session:
            doc = await invoice(session, books.renter.account_id, "2026-11")
            stm = await statement(session, books.provider.account_id, "2026-11")
            balance = await ledger.balance(session, ledger.renter_credit(books.renter.account_id))
        lines = {line["volume_id"]: line for line in doc["storage"]["lines"]}
        assert (lines[kept]["size_gib"], lines[kept]["seconds"], lines[kept]["hours"]) == (
            200,
            12 * 3600,
            "12.000000",
        )
        assert lines[kept]["amount"] == ledger.money(cost("0.000125", 200, 12 * 3600))
        assert (lines[gone]["seconds"], lines[gone]["hours"]) == (34200, "9.500000")
        assert lines[gone]["amount"] == ledger.money(cost("0.000200", 50, 34200))
        total = cost("0.000125", 200, 12 * 3600) + cost("0.000200", 50, 34200)
        assert (doc["storage"]["total"], doc["total_charged"]) == (ledger.money(total), ledger.money(total))
        assert doc["lines"] == [] and Decimal(doc["closing_balance"]) == balance == Decimal("50") - total
        assert Decimal(stm["storage"]["earned"]) + Decimal(stm["storage"]["platform_fee"]) == total
        assert stm["total_earned"] == stm["storage"]["earned"] and stm["total_charged"] == ledger.money(total)
        page = render_html(doc)
        assert "<h2>Storage</h2>" in page and "scratch&lt;b&gt;" in page and "scratch<b>" not in page
