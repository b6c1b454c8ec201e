"""``gpu_packing``: partly used GPUs first, then idle GPUs of used nodes, then empty nodes (the FGD artifact's GpuPacking)."""

from __future__ import annotations

from master.scheduler.fleet import MILLI, Fleet, Node, Request
from master.scheduler.placers.base import IndexedPlacer, Scored, best_fit_gpus


class GpuPacking(IndexedPlacer):
    """Fill shared GPUs first, then idle GPUs of used nodes, then empty nodes (FGD's GpuPacking).

    Scores, as the artifact computes them (integers, higher first): using only partly
    used GPUs ``100 − Σ free%/10`` (at least 50); using idle GPUs of a used node
    ``50 − idle GPUs used`` (at least 33); an entirely idle node ``33 − its GPUs``.
    CPU-only tasks score 0 everywhere (so go to the fullest node).
    """

    name = "gpu_packing"
    scores_by_state = True

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        if request.num_gpu == 0:
            return 0.0, None
        if node.full == node.gpu_count:
            return float(max(100 // 3 - node.full, node.full)), None
        chosen = best_fit_gpus(node, request)
        if len(chosen) < request.num_gpu:
            return None
        idle_used = sum(1 for gpu in chosen if gpu.milli_free == MILLI)
        if idle_used:
            return float(max(100 // 2 - idle_used, 100 // 3)), None
        free_pct = sum(gpu.milli_free * 100 // MILLI for gpu in chosen)
        return float(max(100 - free_pct // 10, 100 // 2)), None


__all__ = ["GpuPacking"]
