"""``first_fit``: the first feasible node in the given order, its lowest-index GPUs (Greedy)."""

from __future__ import annotations

from master.scheduler.fleet import Fleet, Gpu, Node, Request
from master.scheduler.placers.base import IndexedPlacer, Scored


def _first_gpus(node: Node, request: Request) -> list[Gpu]:
    return [gpu for gpu in node.gpus if node.gpu_takes(request, gpu)][: request.num_gpu]


class FirstFit(IndexedPlacer):
    """The first feasible node in the given order, its lowest-index GPUs (Greedy)."""

    name = "first_fit"

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        return -float(position), None

    def choose_gpus(self, node: Node, request: Request, choice: object) -> list[Gpu]:
        return _first_gpus(node, request)


__all__ = ["FirstFit"]
