"""Billing on Celery: real ``gpumarket worker`` processes against the real Redis and PostgreSQL.

Each test has its own PostgreSQL database (migrated the way a master does it) and its own bus
prefix, under which every Celery key lives in Redis; the prefix's keys are deleted afterwards.
Worker processes run in their own process groups and are always stopped, group and all.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import func, select

from billing import credits, ledger
from billing.celery_app import VISIBILITY_TIMEOUT_S, make_celery, queue_name
from billing.jobs import JOBS
from billing.tasks import close_process_databases, run_job, task_name
from gpumarket.cli import main
from master.db import Database, SchemaNotReady
from master.models import Account, Gpu, Host, LedgerTransaction, Rental
from shared.errors import ConfigError
from shared.settings import MasterSettings
from tests.helpers import eventually

# A worker process starts in about two seconds on a quiet machine; this leaves room for a busy one.
STARTUP_S = 30.0
SUCCEEDED = re.compile(r"Task gpumarket\.billing\.rate\[[0-9a-f-]+\] succeeded in [0-9.e-]+s: (\{.*\})")


class Workers:
    """``gpumarket worker`` subprocesses, each in its own process group, logs in tmp; ``stop_all`` ends every one."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp = tmp
        self.env = env
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        with (self.tmp / f"{name}.log").open("wb") as log:
            self.running[name] = subprocess.Popen(
                [sys.executable, "-m", "gpumarket.cli", "worker", "--loglevel", "INFO", *args],
                env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- {name} ---\n{self.log(name)[-4000:]}" for name in self.running)

    async def ready(self, *names: str) -> None:
        """Wait until each worker consumes its queue (Celery logs "ready.")."""

        async def all_ready() -> bool | None:
            for name in names:
                if self.running[name].poll() is not None:
                    raise AssertionError(f"worker {name} exited with {self.running[name].returncode}:\n{self.logs()}")
            return all(" ready." in self.log(name) for name in names) or None

        await eventually(all_ready, timeout=STARTUP_S, every=0.05, what=f"workers {', '.join(names)} ready")

    def stop_all(self) -> None:
        """SIGTERM (Celery's warm shutdown) to each worker, then SIGKILL to whatever is left of its group."""
        for process in self.running.values():
            if process.poll() is None:
                process.terminate()
        for process in self.running.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(process.pid, signal.SIGKILL)  # pool children and the embedded beat, if any outlived it
            except (ProcessLookupError, PermissionError):
                pass
            process.wait()


@pytest.fixture
def celery_prefix(bus_prefix: str, redis_url: str) -> Iterator[str]:
    """The test's bus prefix; every Redis key under it (Celery's included) is deleted afterwards."""
    yield bus_prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{bus_prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
async def billing_db(postgres_url: str) -> AsyncIterator[Database]:
    """The test's PostgreSQL database, migrated as a master migrates it (workers never do)."""
    db = Database(postgres_url)
    await db.migrate()
    try:
        yield db
    finally:
        await db.close()


@pytest.fixture
def worker_settings(tmp_path: Path, postgres_url: str, redis_url: str, celery_prefix: str) -> MasterSettings:
    return MasterSettings.load(data_dir=tmp_path / "worker", database_url=postgres_url, redis_url=redis_url, bus_prefix=celery_prefix)


@pytest.fixture
def workers(tmp_path: Path, worker_settings: MasterSettings) -> Iterator[Workers]:
    """Worker processes configured only by ``GPUMARKET_*`` variables, as in production."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("GPUMARKET_")}
    env.update(
        GPUMARKET_DATABASE_URL=str(worker_settings.database_url), GPUMARKET_REDIS_URL=str(worker_settings.redis_url),
        GPUMARKET_BUS_PREFIX=worker_settings.bus_prefix, GPUMARKET_DATA_DIR=str(worker_settings.data_dir),
    )  # fmt: skip
    procs = Workers(tmp_path, env)
    try:
        yield procs
    finally:
        procs.stop_all()


async def rentals(db: Database, count: int, *, running: bool) -> list[str]:
    """A renter's rentals of one GPU at 0.50 USD per GPU-hour, started 70 minutes ago; ``running`` or ended 10 minutes ago."""
    now = datetime.now(UTC)
    async with db.session() as session:
        session.add_all([Account(id="acct-p", name="prov", role="provider"), Account(id="acct-r", name="rent", role="renter")])
        await session.flush()
        session.add(Host(id="h-1", owner_id="acct-p", state="online"))
        await session.flush()
        session.add(Gpu(id="g-1", host_id="h-1", index=0, uuid="GPU-1", name="NVIDIA GeForce RTX 4090", memory_total_mib=24564, info={}))
        for i in range(count):
            session.add(Rental(id=f"r-{i}", renter_id="acct-r", host_id="h-1", gpu_model="NVIDIA GeForce RTX 4090", gpu_count=1,
                               gpu_uuids=["GPU-1"], state="running" if running else "stopped", price_per_gpu_hour=Decimal("0.50"),
                               started_at=now - timedelta(minutes=70), stopped_at=None if running else now - timedelta(minutes=10),
                               created_at=now - timedelta(minutes=70)))  # fmt: skip
    return [f"r-{i}" for i in range(count)]


async def postings_of(db: Database, rental_id: str) -> int | None:
    async with db.session() as session:
        count = await session.scalar(select(func.count()).select_from(LedgerTransaction).where(LedgerTransaction.rental_id == rental_id))
    return count or None


async def books(db: Database) -> tuple[list[str], dict[str, Any], Decimal]:
    """Every posting's key, the trial balance, and the renter's credit balance."""
    async with db.session() as session:
        keys = list((await session.scalars(select(LedgerTransaction.key))).all())
        return keys, await ledger.trial_balance(session), await ledger.balance(session, ledger.renter_credit("acct-r"))


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.slow
class TestWorkers:
    async def test_a_rating_task_sent_to_a_worker_posts_the_running_rentals_usage(
        self, workers: Workers, billing_db: Database, worker_settings: MasterSettings, redis_url: str
    ) -> None:
        """The rating task, sent to a real `gpumarket worker`, posts a running rental's usage to the ledger in PostgreSQL."""
        [rental] = await rentals(billing_db, 1, running=True)
        workers.start("w", "--concurrency", "1")
        app = make_celery(worker_settings)
        try:
            app.send_task(task_name("rate"))
            await eventually(lambda: postings_of(billing_db, rental), timeout=STARTUP_S, what="the rental's usage posted")
        except BaseException:
            print(workers.logs())
            raise
        finally:
            app.close()
        keys, trial, charged = await books(billing_db)
        assert keys and all(key.startswith(f"rental:{rental}:") for key in keys), keys
        assert trial["balanced"] is True
        assert Decimal("-0.60") < charged < Decimal("-0.55")  # 70 minutes at 0.50 per hour, give or take the seconds it took
        client = redis.Redis.from_url(redis_url)
        try:  # every Celery key is under the test's prefix: deployments (and tests) sharing a Redis stay apart
            queue = queue_name(worker_settings)
            assert client.exists(f"_kombu.binding.{queue}") == 0
            assert client.exists(f"{worker_settings.bus_prefix}celery:_kombu.binding.{queue}") == 1
        finally:
            client.close()

    async def test_a_task_delivered_six_times_to_two_workers_posts_each_usage_once(
        self, workers: Workers, billing_db: Database, worker_settings: MasterSettings
    ) -> None:
        """Six deliveries of the rating task, run by two worker processes of two pool processes each, post every
        rental's usage exactly once between them; every posting key exists once and the books balance."""
        ids = await rentals(billing_db, 30, running=False)
        workers.start("w0", "--concurrency", "2")
        workers.start("w1", "--concurrency", "2")
        app = make_celery(worker_settings)
        try:
            await workers.ready("w0", "w1")
            for _ in range(6):
                app.send_task(task_name("rate"))

            async def all_done() -> list[dict[str, int]] | None:
                done = [ast.literal_eval(m) for name in ("w0", "w1") for m in SUCCEEDED.findall(workers.log(name))]
                return done if len(done) == 6 else None

            results = await eventually(all_done, timeout=STARTUP_S, what="six rating tasks succeeded")
        except BaseException:
            print(workers.logs())
            raise
        finally:
            app.close()
        assert sum(r["postings"] for r in results) == 30, results  # the deliveries after the first found nothing left
        keys, trial, charged = await books(billing_db)
        assert len(keys) == len(set(keys)) == 30
        assert {key.split(":")[1] for key in keys} == set(ids)
        assert trial["balanced"] is True
        assert charged == -30 * Decimal("0.500000")

    async def test_a_worker_with_beat_rates_on_schedule_by_itself(self, workers: Workers, billing_db: Database) -> None:
        """`gpumarket worker --beat` schedules the rating job every billing_interval and runs it: a running rental's
        usage is posted without anyone sending a task, and again on a later tick."""
        [rental] = await rentals(billing_db, 1, running=True)
        async with billing_db.session() as session:  # enough credit that the enforcement job, scheduled too, lets it run
            await credits.top_up(session, "acct-r", "100.00", reference="pay-1", at=datetime.now(UTC))
        workers.start("beat", "--beat", "--concurrency", "1", env={"GPUMARKET_BILLING_INTERVAL": "0.2"})
        try:
            await eventually(lambda: postings_of(billing_db, rental), timeout=STARTUP_S, what="the first scheduled rating")

            async def a_later_posting() -> int | None:
                count = await postings_of(billing_db, rental)
                return count if count and count >= 2 else None

            await eventually(a_later_posting, timeout=STARTUP_S, what="a later scheduled rating")
        except BaseException:
            print(workers.logs())
            raise
        _, trial, _ = await books(billing_db)
        assert trial["balanced"] is True


class TestConfiguration:
    def test_the_beat_schedule_has_every_job_at_its_period(self, tmp_path: Path) -> None:
        """Beat has one entry per JOBS item, at the job's own period, on the billing queue; the app is at-least-once, JSON only."""
        settings = MasterSettings.load(data_dir=tmp_path, database_url="postgresql://x/y", redis_url="redis://127.0.0.1:6379/0",
                                       billing_interval=17, payout_interval=3600, bus_prefix="gmx:")  # fmt: skip
        app = make_celery(settings)
        schedule = app.conf.beat_schedule
        assert len(schedule) == len(JOBS)
        for name, job in JOBS.items():
            entry = schedule[f"billing-{name}"]
            assert entry["task"] == task_name(name) and entry["schedule"] == job.every(settings)
            assert entry["options"]["queue"] == "gmx:billing"
            assert task_name(name) in app.tasks
        assert schedule["billing-rate"]["schedule"] == 17 and schedule["billing-payouts"]["schedule"] == 3600
        conf = app.conf
        assert conf.task_acks_late and conf.task_reject_on_worker_lost and conf.worker_prefetch_multiplier == 1
        assert conf.accept_content == ["json"] and conf.task_serializer == "json" and conf.timezone == "UTC" and conf.enable_utc
        assert conf.broker_transport_options == {"global_keyprefix": "gmx:celery:", "visibility_timeout": VISIBILITY_TIMEOUT_S}

    def test_a_missing_broker_or_database_says_what_to_set(self, tmp_path: Path) -> None:
        """Without redis_url (or database_url) there is no app, and the error names the variable to set."""
        with pytest.raises(ConfigError, match="billing workers need the broker: set GPUMARKET_REDIS_URL"):
            make_celery(MasterSettings.load(data_dir=tmp_path, database_url="postgresql://x/y"))
        with pytest.raises(ConfigError, match="set GPUMARKET_DATABASE_URL"):
            make_celery(MasterSettings.load(data_dir=tmp_path, redis_url="redis://127.0.0.1:6379/0"))

    def test_the_worker_command_without_a_broker_is_one_clear_line(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """`gpumarket worker` without GPUMARKET_REDIS_URL exits 2 naming it, before anything starts."""
        monkeypatch.delenv("GPUMARKET_REDIS_URL", raising=False)
        monkeypatch.setenv("GPUMARKET_DATABASE_URL", "postgresql://x/y")
        monkeypatch.setenv("GPUMARKET_DATA_DIR", str(tmp_path))
        with pytest.raises(SystemExit) as done:
            main(["worker"])
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "GPUMARKET_REDIS_URL" in err

    @pytest.mark.postgres
    @pytest.mark.redis
    def test_a_worker_on_an_unmigrated_database_says_to_migrate_it(
        self, tmp_path: Path, postgres_url: str, redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """On a database nobody migrated, `gpumarket worker` exits 2 and a task fails, both saying to run `gpumarket migrate`."""
        for name, value in (("DATABASE_URL", postgres_url), ("REDIS_URL", redis_url), ("DATA_DIR", str(tmp_path))):
            monkeypatch.setenv(f"GPUMARKET_{name}", value)
        with pytest.raises(SystemExit) as done:
            main(["worker"])
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert "has no gpumarket schema" in err and "do not migrate" in err and "gpumarket migrate" in err
        settings = MasterSettings.load(data_dir=tmp_path, database_url=postgres_url, redis_url=redis_url)
        try:
            with pytest.raises(SchemaNotReady, match="do not migrate"):
                run_job(settings, JOBS["rate"])
        finally:
            close_process_databases()

    def test_worker_help_lists_its_options_and_settings(self, capsys: pytest.CaptureFixture[str]) -> None:
        """`gpumarket worker --help` exits 0 and shows its options, the beat rule and the GPUMARKET_* settings."""
        with pytest.raises(SystemExit) as done:
            main(["worker", "--help"])
        assert done.value.code == 0
        out = capsys.readouterr().out
        for text in ("usage: gpumarket worker", "--beat", "--concurrency", "--loglevel", "exactly one", "billing_in_process=false",
                     "GPUMARKET_REDIS_URL", "GPUMARKET_DATABASE_URL"):  # fmt: skip
            assert text in out, text
