"""The argument types and option groups the renter's commands share (argparse): counts, ports, prices, limits, a
cluster's network bounds, and the login file and timeout every command takes."""

from __future__ import annotations

import argparse
import math
from decimal import Decimal
from pathlib import Path

from shared.money import MAX_PRICE, PRICE_PLACES, amount_problem


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def failover_seconds(text: str) -> int:
    """``--failover-after``: whole seconds, 10 to 86400 (the API's bounds on ``failover_after_s``)."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be whole seconds (10 to 86400), not {text[:20]!r}")
    value = int(text)
    if not 10 <= value <= 86400:
        raise argparse.ArgumentTypeError(f"must be between 10 and 86400 seconds, not {value}")
    return value


def bound(text: str) -> float:
    """A network bound: a finite number, not negative (the API checks each bound's own range and says which)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, not {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of at least 0, not {text!r}")
    return value


NETWORK_BOUNDS = (("max_latency_ms", "MS", "no two nodes on hosts measured further apart (round trip, ms)"),
                  ("max_loss_pct", "PCT", "no two nodes on hosts measured losing more packets (%%)"),
                  ("min_mbit_s", "MBIT", "no two nodes on hosts measured slower (Mbit/s)"))  # fmt: skip


def add_network_bounds(parser: argparse.ArgumentParser, *, prefix: str = "") -> None:
    """``--max-latency-ms``, ``--max-loss-pct``, ``--min-mbit-s``: a cluster's network bounds (docs/clusters.md)."""
    for name, metavar, text in NETWORK_BOUNDS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=bound, metavar=metavar, help=prefix + text)


def network_bounds(args: argparse.Namespace) -> dict[str, float]:
    """The bounds given, by their API names."""
    return {name: value for name, _, _ in NETWORK_BOUNDS if (value := getattr(args, name, None)) is not None}


def limit(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 500:
        raise argparse.ArgumentTypeError(f"must be 1 to 500, not {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def usd(text: str) -> str:
    """A price in USD per GPU-hour as the API takes it (shared/money.py: 0.45; no sign, exponent, separator, "$" or spaces)."""
    problem, amount = amount_problem(text, places=PRICE_PLACES, maximum=MAX_PRICE, positive=True)
    if amount is None:
        raise argparse.ArgumentTypeError(problem)
    return text


def price_tolerance(text: str) -> str:
    """``--price-tolerance``: a fraction of the cheapest price (0.05) or a percentage (5%), 0 to 10 (1000 %), as the API
    takes it (a plain decimal string; master/scheduler/price.py checks it again and answers 400 if not)."""
    percent = text.endswith("%")
    number = text[:-1] if percent else text
    problem, amount = amount_problem(number, places=2 if percent else 4, maximum=Decimal(1000) if percent else Decimal(10))
    if amount is None:
        raise argparse.ArgumentTypeError(f"must be a fraction like 0.05 or a percentage like 5% (0 to 10, or 1000%): {problem}")
    return format((amount / 100).normalize(), "f") if percent else number


def port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 1 to 65535, not {value}")
    return value


def common_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="the login file (default $XDG_CONFIG_HOME/gpumarket/config.json, or $GPUMARKET_CONFIG)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=30.0, metavar="S", help="seconds one API call may take (default 30)")
    parser.add_argument("--team", metavar="TEAM", help="act for this team (its name or id; 'personal': yourself) instead of "
                        "the one `gpumarket team use` chose (or $GPUMARKET_TEAM)")  # fmt: skip
