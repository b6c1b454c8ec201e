"""The console and the CLI say the same about a cluster's private network: ``clusternet.js`` ``networkSummary`` run in
Node against ``gpumarket.renter.clusters.network_summary`` over random networks (states, pairs with figures or errors)."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any

from gpumarket.renter.clusters import network_summary
from tests.test_money_format import _node

CLUSTERNET_JS = Path(__file__).resolve().parents[1] / "console" / "static" / "clusternet.js"
STATES = ("pending", "creating", "connecting", "measuring", "up", "failed", "none", "deleted")


def _network(rng: random.Random) -> dict[str, Any] | None:
    if rng.random() < 0.05:
        return None
    pairs: list[dict[str, object]] = []
    for a in range(rng.randint(0, 4)):
        for b in range(a + 1, 5):
            if rng.random() < 0.2:
                pairs.append({"a": a, "b": b, "rtt_ms": None, "mbit_s": None, "error": f"node-{b} did not answer"})
            else:
                pairs.append({"a": a, "b": b, "rtt_ms": rng.choice([None, round(rng.uniform(0.001, 400), 3), 2.0]),
                              "mbit_s": rng.choice([None, round(rng.uniform(0.1, 40000), 1), 900.0]), "error": None})  # fmt: skip
    return {"state": rng.choice(STATES), "reason": rng.choice([None, "node-1 (r-1): wireguard-go is not installed"]),
            "subnet": "10.70.1.0/24", "pairs": pairs}  # fmt: skip


def test_console_and_cli_say_the_same(tmp_path: Path) -> None:
    rng = random.Random(24)
    networks = [_network(rng) for _ in range(400)]
    module = tmp_path / "clusternet.mjs"
    module.write_text(CLUSTERNET_JS.read_text(encoding="utf-8"), encoding="utf-8")
    script = tmp_path / "run.mjs"
    script.write_text(
        'import { networkSummary } from "./clusternet.mjs";\nimport { readFileSync } from "node:fs";\n'
        "process.stdout.write(JSON.stringify(JSON.parse(readFileSync(0, 'utf8')).map(networkSummary)));\n",
        encoding="utf-8",
    )
    done = subprocess.run([_node(), str(script)], input=json.dumps(networks), capture_output=True, text=True, timeout=60, check=True)
    console = json.loads(done.stdout)
    cli = [network_summary(n) for n in networks]
    assert console == cli
    assert any(line.startswith("up on 10.70.1.0/24: worst round trip") for line in cli)
    assert any("pair(s) unreachable" in line for line in cli) and "not made yet" in cli
