"""``best_fit``: the node left with the least free CPU and GPU (the FGD artifact's BestFit)."""

from __future__ import annotations

from master.scheduler.fleet import Fleet, Node, Request
from master.scheduler.placers.base import IndexedPlacer, Scored


class BestFit(IndexedPlacer):
    """The node left with the least free CPU and GPU: minimise ``0.5·cpu_free/max_cpu + 0.5·gpu_free/max_gpu``.

    The request's own share of both is the same for every node, so it drops out.
    """

    name = "best_fit"
    scores_by_state = True

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        return -(0.5 * node.cpu_milli_free / fleet.max_cpu_milli + 0.5 * node.free_total / fleet.max_gpu_milli), None


__all__ = ["BestFit"]
