"""The "Rent a cluster" dialog's price of the whole cluster (``estimate`` in ``console/static/pages-clusters.js``, over
``GET /offers/clusters``' answer), run in Node (``/usr/bin/node``, or ``GPUMARKET_TEST_NODE``) as
``tests/test_money_format.py`` runs ``money.js``. The answers are the server's own grouping
(``master.services.market.cluster_offers``) of the offers below."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

from master.services.market.cluster_offers import HostOffer, group_cluster_offers, most_nodes
from tests.test_money_format import _node

STATIC = Path(__file__).resolve().parent.parent / "console" / "static"

Offer = tuple[str, str, int, str, str | None]  # host, model, free GPUs, price per GPU-hour, region

OFFERS: list[Offer] = [
    ("a", "X", 2, "0.400000", None),
    ("b", "X", 1, "0.500000", None),
    ("c", "Y", 4, "1.100000", None),
    ("d", "X", 1, "0.450000", None),
    ("c", "Z", 1, "0.200000", None),
]


def answer(offers: Sequence[Offer], *, nodes: int, gpus: int, mixed: bool) -> dict[str, Any]:
    """What GET /offers/clusters answers for these offers (its items and max_nodes)."""
    fitting = [HostOffer(host, model, region, Decimal(price)) for host, model, free, price, region in offers if free >= gpus]
    items = group_cluster_offers(fitting, nodes=nodes, gpus_per_node=gpus, allow_mixed=mixed)
    return {"items": [i.view() for i in items], "max_nodes": most_nodes(fitting, allow_mixed=mixed)}


def _run(tmp_path: Path, answers: list[dict[str, Any]]) -> list[Any]:
    """``estimate(answer)`` for each answer, with the console's modules copied as ``.mjs`` (ES modules in any Node)."""
    for script in STATIC.glob("*.js"):
        text = re.sub(r'from "\./([\w-]+)\.js"', r'from "./\1.mjs"', script.read_text(encoding="utf-8"))
        (tmp_path / f"{script.stem}.mjs").write_text(text, encoding="utf-8")
    runner = tmp_path / "run.mjs"
    runner.write_text(
        'import { estimate } from "./pages-clusters.mjs";\n'
        'import { readFileSync } from "node:fs";\n'
        "const answers = JSON.parse(readFileSync(0, 'utf8'));\n"
        "process.stdout.write(JSON.stringify(answers.map((a) => estimate(a))));\n",
        encoding="utf-8",
    )
    done = subprocess.run([_node(), str(runner)], input=json.dumps(answers), capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    result: list[Any] = json.loads(done.stdout)
    return result


def _decimals(price: dict[str, Any]) -> dict[str, Any]:
    return {k: Decimal(v) if k in ("low", "high") and v is not None else v for k, v in price.items()}


def test_the_price_is_the_cheapest_and_dearest_set_of_hosts_that_fit(tmp_path: Path) -> None:
    """One model: the two cheapest and the two dearest hosts of X; mixed: every host counts once, at its own cheapest
    or dearest offer; 2 GPUs per node: only one host of each model has room, so no price and the count of hosts."""
    one_model, mixed, too_big = _run(tmp_path, [
        answer(OFFERS, nodes=2, gpus=1, mixed=False), answer(OFFERS, nodes=3, gpus=1, mixed=True),
        answer(OFFERS, nodes=2, gpus=2, mixed=False),
    ])  # fmt: skip
    assert _decimals(one_model) == {"low": Decimal("0.85"), "high": Decimal("0.95"), "hosts": 3}
    # c at 0.20 (Z) or 1.10 (Y); then a 0.40, d 0.45 / b 0.50, d 0.45
    assert _decimals(mixed) == {"low": Decimal("1.05"), "high": Decimal("2.05"), "hosts": 4}
    assert too_big == {"low": None, "high": None, "hosts": 1}


def test_groups_in_one_region_are_what_placement_takes_when_there_are_any(tmp_path: Path) -> None:
    """X has two hosts in eu (placement keeps the cluster there); Y's cheaper hosts span regions and are left out of the
    range while a region has room, and count when none has."""
    offers: list[Offer] = [
        ("a", "X", 1, "0.400000", "eu"), ("b", "X", 1, "0.500000", "eu"),
        ("c", "Y", 1, "0.100000", "eu"), ("d", "Y", 1, "0.100000", "us"),
    ]  # fmt: skip
    in_region, across = _run(tmp_path, [answer(offers, nodes=2, gpus=1, mixed=False), answer(offers[2:], nodes=2, gpus=1, mixed=False)])
    assert _decimals(in_region) == {"low": Decimal("0.90"), "high": Decimal("0.90"), "hosts": 2}
    assert _decimals(across) == {"low": Decimal("0.20"), "high": Decimal("0.20"), "hosts": 2}
