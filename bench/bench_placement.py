"""Placement quality on the Alibaba GPU trace beside the FGD paper's published results, and placement speed.

Quality: for every algorithm and every trace variant, the simulator (``master.scheduler.simulate``,
the FGD protocol: inflate 1.3, shuffle, no departures) runs once per seed 42–51 and reports the
GPU allocation % when arrived GPU demand reaches 100 % of capacity, as mean ± population σ over
the seeds — the anchors' statistic. Beside it: the published FGD and BestFit figures
(``fgd_expected_results_summary.csv``: the FGD authors' cached results, 10 seeds each), and
our fgd and fgd_net minus their FGD. A second table gives, per algorithm with a published
counterpart, the mean and range over the traces of (ours − published). The trace has no
network figures, so ``fgd_net`` differs from ``fgd`` only by its model-scarcity term, which
matters on the ``gpuspec`` variants (the only ones with GPU-model constraints).

Speed: every ``place()`` call of a replay (default trace, seed 42, up to 100 % arrived) is
timed (``perf_counter_ns``) through a ``Fleet`` kept across decisions — how the simulator, and
a long-lived master, place: decisions per second and the median, p99 and worst time of one
decision, the worst also in this thread's CPU time (``thread_time_ns``: other load on the machine
stretches the wall clock, much less the CPU time), how many took over 20 ms, and the collector's
full collections and longest pause during the replay. Every algorithm at the trace's 1,213 hosts (6,212 GPUs); ``--scale-algorithms`` also
on a synthetic fleet of the trace's hosts repeated 16 times (19,408 hosts, 99,392 GPUs) with
16 copies of its pods. The one-off path — a fresh placer on a plain list of nodes, scoring
every node once, as for a single decision — is timed on 200 requests (50 at ×16, fgd_net only).
Quality runs in parallel over seeds and traces; the speed runs one at a time afterwards.

Usage: ``python bench/bench_placement.py [--traces all|NAME,...] [--seeds 42-51] [--algorithms NAME,...]
[--scale-algorithms NAME,...] [--jobs N] [--skip-quality] [--skip-speed] [--json FILE] [--quick]`` (traces are named as in the anchors:
``default``, ``cpu050`` … ``multigpu50``; the CSVs and anchors are read from ``../shared`` beside
the checkout unless ``--trace-dir``/``--anchors`` say otherwise).

Measured 2026-11-22 on the development VM (AMD EPYC, 2 cores, CPython 3.11.7), default run:
all 17 traces × 8 algorithms × seeds 42–51 on 2 processes, then the speed runs: 428 s in all
(quality 403 s: 1,360 runs, 0.59 s each; speed 25 s). Load from other work on the VM varies the
times by ±30 %; the allocation figures are exact and repeat run for run.

GPU allocation % at 100 % arrived demand, mean±σ over seeds 42–51 (published = the FGD authors'):

| trace | first_fit | best_fit | random | utilization | gpu_packing | gpu_clustering | fgd | fgd_net | FGD pub. | BestFit pub. | fgd − FGD | fgd_net − FGD |
|---|---|---|---|---|---|---|---|---|---|---|---|---|
| default | 94.19±0.12 | 92.81±0.19 | 86.99±0.38 | 90.87±0.35 | 93.88±0.11 | 93.80±0.17 | 95.28±0.07 | 95.28±0.07 | 95.23±0.10 | 92.86±0.14 | +0.05 | +0.05 |
| cpu050 | 94.24±0.17 | 93.65±0.12 | 90.50±0.30 | 93.12±0.16 | 94.20±0.18 | 94.33±0.18 | 95.11±0.09 | 95.11±0.09 | 95.00±0.11 | 93.56±0.12 | +0.11 | +0.11 |
| cpu100 | 94.17±0.09 | 93.20±0.12 | 88.65±0.39 | 92.02±0.22 | 94.01±0.21 | 94.06±0.15 | 95.04±0.11 | 95.04±0.11 | 95.21±0.13 | 93.26±0.12 | -0.17 | -0.17 |
| cpu200 | 93.49±0.26 | 92.09±0.20 | 83.49±0.37 | 88.08±0.28 | 93.34±0.22 | 93.03±0.24 | 94.79±0.20 | 94.79±0.20 | 94.82±0.15 | 92.15±0.20 | -0.03 | -0.03 |
| cpu250 | 91.10±0.48 | 91.44±0.25 | 80.44±0.49 | 85.84±0.37 | 92.79±0.20 | 92.15±0.23 | 93.21±0.41 | 93.21±0.41 | 93.20±0.27 | 91.21±0.24 | +0.01 | +0.01 |
| gpushare40 | 92.80±0.16 | 91.39±0.23 | 85.67±0.41 | 89.36±0.30 | 92.48±0.19 | 92.38±0.14 | 94.00±0.12 | 94.00±0.12 | 93.96±0.07 | 91.44±0.19 | +0.04 | +0.04 |
| gpushare60 | 90.25±0.16 | 88.79±0.19 | 83.49±0.27 | 86.73±0.28 | 89.78±0.14 | 89.53±0.18 | 91.18±0.12 | 91.18±0.12 | 91.25±0.12 | 89.06±0.17 | -0.07 | -0.07 |
| gpushare80 | 88.15±0.15 | 86.59±0.17 | 81.10±0.39 | 84.49±0.37 | 87.53±0.18 | 87.27±0.23 | 89.12±0.20 | 89.12±0.20 | 89.08±0.10 | 86.66±0.23 | +0.04 | +0.04 |
| gpushare100 | 85.88±0.20 | 84.52±0.25 | 79.32±0.43 | 82.43±0.35 | 85.31±0.14 | 85.52±0.14 | 86.64±0.15 | 86.64±0.15 | 86.64±0.15 | 84.62±0.21 | +0.00 | +0.00 |
| gpuspec10 | 94.13±0.14 | 93.05±0.24 | 87.13±0.31 | 90.47±0.22 | 93.99±0.14 | 93.85±0.28 | 95.01±0.21 | 94.96±0.14 | 94.66±0.18 | 93.10±0.20 | +0.35 | +0.30 |
| gpuspec20 | 93.95±0.18 | 88.26±0.32 | 86.63±0.30 | 87.91±0.31 | 89.09±0.31 | 89.06±0.29 | 94.54±0.31 | 94.92±0.09 | 94.66±0.13 | 88.46±0.12 | -0.12 | +0.26 |
| gpuspec25 | 93.63±0.19 | 85.63±0.38 | 86.38±0.31 | 85.13±0.47 | 86.62±0.48 | 86.42±0.43 | 94.17±0.40 | 94.54±0.12 | 93.91±0.10 | 85.67±0.19 | +0.26 | +0.63 |
| gpuspec33 | 93.46±0.28 | 80.34±0.41 | 84.17±0.48 | 79.40±0.38 | 81.96±0.50 | 81.16±0.35 | 87.58±0.46 | 94.22±0.11 | 87.84±0.17 | 80.39±0.26 | -0.26 | +6.38 |
| multigpu20 | 94.74±0.10 | 93.67±0.15 | 87.82±0.30 | 92.08±0.31 | 94.59±0.14 | 94.50±0.15 | 95.67±0.15 | 95.67±0.15 | 95.53±0.15 | 93.73±0.24 | +0.14 | +0.14 |
| multigpu30 | 95.32±0.19 | 94.36±0.27 | 87.16±0.35 | 93.10±0.23 | 95.24±0.19 | 95.06±0.14 | 96.33±0.06 | 96.33±0.06 | 96.36±0.09 | 94.57±0.22 | -0.03 | -0.03 |
| multigpu40 | 95.68±0.15 | 94.98±0.13 | 84.86±0.75 | 94.12±0.17 | 95.75±0.10 | 95.61±0.18 | 96.83±0.07 | 96.83±0.07 | 96.91±0.10 | 95.10±0.22 | -0.08 | -0.08 |
| multigpu50 | 96.08±0.19 | 95.51±0.13 | 81.31±0.79 | 94.62±0.19 | 96.16±0.16 | 95.93±0.25 | 97.03±0.11 | 97.03±0.11 | 97.09±0.10 | 95.62±0.17 | -0.06 | -0.06 |
| mean | 93.02 | 90.60 | 85.01 | 88.81 | 91.57 | 91.39 | 93.62 | 94.05 | | | | |

ours − published, over the traces (mean, min … max):
  first_fit       no published counterpart
  best_fit        vs 05-BestFit        -0.07  (-0.27 … +0.23)
  random          vs 01-Random         +0.61  (-0.52 … +1.48)
  utilization     vs 02-DotProd        +0.22  (-0.42 … +2.27)
  gpu_packing     vs 04-GpuPacking     +1.58  (-0.26 … +4.74)
  gpu_clustering  vs 03-GpuClustering  +1.63  (-0.05 … +4.40)
  fgd             vs 06-FGD            +0.01  (-0.26 … +0.35)
  fgd_net         vs 06-FGD            +0.44  (-0.17 … +6.38)

fgd_net beats every other algorithm (first_fit, best_fit, random, utilization, gpu_packing, gpu_clustering) on 17 of 17 traces

fgd_net beats every other algorithm (first_fit, best_fit, random, utilization, gpu_packing,
gpu_clustering) on 17 of 17 traces.

Speed (``--skip-quality --scale-algorithms first_fit,best_fit,fgd_net``, 53 s; default trace,
seed 42, every decision up to 100 % arrived; the ×16 fleet is 19,408 hosts / 99,392 GPUs):

| algorithm | fleet | decisions | decisions/s | p50 µs | p99 µs | worst ms | one-off p50 ms | one-off p99 ms |
|---|---|---:|---:|---:|---:|---:|---:|---:|
| first_fit | 1,213 hosts | 8,351 | 41,115 | 11 | 391 | 1.3 | 0.9 | 1.7 |
| best_fit | 1,213 hosts | 8,351 | 31,552 | 13 | 575 | 3.2 | 1.0 | 2.0 |
| random | 1,213 hosts | 8,351 | 20,470 | 18 | 515 | 2.2 | 0.6 | 1.1 |
| utilization | 1,213 hosts | 8,351 | 24,641 | 12 | 674 | 30.1 | 1.3 | 1.5 |
| gpu_packing | 1,213 hosts | 8,351 | 31,684 | 12 | 553 | 4.0 | 1.2 | 2.2 |
| gpu_clustering | 1,213 hosts | 8,351 | 33,264 | 12 | 506 | 3.3 | 1.2 | 1.8 |
| fgd | 1,213 hosts | 8,351 | 16,190 | 26 | 942 | 6.5 | 1.2 | 2.3 |
| fgd_net | 1,213 hosts | 8,351 | 16,033 | 24 | 1035 | 9.5 | 1.2 | 1.7 |
| first_fit | 99,392 GPUs | 133,290 | 15,805 | 30 | 442 | 34.4 | — | — |
| best_fit | 99,392 GPUs | 133,290 | 9,343 | 42 | 756 | 54.5 | — | — |
| fgd_net | 99,392 GPUs | 133,290 | 7,891 | 43 | 1033 | 59.8 | 48.0 | 64.1 |

That table predates issue 22 part 4 (the placers' tail: docs/placement.md, "Speed"); the latest
figures are in docs/performance.md (``make bench``).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Progress, describe_machine, parse_seeds, quantile, record

from master.scheduler import PLACERS, Fleet, FragModel, Request, Workload, get_placer
from master.scheduler.simulate import arrivals, simulate
from master.scheduler.trace import TraceNode, load_variant

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
TRACES = (
    "default", "cpu050", "cpu100", "cpu200", "cpu250", "gpushare40", "gpushare60", "gpushare80", "gpushare100",
    "gpuspec10", "gpuspec20", "gpuspec25", "gpuspec33", "multigpu20", "multigpu30", "multigpu40", "multigpu50",
)  # fmt: skip
DEFAULT_ALGORITHMS = (
    "first_fit", "best_fit", "random", "utilization", "gpu_packing", "gpu_clustering", "fgd", "fgd_net", "fgd_plus",
)  # fmt: skip
OURS = ("fgd", "fgd_net", "fgd_plus")  # compared with the published FGD
# Our algorithm → the anchors' policy it reproduces.
PUBLISHED = {
    "random": "01-Random", "utilization": "02-DotProd", "gpu_clustering": "03-GpuClustering",
    "gpu_packing": "04-GpuPacking", "best_fit": "05-BestFit", "fgd": "06-FGD", "fgd_net": "06-FGD",
    "fgd_plus": "06-FGD",
}  # fmt: skip
SCALE_COPIES = 16  # 1,213 hosts × 16 = 19,408 hosts, 99,392 GPUs


# ---- quality -------------------------------------------------------------------------------------



def quality_job(job: tuple[str, str, str, int]) -> tuple[str, str, int, float, float]:
    """One simulation up to 100 % arrived: (trace, algorithm, seed, GPU alloc %, seconds)."""
    trace_dir, trace, algorithm, seed = job
    nodes, pods = load_variant(trace_dir, trace)
    started = time.perf_counter()
    result = simulate(nodes, pods, algorithm=algorithm, seed=seed, stop_at_pct=100)
    allocated = result.allocated_at(100)
    assert allocated is not None
    return trace, algorithm, seed, allocated, time.perf_counter() - started


def load_anchors(path: Path) -> dict[tuple[str, str], tuple[float, float]]:
    """(trace, policy) → (gpu_alloc_pct_at_100, its σ), traces named without the ``openb_pod_list_`` prefix."""
    if not path.exists():
        return {}
    with path.open(newline="", encoding="utf-8") as handle:
        return {
            (row["workload"].removeprefix("openb_pod_list_"), row["policy"]):
            (float(row["gpu_alloc_pct_at_100"]), float(row["gpu_alloc_sd_at_100"]))
            for row in csv.DictReader(handle)
        }  # fmt: skip


@dataclass
class Cell:
    mean: float
    sd: float

    def __str__(self) -> str:
        return f"{self.mean:5.2f}±{self.sd:4.2f}"


def run_quality(
    trace_dir: Path, traces: Sequence[str], algorithms: Sequence[str], seeds: Sequence[int], jobs: int
) -> tuple[dict[tuple[str, str], Cell], float]:
    work = [(str(trace_dir), t, a, s) for t in traces for a in algorithms for s in seeds]
    # Slow ones first so the processes finish together: FGD, and the traces with many task shapes.
    work.sort(key=lambda job: (job[2] not in ("fgd", "fgd_net"), "gpuspec" not in job[1], job[1], job[2]))
    values: dict[tuple[str, str], list[float]] = {}
    progress = Progress("quality runs", len(work), after=0)
    started = time.perf_counter()
    cpu_seconds = 0.0
    with get_context("fork").Pool(jobs) as pool:
        for done, (trace, algorithm, _seed, allocated, seconds) in enumerate(pool.imap_unordered(quality_job, work), 1):
            values.setdefault((trace, algorithm), []).append(allocated)
            cpu_seconds += seconds
            progress.update(done)
    progress.done()
    wall = time.perf_counter() - started
    print(f"quality: {len(work)} runs in {wall:.0f} s on {jobs} processes ({cpu_seconds / len(work):.2f} s per run)")
    return {key: Cell(statistics.fmean(v), statistics.pstdev(v)) for key, v in values.items()}, wall


def print_quality(
    cells: dict[tuple[str, str], Cell], anchors: dict[tuple[str, str], tuple[float, float]],
    traces: Sequence[str], algorithms: Sequence[str], seeds: Sequence[int],
) -> None:  # fmt: skip
    print(f"\nGPU allocation % at 100 % arrived demand, mean±σ over seeds {seeds[0]}–{seeds[-1]} ({len(seeds)} runs each)")
    header = ["trace", *algorithms]
    if anchors:
        header += ["FGD pub.", "BestFit pub.", *(f"{a} − FGD" for a in OURS if a in algorithms)]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for trace in traces:
        row = [trace] + [str(cells[(trace, a)]) for a in algorithms]
        if anchors:
            fgd_pub, fgd_sd = anchors.get((trace, "06-FGD"), (float("nan"), 0.0))
            bf_pub, bf_sd = anchors.get((trace, "05-BestFit"), (float("nan"), 0.0))
            versus = [f"{cells[(trace, a)].mean - fgd_pub:+.2f}" for a in OURS if a in algorithms]
            row += [f"{fgd_pub:5.2f}±{fgd_sd:4.2f}", f"{bf_pub:5.2f}±{bf_sd:4.2f}", *versus]
        print("| " + " | ".join(row) + " |")
    means = {a: statistics.fmean(cells[(t, a)].mean for t in traces) for a in algorithms}
    blanks = 2 + sum(a in algorithms for a in OURS) if anchors else 0
    print("| mean | " + " | ".join(f"{means[a]:5.2f}" for a in algorithms) + " |" + " |" * blanks)
    if not anchors:
        return
    print("\nours − published, over the traces (mean, min … max):")
    for algorithm in algorithms:
        policy = PUBLISHED.get(algorithm)
        if policy is None:
            print(f"  {algorithm:15s} no published counterpart")
            continue
        diffs = [cells[(t, algorithm)].mean - anchors[(t, policy)][0] for t in traces if (t, policy) in anchors]
        print(f"  {algorithm:15s} vs {policy:17s} {statistics.fmean(diffs):+.2f}  ({min(diffs):+.2f} … {max(diffs):+.2f})")
    for ours in ("fgd_net", "fgd"):
        if ours not in algorithms:
            continue
        others = [a for a in algorithms if a not in OURS]
        wins = [t for t in traces if all(cells[(t, ours)].mean >= cells[(t, a)].mean for a in others)]
        print(f"\n{ours} beats every other algorithm ({', '.join(others)}) on {len(wins)} of {len(traces)} traces")
        for trace in traces:
            if trace not in wins:
                best = max(others, key=lambda a: cells[(trace, a)].mean)
                print(f"  not on {trace}: {best} {cells[(trace, best)].mean:.2f} vs {ours} {cells[(trace, ours)].mean:.2f}")
        break


def record_quality(
    cells: dict[tuple[str, str], Cell], anchors: dict[tuple[str, str], tuple[float, float]],
    traces: Sequence[str], algorithms: Sequence[str], seeds: Sequence[int],
) -> None:  # fmt: skip
    """Each algorithm's mean allocation over the traces into the results file, beside the published FGD's."""
    published = [anchors[(t, "06-FGD")][0] for t in traces if (t, "06-FGD") in anchors]
    complete = len(published) == len(traces)
    for algorithm in algorithms:
        mean = statistics.fmean(cells[(t, algorithm)].mean for t in traces)
        record("placement", f"{algorithm}: GPU allocation at 100 % arrived demand, mean of {len(traces)} trace variants "
               f"× seeds {seeds[0]}–{seeds[-1]}", mean, "%", "published FGD (Weng et al.)" if complete else None,
               statistics.fmean(published) if complete else None, "exact: repeats run for run")  # fmt: skip


# ---- speed ---------------------------------------------------------------------------------------


def scaled(nodes: Sequence[TraceNode], copies: int) -> list[TraceNode]:
    return [TraceNode(f"{n.name}-{c}", n.cpu_milli, n.memory_mib, n.gpus, n.model) for c in range(copies) for n in nodes]



def time_replay(
    nodes: Sequence[TraceNode], pods: Sequence[Request], algorithm: str, *, seed: int, stop_at_pct: float
) -> dict[str, float]:
    """Replay the protocol, timing each ``place`` on a kept ``Fleet``; FGD's caches start empty.

    Each decision is timed twice: wall clock (``perf_counter_ns``) and this thread's CPU time
    (``thread_time_ns``, outside the wall reading), so that a decision stretched by other load on
    the machine shows as such. The garbage the set-up left is collected first, and the collector's
    pauses during the replay are counted (``gc.callbacks``).
    """
    FragModel.forget_shared()
    fleet = Fleet(node.to_node() for node in nodes)
    capacity = sum(node.gpu_milli_capacity for node in fleet)
    placer = get_placer(algorithm, seed=seed, workload=Workload.from_requests(pods))
    queue = arrivals(pods, capacity, inflate=1.3, seed=seed)
    stop = stop_at_pct * capacity / 100
    timings: list[int] = []
    cpu_timings: list[int] = []
    arrived = 0
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    pauses = GcPauses()
    gc.collect()
    with pauses.watching():
        for request in queue:
            cpu_started = cpu_clock()
            started = clock()
            placement = placer.place(request, fleet)
            timings.append(clock() - started)
            cpu_timings.append(cpu_clock() - cpu_started)
            if placement is not None:
                fleet.apply(placement)
            arrived += request.gpu_milli_total
            if arrived >= stop:
                break
    total_s = sum(timings) / 1e9
    timings.sort()
    return {
        "decisions": len(timings), "per_s": len(timings) / total_s, "p50_us": quantile(timings, 0.5) / 1e3,
        "p99_us": quantile(timings, 0.99) / 1e3, "max_ms": timings[-1] / 1e6, "max_cpu_ms": max(cpu_timings) / 1e6,
        "over_20ms": sum(1 for t in timings if t > 20_000_000), "full_gcs": pauses.full, "gc_max_ms": pauses.longest_ms,
    }  # fmt: skip


class GcPauses:
    """The collector's pauses while ``watching``: how many full (generation 2) collections, and the longest pause."""

    def __init__(self) -> None:
        self.full = 0
        self.longest_ms = 0.0
        self._started = 0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter_ns()
            return
        self.longest_ms = max(self.longest_ms, (time.perf_counter_ns() - self._started) / 1e6)
        self.full += info["generation"] == 2

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        gc.callbacks.append(self._callback)
        try:
            yield
        finally:
            gc.callbacks.remove(self._callback)


def time_cold(nodes: Sequence[TraceNode], pods: Sequence[Request], algorithm: str, *, count: int) -> dict[str, float]:
    """A fresh placer on a plain list per decision: every node scored once (the one-off path)."""
    FragModel.forget_shared()
    fleet = [node.to_node() for node in nodes]
    workload = Workload.from_requests(pods)
    queue = arrivals(pods, sum(n.gpu_milli_capacity for n in fleet), inflate=1.3, seed=1)[:count]
    timings = []
    for request in queue:
        started = time.perf_counter_ns()
        get_placer(algorithm, seed=1, workload=workload).place(request, fleet)
        timings.append(time.perf_counter_ns() - started)
    timings.sort()
    return {"p50_ms": quantile(timings, 0.5) / 1e6, "p99_ms": quantile(timings, 0.99) / 1e6}


def run_speed(
    trace_dir: Path, algorithms: Sequence[str], scale_algorithms: Sequence[str]
) -> dict[str, dict[str, dict[str, float]]]:
    nodes, pods = load_variant(trace_dir, "default")
    big = scaled(nodes, SCALE_COPIES)
    big_pods = [pod for pod in pods for _ in range(SCALE_COPIES)]
    results: dict[str, dict[str, dict[str, float]]] = {}
    print(f"\nplacement speed, default trace, seed 42, every decision up to 100 % arrived demand, a Fleet kept across"
          f" decisions;\none-off: a fresh placer on a plain list of nodes (every node scored once), 200 decisions"
          f"\n  {len(nodes):,} hosts / {sum(n.gpus for n in nodes):,} GPUs, and {len(big):,} hosts / "
          f"{sum(n.gpus for n in big):,} GPUs (the trace ×{SCALE_COPIES}, its pods ×{SCALE_COPIES})")  # fmt: skip
    print("worst: the slowest decision by the wall clock, and by this thread's CPU time (what other load on the machine"
          " cannot stretch);\n> 20 ms: decisions over 20 ms by the wall clock; full GCs: generation-2 collections during"
          " the replay (pause ms: the collector's longest pause, any generation)")  # fmt: skip
    print("| algorithm | fleet | decisions | decisions/s | p50 µs | p99 µs | worst ms | worst CPU ms | > 20 ms | full GCs "
          "(pause ms) | one-off p50 ms | one-off p99 ms |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def row(algorithm: str, fleet: str, kept: dict[str, float], cold: dict[str, float] | None) -> None:
        one_off = f"{cold['p50_ms']:.1f} | {cold['p99_ms']:.1f}" if cold else "— | —"
        print(f"| {algorithm} | {fleet} | {kept['decisions']:,.0f} | {kept['per_s']:,.0f} | {kept['p50_us']:.0f} | "
              f"{kept['p99_us']:.0f} | {kept['max_ms']:.1f} | {kept['max_cpu_ms']:.1f} | {kept['over_20ms']:.0f} | "
              f"{kept['full_gcs']:.0f} ({kept['gc_max_ms']:.1f}) | {one_off} |", flush=True)  # fmt: skip

    for algorithm in algorithms:
        small = time_replay(nodes, pods, algorithm, seed=42, stop_at_pct=100)
        cold = time_cold(nodes, pods, algorithm, count=200)
        results[algorithm] = {"trace": small, "cold": cold}
        row(algorithm, f"{len(nodes):,} hosts", small, cold)
    for algorithm in scale_algorithms:
        large = time_replay(big, big_pods, algorithm, seed=42, stop_at_pct=100)
        cold_large = time_cold(big, big_pods, algorithm, count=50) if algorithm == "fgd_net" else None
        results.setdefault(algorithm, {})["x16"] = large
        if cold_large:
            results[algorithm]["cold_x16"] = cold_large
        row(algorithm, f"{sum(n.gpus for n in big):,} GPUs", large, cold_large)
    record_speed(results, small_fleet=f"{len(nodes):,} hosts", large_fleet=f"{sum(n.gpus for n in big):,} GPUs")
    return results


def record_speed(results: dict[str, dict[str, dict[str, float]]], *, small_fleet: str, large_fleet: str) -> None:
    """The headline speed figures into the results file: fgd_net (the default) beside first_fit where both ran."""
    ours = results.get("fgd_net", {})
    first = results.get("first_fit", {})
    for key, fleet in (("trace", small_fleet), ("x16", large_fleet)):
        kept = ours.get(key)
        if kept is None:
            continue
        base = first.get(key)
        record("placement", f"fgd_net decisions at {fleet}, a Fleet kept across decisions", kept["per_s"], "decisions/s",
               "first_fit" if base else None, base["per_s"] if base else None, f"p99 {kept['p99_us']:.0f} µs")  # fmt: skip
        record("placement", f"fgd_net worst single decision at {fleet}", kept["max_ms"], "ms",
               note=f"its CPU time {kept['max_cpu_ms']:.1f} ms; {kept['over_20ms']:.0f} decisions over 20 ms; "
               f"{kept['full_gcs']:.0f} full GCs during the replay")  # fmt: skip
    if "cold_x16" in ours:
        record("placement", f"fgd_net one-off decision at {large_fleet} (fresh placer, plain list), p50",
               ours["cold_x16"]["p50_ms"], "ms", note=f"p99 {ours['cold_x16']['p99_ms']:.1f} ms")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--traces", default="all", help="'all' or comma-separated names (default all 17)")
    parser.add_argument("--seeds", default="42-51", help="seeds, e.g. 42-51 or 42,43 (default 42-51)")
    parser.add_argument("--algorithms", default=",".join(DEFAULT_ALGORITHMS), help="comma-separated (default: all)")
    parser.add_argument("--scale-algorithms", default="fgd_net",
                        help="algorithms also timed on the ×16 fleet (default fgd_net; each takes ~15 s)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="processes for the quality runs")
    parser.add_argument("--trace-dir", type=Path, default=SHARED / "alibaba-gpu-v2023" / "csv")
    parser.add_argument("--anchors", type=Path, default=SHARED / "fgd-anchors" / "fgd_expected_results_summary.csv")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--quick", action="store_true",
                        help="traces default and gpuspec33, seeds 42-43, fgd_net alone at ×16 (for make bench QUICK=1)")
    args = parser.parse_args(argv)
    if args.quick:
        args.traces, args.seeds, args.scale_algorithms = "default,gpuspec33", "42-43", "fgd_net"

    traces = list(TRACES) if args.traces == "all" else [t.strip() for t in args.traces.split(",") if t.strip()]
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = [a for a in algorithms if a not in PLACERS] + [t for t in traces if t not in TRACES]
    if unknown:
        parser.error(f"unknown: {', '.join(unknown)} (algorithms: {', '.join(PLACERS)}; traces: {', '.join(TRACES)})")
    seeds = parse_seeds(args.seeds)
    print(describe_machine())
    started = time.perf_counter()
    report: dict[str, object] = {"seeds": seeds, "traces": traces, "algorithms": algorithms}
    if not args.skip_quality:
        anchors = load_anchors(args.anchors)
        if not anchors:
            print(f"(no anchors at {args.anchors}: published columns left out)")
        cells, wall = run_quality(args.trace_dir, traces, algorithms, seeds, args.jobs)
        print_quality(cells, anchors, traces, algorithms, seeds)
        report["quality"] = {f"{t}/{a}": {"mean": c.mean, "sd": c.sd} for (t, a), c in cells.items()}
        record_quality(cells, anchors, traces, algorithms, seeds)
        report["quality_wall_s"] = wall
    if not args.skip_speed:
        scale = [a.strip() for a in args.scale_algorithms.split(",") if a.strip() in PLACERS]
        report["speed"] = run_speed(args.trace_dir, algorithms, scale)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
