"""Cost of the REST body reader (``master.api.jsonbody``) against parsing alone, in one run.

For each item the reader's scans like least (``BODY_ITEMS``: runs of 100 digits, exponents, empty
and 31-deep arrays, escaped strings, ...), a 1 MiB body of it repeated is read ``--rounds`` times by
``decode_json_body`` and by ``pydantic_core.from_json`` alone (the baseline), interleaved; the
medians and their ratio are printed. The scans run at C speed over the whole body, so the reader
costs a few to a few tens of parses of bodies that parse in a few milliseconds; a scan that went
quadratic in a run of digits or brackets takes seconds here (100-digit runs did, before the scans
were anchored; 350,000 empty arrays took 4 s under load when the depth was summed in Python).

Usage: ``python bench/bench_jsonbody.py [--rounds R] [--quick]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import pydantic_core

from master.api.jsonbody import BODY_ITEMS, decode_json_body, largest_body

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import describe_machine, record


def seconds(read: Callable[[bytes], object], body: bytes) -> float:
    started = time.perf_counter()
    read(body)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="reads of each body by each reader (median counts)")
    parser.add_argument("--quick", action="store_true", help="1 round (for make bench QUICK=1)")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    print(describe_machine())
    print(f"\n  {'1 MiB body of':<18} {'from_json ms':>13} {'reader ms':>10}  reader vs from_json")
    for name, item in BODY_ITEMS.items():
        body = largest_body(item)
        parse, read = [], []
        for _ in range(rounds):
            parse.append(seconds(pydantic_core.from_json, body))
            read.append(seconds(decode_json_body, body))
        p, r = statistics.median(parse), statistics.median(read)
        print(f"  {name:<18} {p * 1e3:>13.1f} {r * 1e3:>10.1f}  {r / p:.2f}×")
        record("jsonbody", f"decode_json_body, 1 MiB body of {name}", r * 1e3, "ms", "pydantic_core.from_json", p * 1e3)


if __name__ == "__main__":
    main()
