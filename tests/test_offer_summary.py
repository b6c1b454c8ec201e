"""``offer_summary`` (migration 0018): the offer search over it answers exactly as the search over the GPU rows did.

Random fleets are written and then changed with plain SQL (inserts, bulk updates, deletes of GPUs, hosts and
listings), as any code path might; the database's triggers keep the summary, and every random search's page and
total must equal ``tests/offers_reference.py`` (the search as it was, over ``gpus``). Runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from alembic import command
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete, func, insert, select, text, update

from master.db import Database, alembic_config
from master.models import Account, Gpu, GpuAllocation, Host, HostListing, OfferSummary, Rental
from master.services.market.listings import window_time
from master.services.market.offers import OfferSearch, Order, Sort, search_offers
from master.services.market.query import parse
from tests.loopthread import LoopThread
from tests.offers_reference import reference_search

NOW = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
# Two models share words (RTX_4090 matches both), one has none of the others' (A100).
MODELS = {
    "NVIDIA GeForce RTX 4090": (24564, "8.9"),
    "NVIDIA GeForce RTX 4090 D": (24564, "8.9"),
    "NVIDIA A100-SXM4-80GB": (81920, "8.0"),
    "NVIDIA H100 80GB HBM3": (81559, "9.0"),
}
TERMS = (
    "gpu_name=RTX_4090", "gpu_name!=A100", "gpu_name=H100|A100", "num_gpus>=2", "num_gpus<2", "price<=0.5", "price>0.3",
    "vram>=40", "vram_mib<30000", "compute_capability>=8.9", "cuda_driver_version>=12.4", "cuda_driver_version<12.4",
    "region=eu-west", "region!=eu-west", "tier=datacenter", "tier!=consumer", "score>=50", "score<60",
    "reliability>0.95", "reliability!=0.9", "download_mbps>=500", "upload_mbps<200", "verified=true", "verified=false",
    "isolated=true", "isolated!=true", "price_per_score<0.01",
)  # fmt: skip


def _window(hours_from_now: int, length: int) -> dict[str, str]:
    start = NOW + timedelta(hours=hours_from_now)
    return {"start": window_time(start), "end": window_time(start + timedelta(hours=length), round_up=True)}


PROOFS: dict[str | None, dict[str, Any]] = {
    None: {},
    "passed": {"verification_outcome": "passed", "verified_at": NOW - timedelta(hours=2), "verified_tflops": 95.5},
    "stale": {"verification_outcome": "passed", "verified_at": NOW - timedelta(days=30), "verified_tflops": 90.0},
    "failed": {"verification_outcome": "failed", "verified_at": None, "verification_reason": "too_slow", "verification_failures": 1},
}


gpu_rows = st.fixed_dictionaries({
    "name": st.sampled_from(sorted(MODELS)),
    "tier": st.sampled_from([None, "flagship", "datacenter", "consumer", "entry"]),
    "score": st.sampled_from([None, 0.0, 40.5, 55.0, 100.0]),
    "needs_review": st.booleans(),
    "present": st.sampled_from([True, True, True, False]),
    "use": st.sampled_from(["free", "free", "free", "rented", "shared", "mig"]),
    # In MIG mode ("mig"): its instances' profiles, and which of them a rental holds.
    "mig": st.lists(st.tuples(st.sampled_from(["1g.10gb", "3g.40gb", ""]), st.booleans()), max_size=3),
    # What its GPU challenge proved (issue 40): a recent pass, a stale one, a failure, or never challenged.
    "proof": st.sampled_from([None, "passed", "passed", "passed", "stale", "failed"]),
})  # fmt: skip
listings = st.none() | st.fixed_dictionaries({
    "price_per_gpu_hour": st.sampled_from([Decimal("0.2"), Decimal("0.45"), Decimal("0.5"), Decimal("1.25")]),
    "verified": st.booleans(),
    "available_until": st.sampled_from([None, NOW - timedelta(days=1), NOW + timedelta(days=3)]),
    "maintenance_windows": st.sampled_from([[], [_window(-1, 3)], [_window(5, 2)], [_window(-5, 2), _window(24, 1)]]),
})  # fmt: skip
hosts = st.fixed_dictionaries({
    "state": st.sampled_from(["online", "online", "rented", "offline", "maintenance"]),
    "region": st.sampled_from([None, "eu-west", "us-east"]),
    "reliability": st.sampled_from([None, 0.9, 0.97, 1.0]),
    "latest_network": st.sampled_from([None, {"download_mbps": 800.0, "upload_mbps": 150.0}, {"download_mbps": 90.5}]),
    "isolation": st.sampled_from([None, {"isolated": True}, {"isolated": False}]),
    "cuda": st.sampled_from(["12.2", "12.4", "12.8"]),
    "gpus": st.lists(gpu_rows, max_size=5),
    "listing": listings,
})  # fmt: skip
searches = st.builds(
    lambda terms, sort, order, limit, offset: OfferSearch(parse(" ".join(terms)), sort=sort, order=order, limit=limit, offset=offset, now=NOW),
    st.lists(st.sampled_from(TERMS), max_size=3, unique=True), st.sampled_from(list(Sort)),
    st.sampled_from([None, Order.ASC, Order.DESC]), st.integers(1, 6), st.sampled_from([0, 0, 1, 3, 50]),
)  # fmt: skip
# What a later transaction does to the fleet: (table, row number, change); rows are picked modulo what exists.
changes = st.lists(
    st.one_of(
        st.tuples(st.just("gpu"), st.integers(0, 99), st.sampled_from([
            {"rental_id": None, "milli_used": 0}, {"milli_used": 500}, {"present": False}, {"present": True},
            {"tier": "datacenter", "score": 80.0}, {"tier": None, "score": None}, {"name": "NVIDIA A100-SXM4-80GB"},
            {"needs_review": True}, "rent", "delete", {"info": {"mig_mode": False}},
        ])),
        st.tuples(st.just("instance"), st.integers(0, 99), st.sampled_from(["release", "take", "delete"])),
        st.tuples(st.just("host"), st.integers(0, 99), st.sampled_from([
            {"state": "online"}, {"state": "offline"}, {"region": "us-east"}, {"region": None}, {"reliability": 0.99},
            {"latest_network": {"download_mbps": 1000.0, "upload_mbps": 900.0}}, {"latest_network": None},
            {"isolation": {"isolated": True}}, {"last_seen_at": NOW}, "delete",
        ])),
        st.tuples(st.just("listing"), st.integers(0, 99), st.sampled_from([
            {"price_per_gpu_hour": Decimal("0.31")}, {"verified": True}, {"available_until": NOW - timedelta(hours=1)},
            {"maintenance_windows": [_window(-2, 4)]}, {"maintenance_windows": []}, "delete", "create",
        ])),
    ),
    max_size=8,
)  # fmt: skip


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    with LoopThread(timeout=120) as thread:
        yield thread


@pytest.fixture
def db(database_url: str, loop: LoopThread) -> Iterator[Database]:
    database = Database(database_url)
    loop.run(database.migrate())
    try:
        yield database
    finally:
        loop.run(database.close())


async def _write_fleet(db: Database, fleet: list[dict[str, Any]]) -> None:
    async with db.session() as session:
        for model in (GpuAllocation, Gpu, Rental, Host, Account):
            await session.execute(delete(model))
        await session.execute(insert(Account), [{"id": "provider", "name": "provider", "role": "provider"},
                                                {"id": "renter", "name": "renter", "role": "renter"}])  # fmt: skip
    for number, host in enumerate(fleet):
        # A transaction per host, as hellos and listings come.
        async with db.session() as session:
            host_id = f"h{number}"
            columns = {k: host[k] for k in ("state", "region", "reliability", "latest_network", "isolation")}
            await session.execute(insert(Host).values(id=host_id, owner_id="provider", **columns))
            for index, gpu in enumerate(host["gpus"]):
                memory, capability = MODELS[gpu["name"]]
                rental_id = None
                if gpu["use"] == "rented":
                    rental_id = f"r{number}-{index}"
                    await session.execute(insert(Rental).values(id=rental_id, renter_id="renter", host_id=host_id, gpu_count=1, state="running"))
                row = Gpu(
                    id=f"g{number}-{index}", host_id=host_id, index=index, uuid=f"GPU-{number}-{index}", name=gpu["name"],
                    memory_total_mib=memory, present=gpu["present"], tier=gpu["tier"], score=gpu["score"],
                    needs_review=gpu["needs_review"], rental_id=rental_id, milli_used=500 if gpu["use"] == "shared" else 0,
                    **PROOFS[gpu.get("proof")],
                )  # fmt: skip
                info: dict[str, Any] = {"compute_capability": capability, "cuda_driver_version": host["cuda"]}
                if gpu["use"] == "mig":
                    info |= {"mig_mode": True, "mig_instances": [{"uuid": f"MIG-{number}-{index}-{n}" if profile else "", "profile": profile}
                                                                 for n, (profile, _) in enumerate(gpu["mig"])]}  # fmt: skip
                row.set_info(info)
                session.add(row)
                await session.flush()
                for n, (profile, taken) in enumerate(gpu["mig"] if gpu["use"] == "mig" else ()):
                    if profile and taken:
                        await _take(session, f"g{number}-{index}", f"MIG-{number}-{index}-{n}")
            if host["listing"] is not None:
                session.add(HostListing(host_id=host_id, **host["listing"]))


async def _apply(db: Database, todo: list[tuple[str, int, Any]]) -> None:
    """``todo`` in one transaction, as Core statements (bulk updates and deletes), not through the ORM's objects."""
    async with db.session() as session:
        for table, pick, change in todo:
            if table == "instance":
                await _change_instance(session, pick, change)
                continue
            model: Any = {"gpu": Gpu, "host": Host, "listing": HostListing}[table]
            key = model.host_id if model is HostListing else model.id
            keys = list((await session.scalars(select(key).order_by(key))).all())
            if change == "create":
                free = list((await session.scalars(select(Host.id).where(Host.id.not_in(keys)).order_by(Host.id))).all())
                if free:
                    session.add(HostListing(host_id=free[pick % len(free)], price_per_gpu_hour=Decimal("0.4")))
                    await session.flush()
                continue
            if not keys:
                continue
            chosen = keys[pick % len(keys)]
            if change == "delete" and model is Host:
                # A host goes with its GPUs (cascade) once no rental row points at it.
                await session.execute(delete(GpuAllocation).where(GpuAllocation.gpu_id.in_(select(Gpu.id).where(Gpu.host_id == chosen))))
                await session.execute(delete(Gpu).where(Gpu.host_id == chosen))
                await session.execute(delete(Rental).where(Rental.host_id == chosen))
                await session.execute(delete(Host).where(Host.id == chosen))
            elif change == "delete":
                if model is Gpu:
                    await session.execute(delete(GpuAllocation).where(GpuAllocation.gpu_id == chosen))
                await session.execute(delete(model).where(key == chosen))
            elif change == "rent":
                rental_id = f"rent-{chosen}"
                if await session.get(Rental, rental_id) is None:
                    host_id = await session.scalar(select(Gpu.host_id).where(Gpu.id == chosen))
                    await session.execute(insert(Rental).values(id=rental_id, renter_id="renter", host_id=host_id, gpu_count=1, state="running"))
                await session.execute(update(Gpu).where(Gpu.id == chosen).values(rental_id=rental_id))
            else:
                await session.execute(update(model).where(key == chosen).values(**change))


async def _take(session: Any, gpu_id: str, instance: str) -> None:
    """A rental holds MIG ``instance`` of ``gpu_id``, as ``allocation.claim`` records it."""
    rental_id = f"r-{instance}"
    host_id = await session.scalar(select(Gpu.host_id).where(Gpu.id == gpu_id))
    await session.execute(insert(Rental).values(id=rental_id, renter_id="renter", host_id=host_id, gpu_count=1, state="running"))
    await session.execute(insert(GpuAllocation).values(rental_id=rental_id, gpu_id=gpu_id, milli=142, memory_mib=0, mig_uuid=instance,
                                                       active_mig=instance))  # fmt: skip


async def _change_instance(session: Any, pick: int, change: str) -> None:
    """Release, take or delete the allocation of one MIG instance (picked modulo the instances the GPUs report)."""
    rows = (await session.execute(select(Gpu.id, Gpu.info).order_by(Gpu.id))).all()
    instances = [(gpu_id, str(m["uuid"])) for gpu_id, info in rows for m in (info or {}).get("mig_instances") or () if m.get("uuid")]
    if not instances:
        return
    gpu_id, instance = instances[pick % len(instances)]
    held = await session.scalar(select(GpuAllocation.id).where(GpuAllocation.active_mig == instance))
    if change == "take" and held is None:
        if await session.get(Rental, f"r-{instance}") is None:
            await _take(session, gpu_id, instance)
        else:
            await session.execute(update(GpuAllocation).where(GpuAllocation.mig_uuid == instance).values(active_mig=instance, released_at=None))
    elif change == "release" and held is not None:
        await session.execute(update(GpuAllocation).where(GpuAllocation.id == held).values(active_mig=None, released_at=NOW))
    elif change == "delete" and held is not None:
        await session.execute(delete(GpuAllocation).where(GpuAllocation.id == held))


async def _compare(db: Database, search: OfferSearch) -> None:
    async with db.session() as session:
        expected = await reference_search(session, search)
    async with db.session() as session:
        assert await search_offers(session, search) == expected, search


class TestOfferSummary:
    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(fleet=st.lists(hosts, max_size=6), todo=changes, asked=st.lists(searches, min_size=1, max_size=6))
    def test_search_over_the_summary_answers_as_the_search_over_gpu_rows(
        self, db: Database, loop: LoopThread, fleet: list[dict[str, Any]], todo: list[tuple[str, int, Any]], asked: list[OfferSearch]
    ) -> None:
        """Whatever the fleet and whatever was changed since, every search's page and total equal the reference's."""
        loop.run(_write_fleet(db, fleet))
        for search in asked[:2]:
            loop.run(_compare(db, search))
        loop.run(_apply(db, todo))
        assert loop.run(_kept_and_recomputed(db)) == loop.run(_kept_and_recomputed(db, recompute=True))
        for search in asked:
            loop.run(_compare(db, search))

    def test_a_hosts_rows_follow_each_change(self, db: Database, loop: LoopThread) -> None:
        """One row per host and kind of free GPU, counting only free ones, with the host's and listing's values."""
        loop.run(_write_fleet(db, [_host(uses=("free", "free", "rented", "shared"))]))
        assert loop.run(_summary(db)) == [("h0", "NVIDIA GeForce RTX 4090", 2, "12.4", "eu-west", False)]
        loop.run(_apply(db, [("gpu", 0, {"present": False}), ("listing", 0, "create"), ("host", 0, {"region": "us-east"})]))
        assert loop.run(_summary(db)) == [("h0", "NVIDIA GeForce RTX 4090", 1, "12.4", "us-east", True)]
        loop.run(_apply(db, [("gpu", 1, {"tier": "datacenter"})]))
        assert [row.tier for row in loop.run(_rows(db))] == ["datacenter"]
        loop.run(_apply(db, [("gpu", 1, {"milli_used": 250})]))
        assert loop.run(_summary(db)) == []

    def test_the_migration_fills_the_summary_of_an_existing_fleet(self, database_url: str, loop: LoopThread) -> None:
        """A fleet written before migration 0018 is searched after it exactly as before (the backfill)."""
        db = Database(database_url)
        try:
            loop.run(_upgrade(db, "0017"))
            loop.run(_write_fleet(db, [_host(uses=("free", "rented", "free")), _host(uses=("free",), listed=True)]))
            before = [loop.run(_reference(db, OfferSearch(parse(q), now=NOW))) for q in ("", "num_gpus>=2", "price<=0.5")]
            loop.run(db.migrate())
            assert loop.run(_summary(db)) == [("h0", "NVIDIA GeForce RTX 4090", 2, "12.4", "eu-west", False),
                                              ("h1", "NVIDIA GeForce RTX 4090", 1, "12.4", "eu-west", True)]  # fmt: skip
            for search, answer in zip((OfferSearch(parse(q), now=NOW) for q in ("", "num_gpus>=2", "price<=0.5")), before, strict=True):
                loop.run(_compare(db, search))
                assert loop.run(_reference(db, search)) == answer
        finally:
            loop.run(db.close())


def _host(*, uses: tuple[str, ...], listed: bool = False) -> dict[str, Any]:
    listing = {"price_per_gpu_hour": Decimal("0.45"), "verified": False, "available_until": None, "maintenance_windows": []}
    return {
        "state": "online", "region": "eu-west", "reliability": 0.97, "latest_network": None, "isolation": {"isolated": True},
        "cuda": "12.4", "listing": listing if listed else None,
        "gpus": [{"name": "NVIDIA GeForce RTX 4090", "tier": "consumer", "score": 55.0, "needs_review": False, "present": True, "use": use,
                  "mig": []}
                 for use in uses],
    }  # fmt: skip


MIGRATION = importlib.import_module("master.migrations.versions.0031_offer_summary_mig")


async def _kept_and_recomputed(db: Database, *, recompute: bool = False) -> list[tuple[Any, ...]]:
    """The summary's rows as the triggers kept them, or as the migration's backfill computes them now, sorted."""
    columns = [column for column in OfferSummary.__table__.columns if column.name != "id"]
    async with db.session() as session:
        if recompute:
            statement = text(MIGRATION.summary_select(session.get_bind().dialect.name, "g.host_id IS NOT NULL"))
            rows = await session.execute(statement.columns(*(column.label(column.name) for column in columns)))
        else:
            rows = await session.execute(select(*columns))
        return sorted(tuple(repr(value) for value in row) for row in rows.all())


async def _upgrade(db: Database, revision: str) -> None:
    async with db.engine.begin() as conn:
        await conn.run_sync(lambda sync: command.upgrade(alembic_config(sync), revision))


async def _reference(db: Database, search: OfferSearch) -> tuple[list[dict[str, Any]], int]:
    async with db.session() as session:
        return await reference_search(session, search)


async def _rows(db: Database) -> list[OfferSummary]:
    async with db.session() as session:
        return list((await session.scalars(select(OfferSummary))).all())


async def _summary(db: Database) -> list[tuple[Any, ...]]:
    async with db.session() as session:
        rows = await session.execute(
            select(OfferSummary.host_id, OfferSummary.gpu_name, OfferSummary.free_gpus, OfferSummary.cuda_driver_version,
                   OfferSummary.region, OfferSummary.listed_price.is_not(None))
            .order_by(OfferSummary.host_id, OfferSummary.gpu_name)
        )  # fmt: skip
        return [tuple(row) for row in rows.all()]


@pytest.mark.postgres
class TestConcurrentCommits:
    async def test_two_transactions_changing_one_hosts_gpus_leave_its_row_right(self, postgres_url: str) -> None:
        """Regression guard for the recompute race: a host's rows recomputed by two overlapping transactions are
        neither doubled nor stale (the later commit waits for the earlier one's and reads its GPUs)."""
        db = Database(postgres_url)
        await db.migrate()
        try:
            await _write_fleet(db, [{
                "state": "online", "region": None, "reliability": None, "latest_network": None, "isolation": None, "cuda": "12.4",
                "listing": None, "gpus": [{"name": "NVIDIA H100 80GB HBM3", "tier": "flagship", "score": 100.0,
                                           "needs_review": False, "present": True, "use": "free", "mig": []}] * 4,
            }])  # fmt: skip
            async with db.sessionmaker() as first, db.sessionmaker() as second:
                await first.execute(update(Gpu).where(Gpu.id == "h0-x").values(present=False))  # nothing: warms the session
                await first.execute(update(Gpu).where(Gpu.id == "g0-0").values(present=False))
                await second.execute(update(Gpu).where(Gpu.id == "g0-1").values(present=False))
                await asyncio.gather(first.commit(), second.commit())
            async with db.session() as session:
                assert await session.scalar(select(func.count()).select_from(OfferSummary)) == 1
                assert await session.scalar(select(OfferSummary.free_gpus)) == 2
        finally:
            await db.close()
