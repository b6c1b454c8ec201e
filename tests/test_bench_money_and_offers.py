"""The billing and offer-search benchmarks still run, at a tiny scale, against the real PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PG_ADMIN_URL

BENCH = Path(__file__).resolve().parent.parent / "bench"


def run_bench(script: str, *args: str, tmp_path: Path) -> tuple[str, dict[str, object]]:
    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, str(BENCH / script), *args, "--admin-url", PG_ADMIN_URL, "--json", str(out)],
        capture_output=True, text=True, timeout=180, cwd=BENCH.parent,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("machine: ")
    return result.stdout, json.loads(out.read_text())


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.usefixtures("postgres_url")  # fails the test, saying how to start PostgreSQL
class TestBenchmarks:
    def test_billing_bench_balances_and_matches_its_reference(self, tmp_path: Path) -> None:
        """Rating 400 rentals: every rental rated, the books balanced, the charge equal to the independent calculation."""
        stdout, result = run_bench("bench_billing.py", "--rentals", "400", "--batch", "50", tmp_path=tmp_path)
        assert result["rated"] == 400 and result["balanced"] is True and result["matches_reference"] is True
        assert result["invoices_match_ledger"] is True and result["documents"] == 40 + 8  # 400 rentals: 40 renters, 8 providers
        assert isinstance(result["postings"], int) and result["postings"] >= 400
        assert "postings/s" in stdout and "match" in stdout

    def test_offer_bench_answers_every_query(self, tmp_path: Path) -> None:
        """800 GPUs: every query returns offers consistent with the fleet, with p50 ≤ p99 ≤ max."""
        stdout, result = run_bench("bench_offers.py", "--gpus", "800", "--repeat", "3", tmp_path=tmp_path)
        fleet = result["fleet"]
        assert isinstance(fleet, dict) and fleet["gpus"] == 800 and fleet["hosts"] == 100
        queries = result["queries"]
        assert isinstance(queries, dict) and len(queries) == 10
        everything = queries["no filter (best score first)"]["matches"]
        for label, figures in queries.items():
            assert figures["p50_ms"] <= figures["p99_ms"] <= figures["max_ms"], label
            assert 0 < figures["matches"] <= everything, label
            if "deep page" not in label:
                assert figures["returned"] == min(50, figures["matches"]), label
        assert queries["deep page (offset 5,000)"]["returned"] == 0  # fewer offers than the offset
        assert "p99 over every query" in stdout
