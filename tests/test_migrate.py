"""`gpumarket migrate`, masters that do not migrate (migrate_on_start=false) and the health probes.

A deployment runs the migrations once, in a job, before the masters start; the masters wait for
it (`gpumarket migrate --check --wait S` in an init container) and refuse a schema they do not
match. Readiness (`/health`) follows the database and Redis; liveness (`/health/live`) does not.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gpumarket.cli import main
from master.app import close_master, open_master
from master.db import Database, SchemaNotReady, current_revisions, head_revisions, migrate_or_wait
from shared.bus import InProcessBus
from shared.errors import ConfigError
from tests.apiclient import Api
from tests.factories import master_settings

pytestmark = pytest.mark.postgres


async def _revisions(url: str) -> set[str]:
    db = Database(url, pool_size=1)
    try:
        async with db.engine.connect() as conn:
            return await conn.run_sync(current_revisions)
    finally:
        await db.close()


def _migrate(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, url: str, *args: str) -> tuple[int, str]:
    monkeypatch.setenv("GPUMARKET_DATABASE_URL", url)
    try:
        main(["migrate", *args])
        code = 0
    except SystemExit as done:
        code = int(done.code or 0)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


class TestMigrateCommand:
    async def test_migrate_brings_a_new_database_to_head_once(
        self, postgres_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """--check fails on an empty database; migrate reaches head; a second run and --check change nothing."""
        heads = head_revisions()
        code, out = await asyncio.to_thread(_migrate, capsys, monkeypatch, postgres_url, "--check")
        assert code == 2 and "has no gpumarket schema" in out and "gpumarket migrate" in out, out
        assert await _revisions(postgres_url) == set()

        code, out = await asyncio.to_thread(_migrate, capsys, monkeypatch, postgres_url)
        assert code == 0, out
        assert f"from revision none to {min(heads)}" in out
        assert await _revisions(postgres_url) == heads

        code, out = await asyncio.to_thread(_migrate, capsys, monkeypatch, postgres_url)
        assert code == 0 and "already at revision" in out, out
        code, out = await asyncio.to_thread(_migrate, capsys, monkeypatch, postgres_url, "--check")
        assert code == 0 and "newest" in out, out

    async def test_check_waits_for_another_process_to_migrate(self, postgres_url: str) -> None:
        """An init container's `--check --wait` returns as soon as the migration job is done, not before."""
        waiter = asyncio.create_task(migrate_or_wait(postgres_url, check_only=True, wait_s=60, poll_s=0.1))
        await asyncio.sleep(0.5)
        assert not waiter.done(), "--check passed before anything migrated"
        before, after = await migrate_or_wait(postgres_url, check_only=False, wait_s=0)
        assert before == set() and after == head_revisions()
        _, seen = await asyncio.wait_for(waiter, timeout=30)
        assert seen == head_revisions()

    async def test_check_gives_up_with_the_reason_when_the_time_is_up(self, postgres_url: str) -> None:
        with pytest.raises(SchemaNotReady, match="no gpumarket schema"):
            await migrate_or_wait(postgres_url, check_only=True, wait_s=0.3, poll_s=0.1)

    async def test_an_unreachable_database_is_retried_then_named(self) -> None:
        """Nothing listens on port 1: the job retries for --wait seconds, then says which database and what to check."""
        url = "postgresql://nobody@127.0.0.1:1/none"
        with pytest.raises(ConfigError, match=r"127\.0\.0\.1:1.*GPUMARKET_DATABASE_URL"):
            await migrate_or_wait(url, check_only=False, wait_s=0.3, poll_s=0.1)

    async def test_two_jobs_at_once_both_succeed(self, postgres_url: str) -> None:
        """Two migration jobs started together (a rollout retried) leave one schema at head."""
        results = await asyncio.gather(
            migrate_or_wait(postgres_url, check_only=False, wait_s=10, poll_s=0.2),
            migrate_or_wait(postgres_url, check_only=False, wait_s=10, poll_s=0.2),
        )
        assert all(after == head_revisions() for _, after in results)
        assert await _revisions(postgres_url) == head_revisions()


class TestMastersThatDoNotMigrate:
    async def test_a_master_refuses_an_unmigrated_database_then_starts_after_migrate(self, postgres_url: str, tmp_path: Path) -> None:
        settings = master_settings(tmp_path, database_url=postgres_url)
        settings.migrate_on_start = False
        with pytest.raises(SchemaNotReady, match="gpumarket migrate"):
            await open_master(settings, bus=InProcessBus())
        assert await _revisions(postgres_url) == set(), "a master with migrate_on_start=false changed the schema"
        await migrate_or_wait(postgres_url, check_only=False, wait_s=0)
        master = await open_master(settings, bus=InProcessBus())
        await close_master(master)


class TestAdminCommands:
    def test_an_admin_command_opens_only_the_database_and_migrates_as_a_master_would(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """`admin create-account` with migrate_on_start=false refuses an unmigrated database as a master does; after
        `gpumarket migrate` it creates the account. It opens the database only: no CA appears in the data dir."""
        monkeypatch.setenv("GPUMARKET_DATA_DIR", str(tmp_path))
        monkeypatch.delenv("GPUMARKET_DATABASE_URL", raising=False)  # the data dir's own SQLite file
        monkeypatch.setenv("GPUMARKET_MIGRATE_ON_START", "false")
        with pytest.raises(SystemExit) as refused:
            main(["admin", "create-account", "--name", "ops", "--role", "admin"])
        assert refused.value.code == 2
        err = capsys.readouterr().err
        assert "has no gpumarket schema and admin commands with migrate_on_start=false" in err and "gpumarket migrate" in err, err
        main(["migrate"])
        capsys.readouterr()
        main(["admin", "create-account", "--name", "ops", "--role", "admin"])
        assert capsys.readouterr().out.strip()
        assert not (tmp_path / "ca").exists()


class TestHealthProbesAndOutages:
    async def test_readiness_follows_the_database_and_liveness_does_not(self, api: Api) -> None:
        status, body = await api.call("GET", "/health", None)
        assert status == 200 and body["checks"] == {"database": "ok", "bus": "ok"}, body
        healthy = api.master.db
        api.master.db = Database("postgresql://nobody@127.0.0.1:1/none", pool_size=1)
        try:
            status, body = await api.call("GET", "/health", None)
            assert status == 503 and body["status"] == "degraded", body
            assert body["checks"]["database"].startswith("error") and body["checks"]["bus"] == "ok"
            status, body = await api.call("GET", "/health/live", None)
            assert status == 200 and body["status"] == "ok" and body["instance"] == api.master.instance_id
            # Every other call is an outage to retry, not a bug: 503 with Retry-After, never 500.
            for method, path in (("GET", "/account"), ("GET", "/rentals"), ("POST", "/rentals")):
                status, body = await api.as_renter(method, path, json={} if method == "POST" else None)
                assert status == 503 and body["code"] == "database_unavailable", (method, path, status, body)
        finally:
            await api.master.db.close()
            api.master.db = healthy
        status, _ = await api.call("GET", "/health", None)
        assert status == 200
