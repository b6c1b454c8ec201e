"""``fgd_plus``: ``fgd_net`` measured against every task shape with its host memory, pulled towards fuller nodes.

Issue 43. FGD's target workload is the most popular task shapes covering 95 % of the tasks (the artifact's
``typicalPodsConfig``), by CPU and GPU only. On the trace, most of the GPU demand that fails once the fleet is
nearly full fails for want of *host memory*: nodes with a free GPU and the CPU for a task but not its memory —
which FGD never looks at. ``fgd_plus`` measures fragmentation against every shape of the workload, host memory
included (:meth:`Workload.complete`; a GPU is fragment to a task on a node short of its memory, as for CPU), keeps
``fgd_net``'s model-scarcity penalty, and subtracts ``FILL_WEIGHT`` score points per unit of the node's free share
(``Node.free_share``), so a node a little fuller can win over one a step better by FGD. docs/placement.md
("Scheduler, round 2") has the measurements behind each choice.
"""

from __future__ import annotations

from master.scheduler.fleet import Fleet, Node, Request
from master.scheduler.fragmentation import Workload
from master.scheduler.placers.base import Scored
from master.scheduler.placers.fgd_net import FgdNet

# fgd_plus: FGD score points per unit of the node's free share (0 = full … 1 = idle: at most this many points).
FILL_WEIGHT = 2.0


class FgdPlus(FgdNet):
    """``fgd_net`` against the complete, memory-aware workload, less ``FILL_WEIGHT`` × the node's free share."""

    name = "fgd_plus"
    state_with_memory = True  # the score reads the node's free host memory, which ``Node.state`` leaves out

    def target(self, workload: Workload) -> Workload:
        return workload.complete()

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        scored = super().score(node, position, request, fleet)
        if scored is None:
            return None
        return scored[0] - FILL_WEIGHT * node.free_share, scored[1]


__all__ = ["FILL_WEIGHT", "FgdPlus"]
