"""``fgd``: Fragmentation Gradient Descent (Weng et al., USENIX ATC 2023) over ``master.scheduler.fragmentation``."""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence
from typing import ClassVar

from master.scheduler.fleet import MILLI, Fleet, Gpu, Node, Placement, Request
from master.scheduler.fragmentation import FragModel, TaskShape, Workload, fgd_score, take_one, task_shape
from master.scheduler.placers.base import IndexedPlacer, Scored, best_fit_gpus


class Fgd(IndexedPlacer):
    """Fragmentation Gradient Descent: the placement that adds the least expected fragmentation.

    Without a ``workload`` it measures against the requests it has been asked to place so far.
    """

    name = "fgd"
    scores_by_state = True
    max_cached_scores: ClassVar[int] = 1_000_000

    def __init__(self, *, seed: int = 0, workload: Workload | None = None) -> None:
        super().__init__(seed=seed, workload=workload)
        self._learn = workload is None
        self._seen: Counter[TaskShape] = Counter()
        self.frag_model = FragModel(Workload(())) if workload is None else FragModel.shared(self.target(workload))

    def target(self, workload: Workload) -> Workload:
        """The workload FGD measures fragmentation against (``fgd``: the given one, its typical shapes)."""
        return workload

    def place(self, request: Request, nodes: Sequence[Node]) -> Placement | None:
        if self._learn and request.mig_profile is None:
            self._seen[task_shape(request)] += 1
            self.frag_model = FragModel(self.target(Workload.from_counts(self._seen)))
            self._fleet = None  # scores against the old workload are stale
        return super().place(request, nodes)

    def frag_delta(self, node: Node, request: Request) -> tuple[float, int | None] | None:
        """The least fragmentation increase ``request`` can cause on ``node``, and the GPU free value it uses."""
        model = self.frag_model
        memory = node.memory_mib_free  # counts only where the model is memory-aware (``fgd_plus``)
        before = model.frag(node.model, node.cpu_milli_free, node.free_desc, memory)
        cpu_after = node.cpu_milli_free - request.cpu_milli
        memory -= request.memory_mib
        if request.num_gpu == 0:
            return model.frag(node.model, cpu_after, node.free_desc, memory) - before, None
        milli = request.gpu_milli
        free_desc = node.free_desc
        if milli >= MILLI:
            count = request.num_gpu
            after = free_desc[count:] + (0,) * count
            return model.frag(node.model, cpu_after, after, memory) - before, None
        if request.num_gpu > 1:  # several shares: best fit for all of them
            after = free_desc
            for gpu in best_fit_gpus(node, request):
                after = take_one(after, gpu.milli_free, milli)
            return model.frag(node.model, cpu_after, after, memory) - before, None
        if node.memory_tracked:
            values = sorted({gpu.milli_free for gpu in node.gpus if node.gpu_takes(request, gpu)}, reverse=True)
        else:
            values = sorted({free for free in free_desc if free >= milli}, reverse=True)
        best: tuple[float, int | None] | None = None
        for value in values:
            delta = model.frag(node.model, cpu_after, take_one(free_desc, value, milli), memory) - before
            if best is None or delta < best[0]:
                best = (delta, value)
        return best

    def fgd(self, node: Node, request: Request) -> tuple[int, int | None] | None:
        """``fgd_score`` of the best placement of ``request`` on ``node``, and its GPU choice; cached by state."""
        if node.memory_tracked:
            found = self.frag_delta(node, request)
            return None if found is None else (fgd_score(found[0]), found[1])
        # Node states recur a lot (> 90 % hits on the trace).
        scores = self.frag_model.scores
        state = node.state  # a string, whose hash is kept: cheaper to look up than the state's parts
        key = (
            (state, request.cpu_milli, request.num_gpu, request.gpu_milli) if state is not None
            else (node.model, node.cpu_milli_free, node.free_desc, request.cpu_milli, request.num_gpu, request.gpu_milli)
        )  # fmt: skip
        if self.frag_model.memory_aware:  # the free memory's bucket before and after, not its exact value
            thresholds, free = self.frag_model.memory_thresholds, node.memory_mib_free
            key = (*key, bisect_right(thresholds, free), bisect_right(thresholds, free - request.memory_mib))
        try:
            return scores[key]
        except KeyError:
            pass
        found = self.frag_delta(node, request)
        scored = None if found is None else (fgd_score(found[0]), found[1])
        if len(scores) >= self.max_cached_scores:
            scores.clear()
        scores[key] = scored
        return scored

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        found = self.fgd(node, request)
        return None if found is None else (float(found[0]), found[1])

    def choose_gpus(self, node: Node, request: Request, choice: object) -> list[Gpu]:
        if isinstance(choice, int) and request.num_gpu == 1 and request.gpu_milli < MILLI:
            for gpu in node.gpus:  # the lowest-index GPU with the free milli FGD chose
                if gpu.milli_free == choice and node.gpu_takes(request, gpu):
                    return [gpu]
        return best_fit_gpus(node, request)


__all__ = ["Fgd"]
