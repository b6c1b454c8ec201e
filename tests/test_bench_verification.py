"""The verification benchmark still runs: a small size end to end (an honest host's commitment verified, which it
asserts), its table and its figures beside their baselines in the results file. No timing is asserted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "bench_verification.py"


def test_a_small_run_prints_host_verifier_and_baseline_and_records_them(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    env = {**os.environ, "GPUMARKET_BENCH_RESULTS": str(results),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    result = subprocess.run([sys.executable, str(BENCH), "--sizes", "64", "--rounds", "1"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT, env=env)  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert out.startswith("machine: ")
    assert re.search(r"^\s+64\s+[\d.]+ ms\s+[\d.]+ ms\s+[\d.]+ ms\s+[\d.]+%$", out, re.MULTILINE), out
    assert re.search(r"verifier's arithmetic at the H200's bf16 size n = 130232: \d+ ms", out), out
    figures = json.loads(results.read_text(encoding="utf-8"))["figures"]
    assert [(f["bench"], f["unit"], f["baseline"]) for f in figures] == [
        ("verification", "ms", "numpy float32 matmul alone"), ("verification", "ms", "the host's work"),
        ("verification", "ms", "the H200's product alone (measured rate)"),
    ]  # fmt: skip
    assert all(f["value"] > 0 and f["baseline_value"] > 0 for f in figures)
