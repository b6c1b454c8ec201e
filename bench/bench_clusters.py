"""Clusters: gang placement's speed at 10,000 hosts, and its effect on the Alibaba trace, each beside a baseline.

Speed: a synthetic fleet of ``--hosts`` hosts (8 GPUs each, four models, ``--regions`` regions, every host
with a random number of its GPUs already taken, seeded) in a ``Fleet`` kept across decisions. ``--decisions``
cluster requests (2–4 nodes of 1, 2 or 4 whole GPUs each, seeded) are placed with ``place_gang`` (the
``--algorithm`` placer, a region and model per cluster, no RTTs); beside them, in the same run and on the
same fleet, the baseline: as many single-node placements of the same member requests by the plain
placer (``Placer.place``, its scores kept across decisions). Each decision is timed alone
(``perf_counter_ns``); what it chose is applied and then released, so the fleet changes as a master's
does but stays at its starting fill. Figures: decisions per second (decisions / their summed time) and
the p50 and p99 of one decision, with the ratio gang / baseline.

Trace: ``master.scheduler.gang_simulate`` on the trace's 1,213 GPU hosts in 4 regions: the tasks asking
for an even number ≥ 2 of whole GPUs become 2-node clusters, replayed to 100 % arrived demand with
``place_gang`` (gang) and with the nodes placed one at a time and rolled back (the baseline), per
``--traces`` × ``--algorithms`` × ``--seeds``: clusters placed (% of those arrived), clusters split
across regions, GPU allocation % and fragmentation % (FGD's amount), means over the seeds. Skipped,
saying so, when the trace is not beside the checkout (``--trace-dir``).

Tunnel throughput between a cluster's nodes (its private network) is not measured here yet: that is
the network part of issue 24; this bench prints it as "not measured".

Usage: ``python bench/bench_clusters.py [--hosts 10000] [--decisions 2000] [--algorithm fgd_net]
[--traces default,multigpu50] [--algorithms fgd_net,best_fit] [--seeds 42-46] [--skip-trace]
[--skip-speed] [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import describe_machine, quantile, record

from master.scheduler import MILLI, Fleet, Gpu, Node, Request, get_placer
from master.scheduler.gang import place_gang
from master.scheduler.gang_simulate import MODES, ClusterResult, simulate_clusters
from master.scheduler.trace import load_nodes, load_pods

REPO = Path(__file__).resolve().parent.parent
TRACE_DIR = REPO.parent / "shared" / "alibaba-gpu-v2023" / "csv"
MODELS = ("A100", "H100", "L40S", "RTX4090")
GPUS_PER_HOST = 8


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        seeds.extend(range(int(low), int(high or low) + 1))
    return seeds


# ---- speed -----------------------------------------------------------------------------------------


def build_fleet(hosts: int, *, regions: int, seed: int) -> Fleet:
    """``hosts`` hosts of 8 GPUs, each with a random number (0–8) of its GPUs taken, spread over models and regions."""
    rng = random.Random(seed)
    nodes = []
    for i in range(hosts):
        free = rng.randint(0, GPUS_PER_HOST)
        gpus = [Gpu(g, uuid=f"h{i}-g{g}", milli_free=MILLI if g < free else 0) for g in range(GPUS_PER_HOST)]
        nodes.append(
            Node(
                f"host-{i:05d}", rng.choice(MODELS), gpus, cpu_milli=128_000, memory_mib=1_048_576,
                cpu_milli_free=128_000 * free // GPUS_PER_HOST, memory_mib_free=1_048_576 * free // GPUS_PER_HOST,
                region=f"r{rng.randrange(regions)}",
            )
        )  # fmt: skip
    return Fleet(nodes)


def cluster_requests(decisions: int, *, seed: int) -> list[tuple[Request, int]]:
    """(member request, node count) per decision: 2–4 nodes of 1, 2 or 4 GPUs of one model."""
    rng = random.Random(seed + 1)
    requests = []
    for _ in range(decisions):
        gpus = rng.choice((1, 2, 4))
        member = Request(
            num_gpu=gpus,
            cpu_milli=8_000 * gpus,
            memory_mib=65_536 * gpus,
            gpu_models=frozenset({rng.choice(MODELS)}),
        )
        requests.append((member, rng.randint(2, 4)))
    return requests


def time_decisions(
    fleet: Fleet, requests: list[tuple[Request, int]], algorithm: str, *, gang: bool
) -> dict[str, float]:
    """Time one decision per request (gang: the cluster; else one node of it), each applied then released."""
    placer = get_placer(algorithm, seed=1)
    times: list[int] = []
    placed = 0
    for member, count in requests:
        started = time.perf_counter_ns()
        if gang:
            placements = place_gang(member, count, fleet, placer=placer) or []
        else:
            single = placer.place(member, fleet)
            placements = [] if single is None else [single]
        times.append(time.perf_counter_ns() - started)
        placed += bool(placements)
        for placement in placements:
            fleet.apply(placement)
        for placement in placements:
            fleet.release(placement)
    total_s = sum(times) / 1e9
    return {
        "per_s": len(times) / total_s if total_s else 0.0,
        "p50_ms": quantile(times, 0.5) / 1e6,
        "p99_ms": quantile(times, 0.99) / 1e6,
        "placed": placed,
    }


def run_speed(hosts: int, decisions: int, algorithm: str, regions: int) -> None:
    fleet = build_fleet(hosts, regions=regions, seed=7)
    requests = cluster_requests(decisions, seed=7)
    free = sum(node.full for node in fleet)
    print(f"\nSpeed: {hosts:,} hosts ({hosts * GPUS_PER_HOST:,} GPUs, {free:,} free), {regions} regions, "
          f"{decisions:,} decisions, {algorithm}")  # fmt: skip
    baseline = time_decisions(fleet, requests, algorithm, gang=False)
    gang = time_decisions(fleet, requests, algorithm, gang=True)
    print(f"  {'':34} {'decisions/s':>12} {'p50 ms':>9} {'p99 ms':>9} {'placed':>8}")
    for name, figures in (
        ("gang placement (place_gang)", gang),
        ("single-node placement (baseline)", baseline),
    ):
        print(f"  {name:34} {figures['per_s']:12,.0f} {figures['p50_ms']:9.3f} {figures['p99_ms']:9.3f} "
              f"{figures['placed']:8,.0f}")  # fmt: skip
    ratio = gang["per_s"] / baseline["per_s"] if baseline["per_s"] else float("nan")
    print(f"  ratio gang / baseline: {ratio:.3f}× the decisions per second, "
          f"p99 {gang['p99_ms'] / baseline['p99_ms']:.1f}× as long")  # fmt: skip
    fleet_name = f"{hosts:,} hosts"
    record("clusters", f"gang placement decisions at {fleet_name} ({algorithm})", round(gang["per_s"], 1),
           "decisions/s", "single-node placements, same placer and fleet", round(baseline["per_s"], 1))  # fmt: skip
    record("clusters", f"gang placement p99 decision at {fleet_name} ({algorithm})", round(gang["p99_ms"], 3), "ms",
           "single-node placement p99", round(baseline["p99_ms"], 3))  # fmt: skip


# ---- trace -----------------------------------------------------------------------------------------


def run_trace(
    trace_dir: Path, traces: Sequence[str], algorithms: Sequence[str], seeds: Sequence[int]
) -> None:
    node_file = trace_dir / "openb_node_list_gpu_node.csv"
    if not node_file.exists():
        print(f"\nTrace: skipped, no {node_file} (--trace-dir)")
        return
    nodes = load_nodes(node_file)
    print(f"\nTrace: {len(nodes):,} GPU hosts in 4 regions, clusters = the tasks asking an even number ≥ 2 of "
          f"whole GPUs, as 2 nodes of half; 100 % arrived demand; means over seeds {seeds[0]}–{seeds[-1]}")  # fmt: skip
    header = f"  {'trace':12} {'algorithm':10} {'mode':14} {'clusters':>9} {'placed %':>9} {'split':>7} " \
             f"{'alloc %':>8} {'frag %':>7}"  # fmt: skip
    print(header)
    for trace in traces:
        pods = [pod.request for pod in load_pods(trace_dir / f"openb_pod_list_{trace}.csv")]
        for algorithm in algorithms:
            means: dict[str, dict[str, float]] = {}
            for mode in MODES:
                runs: list[ClusterResult] = [
                    simulate_clusters(nodes, pods, algorithm=algorithm, mode=mode, seed=seed)
                    for seed in seeds
                ]
                means[mode] = {
                    "clusters": statistics.fmean(r.clusters for r in runs),
                    "placed": statistics.fmean(100 * r.clusters_placed / max(r.clusters, 1) for r in runs),
                    "split": statistics.fmean(r.clusters_split for r in runs),
                    "alloc": statistics.fmean(r.allocated_pct for r in runs),
                    "frag": statistics.fmean(r.fragmented_pct for r in runs),
                }
                m = means[mode]
                print(f"  {trace:12} {algorithm:10} {mode:14} {m['clusters']:9.1f} {m['placed']:9.2f} "
                      f"{m['split']:7.1f} {m['alloc']:8.2f} {m['frag']:7.2f}")  # fmt: skip
            gang, base = means["gang"], means["one_at_a_time"]
            print(f"  {'':12} {'':10} {'gang − base':14} {'':9} {gang['placed'] - base['placed']:+9.2f} "
                  f"{gang['split'] - base['split']:+7.1f} {gang['alloc'] - base['alloc']:+8.2f} "
                  f"{gang['frag'] - base['frag']:+7.2f}")  # fmt: skip
            record("clusters", f"{trace} trace, {algorithm}: clusters placed", round(gang["placed"], 2), "%",
                   "nodes one at a time, rolled back", round(base["placed"], 2))  # fmt: skip
            record("clusters", f"{trace} trace, {algorithm}: GPU allocation at 100 % arrived", round(gang["alloc"], 2),
                   "%", "nodes one at a time, rolled back", round(base["alloc"], 2))  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--hosts", type=int, help="default 10,000 (--quick: 1,000)")
    parser.add_argument("--decisions", type=int, help="default 2,000 (--quick: 200)")
    parser.add_argument("--regions", type=int, default=8)
    parser.add_argument("--algorithm", default="fgd_net", help="the placer of the speed runs")
    parser.add_argument("--trace-dir", type=Path, default=TRACE_DIR)
    parser.add_argument("--traces", help="default default,multigpu50 (--quick: default)")
    parser.add_argument(
        "--algorithms", help="the placers of the trace runs; default fgd_net,best_fit (--quick: fgd_net)"
    )
    parser.add_argument("--seeds", help="default 42-46 (--quick: 42)")
    parser.add_argument("--skip-trace", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smaller defaults: 1,000 hosts, 200 decisions, one trace, one seed",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    hosts = args.hosts or (1_000 if quick else 10_000)
    decisions = args.decisions or (200 if quick else 2_000)
    traces = args.traces or ("default" if quick else "default,multigpu50")
    algorithms = args.algorithms or ("fgd_net" if quick else "fgd_net,best_fit")
    seeds = args.seeds or ("42" if quick else "42-46")
    print(describe_machine())
    started = time.monotonic()
    if not args.skip_speed:
        run_speed(hosts, decisions, args.algorithm, args.regions)
    if not args.skip_trace:
        run_trace(args.trace_dir, traces.split(","), algorithms.split(","), parse_seeds(seeds))
    print("\nTunnel throughput between a cluster's nodes: not measured yet (the network part of issue 24)")
    print(f"\n{time.monotonic() - started:.1f} s in all")


if __name__ == "__main__":
    main()
