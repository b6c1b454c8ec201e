"""The heterogeneous-clusters experiment (issue 26, part 2a): the shape of the design's published one.

Three provider clusters, each in its own region and of its own GPU model — RTX 2080 Ti (11 GB) in
``eu``, GTX 1660 Super (6 GB) in ``us``, RTX 3090 (24 GB) in ``asia`` — whose nodes have measured
links (latency, jitter, loss, with a per-node spread) to each renter region. Tasks arrive one at a
time and never leave: a share of one GPU (250–750 milli with its GPU memory) or 1, 2 or 4 whole GPUs,
some restricted to the models with enough memory, most with network limits from a renter region
(latency, and often jitter and loss). A task nothing can take fails. The count of tasks placed is
the result, as in the published experiment (DDPG 59, Utilization 58, Greedy and BestFit 54, Random 53).

``hetero_episode(seed)`` draws one fleet and arrival sequence; ``run_hetero`` replays it through the
placers (FGD's target workload: the episode's own tasks, as the trace simulator does); ``summarise``
gives mean ± σ per algorithm. Deterministic in the seed. Imports the scheduler only; no I/O.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from master.scheduler.fleet import MILLI, Fleet, Gpu, LinkStats, NetworkLimits, Node, Request
from master.scheduler.fragmentation import Workload
from master.scheduler.placers.base import Placer
from master.scheduler.registry import get_placer

REGIONS = ("eu", "us", "asia")
# Per cluster: region, GPU model, GPU memory (MiB), node count range, GPUs per node (choices), CPU cores, RAM GiB.
CLUSTERS = (
    ("eu", "RTX2080Ti", 11_264, (6, 8), (2, 4), (16, 32), (64, 128)),
    ("us", "GTX1660S", 6_144, (8, 10), (1, 2), (8, 16), (32, 64)),
    ("asia", "RTX3090", 24_576, (4, 5), (1, 2, 4), (16, 32), (64, 128)),
)
# Base one-way latency (ms) from a provider region (row) to a renter region (column).
BASE_LATENCY_MS = {
    "eu": {"eu": 15.0, "us": 90.0, "asia": 160.0},
    "us": {"eu": 90.0, "us": 20.0, "asia": 140.0},
    "asia": {"eu": 160.0, "us": 140.0, "asia": 25.0},
}
DEFAULT_TASKS = 100
# Held out: the experiment's seeds; training draws from TRAINING_SEED_BASE on.
EVALUATION_SEEDS = range(1, 101)
TRAINING_SEED_BASE = 1000
DEFAULT_ALGORITHMS = (
    "first_fit", "best_fit", "random", "utilization", "fgd", "fgd_net", "learned_ppo", "learned_ddpg",
)  # fmt: skip


def hetero_nodes(rng: random.Random) -> list[Node]:
    nodes: list[Node] = []
    for region, model, gpu_memory, (low, high), gpu_choices, cores, ram in CLUSTERS:
        for index in range(rng.randint(low, high)):
            node_id = f"{region}-{model}-{index}"
            gpus = [
                Gpu(i, uuid=f"{node_id}-gpu{i}", memory_mib=gpu_memory) for i in range(rng.choice(gpu_choices))
            ]
            links: dict[str, LinkStats] = {}
            for renter in REGIONS:
                latency = BASE_LATENCY_MS[region][renter] * rng.uniform(0.6, 1.6)
                jitter = rng.uniform(0.5, 0.25 * latency)
                loss = rng.choice((0.0, 0.0, 0.1, 0.3, 0.8, 2.0)) * rng.uniform(0.5, 1.5)
                links[renter] = LinkStats(round(latency, 1), round(jitter, 1), round(loss, 2))
            nodes.append(
                Node(node_id, model, gpus, cpu_milli=1000 * rng.choice(cores), memory_mib=1024 * rng.choice(ram),
                     links=links, region=region)
            )  # fmt: skip
    return nodes


def hetero_task(rng: random.Random) -> Request:
    network = None
    if rng.random() < 0.75:
        network = NetworkLimits(
            rng.choice(REGIONS),
            max_latency_ms=rng.choice((100.0, 200.0, 300.0, None)),
            max_jitter_ms=rng.choice((None, 10.0, 30.0)),
            max_loss_pct=rng.choice((None, 0.5, 1.0)),
        )
    cpu = 1000 * rng.choice((1, 2, 4, 8))
    memory = 1024 * rng.choice((4, 8, 16, 32))
    if rng.random() < 0.55:  # a share of one GPU, with its GPU memory
        milli = rng.choice((250, 500, 750))
        gpu_memory = 1024 * rng.choice((1, 2, 3, 4, 5, 8))
        models = frozenset({"RTX2080Ti", "RTX3090"}) if gpu_memory > 6_144 else frozenset()
        return Request(num_gpu=1, gpu_milli=milli, gpu_memory_mib=gpu_memory, gpu_models=models, cpu_milli=cpu,
                       memory_mib=memory, network=network)  # fmt: skip
    count = rng.choices((1, 2, 4), weights=(0.65, 0.27, 0.08))[0]
    draw = rng.random()
    models = frozenset()
    if draw < 0.2:
        models = frozenset({"RTX3090"})  # needs 24 GB
    elif draw < 0.45:
        models = frozenset({"RTX2080Ti", "RTX3090"})  # needs more than 6 GB
    return Request(num_gpu=count, gpu_milli=MILLI, gpu_models=models, cpu_milli=cpu, memory_mib=memory,
                   network=network)  # fmt: skip


def hetero_episode(seed: int, *, tasks: int = DEFAULT_TASKS) -> tuple[list[Node], list[Request]]:
    """One draw of the experiment: the three clusters' nodes (fresh) and ``tasks`` arrivals."""
    rng = random.Random(f"hetero:{seed}")
    nodes = hetero_nodes(rng)
    return nodes, [hetero_task(rng) for _ in range(tasks)]


def place_all(algorithm: str, nodes: Sequence[Node], requests: Sequence[Request], *, seed: int) -> int:
    """How many of ``requests`` the placer ``algorithm`` places on ``nodes`` (changed in place), in order."""
    return place_in_order(get_placer(algorithm, seed=seed, workload=Workload.from_requests(requests)), nodes, requests)


def place_in_order(placer: Placer, nodes: Sequence[Node], requests: Sequence[Request]) -> int:
    """How many of ``requests`` ``placer`` places on ``nodes`` (changed in place), one at a time, never releasing."""
    fleet = Fleet(nodes)
    placed = 0
    for request in requests:
        placement = placer.place(request, fleet)
        if placement is not None:
            fleet.apply(placement)
            placed += 1
    return placed


@dataclass(frozen=True, slots=True)
class HeteroResult:
    algorithm: str
    placed: tuple[int, ...]  # per seed
    seeds: tuple[int, ...]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.placed)

    @property
    def sd(self) -> float:
        return statistics.pstdev(self.placed)

    def to_json(self) -> dict[str, object]:
        return {"algorithm": self.algorithm, "mean": round(self.mean, 3), "sd": round(self.sd, 3),
                "placed": list(self.placed), "seeds": list(self.seeds)}  # fmt: skip


def run_hetero(
    algorithms: Iterable[str] = DEFAULT_ALGORITHMS,
    seeds: Iterable[int] = EVALUATION_SEEDS,
    *,
    tasks: int = DEFAULT_TASKS,
    progress: Callable[[int, int], None] | None = None,
) -> list[HeteroResult]:
    """Every algorithm on every seed's episode (the same episode for all): tasks placed, per algorithm."""
    names, seed_list = list(algorithms), list(seeds)
    for name in names:
        get_placer(name)  # an unknown name or a missing policy fails before any work
    placed: dict[str, list[int]] = {name: [] for name in names}
    for done, seed in enumerate(seed_list, start=1):
        for name in names:
            nodes, requests = hetero_episode(seed, tasks=tasks)
            placed[name].append(place_all(name, nodes, requests, seed=seed))
        if progress is not None:
            progress(done, len(seed_list))
    return [HeteroResult(name, tuple(placed[name]), tuple(seed_list)) for name in names]


__all__ = [
    "CLUSTERS", "DEFAULT_ALGORITHMS", "DEFAULT_TASKS", "EVALUATION_SEEDS", "REGIONS", "TRAINING_SEED_BASE",
    "HeteroResult", "hetero_episode", "place_all", "place_in_order", "run_hetero",
]  # fmt: skip
