"""The printable page of an invoice or statement (``billing/invoices.py`` computes the document): one self-contained
HTML file, inline CSS, no scripts, no external resources, every text from the data escaped.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from billing.invoice_storage import storage_rows
from billing.invoices import CHARGE_KINDS

CENT = Decimal("0.01")

_STYLE = """
body { font: 13px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #111; margin: 2rem auto; max-width: 64rem; padding: 0 1rem; }
h1 { font-size: 1.5rem; margin: 0 0 .25rem; } h2 { font-size: 1.05rem; margin: 1.6rem 0 .4rem; }
.meta { color: #444; margin: 0 0 1rem; } .meta td { padding: .1rem 1rem .1rem 0; border: 0; }
table { border-collapse: collapse; width: 100%; }
th, td { padding: .3rem .45rem; border-bottom: 1px solid #ddd; text-align: left; vertical-align: top; }
thead th { border-bottom: 2px solid #333; font-weight: 600; }
.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.detail td { color: #555; font-size: .92em; border-bottom: 1px dotted #e3e3e3; }
table.summary { width: auto; min-width: 22rem; margin-left: auto; } table.summary tr.total th, table.summary tr.total td { border-top: 2px solid #333; font-weight: 700; }
.note { color: #666; font-size: .9em; margin-top: 1.5rem; }
@media print { body { margin: 0; max-width: none; font-size: 11px; } tr { break-inside: avoid; } thead { display: table-header-group; } a { color: inherit; text-decoration: none; } }
"""


def format_cents(amount: str | Decimal) -> str:
    """``"1234.567890"`` → ``"1,234.57"`` (half to even, never ``-0.00``)."""
    value = Decimal(amount).quantize(CENT, rounding=ROUND_HALF_EVEN)
    return f"{value.copy_abs() if value == 0 else value:,.2f}"


def _price(amount: str) -> str:
    """A price as people write it: ``"0.420000"`` → ``"0.42"``, ``"0.123457"`` stays."""
    value = Decimal(amount).normalize()
    return f"{value:.{max(2, -int(value.as_tuple().exponent))}f}"


def _gpus(line: dict[str, Any]) -> str:
    if line["gpu_model"] is None:
        return "—"
    share = f" at {line['gpu_milli']}/1000 of each" if line["gpu_milli"] is not None and line["gpu_milli"] != 1000 else ""
    return f"{line['gpu_count']} × {line['gpu_model']}{share}"


def _detail_rows(line: dict[str, Any], columns: int) -> list[str]:
    e = html.escape
    return [
        f"<tr class='detail'><td></td><td colspan='{columns - 2}'>{e(d['label'])} ({e(d['at'][:19])}Z): {e(d['memo'])}</td>"
        f"<td class='num'>{e(format_cents(d['amount']))}</td></tr>"
        for d in line["details"]
    ]


@dataclass(frozen=True)
class _Layout:
    """How one kind of document is laid out: its lines' amount columns, its movements, its summary."""

    lines_title: str
    amount_heads: tuple[str, ...]
    amounts: Callable[[dict[str, Any]], list[str]]  # a line's amounts under amount_heads
    movements_title: str
    movements: str  # the document's key for them
    summary: tuple[tuple[str, str], ...]  # (label, the document's key), the last one the bottom line


_LAYOUTS = {
    "invoice": _Layout(
        "Charges", ("Usage", "Minimum", "Downtime credit", "Corrections", "Total"),
        lambda line: [*(line["amounts"][kind] for kind in CHARGE_KINDS), line["total"]],
        "Payments", "payments",
        (("Opening balance", "opening_balance"), ("Payments", "total_paid"), ("Charges", "total_charged"),
         ("Closing balance", "closing_balance")),
    ),
    "statement": _Layout(
        "Earnings", ("Charged to renter", "Platform fee", "Earned"),
        lambda line: [line["charged"], line["platform_fee"], line["earned"]],
        "Payouts", "payouts",
        (("Opening payable", "opening_payable"), ("Charged to renters", "total_charged"), ("Platform fee", "total_platform_fee"),
         ("Earned", "total_earned"), ("Paid out", "total_paid_out"), ("Closing payable", "closing_payable")),
    ),
}  # fmt: skip


def _body(doc: dict[str, Any], layout: _Layout) -> str:
    e = html.escape
    head = ("Rental", "GPUs", "USD / GPU-hour", "Seconds", *layout.amount_heads)
    rows = []
    for line in doc["lines"]:
        seconds = "" if line["seconds_billed"] is None else f"{line['seconds_billed']:,}"
        price = "" if line["price_per_gpu_hour"] is None else _price(line["price_per_gpu_hour"])
        cells = [line["rental_id"] or "(no rental)", _gpus(line), price, seconds]
        rows.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in cells)
                    + "".join(f"<td class='num'>{e(format_cents(a))}</td>" for a in layout.amounts(line)) + "</tr>")  # fmt: skip
        rows.extend(_detail_rows(line, len(head)))
    storage_head, storage = storage_rows(doc, format_cents)
    rows_of_storage = ["<tr>" + "".join(f"<td class='num'>{e(c)}</td>" if i >= 3 else f"<td>{e(c)}</td>" for i, c in enumerate(cells)) + "</tr>"
                       for cells in storage]  # fmt: skip
    movements = [f"<tr><td>{e(m['at'][:19])}Z</td><td>{e(m['memo'])}</td><td>{e(m['posting'])}</td>"
                 f"<td class='num'>{e(format_cents(m['amount']))}</td></tr>" for m in doc[layout.movements]]  # fmt: skip
    return (_table(layout.lines_title, head, rows, numeric_from=4)
            + (_table("Storage", storage_head, rows_of_storage, numeric_from=3) if storage else "")
            + _table(layout.movements_title, ("Date", "Description", "Reference", "Amount"), movements, numeric_from=3))  # fmt: skip


def _table(title: str, head: Sequence[str], rows: Sequence[str], *, numeric_from: int) -> str:
    e = html.escape
    th = "".join(f"<th class='num'>{e(h)}</th>" if i >= numeric_from else f"<th>{e(h)}</th>" for i, h in enumerate(head))
    tbody = "".join(rows) or f"<tr><td colspan='{len(head)}'>None this month.</td></tr>"
    return f"<h2>{e(title)}</h2>\n<table><thead><tr>{th}</tr></thead><tbody>{tbody}</tbody></table>\n"


def render_html(doc: dict[str, Any]) -> str:
    """A self-contained printable page (inline CSS, no scripts, no external resources) for an invoice or statement.

    Every text that comes from the data is escaped with ``html.escape``. Amounts are shown
    in cents, rounded half to even from the ledger's millionths (the JSON has them exact).
    """
    e = html.escape
    title = f"{'Invoice' if doc['kind'] == 'invoice' else 'Statement'} {doc['id']}"
    layout = _LAYOUTS[doc["kind"]]
    last_day = (datetime.fromisoformat(doc["period"]["end"]) - timedelta(days=1)).date().isoformat()
    summary_rows = "".join(
        f"<tr class='{'total' if i == len(layout.summary) - 1 else 'sum'}'><th>{e(label)}</th>"
        f"<td class='num'>{e(format_cents(doc[key]))} {e(doc['currency'])}</td></tr>"
        for i, (label, key) in enumerate(layout.summary)
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{e(title)}</title>
<style>{_STYLE}</style></head>
<body>
<h1>{e(title)}</h1>
<table class="meta"><tr><td>Account</td><td>{e(doc['account_name'])} ({e(doc['account_id'])})</td></tr>
<tr><td>Period</td><td>{e(doc['period']['start'][:10])} to {e(last_day)} (UTC)</td></tr>
<tr><td>Currency</td><td>{e(doc['currency'])}</td></tr><tr><td>Issued by</td><td>gpumarket</td></tr></table>
<table class="summary">{summary_rows}</table>
{_body(doc, layout)}<p class="note">Amounts are kept to the millionth of a dollar and shown rounded to the cent, so a column may differ
from its total by a cent. Postings are dated when they were made (UTC); usage is posted as it runs.</p>
</body></html>
"""
