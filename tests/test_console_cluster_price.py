"""The "Rent a cluster" dialog's price of the whole cluster (``estimate`` in ``console/static/pages-clusters.js``),
run in Node (``/usr/bin/node``, or ``GPUMARKET_TEST_NODE``) as ``tests/test_money_format.py`` runs ``money.js``."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

from tests.test_money_format import _node

STATIC = Path(__file__).resolve().parent.parent / "console" / "static"

OFFERS = [
    {"host_id": "a", "gpu_name": "X", "num_gpus": 2, "price_per_gpu_hour": "0.400000"},
    {"host_id": "b", "gpu_name": "X", "num_gpus": 1, "price_per_gpu_hour": "0.500000"},
    {"host_id": "c", "gpu_name": "Y", "num_gpus": 4, "price_per_gpu_hour": "1.100000"},
    {"host_id": "d", "gpu_name": "X", "num_gpus": 1, "price_per_gpu_hour": "0.450000"},
    {"host_id": "c", "gpu_name": "Z", "num_gpus": 1, "price_per_gpu_hour": "0.200000"},
]


def _run(tmp_path: Path, calls: list[dict[str, Any]]) -> list[Any]:
    """``estimate(OFFERS, call)`` for each call, with the console's modules copied as ``.mjs`` (ES modules in any Node)."""
    for script in STATIC.glob("*.js"):
        text = re.sub(r'from "\./([\w-]+)\.js"', r'from "./\1.mjs"', script.read_text(encoding="utf-8"))
        (tmp_path / f"{script.stem}.mjs").write_text(text, encoding="utf-8")
    runner = tmp_path / "run.mjs"
    runner.write_text(
        'import { estimate } from "./pages-clusters.mjs";\n'
        'import { readFileSync } from "node:fs";\n'
        "const { offers, calls } = JSON.parse(readFileSync(0, 'utf8'));\n"
        "process.stdout.write(JSON.stringify(calls.map((c) => estimate(offers, c))));\n",
        encoding="utf-8",
    )
    done = subprocess.run([_node(), str(runner)], input=json.dumps({"offers": OFFERS, "calls": calls}), capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    result: list[Any] = json.loads(done.stdout)
    return result


def test_the_price_is_the_cheapest_and_dearest_set_of_hosts_that_fit(tmp_path: Path) -> None:
    """One model: the two cheapest and the two dearest hosts of X; mixed: every host counts once, at its own cheapest
    or dearest offer; 2 GPUs per node: only one host of each model has room, so no price and the count of hosts."""
    one_model, mixed, too_big = _run(tmp_path, [
        {"nodes": 2, "gpus": 1, "mixed": False}, {"nodes": 3, "gpus": 1, "mixed": True}, {"nodes": 2, "gpus": 2, "mixed": False},
    ])  # fmt: skip
    assert one_model == {"low": "0.85", "high": "0.95", "hosts": 3}
    assert mixed == {"low": "1.05", "high": "2.05", "hosts": 4}  # c at 0.20 (Z) or 1.10 (Y); then a 0.40, d 0.45 / b 0.50, d 0.45
    assert too_big == {"low": None, "high": None, "hosts": 1}
