"""``fgd_net``, the default: FGD less a penalty for crowded GPU models, nearest host among equals."""

from __future__ import annotations

from typing import ClassVar

from master.scheduler.fleet import Fleet, Node, Request
from master.scheduler.fragmentation import Workload, model_pressure
from master.scheduler.placers.base import Scored
from master.scheduler.placers.fgd import Fgd

# fgd_net ranks equally good placements by latency to the renter's region up to this much.
MAX_LATENCY_MS = 1000.0
# fgd_net: FGD score points (about 40 milli-GPU of fragment each) per unit of a model's pressure.
SCARCITY_WEIGHT = 10.0


class FgdNet(Fgd):
    """Our default: FGD that also keeps scarce GPU models for the tasks that need them, and prefers near hosts.

    Score = ``fgd_score`` − ``SCARCITY_WEIGHT`` · pressure of the node's model
    (:func:`model_pressure`) for GPU requests; then, among equal scores, the lowest latency
    to the renter's region (unmeasured hosts last), then the fullest node. A task that can
    run anywhere thus avoids the models that constrained tasks crowd (in the trace's
    ``gpuspec33`` variant, T4 nodes, wanted by 17 % of the demand while holding 13.5 % of the
    GPUs), unless FGD sees a real fragmentation gain. Without model constraints in the
    workload and without a region in the request, it places exactly as ``fgd``. The renter's
    network limits filter hosts for every placer (``fits``).
    """

    name = "fgd_net"
    # Score points per unit of the node's model pressure (``fgd_plus`` weighs it more).
    scarcity_weight: ClassVar[float] = SCARCITY_WEIGHT

    def __init__(self, *, seed: int = 0, workload: Workload | None = None) -> None:
        super().__init__(seed=seed, workload=workload)
        self._pressure: dict[str, float] = {}

    def _bind(self, fleet: Fleet) -> None:
        if self._fleet is not fleet:
            self._pressure = model_pressure(self.frag_model.workload, fleet.capacity_by_model)
        super()._bind(fleet)

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        found = self.fgd(node, request)
        if found is None:
            return None
        value = float(found[0])
        if request.num_gpu:
            value -= self.scarcity_weight * self._pressure.get(node.model, 0.0)
        if request.network is not None:
            link = node.links.get(request.network.region)
            # Less than one step of the integer FGD score: latency only decides between equals.
            latency = MAX_LATENCY_MS if link is None else min(link.latency_ms, MAX_LATENCY_MS)
            value -= 0.5 * latency / MAX_LATENCY_MS
        return value, found[1]


__all__ = ["MAX_LATENCY_MS", "SCARCITY_WEIGHT", "FgdNet"]
