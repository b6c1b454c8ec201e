"""What the renter's price first costs the fleet, on the Alibaba trace (issue 43, point 3).

For each trace variant and seed, ``master.scheduler.price_simulate.simulate_prices`` replays the trace with the FGD
protocol (inflate 1.3, shuffle, no departures, up to 100 % arrived) and a price per host: its GPU model's price from
``TIER_PRICES`` ± 10 % per host (seeded). The placer (``--placer``, default ``fgd_net``) runs behind the rule at each
``--tolerances`` value (0, 0.05, 0.2 by default), and plain ("inf": the rule off, every pod as today) in the same run:
the baseline. GPU pods that name no model are placed by the rule; pods naming models (the ``gpuspec`` variants) and
CPU-only pods by the plain placer, as in the master.

Reported per trace and tolerance, mean ± σ over the seeds: GPU allocation % at 100 % arrived demand (the FGD paper's
figure, as ``bench_placement.py``), its difference from the plain placer, and the mean price per GPU-hour of the GPUs
placed when arrived demand reached 50 % and 100 % of capacity (what renters pay on average), with the change against
the plain placer. The CPU time of each run (``thread_time``) too: the rule scores a band of nodes afresh per decision.

Usage: ``python bench/bench_price.py [--traces default,gpushare40,gpuspec33,multigpu50] [--seeds 42-44]
[--placer fgd_net] [--tolerances 0,0.05,0.2] [--price MODEL=USD ...] [--jobs N] [--json FILE] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from decimal import Decimal
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Progress, describe_machine, parse_seeds, record

from master.scheduler.price_simulate import TIER_PRICES, simulate_prices
from master.scheduler.trace import load_variant

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
DEFAULT_TRACES = ("default", "gpushare40", "gpuspec33", "multigpu50")
PLAIN = "inf"



Job = tuple[str, str, str, str, int, tuple[tuple[str, str], ...]]  # trace dir, trace, placer, tolerance ("inf": plain), seed, prices
Outcome = tuple[str, str, int, float, float, float, float]  # trace, tolerance, seed, alloc %, price @50, price @100, CPU s


def job(work: Job) -> Outcome:
    trace_dir, trace, placer, tolerance, seed, table = work
    nodes, pods = load_variant(trace_dir, trace)
    started = time.thread_time()
    result = simulate_prices(nodes, pods, algorithm=placer, tolerance=None if tolerance == PLAIN else Decimal(tolerance),
                             seed=seed, stop_at_pct=100, table={m: Decimal(p) for m, p in table})  # fmt: skip
    half, full = result.at(50), result.at(100)
    assert half is not None and full is not None
    return trace, tolerance, seed, full.allocated_pct, half.mean_price, full.mean_price, time.thread_time() - started


def mean(rows: Sequence[dict[str, float | str]], key: str) -> float:
    return statistics.fmean(float(row[key]) for row in rows)


def cell(values: Sequence[float], places: int = 2) -> str:
    return f"{statistics.fmean(values):.{places}f}±{statistics.pstdev(values):.{places}f}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--traces", default=",".join(DEFAULT_TRACES), help="comma-separated trace variants")
    parser.add_argument("--seeds", default="42-44", help="seeds, e.g. 42-44 (default)")
    parser.add_argument("--placer", default="fgd_net", help="the placer behind the rule (default fgd_net)")
    parser.add_argument("--tolerances", default="0,0.05,0.2", help="comma-separated; the plain placer (inf) always runs too")
    parser.add_argument("--jobs", type=int, default=min(2, len(os.sched_getaffinity(0))), help="processes (default ≤ 2)")
    parser.add_argument("--trace-dir", type=Path, default=SHARED / "alibaba-gpu-v2023" / "csv")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--quick", action="store_true", help="the default trace, seed 42 only")
    parser.add_argument("--price", action="append", default=[], metavar="MODEL=USD",
                        help="another price for a model than TIER_PRICES' (repeatable), e.g. T4=0.45; figures are then not recorded")
    args = parser.parse_args(argv)
    traces = ["default"] if args.quick else [t for t in args.traces.split(",") if t]
    seeds = [42] if args.quick else parse_seeds(args.seeds)
    tolerances = [str(Decimal(t)) for t in args.tolerances.split(",") if t and t != PLAIN] + [PLAIN]
    table = {model: str(price) for model, price in TIER_PRICES.items()}
    for override in args.price:
        model, _, price = override.partition("=")
        table[model] = str(Decimal(price))
    print(describe_machine())
    print(f"prices per GPU-hour: {', '.join(f'{m} ${p}' for m, p in table.items())}, each host ±10 % (seeded)")
    prices = tuple(table.items())
    work: list[Job] = [(str(args.trace_dir), t, args.placer, tol, s, prices) for t in traces for tol in tolerances for s in seeds]
    outcomes: dict[tuple[str, str], list[Outcome]] = {}
    progress = Progress("price runs", len(work), after=0)
    started = time.perf_counter()
    with get_context("fork").Pool(args.jobs) as pool:
        for done, outcome in enumerate(pool.imap_unordered(job, work), 1):
            outcomes.setdefault((outcome[0], outcome[1]), []).append(outcome)
            progress.update(done)
    progress.done()
    print(f"{len(work)} runs in {time.perf_counter() - started:.0f} s on {args.jobs} processes")
    print(f"\n{args.placer} behind the price rule; mean±σ over seeds {seeds[0]}–{seeds[-1]}; Δ against the plain placer "
          "(tolerance inf) of the same trace and seeds")  # fmt: skip
    print("| trace | tolerance | GPU alloc % at 100 % | Δ alloc | $/GPU-h at 50 % | Δ $ at 50 % | $/GPU-h at 100 % | Δ $ at 100 % | CPU s/run |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows: list[dict[str, float | str]] = []
    for trace in traces:
        plain = outcomes[(trace, PLAIN)]
        plain_alloc = statistics.fmean(o[3] for o in plain)
        plain_half, plain_full = statistics.fmean(o[4] for o in plain), statistics.fmean(o[5] for o in plain)
        for tolerance in tolerances:
            runs = outcomes[(trace, tolerance)]
            alloc, half, full = [o[3] for o in runs], [o[4] for o in runs], [o[5] for o in runs]
            delta_half = 100 * (statistics.fmean(half) / plain_half - 1)
            delta_full = 100 * (statistics.fmean(full) / plain_full - 1)
            cpu = statistics.fmean(o[6] for o in runs)
            print(f"| {trace} | {tolerance} | {cell(alloc)} | {statistics.fmean(alloc) - plain_alloc:+.2f} | {cell(half, 3)} | "
                  f"{delta_half:+.1f} % | {cell(full, 3)} | {delta_full:+.1f} % | {cpu:.1f} |")  # fmt: skip
            rows.append({"trace": trace, "tolerance": tolerance, "alloc_pct": statistics.fmean(alloc),
                         "alloc_sd": statistics.pstdev(alloc), "price_at_50": statistics.fmean(half),
                         "price_at_100": statistics.fmean(full), "cpu_s": cpu})  # fmt: skip
    for tolerance in tolerances:
        if tolerance == PLAIN or args.price:
            continue
        of = [r for r in rows if r["tolerance"] == tolerance]
        base = [r for r in rows if r["tolerance"] == PLAIN]
        what = f"{len(traces)} trace variants × seeds {seeds[0]}–{seeds[-1]}"
        record("price", f"{args.placer} + price rule at {tolerance}: GPU allocation at 100 % arrived, mean of {what}",
               round(mean(of, "alloc_pct"), 2), "%", f"plain {args.placer}", round(mean(base, "alloc_pct"), 2),
               "exact: repeats run for run", component="placement")  # fmt: skip
        record("price", f"{args.placer} + price rule at {tolerance}: mean $/GPU-hour paid at 50 % arrived, mean of {what}",
               round(mean(of, "price_at_50"), 4), "USD", f"plain {args.placer}", round(mean(base, "price_at_50"), 4),
               "TIER_PRICES ± 10 % per host", component="placement")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"placer": args.placer, "seeds": seeds, "rows": rows}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
