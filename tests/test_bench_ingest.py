"""The ingestion benchmark still runs: a tiny fleet, end to end, against the real PostgreSQL and Redis."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PG_ADMIN_URL, REDIS_URL

BENCH = Path(__file__).resolve().parent.parent / "bench" / "bench_ingest.py"


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.usefixtures("postgres_url", "redis_url")  # each fails the test, saying how to start its server
class TestBenchIngest:
    def test_tiny_fleet_runs_and_prints_every_figure(self) -> None:
        """Twenty hosts for two seconds: exit code 0, a row per run (the COPY of the same rows too), the ratios, and
        every sample stored exactly once."""
        result = subprocess.run(
            [
                sys.executable, str(BENCH), "--hosts", "20", "--seconds", "2", "--baseline-limit", "5",
                "--database-url", PG_ADMIN_URL, "--redis-url", REDIS_URL,
            ],
            capture_output=True, text=True, timeout=120, cwd=BENCH.parent.parent,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        out = result.stdout
        assert out.startswith("machine: ")
        assert "samples/s" in out and "GPU samples/s" in out and "lag p50/p99/max s" in out
        rows = [line for line in out.splitlines() if re.match(r"\s+20 (protocol rate|backlog), ", line)]
        assert [row.split()[1:3] for row in rows] == [
            ["protocol", "rate,"], ["backlog,", "batched"], ["backlog,", "COPY"], ["backlog,", "unbatched"]
        ]
        assert len(re.findall(r" \d+\.\d\dx ", rows[1])) == 2, out  # vs the baseline and vs the COPY
        assert " (ceiling) " in rows[2] and " (baseline) " in rows[3], out
        verdicts = [line for line in out.splitlines() if line.startswith("  20 hosts, ")]
        assert len(verdicts) == 4 and all(line.endswith("→ OK") for line in verdicts), out
