"""How the renter's commands write: one-line errors on stderr, tables and amounts as the console writes them, JSON,
times and sizes, an object's events."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shared.money import format_usd


def err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def money_column(values: Sequence[str | None], kind: str = "total") -> list[str]:
    """Amounts as the console writes them (``shared.money.format_usd``), aligned on the decimal point; ``-`` for none."""
    shown = [format_usd(value, kind, missing="-") for value in values]
    dots = [text.find(".") if "." in text else len(text) for text in shown]
    return [" " * (max(dots) - dot) + text for text, dot in zip(shown, dots, strict=True)]


def money(value: str | None, kind: str = "total") -> str:
    return format_usd(value, kind, missing="-")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in [headers, *rows]]
    return "\n".join(lines)


def short_time(iso: str | None) -> str:
    return iso[:19].replace("T", " ") if iso else "-"


def gib(mib: Any) -> str:
    return f"{round(mib / 1024)} GiB" if isinstance(mib, int | float) else "-"


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2))


def event_lines(events: Sequence[Mapping[str, Any]], what: Callable[[Mapping[str, Any]], str]) -> list[str]:
    """A blank line, ``events:`` and a line per event (its time, ``what`` happened, its cause); none without events."""
    if not events:
        return []
    return ["", "events:"] + [f"  {short_time(e.get('at'))}  {what(e)}" + (f": {e['cause']}" if e.get("cause") else "") for e in events]
