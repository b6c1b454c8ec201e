"""The learned placer (issue 26): its inference cost beside FGD, and its placements measured two ways.

1. **Inference.** Every ``place()`` of a replay of the default trace (seed 42, up to 100 % arrived) is timed
   (``perf_counter_ns``) through a ``Fleet`` kept across decisions, as the simulator and a long-lived master
   place, for a learned placer and for ``fgd`` (the baseline) in the same run: mean, p50 and p99 of one
   decision. Likewise every decision of the heterogeneous-clusters episodes of seeds 1–20 (``learned_ppo``,
   ``learned_ddpg`` beside ``fgd``). Beside it, the scorer alone: one ``Policy.score`` call (one candidate's
   MLP) in µs.
2. **Heterogeneous clusters** (``master.scheduler.hetero``, the published experiment's shape): tasks placed
   out of 100 per episode, mean ± σ over the held-out seeds 1–100 (training used seeds ≥ 1000), for
   Greedy (``first_fit``), ``best_fit``, ``random``, ``utilization``, ``fgd``, ``fgd_net`` and the learned
   placers.
3. **Trace, held out.** The FGD protocol (``master.scheduler.simulate``) on the full trace: GPU allocation %
   at 100 % arrived, mean ± σ over seeds 42–51, for ``fgd``, ``fgd_net``, the trace-trained learned
   placers and ``learned_ppo`` (trained on the hetero experiment), on the ``default`` variant (the one they trained on, but with the whole 1,213-node fleet and
   seeds they never saw) and on variants they never saw.

Usage: ``python bench/bench_learned.py [--hetero-seeds 1-100] [--traces default,cpu050,gpushare40,gpuspec33,multigpu50]
[--seeds 42-51] [--jobs 2] [--skip-speed] [--skip-hetero] [--skip-trace] [--trace-dir DIR] [--quick]``; ``--quick``:
hetero seeds 1–20, the default trace with seeds 42–43. The trace is read from ``../shared`` beside the checkout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from multiprocessing import get_context
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import describe_machine, parse_seeds, quantile, record

from master.scheduler import Fleet, Workload, get_placer
from master.scheduler.hetero import DEFAULT_ALGORITHMS as HETERO_ALGORITHMS
from master.scheduler.hetero import hetero_episode, run_hetero
from master.scheduler.learned.features import FEATURE_COUNT
from master.scheduler.learned.policy import load_policy
from master.scheduler.simulate import arrivals, fresh_node, simulate
from master.scheduler.trace import load_nodes, load_pods

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
TRACE_ALGORITHMS = ("fgd", "fgd_net", "learned_ppo_trace", "learned_ddpg_trace", "learned_ppo")
SPEED_ALGORITHMS = ("fgd", "learned_ppo_trace", "learned_ddpg_trace", "learned_ppo")


def _trace(trace_dir: Path, variant: str) -> tuple[list, list]:  # type: ignore[type-arg]
    nodes = load_nodes(trace_dir / "openb_node_list_gpu_node.csv")
    pods = [pod.request for pod in load_pods(trace_dir / f"openb_pod_list_{variant}.csv")]
    return nodes, pods


# ---- 1. inference ---------------------------------------------------------------------------------


def speed(trace_dir: Path, algorithms: Sequence[str]) -> None:
    nodes, pods = _trace(trace_dir, "default")
    workload = Workload.from_requests(pods)
    print("\nInference: every place() of the default trace, seed 42, to 100 % arrived (Fleet kept across decisions)")
    print("| placer | decisions | mean µs | p50 µs | p99 µs | worst ms |")
    print("|---|---:|---:|---:|---:|---:|")
    figures: dict[str, tuple[float, float, float]] = {}
    for algorithm in algorithms:
        fleet = Fleet(fresh_node(node) for node in nodes)
        capacity = sum(node.gpu_milli_capacity for node in fleet)
        placer = get_placer(algorithm, seed=42, workload=workload)
        times: list[int] = []
        arrived = 0
        for request in arrivals(pods, capacity, inflate=1.3, seed=42):
            started = time.perf_counter_ns()
            placement = placer.place(request, fleet)
            times.append(time.perf_counter_ns() - started)
            if placement is not None:
                fleet.apply(placement)
            arrived += request.gpu_milli_total
            if arrived >= capacity:
                break
        mean, p50, p99 = statistics.fmean(times) / 1e3, quantile(times, 0.5) / 1e3, quantile(times, 0.99) / 1e3
        figures[algorithm] = (mean, p50, p99)
        print(f"| {algorithm} | {len(times):,} | {mean:.0f} | {p50:.0f} | {p99:.0f} | {max(times) / 1e6:.1f} |")
    base = figures.get("fgd")
    for algorithm, (mean, _, p99) in figures.items():
        if algorithm == "fgd":
            continue
        record("learned", f"mean decision, default trace ({algorithm})", round(mean, 1), "µs", "fgd",
               None if base is None else round(base[0], 1), component="placement")  # fmt: skip
        record("learned", f"p99 decision, default trace ({algorithm})", round(p99, 1), "µs", "fgd",
               None if base is None else round(base[2], 1), component="placement")  # fmt: skip
    # The master's path: a fresh placer (no workload: it learns it from the requests) on a plain list of nodes,
    # scoring every node once — on the trace half placed by fgd, 100 of the next requests.
    fleet = Fleet(fresh_node(node) for node in nodes)
    capacity = sum(node.gpu_milli_capacity for node in fleet)
    queue = arrivals(pods, capacity, inflate=1.3, seed=42)
    filler = get_placer("fgd", seed=42, workload=workload)
    arrived = done = 0
    while done < len(queue) and 2 * arrived < capacity:
        placement = filler.place(queue[done], fleet)
        if placement is not None:
            fleet.apply(placement)
        arrived += queue[done].gpu_milli_total
        done += 1
    plain = list(fleet)
    print("\nOne-off decision (a fresh placer on a plain list, as the master decides), the trace half placed by fgd,")
    print("the next 100 requests:")
    oneoff: dict[str, float] = {}
    for algorithm in ("fgd", *algorithms[1:]):
        times = []
        for request in queue[done : done + 100]:
            started = time.perf_counter_ns()
            get_placer(algorithm).place(request, plain)
            times.append(time.perf_counter_ns() - started)
        oneoff[algorithm] = quantile(times, 0.5) / 1e6
        print(f"  {algorithm:20s} p50 {oneoff[algorithm]:.2f} ms, p99 {quantile(times, 0.99) / 1e6:.2f} ms")
    for algorithm in algorithms[1:]:
        record("learned", f"one-off decision p50, default trace half full ({algorithm})", round(oneoff[algorithm], 2),
               "ms", "fgd", round(oneoff["fgd"], 2), component="placement")  # fmt: skip

    print("\nInference on the heterogeneous clusters (seeds 1-20, every place() of the episodes; a fresh Fleet each)")
    print("| placer | decisions | mean µs | p50 µs | p99 µs |")
    print("|---|---:|---:|---:|---:|")
    hetero_figures: dict[str, float] = {}
    for algorithm in ("fgd", "learned_ppo", "learned_ddpg"):
        times = []
        for seed in range(1, 21):
            nodes, requests = hetero_episode(seed)
            fleet = Fleet(nodes)
            placer = get_placer(algorithm, seed=seed, workload=Workload.from_requests(requests))
            for request in requests:
                started = time.perf_counter_ns()
                placement = placer.place(request, fleet)
                times.append(time.perf_counter_ns() - started)
                if placement is not None:
                    fleet.apply(placement)
        hetero_figures[algorithm] = statistics.fmean(times) / 1e3
        print(f"| {algorithm} | {len(times):,} | {hetero_figures[algorithm]:.0f} | {quantile(times, 0.5) / 1e3:.0f} | "
              f"{quantile(times, 0.99) / 1e3:.0f} |")  # fmt: skip
    for algorithm in ("learned_ppo", "learned_ddpg"):
        record("learned", f"mean decision, hetero clusters ({algorithm})", round(hetero_figures[algorithm], 1), "µs",
               "fgd", round(hetero_figures["fgd"], 1), component="placement")  # fmt: skip
    policy = load_policy("learned_ppo_trace")
    rows = np.random.default_rng(0).normal(size=(2_000, FEATURE_COUNT))
    started = time.perf_counter_ns()
    for row in rows:
        policy.score(row)
    per_call = (time.perf_counter_ns() - started) / len(rows) / 1e3
    print(f"\none Policy.score call (a candidate's MLP, {sum(w.size + b.size for w, b in zip(policy.weights, policy.biases, strict=True)):,} "
          f"parameters): {per_call:.1f} µs")  # fmt: skip
    record("learned", "one candidate's MLP score (Policy.score)", round(per_call, 2), "µs", component="placement")


# ---- 2. heterogeneous clusters --------------------------------------------------------------------


def hetero(seeds: Sequence[int], algorithms: Sequence[str]) -> None:
    started = time.perf_counter()
    results = run_hetero(algorithms, seeds)
    print(f"\nHeterogeneous clusters: tasks placed of 100, mean ± σ over seeds {seeds[0]}–{seeds[-1]} "
          f"({len(seeds)} episodes, never trained on; {time.perf_counter() - started:.0f} s)")  # fmt: skip
    print("| " + " | ".join(r.algorithm for r in results) + " |")
    print("|" + "---|" * len(results))
    print("| " + " | ".join(f"{r.mean:.2f} ± {r.sd:.2f}" for r in results) + " |")
    by_name = {r.algorithm: r.placed for r in results}
    heuristics = [r for r in results if not r.algorithm.startswith("learned_")]
    best = max(heuristics, key=lambda r: r.mean).algorithm if heuristics else None
    for result in results:
        if not result.algorithm.startswith("learned_"):
            continue
        for other in dict.fromkeys(name for name in ("fgd", best) if name in by_name):
            diff = [a - b for a, b in zip(result.placed, by_name[other], strict=True)]
            print(f"  {result.algorithm} − {other}, paired by seed: {statistics.fmean(diff):+.2f} ± "
                  f"{statistics.pstdev(diff):.2f}; more on {sum(d > 0 for d in diff)}, as many on "
                  f"{sum(d == 0 for d in diff)}, fewer on {sum(d < 0 for d in diff)} of {len(diff)} seeds")  # fmt: skip
    base = next((r.mean for r in results if r.algorithm == "fgd"), None)
    for result in results:
        record("learned", f"hetero clusters: tasks placed ({result.algorithm})", round(result.mean, 2), "tasks", "fgd",
               None if base is None else round(base, 2), note=f"σ {result.sd:.2f}, seeds {seeds[0]}-{seeds[-1]}")  # fmt: skip


# ---- 3. the trace, held out -----------------------------------------------------------------------

_loaded: dict[tuple[str, str], tuple[list, list]] = {}  # type: ignore[type-arg]


def trace_job(job: tuple[str, str, str, int]) -> tuple[str, str, int, float, float]:
    trace_dir, variant, algorithm, seed = job
    key = (trace_dir, variant)
    if key not in _loaded:
        _loaded[key] = _trace(Path(trace_dir), variant)
    nodes, pods = _loaded[key]
    started = time.perf_counter()
    allocated = simulate(nodes, pods, algorithm=algorithm, seed=seed, stop_at_pct=100).allocated_at(100)
    assert allocated is not None
    return variant, algorithm, seed, allocated, time.perf_counter() - started


def trace(trace_dir: Path, variants: Sequence[str], algorithms: Sequence[str], seeds: Sequence[int], jobs: int) -> None:
    work = [(str(trace_dir), v, a, s) for v in variants for a in algorithms for s in seeds]
    started = time.perf_counter()
    with get_context("fork").Pool(jobs) as pool:
        done = pool.map(trace_job, work, chunksize=1)
    cells: dict[tuple[str, str], list[float]] = {}
    for variant, algorithm, _, allocated, _ in done:
        cells.setdefault((variant, algorithm), []).append(allocated)
    print(f"\nAlibaba trace, FGD protocol: GPU allocation % at 100 % arrived, mean ± σ over seeds {seeds[0]}–{seeds[-1]} "
          f"({len(work)} runs on {jobs} processes, {time.perf_counter() - started:.0f} s)")  # fmt: skip
    print("| trace | " + " | ".join(algorithms) + " | best learned − fgd |")
    print("|---|" + "---|" * (len(algorithms) + 1))
    for variant in variants:
        means = {a: statistics.fmean(cells[(variant, a)]) for a in algorithms}
        row = " | ".join(f"{means[a]:.2f}±{statistics.pstdev(cells[(variant, a)]):.2f}" for a in algorithms)
        learned = [means[a] for a in algorithms if a.startswith("learned_")]
        gap = f"{max(learned) - means['fgd']:+.2f}" if learned and "fgd" in means else ""
        print(f"| {variant} | {row} | {gap} |")
        for algorithm in algorithms:
            if algorithm.startswith("learned_"):
                record("learned", f"{variant} trace: GPU allocation at 100 % arrived ({algorithm})",
                       round(means[algorithm], 2), "%", "fgd", round(means.get("fgd", float("nan")), 2),
                       note=f"seeds {seeds[0]}-{seeds[-1]}")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--hetero-seeds", default="1-100", help="default 1-100 (--quick: 1-20)")
    parser.add_argument("--traces", default="default,cpu050,gpushare40,gpuspec33,multigpu50", help="trace variants")
    parser.add_argument("--seeds", default="42-51", help="trace seeds (default 42-51; --quick: 42-43)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes for the trace runs")
    parser.add_argument("--trace-dir", type=Path, default=SHARED / "alibaba-gpu-v2023" / "csv")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-hetero", action="store_true")
    parser.add_argument("--skip-trace", action="store_true")
    parser.add_argument("--quick", action="store_true", help="hetero seeds 1-20; the default trace, seeds 42-43")
    args = parser.parse_args(argv)
    if args.quick:
        args.hetero_seeds, args.traces, args.seeds = "1-20", "default", "42-43"
    print(describe_machine())
    have_trace = (args.trace_dir / "openb_node_list_gpu_node.csv").is_file()
    if not have_trace:
        print(f"(no trace at {args.trace_dir}: the inference and trace parts are not measured)")
    if have_trace and not args.skip_speed:
        speed(args.trace_dir, SPEED_ALGORITHMS)
    if not args.skip_hetero:
        hetero(parse_seeds(args.hetero_seeds), (*HETERO_ALGORITHMS, "learned_ppo_trace", "learned_ddpg_trace"))
    if have_trace and not args.skip_trace:
        variants = [v.strip() for v in args.traces.split(",") if v.strip()]
        trace(args.trace_dir, variants, TRACE_ALGORITHMS, parse_seeds(args.seeds), args.jobs)


if __name__ == "__main__":
    main()
