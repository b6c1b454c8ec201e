"""``learned_*``: placers whose score is a small MLP trained by reinforcement learning (issue 26, part 1).

The scorer is one MLP shared across candidate nodes: ``score = mlp(features(node, request, fleet))``,
the features those of ``master.scheduler.learned.features`` (FGD's fragmentation change, best fit,
utilization, model pressure, network slack, …) and the MLP a shipped ``.npz`` policy run in numpy
(``master.scheduler.learned.policy``), loaded by name when the placer is built — so a missing or
damaged policy fails at start-up, as a ``PolicyError`` (a ``ConfigError``). Everything else is the
shared machinery's: the hard constraints, ties, MIG, and within the chosen node the GPU FGD would take.

Features, and so scores, depend on the node only through ``Node.state`` when the request has no
network limits, so scores are cached by state as FGD's are. Trained with ``gpumarket train-placer``
(``gpumarket.learn``, the optional ``learn`` extra); the numbers are in docs/placement.md.
"""

from __future__ import annotations

from typing import ClassVar

from master.scheduler.fleet import Fleet, Node, Placement, Request
from master.scheduler.fragmentation import Workload
from master.scheduler.learned.features import FeatureContext, FloatArray, node_features
from master.scheduler.learned.policy import Policy, load_policy
from master.scheduler.placers.base import Scored
from master.scheduler.placers.fgd import Fgd


class FeaturePlacer(Fgd):
    """FGD's placer that also computes each candidate's learned-scorer features (the training environment's view).

    As a placer it places exactly as ``fgd``; ``LearnedPlacer`` replaces the score.
    """

    def __init__(self, *, seed: int = 0, workload: Workload | None = None) -> None:
        super().__init__(seed=seed, workload=workload)
        self._context: FeatureContext | None = None

    def _bind(self, fleet: Fleet) -> None:
        if self._fleet is not fleet:
            self._context = None  # a new fleet, or FGD learnt a new workload: new normalisers and pressures
        super()._bind(fleet)

    def context(self, fleet: Fleet) -> FeatureContext:
        self._bind(fleet)
        if self._context is None:
            self._context = FeatureContext(fleet, self.frag_model)
        return self._context

    def candidate(self, node: Node, request: Request, fleet: Fleet) -> tuple[FloatArray, int | None] | None:
        """The features of placing ``request`` (not MIG) on the feasible ``node``, and FGD's GPU choice there."""
        found = self.frag_delta(node, request)
        if found is None:
            return None
        return node_features(self.context(fleet), node, request, found[0]), found[1]

    def placement_on(self, position: int, request: Request, fleet: Fleet, choice: object) -> Placement:
        """The placement on the feasible node at ``position`` with the GPU ``choice`` that ``candidate`` gave."""
        return self._placement(fleet[position], position, request, choice)


class LearnedPlacer(FeaturePlacer):
    """Scores each feasible node with the policy ``policy_name``; see the module docstring."""

    policy_name: ClassVar[str] = ""
    scores_by_state = True
    max_cached_learned: ClassVar[int] = 200_000

    def __init__(self, *, seed: int = 0, workload: Workload | None = None, policy: Policy | None = None) -> None:
        super().__init__(seed=seed, workload=workload)
        self.policy = policy if policy is not None else load_policy(self.policy_name)
        self._learned: dict[tuple[object, ...], Scored | None] = {}

    def _bind(self, fleet: Fleet) -> None:
        if self._fleet is not fleet:
            self._learned.clear()
        super()._bind(fleet)

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        key: tuple[object, ...] | None = None
        if node.state is not None and request.network is None:
            key = (node.state, request.cpu_milli, request.num_gpu, request.gpu_milli, request.gpu_models)
            try:
                return self._learned[key]
            except KeyError:
                pass
        found = self.candidate(node, request, fleet)
        scored = None if found is None else (self.policy.score(found[0]), found[1])
        if key is not None:
            if len(self._learned) >= self.max_cached_learned:
                self._learned.clear()
            self._learned[key] = scored
        return scored


class LearnedPpo(LearnedPlacer):
    """MaskablePPO's scorer, trained on the heterogeneous-clusters experiment (``master.scheduler.hetero``)."""

    name = "learned_ppo"
    policy_name = "learned_ppo"


class LearnedDdpg(LearnedPlacer):
    """DDPG's scorer (the design's baseline), trained on the heterogeneous-clusters experiment."""

    name = "learned_ddpg"
    policy_name = "learned_ddpg"


class LearnedPpoTrace(LearnedPlacer):
    """MaskablePPO's scorer, trained on small subsets of the Alibaba trace (variant ``default``, seeds ≥ 1000)."""

    name = "learned_ppo_trace"
    policy_name = "learned_ppo_trace"


class LearnedDdpgTrace(LearnedPlacer):
    """DDPG's scorer, trained on small subsets of the Alibaba trace (variant ``default``, seeds ≥ 1000)."""

    name = "learned_ddpg_trace"
    policy_name = "learned_ddpg_trace"


__all__ = ["FeaturePlacer", "LearnedDdpg", "LearnedDdpgTrace", "LearnedPlacer", "LearnedPpo", "LearnedPpoTrace"]
