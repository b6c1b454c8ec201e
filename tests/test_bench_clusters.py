"""The clusters benchmark still runs: ``--quick`` on a small fleet prints gang placement's figures beside the
single-node baseline and records them in the results file. No timing is asserted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "bench_clusters.py"
NUMBER = r"[\d,]+\.?\d*"


def test_quick_run_prints_gang_placement_beside_its_baseline(tmp_path: Path) -> None:
    """A tiny fleet and no trace (an empty --trace-dir): the speed table, the links table, the skipped trace and the
    tunnel's place."""
    results = tmp_path / "results.json"
    env = {**os.environ, "GPUMARKET_BENCH_RESULTS": str(results),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    command = [
        sys.executable,
        str(BENCH),
        "--quick",
        "--hosts",
        "300",
        "--decisions",
        "30",
        "--trace-dir",
        str(tmp_path),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert out.startswith("machine: ") and "300 hosts (2,400 GPUs" in out
    rows = {
        name: re.search(rf"  {re.escape(name)}\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})\s+(\d+)", out)
        for name in ("gang placement (place_gang)", "single-node placement (baseline)")
    }
    for name, row in rows.items():
        assert row is not None, (name, out)
        per_s, p50, p99, placed = (float(value.replace(",", "")) for value in row.groups())
        assert per_s > 0 and 0 < p50 <= p99 and 0 < placed <= 30
    assert re.search(rf"ratio gang / baseline: {NUMBER}× the decisions per second", out), out
    assert "Trace: skipped" in out and "Tunnel throughput between a cluster's nodes: not measured yet" in out
    assert re.search(rf"\n\s+100\s+1%\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\n", out), out  # the links runs, 100 hosts
    figures = json.loads(results.read_text(encoding="utf-8"))["figures"]
    assert [(f["bench"], f["unit"]) for f in figures] == [("clusters", "decisions/s"), ("clusters", "ms")]
    assert all(f["value"] > 0 and f["baseline_value"] > 0 for f in figures)


def test_the_trace_comparison_runs_on_the_fixture_slice(tmp_path: Path) -> None:
    """The test slice of the trace, named as the bench expects: both modes' rows and the gang − base line."""
    trace = tmp_path / "trace"
    trace.mkdir()
    fixtures = ROOT / "tests" / "fixtures" / "trace"
    (trace / "openb_node_list_gpu_node.csv").write_text((fixtures / "nodes.csv").read_text())
    (trace / "openb_pod_list_default.csv").write_text((fixtures / "pods.csv").read_text())
    env = {**os.environ, "GPUMARKET_BENCH_RESULTS": str(tmp_path / "results.json"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    command = [sys.executable, str(BENCH), "--quick", "--skip-speed", "--trace-dir", str(trace)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    for mode in ("gang", "one_at_a_time"):
        row = re.search(
            rf"  default\s+fgd_net\s+{mode}\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})", out
        )
        assert row is not None, out
        clusters, placed_pct, _, alloc = (float(value) for value in row.groups())
        assert clusters > 0 and 0 <= placed_pct <= 100 and 0 < alloc <= 100
    assert re.search(r"gang − base\s+[+-]\d", out), out
