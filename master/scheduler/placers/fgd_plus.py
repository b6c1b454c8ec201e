"""``fgd_plus``: ``fgd_net`` measured against every task shape with its host memory, pulled towards fuller nodes.

Issue 43. FGD's target workload is the most popular task shapes covering 95 % of the tasks (the artifact's
``typicalPodsConfig``), by CPU and GPU only. On the trace, most of the GPU demand that fails once the fleet is
nearly full fails for want of *host memory*: nodes with a free GPU and the CPU for a task but not its memory —
which FGD never looks at. ``fgd_plus`` measures fragmentation against every shape of the workload, host memory
included (:meth:`Workload.complete`; a GPU is fragment to a task on a node short of its memory, as for CPU), keeps
``fgd_net``'s model-scarcity penalty (weighed ``PLUS_SCARCITY_WEIGHT``, not 10), and subtracts ``FILL_WEIGHT`` score points per unit of the node's free share
(``Node.free_share``), so a node a little fuller can win over one a step better by FGD, and ``MEMORY_WEIGHT``
(``CPU_WEIGHT``) points per unit by which the request's share of the node's host memory (CPU) exceeds its share of
the node's GPU — a task heavy in memory or CPU for its GPU goes where that leaves the node's remaining GPUs their
memory and CPU. docs/placement.md ("Scheduler, round 2") has the measurements behind each choice.
"""

from __future__ import annotations

from bisect import bisect_right

from master.scheduler.fleet import Fleet, Node, Request
from master.scheduler.fragmentation import Workload
from master.scheduler.placers.base import Scored
from master.scheduler.placers.fgd_net import FgdNet

# fgd_plus: FGD score points per unit of the node's free share (0 = full … 1 = idle: at most this many points).
FILL_WEIGHT = 5.0
# fgd_plus: score points per unit of the node's model pressure (``fgd_net``'s term, weighed more: the stronger pull
# towards fuller nodes would otherwise fill the crowded models' nodes).
PLUS_SCARCITY_WEIGHT = 15.0
# fgd_plus: score points per unit by which a request's share of the node's host memory (of its CPU) exceeds its
# share of the node's GPU.
MEMORY_WEIGHT = 10.0
CPU_WEIGHT = 10.0


class FgdPlus(FgdNet):
    """``fgd_net`` against the complete, memory-aware workload, less ``FILL_WEIGHT`` × the node's free share and
    the memory and CPU the request takes beyond its GPU share of the node."""

    name = "fgd_plus"
    scarcity_weight = PLUS_SCARCITY_WEIGHT
    scores_memory = True  # the score reads host memory, the node's and the request's

    def memory_key(self, node: Node, request: Request) -> object:
        # The score reads the node's total memory (the alignment term) and, through FGD, only the bucket of its free
        # memory before and after: nodes alike in these share a score, as most do.
        if not self.frag_model.memory_aware:
            return node.memory_mib
        thresholds, free = self.frag_model.memory_thresholds, node.memory_mib_free
        return (node.memory_mib, bisect_right(thresholds, free), bisect_right(thresholds, free - request.memory_mib))

    def target(self, workload: Workload) -> Workload:
        return workload.complete()

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        scored = super().score(node, position, request, fleet)
        if scored is None:
            return None
        value = scored[0] - FILL_WEIGHT * node.free_share
        gpu_share = request.gpu_milli_total / (node.gpu_milli_capacity or 1)
        if request.memory_mib and node.memory_mib:
            value -= MEMORY_WEIGHT * max(0.0, request.memory_mib / node.memory_mib - gpu_share)
        if request.cpu_milli and node.cpu_milli:
            value -= CPU_WEIGHT * max(0.0, request.cpu_milli / node.cpu_milli - gpu_share)
        return value, scored[1]


__all__ = ["CPU_WEIGHT", "FILL_WEIGHT", "MEMORY_WEIGHT", "PLUS_SCARCITY_WEIGHT", "FgdPlus"]
