"""The offer-search benchmark at a tiny scale, against the real PostgreSQL: the fleet it seeds, the
answers it checks and the report it writes. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from types import ModuleType

import asyncpg
import pytest
from sqlalchemy import func, select, text

from master.db import Database
from master.models import Gpu, GpuAllocation, Host, HostListing, Rental, version_key
from master.services.market.offers import search_offers
from tests.conftest import PG_ADMIN_URL

BENCH = Path(__file__).resolve().parent.parent / "bench" / "bench_offers.py"


def _load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_offers", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


@pytest.fixture
async def db(postgres_url: str) -> AsyncIterator[Database]:
    """A migrated, empty database (fails the test, saying how to start PostgreSQL, when it is not running)."""
    database = Database(postgres_url)
    await database.migrate()
    try:
        yield database
    finally:
        await database.close()


class TestFleet:
    def test_fleet_is_the_same_for_a_seed_and_has_the_promised_variety(self) -> None:
        """200 GPUs on 25 hosts: many models and every region, some hosts listed, some GPUs rented, all from the seed."""
        fleet = bench.build_fleet(200, seed=7)
        assert fleet == bench.build_fleet(200, seed=7) and fleet != bench.build_fleet(200, seed=8)
        counts = fleet.counts()
        assert (counts["hosts"], counts["gpus"]) == (25, 200)
        assert counts["models"] >= 12 and counts["regions"] == 6
        assert 0 < counts["listed_hosts"] < 25 and counts["rentals"] > 0 and counts["rented_gpus"] > 0
        rentals = {rental["id"]: rental for rental in fleet.rentals}
        for gpu in fleet.gpus:
            assert gpu["compute_capability_key"] == version_key(gpu["info"]["compute_capability"])
            assert gpu["cuda_version_key"] == version_key(gpu["info"]["cuda_driver_version"])
            assert gpu["info"]["uuid"] == gpu["uuid"] and gpu["info"]["name"] == gpu["name"]
            if gpu["rental_id"] is not None:
                assert gpu["uuid"] in rentals[gpu["rental_id"]]["gpu_uuids"] and gpu["milli_used"] == 1000

    @pytest.mark.postgres
    async def test_seed_inserts_every_row(self, db: Database) -> None:
        """What ``seed`` inserts is the fleet: hosts, GPUs, listings, rentals, allocations and the GPUs' rental ids."""
        fleet = bench.build_fleet(200, seed=3)
        await bench.seed(db, fleet)
        await bench.analyze(db)
        counts = fleet.counts()
        async with db.session() as session:
            stored = {
                "hosts": await session.scalar(select(func.count()).select_from(Host)),
                "gpus": await session.scalar(select(func.count()).select_from(Gpu)),
                "listed_hosts": await session.scalar(select(func.count()).select_from(HostListing)),
                "rentals": await session.scalar(select(func.count()).select_from(Rental)),
                "rented_gpus": await session.scalar(select(func.count()).where(Gpu.rental_id.is_not(None))),
                "shared_gpus": await session.scalar(select(func.count()).where(Gpu.rental_id.is_(None), Gpu.milli_used > 0)),
            }
            allocations = await session.scalar(select(func.count()).select_from(GpuAllocation))
            keys_off = await session.scalar(
                text("SELECT count(*) FROM gpus WHERE compute_capability_key IS DISTINCT FROM "
                     "(split_part(info->>'compute_capability', '.', 1)::int * 1000 + split_part(info->>'compute_capability', '.', 2)::int)")
            )  # fmt: skip
        assert stored == {name: counts[name] for name in stored}
        assert allocations == len(fleet.allocations) and keys_off == 0


@pytest.mark.postgres
class TestAnswers:
    async def test_every_query_agrees_with_the_python_evaluation(self, db: Database) -> None:
        """800 GPUs: each query finds offers, and its total and page equal the evaluation of the fleet in Python."""
        fleet = bench.build_fleet(800)
        await bench.seed(db, fleet)
        checked = await bench.check_queries(db, fleet)
        assert [c["label"] for c in checked] == [q.label for q in bench.QUERIES]
        for check in checked:
            assert check["problems"] == [], check
            if check["offset"] == 0:
                assert 0 < check["matches"] and check["returned"] == min(bench.PAGE, check["matches"]), check
            else:
                assert check["returned"] == 0 and check["matches"] > 0, check  # fewer offers than the offset

    async def test_a_wrong_answer_is_reported(self, db: Database) -> None:
        """An offer of another model, a wrong GPU count or price, a missing offer and a wrong total each show up."""
        fleet = bench.build_fleet(800)
        await bench.seed(db, fleet)
        [query] = [q for q in bench.QUERIES if q.label == "the issue's example"]
        [search] = bench.searches([query])
        async with db.session() as session:
            items, total = await search_offers(session, search)
        expected = bench.expected_offers(fleet, search)
        assert len(items) >= 2 and bench.check_page(search, items, total, expected) == []

        def problems(changed: list[dict[str, object]], changed_total: int = total) -> list[str]:
            result: list[str] = bench.check_page(search, changed, changed_total, expected)
            return result

        assert any("total" in p for p in problems(items, total + 1))
        assert any("page" in p for p in problems(items[1:]))
        assert any("expected" in p for p in problems([{**items[0], "num_gpus": items[0]["num_gpus"] + 1}, *items[1:]]))
        cheap = {**items[0], "price_per_gpu_hour": str(Decimal(items[0]["price_per_gpu_hour"]) + Decimal("9"))}
        assert any("fails price<=0.5" in p for p in problems([cheap, *items[1:]]))
        other = {**items[0], "gpu_name": "NVIDIA H100 80GB HBM3"}
        assert any("fails gpu_name" in p for p in problems([other, *items[1:]]))


class TestReport:
    @pytest.mark.postgres
    @pytest.mark.usefixtures("postgres_url")  # fails the test, saying how to start PostgreSQL
    def test_json_holds_every_figure(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A whole run at 200 GPUs exits 0 and writes per-query p50/p99/max, the overall p99, the baseline and the
        search over GPU rows' figures."""
        out = tmp_path / "offers.json"
        code = bench.main(["--gpus", "200", "--repeat", "3", "--warmup", "1", "--admin-url", PG_ADMIN_URL, "--json", str(out)])
        stdout = capsys.readouterr().out
        assert code == 0, stdout
        result = json.loads(out.read_text())
        assert result["fleet"]["gpus"] == 200 and result["fleet"]["hosts"] == 25 and result["checks_ok"] is True
        assert result["repeat"] == 3 and result["seed_s"] > 0 and result["analyze_s"] >= 0
        assert list(result["queries"]) == [q.label for q in bench.QUERIES]
        for label, figures in result["queries"].items():
            assert figures["p50_ms"] <= figures["p99_ms"] <= figures["max_ms"], label
            assert figures["problems"] == [] and figures["p99_vs_baseline"] > 0, label
        baseline = result["baseline"]
        assert 0 < baseline["p50_ms"] <= baseline["p99_ms"] <= baseline["max_ms"] and "JOIN hosts" in baseline["sql"]
        every = result["queries"].values()
        assert min(f["p50_ms"] for f in every) <= result["overall_p99_ms"] <= max(f["max_ms"] for f in every)
        assert result["overall_p99_vs_baseline"] > 0
        # The search over GPU rows (tests/offers_reference.py) timed in the same rounds: every 5th, so once in 3.
        for label, figures in result["queries"].items():
            assert figures["gpu_rows"]["p50_ms"] <= figures["gpu_rows"]["p99_ms"] and figures["gpu_rows_p99_vs_p99"] > 0, label
        assert result["gpu_rows_overall_p99_ms"] > 0 and result["reference_every"] == 5
        assert stdout.startswith("machine: ") and "p99 over every query" in stdout and "all OK" in stdout
        assert "the search over GPU rows" in stdout

    def test_gpus_must_fill_whole_hosts(self, capsys: pytest.CaptureFixture[str]) -> None:
        """``--gpus`` that does not fill 8-GPU hosts is refused before anything is created."""
        with pytest.raises(SystemExit) as refused:
            bench.main(["--gpus", "203"])
        assert refused.value.code == 2 and "multiple of 8" in capsys.readouterr().err

    @pytest.mark.postgres
    @pytest.mark.usefixtures("postgres_url")
    async def test_throwaway_database_is_dropped_on_failure(self) -> None:
        """The benchmark's database is gone after a run that fails half-way."""
        with pytest.raises(RuntimeError, match="half-way"):
            async with bench.fresh_database(PG_ADMIN_URL) as url:
                name = url.rsplit("/", 1)[1]
                raise RuntimeError("half-way")
        admin = await asyncpg.connect(PG_ADMIN_URL, timeout=10)
        try:
            assert await admin.fetchval("SELECT count(*) FROM pg_database WHERE datname = $1", name) == 0
        finally:
            await admin.close()
