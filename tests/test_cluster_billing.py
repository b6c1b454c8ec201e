"""Billing a cluster: its whole meter pauses while any member's host is silent, and a lost host credits the minimum.

On SQLite and PostgreSQL; amounts checked to the millionth against ``tests.test_billing.reference``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from decimal import Decimal

import pytest
from sqlalchemy import select

from billing import invoices, ledger
from billing.rating import rate_open_rentals
from master.models import Cluster, Gpu, HostEvent, LedgerTransaction, Rental, RentalEvent, Service
from shared.ids import new_id
from tests.apiclient import Api
from tests.test_billing import POLICY, T0, charges, reference


@pytest.fixture
async def ledger_api(api: Api) -> AsyncIterator[Api]:
    """The api, with the ledger's balance asserted after the test."""
    yield api
    async with api.master.db.session() as session:
        assert (await ledger.trial_balance(session))["balanced"]


async def cluster(api: Api) -> str:
    async with api.master.db.session() as session:
        row = Cluster(id=new_id("c"), renter_id=api.renter.account_id, state="running", node_count=2, gpus_per_node=1, created_at=T0)
        session.add(row)
    return row.id


async def member(api: Api, cluster_id: str | None, rank: int, *, price: str, start: datetime, end: datetime,
                 state: str = "stopped", lost: datetime | None = None) -> tuple[str, str]:  # fmt: skip
    """A member rental (or a plain one, ``cluster_id`` None) on a host of its own; returns its id and host."""
    host_id, _ = await api.host(1)
    async with api.master.db.session() as session:
        uuids = list((await session.scalars(select(Gpu.uuid).where(Gpu.host_id == host_id))).all())
        rental = Rental(
            id=new_id("r"), renter_id=api.renter.account_id, host_id=host_id, gpu_model="NVIDIA GeForce RTX 4090", gpu_count=1,
            gpu_uuids=uuids, state=state, price_per_gpu_hour=Decimal(price), started_at=start, stopped_at=end, host_lost_at=lost,
            created_at=start, cluster_id=cluster_id, node_rank=rank if cluster_id else None,
        )  # fmt: skip
        session.add(rental)
    return rental.id, host_id


async def offline(api: Api, host_id: str, went: datetime, back: datetime | None = None) -> None:
    async with api.master.db.session() as session:
        session.add(HostEvent(host_id=host_id, at=went, from_state="rented", to_state="offline", cause="t", actor="t"))
        if back is not None:
            session.add(HostEvent(host_id=host_id, at=back, from_state="offline", to_state="rented", cause="t", actor="t"))


class TestClusterMeter:
    async def test_one_silent_host_pauses_every_member(self, ledger_api: Api) -> None:
        """Node 1's host offline for 10 minutes of an hour: both nodes bill 50 minutes; a plain rental beside them bills 60."""
        api = ledger_api
        cid = await cluster(api)
        end = T0 + timedelta(hours=1)
        a, _ = await member(api, cid, 0, price="0.60", start=T0, end=end)
        b, host_b = await member(api, cid, 1, price="0.60", start=T0, end=end)
        plain, _ = await member(api, None, 0, price="0.60", start=T0, end=end)
        await offline(api, host_b, T0 + timedelta(minutes=20), T0 + timedelta(minutes=30))
        await rate_open_rentals(api.master.db, now=end + timedelta(hours=1), policy=POLICY)
        assert (await charges(api, a))["renter"] == (await charges(api, b))["renter"] == reference("0.60", 50 * 60) == Decimal("0.5")
        assert (await charges(api, plain))["renter"] == Decimal("0.600000")

    async def test_overlapping_silences_are_left_out_once(self, ledger_api: Api) -> None:
        """Hosts offline 10–25 and 20–30 minutes into the hour leave out 20 minutes, not 25: 40 minutes billed."""
        api = ledger_api
        cid = await cluster(api)
        end = T0 + timedelta(hours=1)
        a, host_a = await member(api, cid, 0, price="0.60", start=T0, end=end)
        b, host_b = await member(api, cid, 1, price="0.60", start=T0, end=end)
        await offline(api, host_a, T0 + timedelta(minutes=10), T0 + timedelta(minutes=25))
        await offline(api, host_b, T0 + timedelta(minutes=20), T0 + timedelta(minutes=30))
        await rate_open_rentals(api.master.db, now=end + timedelta(hours=1), policy=POLICY)
        assert (await charges(api, a))["renter"] == (await charges(api, b))["renter"] == Decimal("0.400000")

    async def test_a_lost_member_pauses_the_others_until_it_is_failed(self, ledger_api: Api) -> None:
        """Node 1's host, silent from 50 s and failed at 5 min, pauses node 0 for 250 s, not for the rest of its run."""
        api = ledger_api
        cid = await cluster(api)
        a, _ = await member(api, cid, 0, price="0.36", start=T0, end=T0 + timedelta(minutes=10))
        lost_at = T0 + timedelta(seconds=20)
        b, host_b = await member(api, cid, 1, price="0.36", start=T0, end=lost_at, state="failed", lost=lost_at)
        await offline(api, host_b, T0 + timedelta(seconds=50))  # never back
        async with api.master.db.session() as session:
            session.add(RentalEvent(rental_id=b, from_state="running", to_state="failed", cause="host lost", at=T0 + timedelta(minutes=5)))
        await rate_open_rentals(api.master.db, now=T0 + timedelta(hours=1), policy=POLICY)
        assert (await charges(api, a))["renter"] == reference("0.36", 600 - 250) == Decimal("0.035")
        assert (await charges(api, b))["renter"] == reference("0.36", 20)  # its own minimum credited back, as a rental's

    async def test_a_lost_member_credits_the_others_unserved_minimum(self, ledger_api: Api) -> None:
        """Node 0 stopped after 40 s because node 1's host was lost: its 20 s of minimum are charged and credited back."""
        api = ledger_api
        cid = await cluster(api)
        a, _ = await member(api, cid, 0, price="0.36", start=T0, end=T0 + timedelta(seconds=40))
        lost_at = T0 + timedelta(seconds=20)
        _, host_b = await member(api, cid, 1, price="0.36", start=T0, end=lost_at, state="failed", lost=lost_at)
        await rate_open_rentals(api.master.db, now=T0 + timedelta(hours=1), policy=POLICY)
        got = await charges(api, a)
        assert got["renter"] == reference("0.36", 40) == Decimal("0.004")
        assert got["minimum"] == -got["downtime_credit"] == reference("0.36", 20)
        async with api.master.db.session() as session:
            memo = await session.scalar(
                select(LedgerTransaction.memo).where(LedgerTransaction.rental_id == a, LedgerTransaction.kind == "downtime_credit")
            )
        assert memo is not None and f"host {host_b} of cluster {cid} lost" in memo

    async def test_a_plain_rental_stopped_early_is_not_credited(self, ledger_api: Api) -> None:
        """The cluster credit is the cluster's: a plain rental of 40 s pays its minimum in full."""
        api = ledger_api
        plain, _ = await member(api, None, 0, price="0.36", start=T0, end=T0 + timedelta(seconds=40))
        await rate_open_rentals(api.master.db, now=T0 + timedelta(hours=1), policy=POLICY)
        got = await charges(api, plain)
        assert got["renter"] == reference("0.36", 60) and "downtime_credit" not in got


class TestInvoiceLines:
    async def test_members_lines_carry_and_group_under_their_cluster(self, ledger_api: Api) -> None:
        """The invoice's lines name each member's cluster, members together in rank order, and a per-cluster total."""
        api = ledger_api
        cid = await cluster(api)
        end = T0 + timedelta(hours=1)
        first_plain, _ = await member(api, None, 0, price="0.60", start=T0 - timedelta(minutes=1), end=end)
        b, _ = await member(api, cid, 1, price="0.60", start=T0, end=end)
        later_plain, _ = await member(api, None, 0, price="0.30", start=T0 + timedelta(seconds=30), end=end)
        a, _ = await member(api, cid, 0, price="0.60", start=T0 + timedelta(minutes=1), end=end)
        await rate_open_rentals(api.master.db, now=end + timedelta(hours=1), policy=POLICY)
        async with api.master.db.session() as session:
            doc = await invoices.invoice(session, api.renter.account_id, "2026-11")
        assert [(line["rental_id"], line["cluster_id"]) for line in doc["lines"]] == [
            (first_plain, None), (a, cid), (b, cid), (later_plain, None),
        ]  # fmt: skip
        assert [line["node_rank"] for line in doc["lines"]] == [None, 0, 1, None]
        assert doc["clusters"] == [{"cluster_id": cid, "rental_ids": [a, b], "total": "1.190000"}]
        assert doc["services"] == [] and {line["service_id"] for line in doc["lines"]} == {None}

    async def test_a_services_replicas_lines_name_it_and_sum_under_it(self, ledger_api: Api) -> None:
        """Replicas are rentals: each has its line, naming its service, and the invoice sums them per service."""
        api = ledger_api
        end = T0 + timedelta(hours=1)
        async with api.master.db.session() as session:
            service = Service(id=new_id("svc"), renter_id=api.renter.account_id, name="chat", state="active", workload={},
                              port=8000, min_replicas=1, max_replicas=2, desired_replicas=2, scaling={}, token_hash="0" * 64,
                              token_prefix="gms_x", created_at=T0)  # fmt: skip
            session.add(service)
        first, _ = await member(api, None, 0, price="0.60", start=T0, end=end)
        second, _ = await member(api, None, 0, price="0.60", start=T0 + timedelta(minutes=30), end=end)
        plain, _ = await member(api, None, 0, price="0.30", start=T0, end=end)
        async with api.master.db.session() as session:
            for rid in (first, second):
                (await session.get(Rental, rid)).service_id = service.id  # type: ignore[union-attr]
        await rate_open_rentals(api.master.db, now=end + timedelta(hours=1), policy=POLICY)
        async with api.master.db.session() as session:
            doc = await invoices.invoice(session, api.renter.account_id, "2026-11")
        assert {line["rental_id"]: line["service_id"] for line in doc["lines"]} == {first: service.id, second: service.id, plain: None}
        assert doc["services"] == [{"service_id": service.id, "rental_ids": [first, second], "total": "0.900000"}]
