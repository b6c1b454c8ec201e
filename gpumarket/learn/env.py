"""The placement simulator as a Gymnasium environment.

An episode is one arrival sequence on one fleet: ``hetero`` — one draw of the heterogeneous-clusters
experiment (``master.scheduler.hetero``, seeds from 1000 on, never the experiment's held-out 1–100);
``trace`` — a random subset of 48–64 of the Alibaba trace's nodes and the pods of one variant (by
default ``default``), topped up or cut to 1.3 × the subset's GPU capacity and shuffled as the
simulator does. Each step presents the current task's feasible nodes (``fits``), up to
``max_candidates`` (a random subset past that): the observation is their features
(``master.scheduler.learned.features``), ``max_candidates × F`` flattened, then a 0/1 mask of which
rows are real, then ``GLOBALS``: the share of the episode's tasks arrived so far, the fleet's share of GPU
milli still free and the share of the rows that are real — for the critics (the return to go depends on
how far the episode is), never for the shipped scorer, which reads only the rows. Tasks no node can take are skipped and counted as failed; an action naming no
candidate fails the task too (a masked policy never does). Reward: 1 per placed task (``hetero``:
the return is the count placed) or the GPU milli placed / 1000 (``trace``); with ``failure_penalty``
p > 0, each task that fails after a decision costs p × what it would have earned, charged to that
decision (training uses p = 1: the return is then placed − failed, which orders episodes as the count
placed does, with a failure felt at once rather than only as an episode one step shorter).

``action="discrete"`` (``Discrete(K)``, with ``action_masks()`` for sb3-contrib's MaskablePPO) or
``"box"`` (``Box(-1, 1, (K,))`` for DDPG: the env takes the argmax over the masked candidates).
The placement on the chosen node — its GPUs — is the one the learned placer makes (FGD's choice).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import numpy.typing as npt

from master.scheduler.fleet import MILLI, Fleet, Node, Request, fits
from master.scheduler.fragmentation import Workload
from master.scheduler.hetero import TRAINING_SEED_BASE, hetero_episode
from master.scheduler.learned.features import FEATURE_COUNT
from master.scheduler.placers.learned import FeaturePlacer
from master.scheduler.simulate import arrivals, fresh_node
from master.scheduler.trace import TraceNode, load_nodes, load_pods

Setting = Literal["hetero", "trace"]
ActionKind = Literal["discrete", "box"]
DEFAULT_CANDIDATES = 64
GLOBALS = 3  # tasks arrived / tasks, fleet GPU free share, feasible candidates / K
FEATURE_BOUND = 8.0  # the observation space's bound on a feature (they lie within ±4)
Observation = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class Episode:
    nodes: list[Node]
    requests: list[Request]
    workload: Workload


class TraceSource:
    """Episodes of the ``trace`` setting: random node subsets of the trace, pods of one variant."""

    def __init__(self, trace_dir: Path, *, variant: str = "default", min_nodes: int = 48, max_nodes: int = 64,
                 inflate: float = 1.3) -> None:  # fmt: skip
        self.nodes: list[TraceNode] = load_nodes(trace_dir / "openb_node_list_gpu_node.csv")
        self.pods = [pod.request for pod in load_pods(trace_dir / f"openb_pod_list_{variant}.csv")]
        self.pods = [pod for pod in self.pods if pod.mig_profile is None]
        self.workload = Workload.from_requests(self.pods)
        self.min_nodes, self.max_nodes, self.inflate = min_nodes, max_nodes, inflate

    def __call__(self, seed: int) -> Episode:
        rng = random.Random(f"trace:{seed}")
        count = rng.randint(self.min_nodes, self.max_nodes)
        nodes = [fresh_node(node) for node in rng.sample(self.nodes, count)]
        capacity = sum(node.gpu_milli_capacity for node in nodes)
        return Episode(nodes, arrivals(self.pods, capacity, inflate=self.inflate, seed=seed), self.workload)


def hetero_source(seed: int) -> Episode:
    nodes, requests = hetero_episode(seed)
    return Episode(nodes, requests, Workload.from_requests(requests))


class PlacementEnv(gym.Env[Observation, Any]):
    """See the module docstring."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        setting: Setting = "hetero",
        *,
        action: ActionKind = "discrete",
        max_candidates: int = DEFAULT_CANDIDATES,
        trace_dir: Path | None = None,
        trace_variant: str = "default",
        trace_nodes: tuple[int, int] = (48, 64),
        seed_base: int = TRAINING_SEED_BASE,
        failure_penalty: float = 0.0,
    ) -> None:
        self.setting = setting
        self.action_kind = action
        self.max_candidates = max_candidates
        self.seed_base = seed_base
        self.failure_penalty = failure_penalty
        self._penalty = 0.0  # what the tasks failed since the last decision cost
        if setting == "trace":
            if trace_dir is None:
                raise ValueError("the trace setting needs trace_dir (the folder of the trace's CSVs)")
            self._source: Any = TraceSource(trace_dir, variant=trace_variant, min_nodes=trace_nodes[0],
                                            max_nodes=trace_nodes[1])
        else:
            self._source = hetero_source
        width = max_candidates * FEATURE_COUNT
        low = np.concatenate([np.full(width, -FEATURE_BOUND), np.zeros(max_candidates + GLOBALS)]).astype(np.float32)
        high = np.concatenate([np.full(width, FEATURE_BOUND), np.ones(max_candidates + GLOBALS)]).astype(np.float32)
        self.observation_space = gym.spaces.Box(low, high, dtype=np.float32)
        self.action_space: gym.Space[Any] = (
            gym.spaces.Discrete(max_candidates) if action == "discrete"
            else gym.spaces.Box(-1.0, 1.0, (max_candidates,), dtype=np.float32)
        )  # fmt: skip
        self._features = np.zeros((max_candidates, FEATURE_COUNT), dtype=np.float32)
        self._mask = np.zeros(max_candidates, dtype=bool)
        self._positions: list[int] = []
        self._choices: list[int | None] = []
        self._queue: list[Request] = []
        self._next = 0
        self._request: Request | None = None
        self._fleet = Fleet(())
        self._placer = FeaturePlacer()
        self.episode_seed = 0
        self.placed = self.failed = 0
        self.milli_placed = 0

    # -- gymnasium --

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Observation, dict[str, Any]]:
        super().reset(seed=seed)
        chosen = None if options is None else options.get("episode_seed")
        while True:
            episode_seed = int(chosen) if chosen is not None else self.seed_base + int(self.np_random.integers(0, 10**7))
            episode = self._source(episode_seed)
            self._start(episode, episode_seed)
            if self._request is not None or chosen is not None:
                break
        return self._observation(), self._info()

    def step(self, action: Any) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        if self._request is None:
            raise RuntimeError("the episode is over: call reset()")
        index = self._index(action)
        request = self._request
        if index is None:  # a choice of no feasible node: the task fails
            self.failed += 1
            reward = -self.failure_penalty * self._worth(request)
        else:
            placement = self._placer.placement_on(self._positions[index], request, self._fleet, self._choices[index])
            self._fleet.apply(placement)
            self.placed += 1
            self.milli_placed += request.gpu_milli_total
            reward = self._worth(request)
        self._penalty = 0.0
        self._advance()
        reward -= self._penalty
        return self._observation(), reward, self._request is None, False, self._info()

    def _worth(self, request: Request) -> float:
        return 1.0 if self.setting == "hetero" else request.gpu_milli_total / MILLI

    def action_masks(self) -> npt.NDArray[np.bool_]:
        """Which actions name a feasible node (sb3-contrib's MaskablePPO reads it)."""
        return self._mask.copy()

    # -- the episode --

    def _start(self, episode: Episode, episode_seed: int) -> None:
        self.episode_seed = episode_seed
        self._fleet = Fleet(episode.nodes)
        self._placer = FeaturePlacer(seed=episode_seed, workload=episode.workload)
        self._queue = episode.requests
        self._next = 0
        self.placed = self.failed = self.milli_placed = 0
        self._advance()

    def _advance(self) -> None:
        """Move to the next task that some node can take, counting the ones none can as failed."""
        self._request = None
        self._mask[:] = False
        self._features[:] = 0.0
        nodes = self._fleet.nodes
        while self._next < len(self._queue):
            request = self._queue[self._next]
            self._next += 1
            feasible = [p for p in self._fleet.candidates(request) if fits(nodes[p], request)]
            if not feasible:
                self.failed += 1
                self._penalty += self.failure_penalty * self._worth(request)
                continue
            if len(feasible) > self.max_candidates:
                picked = self.np_random.choice(len(feasible), self.max_candidates, replace=False)
                feasible = [feasible[i] for i in sorted(picked)]
            self._positions, self._choices = [], []
            for row, position in enumerate(feasible):
                found = self._placer.candidate(nodes[position], request, self._fleet)
                if found is None:  # cannot happen for a feasible node; keep the row masked
                    self._positions.append(position)
                    self._choices.append(None)
                    continue
                self._features[row] = found[0]
                self._mask[row] = True
                self._positions.append(position)
                self._choices.append(found[1])
            if self._mask.any():
                self._request = request
                return
            self.failed += 1
            self._penalty += self.failure_penalty * self._worth(request)

    def _index(self, action: Any) -> int | None:
        if self.action_kind == "box":
            scores = np.asarray(action, dtype=np.float64).reshape(-1)
            return int(np.argmax(np.where(self._mask, scores, -np.inf))) if self._mask.any() else None
        index = int(action)
        return index if 0 <= index < self.max_candidates and self._mask[index] else None

    def _observation(self) -> Observation:
        capacity = sum(node.gpu_milli_capacity for node in self._fleet) or 1
        free = sum(node.free_total for node in self._fleet) / capacity
        arrived = self._next / len(self._queue) if self._queue else 1.0
        globals_ = np.array((arrived, free, self._mask.mean()), dtype=np.float32)
        return np.concatenate([self._features.reshape(-1), self._mask.astype(np.float32), globals_]).astype(np.float32)

    def _info(self) -> dict[str, Any]:
        return {"placed": self.placed, "failed": self.failed, "milli_placed": self.milli_placed,
                "episode_seed": self.episode_seed}  # fmt: skip


__all__ = ["DEFAULT_CANDIDATES", "GLOBALS", "Episode", "PlacementEnv", "TraceSource", "hetero_source"]
