"""The power bench still runs: on the test slice of the trace, tuning one weight and testing it, it prints pwr_fgd
against fgd and records its figures. No timing is asserted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "bench_power.py"
FIXTURES = ROOT / "tests" / "fixtures" / "trace"


def test_the_slice_tunes_tests_and_records(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    trace.mkdir()
    (trace / "openb_node_list_gpu_node.csv").write_text((FIXTURES / "nodes.csv").read_text())
    (trace / "openb_pod_list_default.csv").write_text((FIXTURES / "pods.csv").read_text())
    results = tmp_path / "results.json"
    env = {**os.environ, "GPUMARKET_BENCH_RESULTS": str(results),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    command = [sys.executable, str(BENCH), "--trace-dir", str(trace), "--traces", "default", "--tune", "--alphas",
               "5,20", "--tune-seeds", "1-2", "--test-seeds", "3-4", "--jobs", "1"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert re.search(r"\| 5 \| default [+-]\d+\.\d\d \|", out) and re.search(r"\| 20 \| default [+-]\d+\.\d\d \|", out)
    assert re.search(r"chosen alpha = (5|20)|taking the one losing least", out), out
    row = re.search(r"\| default \| ([+-]\d+\.\d\d)±\d+\.\d\d \| (-?\d+\.\d\d)±", out)
    assert row is not None, out
    figures = {f["figure"].split(" (")[0]: f for f in json.loads(results.read_text(encoding="utf-8"))["figures"]}
    assert len(figures) == 4 and all(f["bench"] == "power" and f["component"] == "placement" for f in figures.values())
    saved = figures["pwr_fgd energy saved against fgd"]["value"]
    assert saved == float(row.group(2)) or abs(saved - float(row.group(2))) < 0.006
    # The ceiling (any placement at fgd's allocation) lies above what pwr_fgd saves; capping idle GPUs only lowers power.
    assert figures["the most any placement could save at fgd's allocation"]["value"] >= saved - 1e-9
    capped = figures["pwr_fgd with off-peak caps, energy saved against fgd uncapped"]
    assert capped["value"] > saved and capped["baseline_value"] > 0
