"""``pwr_fgd``: FGD (with fgd_net's model scarcity) less a weighted penalty for the power a placement adds.

After PWR+FGD (Lettich et al., "Power- and Fragmentation-aware Online Scheduling for GPU Datacenters", CCGrid 2025,
arXiv 2412.17484), which adds a power score (PWR: the power increase a placement causes) to FGD's.
"""

from __future__ import annotations

from typing import ClassVar

from master.scheduler.fleet import MILLI, Fleet, Node, Request
from master.scheduler.fragmentation import Workload
from master.scheduler.placers.base import Scored
from master.scheduler.placers.fgd_net import FgdNet
from master.scheduler.power import TRACE_POWER, PowerModel

# Score points per 100 W a placement adds: chosen on tuning seeds 1000–1009 over the 17 trace variants, the weight
# of 2, 5, 10, 20 whose worst variant lost least allocation against fgd (docs/power.md, "Power-aware placement").
PWR_WEIGHT = 20.0


class PwrFgd(FgdNet):
    """Score = fgd_net's score − ``alpha`` · ΔP / 100 W, ΔP = ``PowerModel.delta_w`` (watts the placement adds).

    One FGD score point is about 40 milli-GPU of expected fragment (``fgd_score``'s slope near 0); with
    ``alpha`` = 2, a whole V100-class GPU (+273 W) costs 5.5 points and a whole T4 (+60 W) 1.2, and a share that
    wakes an idle GPU pays its step (30 W on a V100-class board: 0.6 points) on top of its slope. The default, 20,
    weighs 100 W as much as some 800 milli-GPU of expected fragment: power leads between models, FGD within one. A model that tasks restricted to few models need (``model_pressure``) loses its power
    advantage in proportion to its pressure: its slope is raised toward the fleet's highest, so the power term does
    not undo fgd_net's scarcity term. ΔP reads only the node's model, CPU and free GPU milli, so scores stay a
    function of ``Node.state`` and the shared machinery's caches and heaps apply unchanged.
    """

    name = "pwr_fgd"
    # The weight a placer built without one gets (``get_placer``); the bench sets it per process when it tunes.
    default_alpha: ClassVar[float] = PWR_WEIGHT

    def __init__(
        self, *, seed: int = 0, workload: Workload | None = None, power: PowerModel = TRACE_POWER,
        alpha: float | None = None,
    ) -> None:  # fmt: skip
        super().__init__(seed=seed, workload=workload)
        self.power = power
        # ΔP by node state and request (states recur, as FGD's scores do).
        self._deltas: dict[tuple[object, ...], float] = {}
        self._surcharge: dict[str, float] = {}
        self.alpha = self.default_alpha if alpha is None else alpha

    def _bind(self, fleet: Fleet) -> None:
        if self._fleet is not fleet:
            super()._bind(fleet)  # the models' pressure first
            slopes = {model: self.power.gpu(model).slope_w for model in fleet.capacity_by_model}
            top = max(slopes.values(), default=0.0)
            # A model constrained tasks need loses its power advantage in proportion to its pressure (all of it at 1
            # and above): its cheap watts would go to tasks that could run elsewhere, and the ones that cannot fail.
            self._surcharge = {
                model: min(1.0, self._pressure.get(model, 0.0)) * (top - slope) for model, slope in slopes.items()
            }
            self._deltas.clear()
            return
        super()._bind(fleet)

    def delta_w(self, node: Node, request: Request, taken: tuple[int, ...]) -> float:
        """The watts the placement adds, plus the surcharge of a model constrained tasks need."""
        delta = self.power.delta_w(node, request, taken)
        if request.num_gpu and request.mig_profile is None:
            delta += self._surcharge.get(node.model, 0.0) * request.gpu_milli_total / MILLI
        return delta

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        scored = super().score(node, position, request, fleet)
        if scored is None:
            return None
        choice = scored[1]
        # A single share goes to the GPU FGD chose (its free milli); otherwise as ``delta_w`` assumes (best fit).
        taken = (choice,) if isinstance(choice, int) and request.num_gpu == 1 else ()
        state = node.state
        if state is None:
            return scored[0] - self.alpha * self.delta_w(node, request, taken) / 100.0, choice
        key = (state, request.cpu_milli, request.num_gpu, request.gpu_milli, taken)
        delta = self._deltas.get(key)
        if delta is None:
            if len(self._deltas) >= self.max_cached_scores:
                self._deltas.clear()
            delta = self._deltas[key] = self.delta_w(node, request, taken)
        return scored[0] - self.alpha * delta / 100.0, choice


__all__ = ["PWR_WEIGHT", "PwrFgd"]
