"""``utilization``: dot-product packing (Tetris's alignment score as a most-allocated rule, the FGD paper's DotProd)."""

from __future__ import annotations

from master.scheduler.fleet import Fleet, Node, Request
from master.scheduler.placers.base import IndexedPlacer, Scored


class Utilization(IndexedPlacer):
    """Dot-product packing: the node whose free resources align least with the request.

    ``dot = ⟨(cpu_free/max_cpu, gpu_free/max_gpu), (cpu/max_cpu, gpu/max_gpu)⟩``, normalised by
    the largest node, scored ``int(100 · (1 − dot/2))``, higher first — the Tetris alignment
    score (Grandl et al., SIGCOMM 2014) turned into a most-allocated rule, on the integer scale
    the FGD paper's DotProd baseline uses (its "merge" form: a node's GPUs count as one pool).
    Shares go to the best-fitting GPU.
    """

    name = "utilization"
    scores_by_state = True

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        max_cpu, max_gpu = fleet.max_cpu_milli, fleet.max_gpu_milli
        dot = (node.cpu_milli_free / max_cpu) * (request.cpu_milli / max_cpu) + (node.free_total / max_gpu) * (
            request.gpu_milli_total / max_gpu
        )
        return float(int(100 * (1 - dot / 2))), None


__all__ = ["Utilization"]
