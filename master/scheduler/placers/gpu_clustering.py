"""``gpu_clustering``: tasks of one GPU shape together (the FGD artifact's GpuClustering)."""

from __future__ import annotations

from master.scheduler.fleet import Fleet, Node, Request, gpu_shape
from master.scheduler.placers.base import IndexedPlacer, Scored


class GpuClustering(IndexedPlacer):
    """Put tasks of one GPU shape together (FGD's GpuClustering).

    Bands (higher first): the node runs only this shape (75–100), this shape among others
    (50–75), nothing (25–50), only other shapes (0–25); within a band, the less GPU the
    node has free the better: ``25·(max_gpu − gpu_free) // max_gpu``. CPU-only tasks score 0.
    """

    name = "gpu_clustering"

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        if request.num_gpu == 0:
            return 0.0, None
        max_gpu = fleet.max_gpu_milli
        within = 25 * (max_gpu - node.free_total) // max_gpu
        shape = gpu_shape(request)
        if node.affinity.get(shape, 0) > 0:
            band = 75 if len(node.affinity) == 1 else 50
        else:
            band = 25 if not node.affinity else 0
        return float(band + within), None


__all__ = ["GpuClustering"]
