"""``fgd_plus``: ``fgd_net`` measured against every task shape, with a pull towards fuller nodes (issue 43).

FGD's target workload is the most popular task shapes covering 95 % of the tasks (the artifact's
``typicalPodsConfig``). On the trace that leaves out the last 5 % of the tasks — dozens of rare shapes, many of
them asking for more CPU per GPU than the popular ones — so FGD does not see the fragment a placement makes for
them. ``fgd_plus`` measures fragmentation against all the shapes, each weighted by its share of the tasks
(:meth:`Workload.complete`), keeps ``fgd_net``'s model-scarcity penalty, and subtracts ``FILL_WEIGHT`` score
points per unit of the node's free share (``Node.free_share``): equal FGD scores already go to the fullest node,
and this lets a node a little fuller win over one a step better by FGD. docs/placement.md ("Scheduler, round 2")
has the measurements behind both choices.
"""

from __future__ import annotations

from master.scheduler.fleet import Fleet, Node, Request
from master.scheduler.fragmentation import Workload
from master.scheduler.placers.base import Scored
from master.scheduler.placers.fgd_net import FgdNet

# fgd_plus: FGD score points per unit of the node's free share (0 = idle → 1 = full: at most this many points).
FILL_WEIGHT = 2.0


class FgdPlus(FgdNet):
    """``fgd_net`` against the complete workload (every task shape), less ``FILL_WEIGHT`` × the node's free share."""

    name = "fgd_plus"

    def target(self, workload: Workload) -> Workload:
        return workload.complete()

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        scored = super().score(node, position, request, fleet)
        if scored is None:
            return None
        return scored[0] - FILL_WEIGHT * node.free_share, scored[1]


__all__ = ["FILL_WEIGHT", "FgdPlus"]
