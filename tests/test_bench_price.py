"""The price bench still runs: on a small trace of its own it prints the rule's table beside the plain placer and
records allocation and price beside their baselines. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "bench_price.py"


def test_a_small_trace_prints_the_rule_beside_the_plain_placer(tmp_path: Path) -> None:
    nodes = ["sn,cpu_milli,memory_mib,gpu,model"] + [f"n{i},32000,131072,4,{('T4', 'P100', 'G2', 'V100M32')[i % 4]}" for i in range(24)]
    (tmp_path / "openb_node_list_gpu_node.csv").write_text("\n".join(nodes) + "\n")
    pods = ["name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec"] + [
        f"p{i},{2000 * (1 + i % 3)},4096,{(1, 1, 2, 4, 1)[i % 5]},{(1000, 500, 1000, 1000, 1000)[i % 5]},{'T4' if i % 7 == 0 else ''}"
        for i in range(60)
    ]  # fmt: skip
    (tmp_path / "openb_pod_list_tiny.csv").write_text("\n".join(pods) + "\n")
    results = tmp_path / "results.json"
    env = {**os.environ, "GPUMARKET_BENCH_RESULTS": str(results),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    command = [sys.executable, str(BENCH), "--trace-dir", str(tmp_path), "--traces", "tiny", "--seeds", "1-2", "--jobs", "1",
               "--json", str(tmp_path / "out.json")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| tiny |")]
    assert [row.split("|")[2].strip() for row in rows] == ["0", "0.05", "0.2", "inf"]
    assert rows[-1].split("|")[4].strip() == "+0.00"  # the plain placer against itself
    out = json.loads((tmp_path / "out.json").read_text())
    by_tolerance = {row["tolerance"]: row for row in out["rows"]}
    assert by_tolerance["0"]["price_at_50"] < by_tolerance["inf"]["price_at_50"]  # the rule pays less while there is room
    figures = json.loads(results.read_text())["figures"]
    assert {f["baseline"] for f in figures} == {"plain fgd_net"} and len(figures) == 6
