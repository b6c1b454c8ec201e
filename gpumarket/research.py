"""The scheduler's experiments as commands: ``gpumarket simulate`` (the Alibaba trace, or ``--hetero``, through the
placers) and ``gpumarket train-placer`` (the learned placer's training). Nothing here touches a marketplace: they run
``master.scheduler`` and ``gpumarket.learn`` in this process."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpumarket.renter.options import positive_int


def cmd_simulate(args: argparse.Namespace) -> None:
    import json

    from master.scheduler.simulate import ProgressBar, simulate
    from master.scheduler.trace import load_nodes, load_pods
    from shared.errors import ValidationFailed

    if args.hetero:
        cmd_simulate_hetero(args)
        return
    if args.nodes is None or args.pods is None:
        raise ValidationFailed("simulate needs --nodes and --pods (the trace's CSVs), or --hetero for the heterogeneous-clusters experiment")
    nodes = load_nodes(args.nodes)
    pods = [pod.request for pod in load_pods(args.pods)]
    progress = None if args.quiet else ProgressBar(f"simulate {args.algorithm} seed {args.seed}")
    result = simulate(
        nodes, pods, algorithm=args.algorithm, inflate=args.inflate, seed=args.seed, stop_at_pct=args.stop_at,
        progress=progress,
    )  # fmt: skip
    if args.json:
        print(json.dumps(result.to_json()))
        return
    print(f"{result.algorithm} (seed {result.seed}): {result.nodes:,} nodes, {result.gpus:,} GPUs, "
          f"{result.pods:,} pods arriving: {result.placed:,} placed, {result.failed:,} failed")  # fmt: skip
    print("arrived %  GPU allocated %  fragmented %  power kW")
    for pct in (50, 80, 90, 95, 100, 110, 120, 130):
        allocated, fragmented, watts = result.allocated_at(pct), result.fragmented_at(pct), result.power_at(pct)
        if allocated is not None and fragmented is not None and watts is not None:
            print(f"{pct:9d}  {allocated:15.2f}  {fragmented:12.2f}  {watts / 1000:8.1f}")


def _seed_list(text: str) -> list[int]:
    """``1-100`` or ``1,5,9-12`` as a list of seeds."""
    seeds: list[int] = []
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            seeds.extend(range(int(low), int(high or low) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds are like 1-100 or 1,5,9-12, not {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("no seeds given")
    return seeds


def cmd_simulate_hetero(args: argparse.Namespace) -> None:
    import json

    from master.scheduler.hetero import DEFAULT_ALGORITHMS, run_hetero
    from shared.errors import ValidationFailed

    if args.nodes is not None or args.pods is not None:
        raise ValidationFailed("--hetero draws its own fleet and tasks: drop --nodes and --pods")
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()] if args.algorithms else list(DEFAULT_ALGORITHMS)
    def progress(done: int, total: int) -> None:
        if not args.quiet and (done == total or done % max(1, total // 10) == 0):
            print(f"simulate --hetero: {done}/{total} seeds", file=sys.stderr, flush=True)

    results = run_hetero(algorithms, args.seeds, tasks=args.tasks, progress=progress)
    if args.json:
        print(json.dumps({"experiment": "hetero", "tasks": args.tasks, "seeds": args.seeds,
                          "results": [result.to_json() for result in results]}))  # fmt: skip
        return
    print(f"heterogeneous clusters: {args.tasks} tasks arriving, seeds {args.seeds[0]}..{args.seeds[-1]} "
          f"({len(args.seeds)}); tasks placed, mean ± σ over the seeds")  # fmt: skip
    for result in results:
        print(f"  {result.algorithm:20s} {result.mean:6.2f} ± {result.sd:5.2f}   (min {min(result.placed)}, max {max(result.placed)})")


def cmd_train_placer(args: argparse.Namespace) -> None:
    from shared.errors import ConfigError

    try:
        from gpumarket.learn.train import train_placer
    except ImportError as exc:
        raise ConfigError(
            f"train-placer needs the learn extra ({exc.name or exc} is not installed): pip install 'gpumarket[learn]'"
        ) from None
    if args.setting == "trace":
        if args.trace_dir is None:
            raise ConfigError("the trace setting needs --trace-dir DIR: the folder holding openb_node_list_gpu_node.csv")
        if not (args.trace_dir / "openb_node_list_gpu_node.csv").is_file():
            raise ConfigError(f"{args.trace_dir} holds no openb_node_list_gpu_node.csv: pass the trace's csv folder as --trace-dir")

    def report(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    result = train_placer(
        args.algorithm, args.setting, steps=args.steps, seed=args.seed, name=args.out, directory=args.dir,
        trace_dir=args.trace_dir, report=report, start_from_fgd=args.start_from_fgd,
    )  # fmt: skip
    print(f"saved {result.path} ({args.algorithm}, {args.setting}, {result.steps:,} steps in {result.seconds:.0f} s, "
          f"{result.episodes:,} episodes, mean return {result.mean_return:.2f} over the last ones)")  # fmt: skip


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from master.scheduler.registry import DEFAULT_PLACER, PLACERS

    formatter = argparse.RawDescriptionHelpFormatter

    simulate = sub.add_parser(
        "simulate", help="replay a GPU cluster trace through a placement algorithm", formatter_class=formatter,
        description="Replay the Alibaba GPU cluster trace v2023 (FGD paper) through the scheduler's placers: top the "
        "trace's pods up to INFLATE x the GPU capacity with copies of random pods, shuffle them with the seed, place "
        "them one at a time, never release, drop the ones that fail. Reports GPU allocation and fragmentation at each "
        "whole percent of arrived GPU demand; a progress bar goes to stderr.",
        epilog=f"algorithms: {', '.join(PLACERS)} (default {DEFAULT_PLACER}).\n"
        "example: gpumarket simulate --nodes openb_node_list_gpu_node.csv --pods openb_pod_list_default.csv "
        "--algorithm fgd --seed 42 --json\n"
        "example: gpumarket simulate --hetero --seeds 1-100 --json",
    )  # fmt: skip
    simulate.add_argument("--nodes", type=Path, metavar="NODES.csv", help="trace node list (sn,cpu_milli,memory_mib,gpu,model)")
    simulate.add_argument("--pods", type=Path, metavar="PODS.csv", help="trace pod list (name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,...])")
    simulate.add_argument("--algorithm", default=DEFAULT_PLACER, choices=tuple(PLACERS), metavar="NAME", help=f"placement algorithm (default {DEFAULT_PLACER})")
    simulate.add_argument("--inflate", type=float, default=1.3, metavar="X", help="arriving GPU demand as a multiple of capacity (default 1.3)")
    simulate.add_argument("--seed", type=int, default=42, help="seed for the workload and the algorithm (default 42)")
    simulate.add_argument("--stop-at", type=float, metavar="PCT", help="stop once this %% of capacity has arrived (default: all of it)")
    simulate.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    simulate.add_argument("--quiet", action="store_true", help="no progress bar")
    hetero = simulate.add_argument_group(
        "heterogeneous clusters (--hetero)", "three clusters of different GPU models and networks, tasks with GPU shares "
        "and network limits; counts the tasks each algorithm places (docs/placement.md, the learned placer)",
    )  # fmt: skip
    hetero.add_argument("--hetero", action="store_true", help="run the heterogeneous-clusters experiment instead of a trace")
    hetero.add_argument("--algorithms", metavar="A,B,...", help="algorithms to compare (default: first_fit, best_fit, random, utilization, fgd, fgd_net, learned_ppo, learned_ddpg)")
    hetero.add_argument("--seeds", type=_seed_list, default=list(range(1, 101)), metavar="1-100", help="episodes' seeds (default 1-100, never trained on)")
    hetero.add_argument("--tasks", type=positive_int, default=100, metavar="N", help="tasks arriving per episode (default 100)")
    simulate.set_defaults(func=cmd_simulate)

    train = sub.add_parser(
        "train-placer", help="train the learned placer by reinforcement learning (needs gpumarket[learn])",
        formatter_class=formatter,
        description="Train the learned placer's scorer — one small MLP shared across candidate nodes — with "
        "Stable-Baselines3 in the placement simulator as a Gymnasium environment: MaskablePPO (ppo) or DDPG (ddpg), on "
        "the heterogeneous-clusters experiment (hetero, episode seeds from 1000 on) or on random 48-64-node subsets of "
        "the Alibaba trace with its default variant's pods (trace). Saves the numpy policy as DIR/NAME.npz, which "
        "gpumarket simulate --algorithm NAME and the master's placer setting load by name. CPU only, one thread; a "
        "progress line goes to stderr.",
        epilog="needs the optional extra: pip install 'gpumarket[learn]'\n"
        "example: gpumarket train-placer --algorithm ppo --setting hetero --steps 300000 --seed 1",
    )  # fmt: skip
    train.add_argument("--algorithm", required=True, choices=("ppo", "ddpg"), help="MaskablePPO (ppo) or DDPG (ddpg)")
    train.add_argument("--setting", default="hetero", choices=("hetero", "trace"), help="what to train on (default hetero)")
    train.add_argument("--steps", type=positive_int, default=200_000, metavar="N", help="environment steps (default 200000)")
    train.add_argument("--seed", type=int, default=0, help="seed of the training run (default 0)")
    train.add_argument("--out", metavar="NAME", help="policy name (default learned_ALGORITHM, learned_ALGORITHM_trace for trace)")
    train.add_argument("--dir", type=Path, metavar="DIR", help="where to save NAME.npz (default: the shipped policies, master/scheduler/policies)")
    train.add_argument("--trace-dir", type=Path, metavar="DIR", help="the trace's csv folder (the trace setting)")
    train.add_argument("--start-from-fgd", action="store_true", help="start the actor as FGD (its score increasing in FGD's) and refine it")
    train.add_argument("--quiet", action="store_true", help="no progress lines")
    train.set_defaults(func=cmd_train_placer)
