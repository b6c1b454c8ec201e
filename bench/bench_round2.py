"""Issue 43, point 1: a candidate placer against ``fgd`` and ``fgd_net`` on the trace, paired by seed.

The protocol is docs/placement.md, "Scheduler, round 2: the protocol": GPU allocation % at 100 % arrived demand
(``bench_placement.quality_job``: the simulator, inflate 1.3), on the 13 variants without GPU-model constraints and
the 4 ``gpuspec`` ones; per variant the mean of each placer and the paired difference candidate − baseline (mean
± its standard error, σ/√n); the mean of the differences over the 13; and the criteria checked. ``fgd_net`` runs on
the ``gpuspec`` variants only: on the other 13 it places exactly as ``fgd`` (tests/test_placers.py; the bench's
table shows the equality), so its column there is ``fgd``'s.

Usage: ``python bench/bench_round2.py --seeds 3000-3019 [--candidate fgd_plus] [--jobs 2] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parse_seeds
from bench_placement import SHARED, quality_job

UNCONSTRAINED = (
    "default", "cpu050", "cpu100", "cpu200", "cpu250", "gpushare40", "gpushare60", "gpushare80", "gpushare100",
    "multigpu20", "multigpu30", "multigpu40", "multigpu50",
)  # fmt: skip
GPUSPEC = ("gpuspec10", "gpuspec20", "gpuspec25", "gpuspec33")
# The protocol's criteria (docs/placement.md).
MEAN_GAIN = 0.30
WORST_LOSS = -0.10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seeds", default="3000-3019")
    parser.add_argument("--candidate", default="fgd_plus")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--trace-dir", type=Path, default=SHARED / "alibaba-gpu-v2023" / "csv")
    parser.add_argument("--json", type=Path, metavar="FILE")
    args = parser.parse_args()
    seeds = parse_seeds(args.seeds)
    candidate = args.candidate
    work = [(str(args.trace_dir), t, a, s) for t in UNCONSTRAINED + GPUSPEC for a in ("fgd", candidate) for s in seeds]
    work += [(str(args.trace_dir), t, "fgd_net", s) for t in GPUSPEC for s in seeds]
    started = time.perf_counter()
    allocated: dict[tuple[str, str, int], float] = {}
    with get_context("fork").Pool(args.jobs) as pool:
        for trace, algorithm, seed, value, _ in pool.imap_unordered(quality_job, work):
            allocated[trace, algorithm, seed] = value
    print(f"{len(work)} runs in {time.perf_counter() - started:.0f} s on {args.jobs} processes; seeds {args.seeds}")

    def mean(trace: str, algorithm: str) -> float:
        if algorithm == "fgd_net" and trace in UNCONSTRAINED:
            algorithm = "fgd"
        return statistics.fmean(allocated[trace, algorithm, s] for s in seeds)

    def paired(trace: str, baseline: str) -> tuple[float, float]:
        if baseline == "fgd_net" and trace in UNCONSTRAINED:
            baseline = "fgd"
        diffs = [allocated[trace, candidate, s] - allocated[trace, baseline, s] for s in seeds]
        return statistics.fmean(diffs), statistics.pstdev(diffs) / math.sqrt(len(diffs))

    print(f"| variant | fgd | fgd_net | {candidate} | {candidate} − fgd | {candidate} − fgd_net |")
    print("|---|---:|---:|---:|---:|---:|")
    gains = []
    for trace in UNCONSTRAINED + GPUSPEC:
        versus_fgd, versus_net = paired(trace, "fgd"), paired(trace, "fgd_net")
        if trace in UNCONSTRAINED:
            gains.append(versus_fgd[0])
        print(f"| {trace} | {mean(trace, 'fgd'):.2f} | {mean(trace, 'fgd_net'):.2f} | {mean(trace, candidate):.2f} | "
              f"{versus_fgd[0]:+.2f} ± {versus_fgd[1]:.2f} | {versus_net[0]:+.2f} ± {versus_net[1]:.2f} |")  # fmt: skip
    mean_gain = statistics.fmean(gains)
    print(f"| mean of the 13 | | | | {mean_gain:+.3f} | |")
    worst = min((paired(t, "fgd")[0], t) for t in UNCONSTRAINED + GPUSPEC)
    spec = [(t, *paired(t, "fgd_net")) for t in GPUSPEC]
    spec_ok = all(gain >= -2 * error for _, gain, error in spec)
    print(f"\n(1) mean gain over the 13 ≥ +{MEAN_GAIN:.2f}: {mean_gain:+.3f} → {'met' if mean_gain >= MEAN_GAIN else 'NOT met'}")
    print(f"(2) every variant ≥ {WORST_LOSS:+.2f} vs fgd: worst {worst[0]:+.2f} ({worst[1]}) → "
          f"{'met' if worst[0] >= WORST_LOSS else 'NOT met'}")  # fmt: skip
    print(f"(3) gpuspec* ≥ fgd_net within noise (−2 standard errors): {'met' if spec_ok else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps({f"{t}/{a}/{s}": v for (t, a, s), v in allocated.items()}, indent=0))


if __name__ == "__main__":
    main()
