"""Billing on Celery: real ``gpumarket worker`` processes against the real Redis and PostgreSQL."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import select

from billing import ledger
from billing.celery_app import TASK_PREFIX, make_celery, queue_name
from billing.jobs import JOBS
from master.db import Database
from master.models import Account, Gpu, Host, LedgerTransaction, Rental
from shared.errors import ConfigError
from shared.settings import MasterSettings
from tests.helpers import eventually
from tests.test_services_integration import Processes, processes  # noqa: F401


@pytest.fixture
async def billing_db(postgres_url: str) -> AsyncIterator[Database]:
    db = Database(postgres_url)
    await db.migrate()
    try:
        yield db
    finally:
        await db.close()


async def ended_rentals(db: Database, count: int) -> list[str]:
    """A renter's rentals that ran for an hour at 0.50 USD per GPU-hour and ended ten minutes ago."""
    now = datetime.now(UTC)
    async with db.session() as session:
        session.add_all([Account(id="acct-p", name="prov", role="provider"), Account(id="acct-r", name="rent", role="renter")])
        await session.flush()
        session.add(Host(id="h-1", owner_id="acct-p", state="online"))
        await session.flush()
        session.add(Gpu(id="g-1", host_id="h-1", index=0, uuid="GPU-1", name="NVIDIA GeForce RTX 4090", memory_total_mib=24564, info={}))
        for i in range(count):
            session.add(Rental(id=f"r-{i}", renter_id="acct-r", host_id="h-1", gpu_count=1, gpu_uuids=["GPU-1"], state="stopped",
                               price_per_gpu_hour=Decimal("0.50"), started_at=now - timedelta(minutes=70),
                               stopped_at=now - timedelta(minutes=10)))  # fmt: skip
    return [f"r-{i}" for i in range(count)]


def settings_for(tmp_path: Path, postgres_url: str, redis_url: str, bus_prefix: str) -> MasterSettings:
    return MasterSettings.load(data_dir=tmp_path / "worker", database_url=postgres_url, redis_url=redis_url, bus_prefix=bus_prefix)


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.slow
class TestCeleryWorkers:
    async def test_real_workers_rate_and_redelivered_tasks_post_nothing_twice(
        self, processes: Processes, billing_db: Database, tmp_path: Path, postgres_url: str, redis_url: str, bus_prefix: str,  # noqa: F811
    ) -> None:
        """Two worker processes (two pool processes each) get the rating task six times at once: every rental is rated
        once, each posting exists once, and the books balance."""
        rentals = await ended_rentals(billing_db, 30)
        settings = settings_for(tmp_path, postgres_url, redis_url, bus_prefix)
        env = {**os.environ, "GPUMARKET_DATABASE_URL": postgres_url, "GPUMARKET_REDIS_URL": redis_url, "GPUMARKET_BUS_PREFIX": bus_prefix,
               "GPUMARKET_DATA_DIR": str(tmp_path / "worker")}  # fmt: skip
        for n in range(2):
            processes.start(f"worker-{n}", "worker", "--concurrency", "2", "--loglevel", "WARNING", env=env)
        app = make_celery(settings)
        try:
            for _ in range(6):
                app.send_task(TASK_PREFIX + "rate", queue=queue_name(settings))

            async def all_rated() -> bool | None:
                async with billing_db.session() as session:
                    rated = (await session.scalars(select(Rental.rated_until).where(Rental.id.in_(rentals)))).all()
                return all(r is not None for r in rated) or None

            await eventually(all_rated, timeout=60, what="every rental rated by the workers")
            await asyncio.sleep(2)  # the other deliveries finish
        except BaseException:
            print(processes.logs())
            raise
        finally:
            app.close()
        async with billing_db.session() as session:
            keys = (await session.scalars(select(LedgerTransaction.key))).all()
            trial = await ledger.trial_balance(session)
            charged = await ledger.balance(session, ledger.renter_credit("acct-r"))
        assert sorted(keys) == sorted(set(keys)) and len(keys) == 30
        assert trial["balanced"] is True
        assert charged == -30 * Decimal("0.500000")

    def test_the_beat_schedule_has_every_job(self, tmp_path: Path, redis_url: str) -> None:
        """Beat schedules each billing job at its own period, on the billing queue, with at-least-once delivery settings."""
        settings = MasterSettings.load(data_dir=tmp_path, database_url="postgresql://x/y", redis_url=redis_url, billing_interval=17,
                                       payout_interval=3600)  # fmt: skip
        app = make_celery(settings)
        schedule = app.conf.beat_schedule
        assert {entry["task"] for entry in schedule.values()} == {TASK_PREFIX + name for name in JOBS}
        assert schedule["billing-rate"]["schedule"] == 17 and schedule["billing-payouts"]["schedule"] == 3600
        assert app.conf.task_acks_late and app.conf.task_reject_on_worker_lost and app.conf.accept_content == ["json"]
        assert set(JOBS) <= {name.removeprefix(TASK_PREFIX) for name in app.tasks if name.startswith(TASK_PREFIX)}

    def test_missing_broker_or_database_says_what_to_set(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError, match="GPUMARKET_REDIS_URL"):
            make_celery(MasterSettings.load(data_dir=tmp_path, database_url="postgresql://x/y"))
        with pytest.raises(ConfigError, match="GPUMARKET_DATABASE_URL"):
            make_celery(MasterSettings.load(data_dir=tmp_path, redis_url="redis://127.0.0.1:6379/0"))
