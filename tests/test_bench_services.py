"""The services benchmark still runs in its production-shaped layout: ``--layout processes``, the relay and the three
agents in child processes of their own (the relay over the Redis bus and registry under the run's prefix), a small run
through the endpoint and directly; it prints each process's CPU per request and records its figures. No timing is
asserted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "bench_services.py"
REDIS_URL = os.environ.get("GPUMARKET_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the replicas' loop-mounted disks, the container engine)")
def test_processes_layout_reports_each_process_and_leaves_no_keys(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    env = {**os.environ, "GPUMARKET_BENCH_RESULTS": str(results),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    argv = [sys.executable, str(BENCH), "--layout", "processes", "--requests", "400", "--round-trips", "20", "--scale-ups", "0"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)  # a hang guard
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert re.search(r"requests/s, 16 at once: endpoint [\d,]+, direct [\d,]+", out), out
    for who in ("the master's process \\(API, gateway, loops\\)'s", "the relay's process's", "the agents' processes'"):
        assert re.search(rf"{who} CPU per request: endpoint [\d,]+ µs, direct [\d,]+ µs", out), (who, out)
    figures = {f["figure"] for f in json.loads(results.read_text(encoding="utf-8"))["figures"]}
    assert "the relay's process's CPU per endpoint request" in figures, figures
    assert "the master's process's CPU per endpoint request (API, gateway, background loops)" in figures, figures
    [prefix] = re.findall(r"the Redis bus and registry under (bench-services-[0-9a-f]+:)", out)
    client = redis.Redis.from_url(REDIS_URL)
    assert not list(client.scan_iter(match=f"{prefix}*")), "the run's bus and registry keys were left in Redis"
