"""The tunnel benchmark still runs: ``--quick`` end to end (real relay, real agent, a renter process),
prints every figure beside its baseline and records its headline figures in the results file. No
timing is asserted: the goals' verdicts may read OK or MISSED."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "bench_tunnel.py"
NUMBER = r"[\d,]+\.?\d*"


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "lag_of"), [("processes", "the agent's"), ("one-process", "relay+agent")])
def test_quick_run_prints_every_figure_beside_its_baseline(tmp_path: Path, layout: str, lag_of: str) -> None:
    results = tmp_path / "results.json"
    env = {**os.environ, "GPUMARKET_BENCH_RESULTS": str(results),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "--layout", layout], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env=env)  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert out.startswith("machine: ") and "layout: " in out
    for direction in ("upload   renter → rental", "download rental → renter"):
        assert re.search(rf"{direction}\s+{NUMBER} MB/s\s+{NUMBER} MB/s\s+{NUMBER}×\s+≥300 MB/s (OK|MISSED), ≥0.3× (OK|MISSED)\s+CPU: relay\+agent \d+%", out), out
    rows = {name: re.search(rf"  {re.escape(name)}\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})", out) for name in (
        "tunnel", "direct TCP (baseline)", "through the tunnel, same link", "direct TCP, 20 direct copies",
        "through the tunnel at rest", f"event-loop lag, {lag_of} process", "beside 20 tunnel copies", "idle (baseline)",
    )}  # fmt: skip
    assert all(rows.values()), {name: bool(row) for name, row in rows.items()}
    for name, row in rows.items():
        assert row is not None
        p50, p99, top = (float(value.replace(",", "")) for value in row.groups())
        assert p50 <= p99 <= top, (name, row.group(0))
    assert re.search(r"added by the tunnel, p50\s+-?\d+\.\d\d .*goal < 1 ms: (OK|MISSED)", out), out
    assert re.search(r"tunnel p99 \d+\.\d ms: .*goal < 20 ms: (OK|MISSED)", out), out
    assert re.search(r"beside copies p99 \d+\.\d× idle; max \d+ ms", out), out
    figures = json.loads(results.read_text(encoding="utf-8"))["figures"]
    assert [(f["bench"], f["unit"], f["baseline"]) for f in figures] == [
        ("tunnel", "MB/s", "direct TCP"), ("tunnel", "MB/s", "direct TCP"), ("tunnel", "ms", "direct TCP echo"),
        ("tunnel", "ms", "direct TCP beside 20 direct copies"),
    ]  # fmt: skip
    assert all(f["value"] > 0 and f["baseline_value"] > 0 for f in figures)
    assert all(f"layout {layout}" in f["note"] for f in figures[:2]), figures
