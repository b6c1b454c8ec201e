"""Power-aware placement on the Alibaba GPU trace: ``pwr_fgd`` beside ``fgd`` in the same run (issue 43, point 2).

The FGD protocol (``master.scheduler.simulate``: inflate 1.3, shuffle, no departures, up to 100 % arrived) with the
datacenter's power at each arrived % under ``master.scheduler.power`` (docs/power.md, "Power-aware placement").
Per trace variant and seed, ``fgd`` and ``pwr_fgd`` run on the same arrivals, and:

* **allocation lost** = fgd's GPU allocation % − pwr_fgd's, at 100 % arrived (points);
* **energy saved** = 1 − Σ P(pwr_fgd) / Σ P(fgd) over the curve's points 1–100 % arrived — the ratio of the areas
  under the two power curves, which is the energy if demand arrives at a steady rate; also at 50 % and 100 %;
* **with off-peak caps**: the same with every idle GPU capped (``PowerModel.capped()``) — for pwr_fgd and for fgd —
  each against fgd uncapped;
* **ceiling**: the most any placement could save at fgd's allocation: fgd's GPU power against every allocated
  milli-GPU put on the GPUs that add the fewest watts per GPU (no shapes, no fragmentation, CPUs as fgd's).

1. **Tuning**, with ``--tune`` (``--tune-seeds``, default 1000–1019): every ``--alphas`` weight on every trace; the
   chosen weight saves the most energy while losing at most ``--max-lost`` (0.5) points of allocation on every trace
   (mean over the tuning seeds). Without ``--tune``: ``pwr_fgd``'s weight (``PWR_WEIGHT``, chosen so), or ``--alpha``.
2. **Test** (``--test-seeds``, default 3000–3009, seeds the tuning never saw): the weight, each trace's mean ± σ over
   the seeds.

Usage: ``python bench/bench_power.py [--traces default,gpushare40,...|all] [--tune [--alphas 2,5,10,20]
[--tune-seeds 1000-1019]] [--alpha A] [--test-seeds 3000-3009] [--jobs 2] [--quick]``. The default (13 variants, no
tuning) takes a few minutes on 2 quiet cores. Figures go to bench/results.json (component ``placement``) beside fgd's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Progress, describe_machine, parse_seeds, record

from master.scheduler.fleet import MILLI
from master.scheduler.placers.pwr_fgd import PWR_WEIGHT, PwrFgd
from master.scheduler.power import TRACE_POWER, CpuPower, PowerModel
from master.scheduler.simulate import SimulationResult, simulate
from master.scheduler.trace import TraceNode, load_variant

REPO = Path(__file__).resolve().parent.parent
TRACE_DIR = REPO.parent / "shared" / "alibaba-gpu-v2023" / "csv"
ALL_TRACES = (
    "default", "cpu050", "cpu100", "cpu200", "cpu250", "gpushare40", "gpushare60", "gpushare80", "gpushare100",
    "gpuspec10", "gpuspec20", "gpuspec25", "gpuspec33", "multigpu20", "multigpu30", "multigpu40", "multigpu50",
)  # fmt: skip
DEFAULT_TRACES = tuple(t for t in ALL_TRACES if not t.startswith("gpuspec"))
CAPPED = TRACE_POWER.capped()
GPU_ONLY = PowerModel(cpu=CpuPower(0.0, 0.0))



def _run(trace_dir: str, trace: str, algorithm: str, seed: int, power: PowerModel) -> SimulationResult:
    nodes, pods = load_variant(trace_dir, trace)
    return simulate(nodes, pods, algorithm=algorithm, seed=seed, stop_at_pct=100, power=power)


def _area(result: SimulationResult) -> float:
    return sum(point.power_w for point in result.curve if point.arrived_pct <= 100)


def ceiling_gpu_w(nodes: Sequence[TraceNode], allocated_milli: float, power: PowerModel) -> float:
    """The least GPU power (W) with ``allocated_milli`` in use: the GPUs adding the fewest watts filled first."""
    boards = sorted(
        (power.gpu(node.model) for node in nodes for _ in range(node.gpus)), key=lambda g: g.max_w - g.idle_w
    )
    watts = sum(board.idle_w for board in boards)
    left = allocated_milli
    for board in boards:
        if left <= 0:
            break
        share = min(left, MILLI) / MILLI
        watts += board.active_w + board.slope_w * share
        left -= MILLI
    return watts


@dataclass(frozen=True)
class Pair:
    """One trace and seed: fgd against pwr_fgd at one weight."""

    trace: str
    seed: int
    alpha: float
    lost: float  # points of GPU allocation at 100 % arrived
    saved: float  # 1 − area ratio
    saved_50: float
    saved_100: float
    saved_capped: float | None = None  # pwr_fgd capped vs fgd uncapped
    caps_alone: float | None = None  # fgd capped vs fgd uncapped
    ceiling: float | None = None  # the most any placement could save at fgd's allocation


def _saved_at(ours: SimulationResult, base: SimulationResult, pct: int) -> float:
    mine, theirs = ours.power_at(pct), base.power_at(pct)
    assert mine is not None and theirs is not None
    return 1 - mine / theirs


def tuning_job(job: tuple[str, str, int, tuple[float, ...]]) -> list[Pair]:
    """fgd once, then pwr_fgd at each weight, on one trace and seed."""
    trace_dir, trace, seed, alphas = job
    base = _run(trace_dir, trace, "fgd", seed, TRACE_POWER)
    return [_pair(trace_dir, trace, seed, alpha, base) for alpha in alphas]


def _pair(trace_dir: str, trace: str, seed: int, alpha: float, base: SimulationResult) -> Pair:
    PwrFgd.default_alpha = alpha  # this process's weight (a class attribute: get_placer builds the placer)
    ours = _run(trace_dir, trace, "pwr_fgd", seed, TRACE_POWER)
    base_alloc, ours_alloc = base.allocated_at(100), ours.allocated_at(100)
    assert base_alloc is not None and ours_alloc is not None
    pair = Pair(
        trace, seed, alpha, base_alloc - ours_alloc, 1 - _area(ours) / _area(base),
        _saved_at(ours, base, 50), _saved_at(ours, base, 100),
    )  # fmt: skip
    return pair


def test_job(job: tuple[str, str, int, float]) -> Pair:
    """fgd and pwr_fgd, each also with idle GPUs capped, and fgd's GPU power for the ceiling."""
    trace_dir, trace, seed, alpha = job
    base = _run(trace_dir, trace, "fgd", seed, TRACE_POWER)
    pair = _pair(trace_dir, trace, seed, alpha, base)
    ours_capped = _run(trace_dir, trace, "pwr_fgd", seed, CAPPED)
    base_capped = _run(trace_dir, trace, "fgd", seed, CAPPED)
    base_gpu = _run(trace_dir, trace, "fgd", seed, GPU_ONLY)
    nodes, _ = load_variant(trace_dir, trace)
    capacity = sum(node.gpus for node in nodes) * MILLI
    best = 0.0
    for point, gpu_point in zip(base.curve, base_gpu.curve, strict=True):
        if point.arrived_pct > 100:
            break
        least = ceiling_gpu_w(nodes, point.allocated_pct / 100 * capacity, TRACE_POWER)
        best += point.power_w - (gpu_point.power_w - least)
    return Pair(
        **{**pair.__dict__, "saved_capped": 1 - _area(ours_capped) / _area(base),
           "caps_alone": 1 - _area(base_capped) / _area(base), "ceiling": 1 - best / _area(base)},
    )  # fmt: skip


def run_pairs(
    function: Callable[[Any], Pair | list[Pair]], jobs: Sequence[Any], processes: int, label: str
) -> list[Pair]:
    progress = Progress(label, len(jobs), after=0)
    pairs: list[Pair] = []
    with get_context("fork").Pool(processes) as pool:
        for done, found in enumerate(pool.imap_unordered(function, jobs), 1):
            pairs.extend(found if isinstance(found, list) else [found])
            progress.update(done)
    progress.done()
    return pairs


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values)


def tune(trace_dir: str, traces: Sequence[str], alphas: Sequence[float], seeds: Sequence[int], processes: int,
         max_lost: float) -> float:  # fmt: skip
    jobs = [(trace_dir, t, s, tuple(alphas)) for t in traces for s in seeds]
    pairs = run_pairs(tuning_job, jobs, processes, f"tuning (fgd and {len(alphas)} weights)")
    print(f"\nTuning, seeds {seeds[0]}–{seeds[-1]}: per weight, allocation lost (worst trace's mean) and energy saved "
          "(mean over traces and seeds)")  # fmt: skip
    print(
        f"| alpha | worst trace: lost points | mean lost | energy saved % | saved at 50 % | meets ≤ {max_lost:.2f} |"
    )
    print("|---:|---|---:|---:|---:|---|")
    chosen: tuple[float, float] | None = None
    for alpha in alphas:
        mine = [p for p in pairs if p.alpha == alpha]
        by_trace = {t: _mean([p.lost for p in mine if p.trace == t]) for t in traces}
        worst = max(by_trace, key=lambda t: by_trace[t])
        saved = _mean([p.saved for p in mine])
        ok = by_trace[worst] <= max_lost
        print(f"| {alpha:g} | {worst} {by_trace[worst]:+.2f} | {_mean([p.lost for p in mine]):+.2f} | "
              f"{100 * saved:.2f} | {100 * _mean([p.saved_50 for p in mine]):.2f} | {'yes' if ok else 'no'} |")  # fmt: skip
        if ok and (chosen is None or saved > chosen[1]):
            chosen = (alpha, saved)
    if chosen is None:
        print(f"no weight keeps every trace within {max_lost} points: taking the one losing least")
        return min(alphas, key=lambda a: max(_mean([p.lost for p in pairs if p.alpha == a and p.trace == t])
                                             for t in traces))  # fmt: skip
    print(f"chosen alpha = {chosen[0]:g}")
    return chosen[0]


def test(
    trace_dir: str, traces: Sequence[str], alpha: float, seeds: Sequence[int], processes: int
) -> list[Pair]:
    jobs = [(trace_dir, t, s, alpha) for t in traces for s in seeds]
    pairs = run_pairs(test_job, jobs, processes, "test runs")

    def cell(values: Sequence[float], scale: float = 100.0, signed: bool = False) -> str:
        mean, sd = scale * _mean(values), scale * statistics.pstdev(values)
        return f"{mean:+.2f}±{sd:.2f}" if signed else f"{mean:.2f}±{sd:.2f}"

    print(f"\nTest, alpha = {alpha:g}, seeds {seeds[0]}–{seeds[-1]}: pwr_fgd against fgd in the same run, mean±σ "
          "(energy saved = 1 − area under pwr_fgd's power curve / fgd's, arrived 1–100 %)")  # fmt: skip
    print("| trace | allocation lost, points | energy saved % | saved at 50 % | saved at 100 % | with off-peak caps % "
          "| caps alone (fgd) % | ceiling % |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for trace in traces:
        mine = [p for p in pairs if p.trace == trace]
        print(
            f"| {trace} | {cell([p.lost for p in mine], 1.0, True)} | {cell([p.saved for p in mine])} "
            f"| {cell([p.saved_50 for p in mine])} | {cell([p.saved_100 for p in mine])} "
            f"| {cell([p.saved_capped or 0.0 for p in mine])} | {cell([p.caps_alone or 0.0 for p in mine])} "
            f"| {cell([p.ceiling or 0.0 for p in mine])} |"
        )
    print(
        f"| mean | {_mean([p.lost for p in pairs]):+.2f} | {100 * _mean([p.saved for p in pairs]):.2f} "
        f"| {100 * _mean([p.saved_50 for p in pairs]):.2f} | {100 * _mean([p.saved_100 for p in pairs]):.2f} "
        f"| {100 * _mean([p.saved_capped or 0.0 for p in pairs]):.2f} "
        f"| {100 * _mean([p.caps_alone or 0.0 for p in pairs]):.2f} | {100 * _mean([p.ceiling or 0.0 for p in pairs]):.2f} |"
    )  # fmt: skip
    return pairs


def record_test(pairs: Sequence[Pair], alpha: float, traces: Sequence[str], seeds: Sequence[int]) -> None:
    where = f"{len(traces)} trace variants × seeds {seeds[0]}–{seeds[-1]}, alpha {alpha:g}"
    record("power", f"pwr_fgd energy saved against fgd ({where})", 100 * _mean([p.saved for p in pairs]), "%",
           "fgd (0 % by definition)", 0.0, "1 − area under the power curve / fgd's, arrived 1–100 %",
           component="placement")  # fmt: skip
    record("power", f"pwr_fgd GPU allocation lost against fgd at 100 % arrived ({where})",
           _mean([p.lost for p in pairs]), "points", "fgd", 0.0, "goal ≤ 0.5", component="placement")  # fmt: skip
    record("power", f"pwr_fgd with off-peak caps, energy saved against fgd uncapped ({where})",
           100 * _mean([p.saved_capped or 0.0 for p in pairs]), "%", "fgd with the caps alone",
           100 * _mean([p.caps_alone or 0.0 for p in pairs]), component="placement")  # fmt: skip
    record("power", f"the most any placement could save at fgd's allocation ({where})",
           100 * _mean([p.ceiling or 0.0 for p in pairs]), "%", "pwr_fgd", 100 * _mean([p.saved for p in pairs]),
           component="placement")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--traces", default=",".join(DEFAULT_TRACES), help="'all' or comma-separated names")
    parser.add_argument("--tune", action="store_true", help="choose the weight on the tuning seeds first")
    parser.add_argument("--alphas", default="2,5,10,20", help="weights tried in tuning")
    parser.add_argument("--alpha", type=float, help="test this weight (default: pwr_fgd's)")
    parser.add_argument("--tune-seeds", default="1000-1019")
    parser.add_argument("--test-seeds", default="3000-3009")
    parser.add_argument(
        "--max-lost", type=float, default=0.5, help="allocation points a weight may lose (tuning)"
    )
    parser.add_argument("--jobs", type=int, default=min(2, len(os.sched_getaffinity(0))))
    parser.add_argument("--trace-dir", type=Path, default=TRACE_DIR)
    parser.add_argument(
        "--quick", action="store_true", help="default and gpushare40, 4 tuning and 3 test seeds"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.traces, args.tune_seeds, args.test_seeds = "default,gpushare40", "1000-1003", "3000-3002"
    traces = (
        list(ALL_TRACES) if args.traces == "all" else [t.strip() for t in args.traces.split(",") if t.strip()]
    )
    unknown = [t for t in traces if t not in ALL_TRACES]
    if unknown:
        parser.error(f"unknown traces: {', '.join(unknown)} (choose from {', '.join(ALL_TRACES)})")
    print(describe_machine())
    started = time.perf_counter()
    if not args.tune:
        alpha = PWR_WEIGHT if args.alpha is None else args.alpha
        print(f"alpha = {alpha:g} (pwr_fgd's default: {PWR_WEIGHT:g}; --tune chooses one)")
    else:
        alphas = [float(a) for a in args.alphas.split(",") if a.strip()]
        alpha = tune(
            str(args.trace_dir), traces, alphas, parse_seeds(args.tune_seeds), args.jobs, args.max_lost
        )
    seeds = parse_seeds(args.test_seeds)
    pairs = test(str(args.trace_dir), traces, alpha, seeds, args.jobs)
    record_test(pairs, alpha, traces, seeds)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
