"""One way to write money: ``format_usd`` (shared/money.py, the CLI's) and ``formatUsd`` (console/static/money.js).

The JavaScript runs in Node (``/usr/bin/node``, or ``GPUMARKET_TEST_NODE``) over the same corpus as the Python,
and the two must write every amount alike.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
from decimal import Decimal
from pathlib import Path

import pytest

from billing.ledger import money
from master.api.openapi import build_openapi
from master.api.table import ROUTES
from shared.money import format_usd

MONEY_JS = Path(__file__).resolve().parents[1] / "console" / "static" / "money.js"


def _corpus() -> list[str]:
    """Decimal strings as the API writes them, the edges of rounding and grouping, and a seeded random spread."""
    edges = [
        "0", "0.000000", "-0.00", "0.3", "0.30", "0.300000", "0.45", "0.004999", "0.005", "0.005000", "0.0049999999",
        "0.000125", "0.0000005", "0.00000049", "0.0000004", "0.000001", "0.1234565", "0.1234564", "1", "12", "999.995",
        "999.994999", "1000", "1234.5", "1234567.891", "999999.999999", "99999999999999999999.99", "-0.004", "-1234.567",
        "-0.0000001", "007.50", "5.", "1e3", "abc", "", " 0.45 ",
    ]  # fmt: skip
    draw = random.Random(23)
    spread = []
    for _ in range(400):
        whole = str(draw.choice([0, 0, 0, draw.randrange(10), draw.randrange(10**4), draw.randrange(10**9)]))
        places = draw.randrange(0, 11)
        fraction = "".join(draw.choice("0123456789") for _ in range(places))
        sign = "-" if draw.random() < 0.1 else ""
        spread.append(f"{sign}{whole}.{fraction}" if places else f"{sign}{whole}")
    return edges + spread


def _node() -> str:
    node = os.environ.get("GPUMARKET_TEST_NODE") or shutil.which("node") or "/usr/bin/node"
    assert Path(node).exists(), f"{node} is missing: the money formatter's agreement test runs money.js in Node"
    return node


def _format_in_node(tmp_path: Path, cases: list[dict[str, str]]) -> list[str]:
    module = tmp_path / "money.mjs"  # .mjs: an ES module whatever the Node version
    module.write_text(MONEY_JS.read_text(encoding="utf-8"), encoding="utf-8")
    script = tmp_path / "run.mjs"
    script.write_text(
        'import { formatUsd } from "./money.mjs";\n'
        'import { readFileSync } from "node:fs";\n'
        "const cases = JSON.parse(readFileSync(0, 'utf8'));\n"
        "process.stdout.write(JSON.stringify(cases.map((c) => formatUsd(c.amount, { kind: c.kind, per: c.per }))));\n",
        encoding="utf-8",
    )
    done = subprocess.run([_node(), str(script)], input=json.dumps(cases), capture_output=True, text=True, timeout=60, check=True)
    result: list[str] = json.loads(done.stdout)
    return result


class TestFormatUsd:
    @pytest.mark.parametrize(
        ("amount", "kind", "per", "shown"),
        [
            ("0.300000", "total", "", "$0.30"),
            ("1234567.891", "total", "", "$1,234,567.89"),
            ("999.995", "total", "", "$1,000.00"),
            ("0.004999", "total", "", "<$0.01"),
            ("-12.5", "total", "", "-$12.50"),
            ("0.300000", "rate", "h", "$0.30/h"),
            (Decimal("0.45") / 3600, "rate", "s", "$0.000125/s"),
            ("0.1234565", "rate", "", "$0.123457"),
            (Decimal("1E-7"), "rate", "s", "<$0.000001/s"),
            (Decimal("2.5E+4"), "total", "", "$25,000.00"),
        ],
    )
    def test_totals_in_cents_rates_to_the_millionth_grouped_and_never_scientific(
        self, amount: Decimal | str, kind: str, per: str, shown: str
    ) -> None:
        """A total is rounded half up to the cent, a rate keeps its decimals to a millionth; thousands grouped; no exponent."""
        assert format_usd(amount, kind, per=per) == shown

    def test_nothing_and_what_is_no_amount(self) -> None:
        """None reads as the placeholder asked for, text that is no decimal as it is, and an unknown kind is refused."""
        assert (format_usd(None), format_usd(None, missing="-"), format_usd("n/a")) == ("—", "-", "n/a")
        with pytest.raises(ValueError, match="kind"):
            format_usd("1", "price")

    def test_the_console_and_the_cli_write_every_amount_alike(self, tmp_path: Path) -> None:
        """money.js's formatUsd, run in Node, writes each amount of the corpus exactly as format_usd does, both kinds."""
        cases = [{"amount": amount, "kind": kind, "per": per} for amount in _corpus()
                 for kind, per in (("total", ""), ("rate", ""), ("rate", "s"))]  # fmt: skip
        expected = [format_usd(case["amount"], case["kind"], per=case["per"]) for case in cases]
        got = _format_in_node(tmp_path, cases)
        differ = [(case, py, js) for case, py, js in zip(cases, expected, got, strict=True) if py != js]
        assert differ == [], differ[:10]


class TestOpenApiMoney:
    def test_the_document_describes_the_decimal_strings_the_ledger_writes(self) -> None:
        """The OpenAPI document's Money schema matches every amount billing writes, and no float, exponent or separator."""
        document = build_openapi(ROUTES)
        schema = document["components"]["schemas"]["Money"]
        assert "#/components/schemas/Money" in document["info"]["description"]
        assert "60-second minimum" in schema["description"]
        pattern = re.compile(schema["pattern"])
        for amount in ("0", "0.45", "-12.5", "1234567.891", "0.0000004"):
            assert pattern.fullmatch(money(Decimal(amount))), amount
        for written in ("1e3", "1,000.00", "0.45 ", "$1", ".5", "NaN"):
            assert not pattern.fullmatch(written), written
