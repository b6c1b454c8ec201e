"""FGD's fragmentation math: the target workload, a node's expected fragmentation, the score.

For a node ``n`` with free GPU milli ``R_1..R_k`` (model ``M``, free CPU ``C``) and a
task type ``m`` (CPU ``c_m``, ``d_m`` GPUs of ``g_m`` milli each, models ``S_m``), the
fragment is the free GPU that ``m`` cannot use::

    F_n(m) = Σ_i R_i                       if g_m = 0 (a CPU task), or M ∉ S_m,
                                           or C < c_m, or #{i : R_i ≥ g_m} < d_m
    F_n(m) = Σ_{i : R_i < g_m} R_i         otherwise

and the node's expected fragmentation against the target workload (task types with
popularity ``p_m``) is ``F_n = Σ_m p_m · F_n(m)``. For each feasible node (and, for a
share, each GPU) FGD computes ``Δ = F_n(after) − F_n(before)`` and scores it
``int(100 · sigmoid(−Δ/1000))`` (:func:`fgd_score`); the best score wins. The
workload is the most popular task types covering 95 % of the tasks, renormalised (the
artifact's ``typicalPodsConfig``); :class:`Workload` builds it from requests.

``Workload.every`` keeps every task shape with its host memory; against it (``complete()``, ``fgd_plus``)
``FragModel`` is *memory-aware*: a node short of a task's memory is all fragment to it, as for CPU.

:func:`model_pressure` measures how much the tasks restricted to a few GPU models crowd
each model (``fgd_net``'s penalty). ``FragModel`` caches fragmentation by node state, which recurs.

Imports ``shared`` and the placement model only; no database, no I/O.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar

from master.scheduler.fleet import MILLI, Node, Request

# The workload's most popular task types that together make up this share are FGD's target.
DEFAULT_POPULARITY_THRESHOLD = 0.95


TaskShape = tuple[int, int, int, frozenset[str], int]  # (cpu_milli, num_gpu, gpu_milli, gpu_models, memory_mib)


def task_shape(request: Request) -> TaskShape:
    return (request.cpu_milli, request.num_gpu, request.gpu_milli, request.gpu_models, request.memory_mib)


@dataclass(frozen=True, slots=True)
class TaskType:
    """One task shape of the target workload and its share of the tasks."""

    cpu_milli: int
    num_gpu: int
    gpu_milli: int
    gpu_models: frozenset[str]
    popularity: float
    # Host memory (MiB) the task asks for; 0 = not counted (FGD's typical set counts CPU and GPU only).
    memory_mib: int = 0


@dataclass(frozen=True, slots=True)
class Workload:
    """The target workload: task types with popularities summing to 1.

    ``constraints`` is, for each set of GPU models some tasks are restricted to, that set's share
    of the workload's GPU demand — counted over *all* tasks, not only the popular types, since a
    rare constraint can still claim a scarce model (``fgd_net`` uses it).
    """

    tasks: tuple[TaskType, ...]
    constraints: tuple[tuple[frozenset[str], float], ...] = ()
    # Every task shape, host memory included, each with its share of *all* the tasks — no popularity threshold
    # (``complete``; ``fgd_plus`` measures against it).
    every: tuple[TaskType, ...] = ()

    @classmethod
    def from_requests(
        cls, requests: Iterable[Request], *, popularity_threshold: float = DEFAULT_POPULARITY_THRESHOLD
    ) -> Workload:
        """The most popular shapes covering ``popularity_threshold`` of ``requests``, renormalised.

        Shapes are ``(cpu, num_gpu, gpu_milli, models)``, as the FGD artifact's
        ``GetTypicalPods`` counts them (memory plays no part in FGD's fragmentation); ``every`` keeps
        all the shapes with their host memory.
        """
        counts: Counter[TaskShape] = Counter(task_shape(r) for r in requests if r.mig_profile is None)
        return cls.from_counts(counts, popularity_threshold=popularity_threshold)

    @classmethod
    def from_counts(
        cls, counts: Mapping[TaskShape, int], *, popularity_threshold: float = DEFAULT_POPULARITY_THRESHOLD
    ) -> Workload:
        """As ``from_requests``, from how many tasks of each shape (host memory included) there were."""
        total = sum(counts.values())
        if total == 0:
            return cls(())
        demand: Counter[frozenset[str]] = Counter()
        typical: Counter[tuple[int, int, int, frozenset[str]]] = Counter()
        for (cpu, num_gpu, milli, models, _), count in counts.items():
            demand[models] += num_gpu * milli * count
            typical[cpu, num_gpu, milli, models] += count
        all_demand = sum(demand.values())
        constraints = tuple(
            sorted(((models, gpu / all_demand) for models, gpu in demand.items() if models and gpu), key=lambda c: sorted(c[0]))
        )
        # Most popular first; equal counts in a fixed order so the workload does not depend on input order.
        ranked = sorted(typical.items(), key=lambda item: (-item[1], item[0][0], item[0][2], item[0][1], sorted(item[0][3])))
        chosen: list[tuple[tuple[int, int, int, frozenset[str]], int]] = []
        covered = 0
        for shape, count in ranked:
            if covered >= popularity_threshold * total:
                break
            chosen.append((shape, count))
            covered += count
        tasks = tuple(TaskType(cpu, num, milli, models, count / covered) for (cpu, num, milli, models), count in chosen)
        every = tuple(
            TaskType(cpu, num, milli, models, count / total, memory)
            for (cpu, num, milli, models, memory), count in sorted(
                counts.items(), key=lambda item: (-item[1], item[0][0], item[0][2], item[0][1], sorted(item[0][3]), item[0][4])
            )
        )  # fmt: skip
        return cls(tasks, constraints, every)

    def complete(self) -> Workload:
        """Every task shape with its host memory, each with its share of all the tasks (no popularity threshold);
        a workload built without them (``Workload(tasks)``) is returned as it is."""
        if not self.every:
            return self
        return Workload(self.every, self.constraints)


# A task type as the memory-aware fragmentation reads it: (cpu_milli, memory_mib, num_gpu, popularity); in
# ``_MemoryModel``'s groups CPU and memory are ranks among the model's thresholds.
_MemoryTask = tuple[int, int, int, float]
_MemoryGroup = tuple[int, float, list[_MemoryTask]]  # (GPU milli, the group's popularity, its tasks)
_MemoryModel = tuple[float, list[int], list[int], list[_MemoryGroup], dict[tuple[int, int], tuple[tuple[float, ...], ...]]]


def _by_count(tasks: list[_MemoryTask], cpu_bucket: int, memory_bucket: int) -> tuple[float, ...]:
    """For 0, 1, … GPUs fitting, the popularity of ``tasks`` whose CPU and memory rank fall below the buckets and
    whose GPUs fit (a tuple: the collector stops tracking it, and many are kept)."""
    most = max(count for _, _, count, _ in tasks)
    by_count = [0.0] * (most + 1)
    for cpu_rank, memory_rank, count, popularity in tasks:
        if cpu_rank < cpu_bucket and memory_rank < memory_bucket:
            by_count[count] += popularity
    for count in range(1, most + 1):
        by_count[count] += by_count[count - 1]
    return tuple(by_count)


class FragModel:
    """FGD's expected fragmentation of a node against a workload, cached by node state.

    A node's fragmentation depends only on its model, which task types its free CPU
    can hold (a bucket among the types' CPU needs) and its sorted free GPU milli, so
    that triple is the cache key. Where task types ask for host memory (``memory_aware``:
    ``Workload.complete``), a task also finds all free GPU fragment on a node short of
    its memory, and the bucket of the node's free memory joins the key; there the task types are grouped by GPU
    milli and each (CPU bucket, memory bucket) gets a table of the group's popularity that fits by GPUs that fit,
    so a new state costs O(groups) (21 on the trace), not O(task types) (151).
    """

    # A few models per process, by workload, so runs against one workload share the caches
    # (they memoise pure functions of the workload; nothing else is kept).
    _shared: ClassVar[dict[Workload, FragModel]] = {}
    max_shared: ClassVar[int] = 4

    def __init__(self, workload: Workload, *, max_cache: int = 2_000_000) -> None:
        self.workload = workload
        self._max_cache = max_cache
        self._cache: dict[tuple[object, ...], float] = {}
        # FGD's scores by (model, free CPU, sorted free GPU, request CPU, GPUs, milli).
        self.scores: dict[tuple[object, ...], tuple[int, int | None] | None] = {}
        self._per_model: dict[str, tuple[float, list[int], list[tuple[int, list[tuple[int, int, float]]]]]] = {}
        self.memory_aware = any(task.memory_mib for task in workload.tasks)
        self._per_model_memory: dict[str, _MemoryModel] = {}
        # Every host memory need of the workload, sorted: the buckets of free memory nodes are told apart by.
        self.memory_thresholds = sorted({task.memory_mib for task in workload.tasks})

    def _tasks(self, model: str) -> tuple[float, list[int], list[tuple[int, list[tuple[int, int, float]]]]]:
        """(share of tasks for which all free GPU is fragment, CPU thresholds, tasks grouped by GPU milli)."""
        found = self._per_model.get(model)
        if found is not None:
            return found
        always = 0.0
        groups: dict[int, list[tuple[int, int, float]]] = {}
        for task in self.workload.tasks:
            if task.gpu_milli == 0 or (task.gpu_models and model not in task.gpu_models):
                always += task.popularity
            else:
                groups.setdefault(task.gpu_milli, []).append((task.cpu_milli, task.num_gpu, task.popularity))
        thresholds = sorted({cpu for tasks in groups.values() for cpu, _, _ in tasks})
        found = (always, thresholds, sorted(groups.items()))
        self._per_model[model] = found
        return found

    def _memory_tasks(self, model: str) -> _MemoryModel:
        """As ``_tasks`` with each task's host memory, tabulated: (always, CPU thresholds, memory thresholds,
        per GPU-milli group its milli, total popularity and tasks as (CPU rank, memory rank, GPUs, popularity),
        and a table filled as states come: (CPU bucket, memory bucket) → per group, by GPUs that fit, the
        popularity of the group's tasks that fit)."""
        found = self._per_model_memory.get(model)
        if found is not None:
            return found
        always = 0.0
        groups: dict[int, list[_MemoryTask]] = {}
        for task in self.workload.tasks:
            if task.gpu_milli == 0 or (task.gpu_models and model not in task.gpu_models):
                always += task.popularity
            else:
                groups.setdefault(task.gpu_milli, []).append((task.cpu_milli, task.memory_mib, task.num_gpu, task.popularity))
        tasks = [task for group in groups.values() for task in group]
        cpu_thresholds, memory_thresholds = sorted({t[0] for t in tasks}), sorted({t[1] for t in tasks})
        ranked = [
            (milli, sum(t[3] for t in group), [
                (bisect_left(cpu_thresholds, cpu), bisect_left(memory_thresholds, memory), count, popularity)
                for cpu, memory, count, popularity in group
            ])
            for milli, group in sorted(groups.items())
        ]  # fmt: skip
        found = (always, cpu_thresholds, memory_thresholds, ranked, {})
        self._per_model_memory[model] = found
        return found

    def memory_bucket(self, model: str, memory_free: int) -> int:
        """Which of the workload's memory needs (any model's) ``memory_free`` covers: nodes in one bucket (and
        otherwise alike) fragment alike. ``model`` is accepted for symmetry; the buckets are the workload's."""
        return bisect_right(self.memory_thresholds, memory_free)

    def _frag_memory(self, model: str, cpu_free: int, free_desc: tuple[int, ...], memory_free: int) -> float:
        always, cpu_thresholds, memory_thresholds, groups, table = self._memory_tasks(model)
        cpu_bucket, memory_bucket = bisect_right(cpu_thresholds, cpu_free), bisect_right(memory_thresholds, memory_free)
        key = (model, cpu_bucket, memory_bucket, free_desc)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        # Per group, by how many of its GPUs fit, the popularity of its tasks whose CPU, memory and GPUs fit: a
        # table per (CPU, memory) bucket, so a state costs O(groups), not O(task types).
        fitting_popularity = table.get((cpu_bucket, memory_bucket))
        if fitting_popularity is None:
            fitting_popularity = table[cpu_bucket, memory_bucket] = tuple(
                _by_count(tasks, cpu_bucket, memory_bucket) for _, _, tasks in groups
            )
        total = sum(free_desc)
        value = always * total
        # The groups by GPU milli ascending, the free GPUs ascending: the GPUs too small for a group stay too small
        # for the next.
        ascending = free_desc[::-1]
        gpus = len(ascending)
        small = 0  # GPUs with less free than the group's milli
        unusable = 0  # their free milli
        for (milli, popularity, _), by_count in zip(groups, fitting_popularity, strict=True):
            while small < gpus and ascending[small] < milli:
                unusable += ascending[small]
                small += 1
            fitting = gpus - small
            usable = by_count[fitting] if fitting < len(by_count) else by_count[-1]
            value += usable * unusable + (popularity - usable) * total
        if len(self._cache) >= self._max_cache:
            self._cache.clear()
        self._cache[key] = value
        return value

    def frag(self, model: str, cpu_free: int, free_desc: tuple[int, ...], memory_free: int = 0) -> float:
        """Expected fragmented milli-GPU of a node in this state (``free_desc`` sorted, largest first; its free host
        memory counts only where the model is ``memory_aware``)."""
        if self.memory_aware:
            return self._frag_memory(model, cpu_free, free_desc, memory_free)
        always, thresholds, groups = self._tasks(model)
        key = (model, bisect_right(thresholds, cpu_free), free_desc)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        total = sum(free_desc)
        value = always * total
        for milli, tasks in groups:
            fitting = 0
            unusable = 0
            for free in free_desc:
                if free >= milli:
                    fitting += 1
                else:
                    unusable += free
            for cpu, count, popularity in tasks:
                value += popularity * (unusable if cpu <= cpu_free and fitting >= count else total)
        if len(self._cache) >= self._max_cache:
            self._cache.clear()
        self._cache[key] = value
        return value

    def node_frag(self, node: Node) -> float:
        return self.frag(node.model, node.cpu_milli_free, node.free_desc, node.memory_mib_free)

    @classmethod
    def forget_shared(cls) -> None:
        """Drop the shared models (their caches with them)."""
        cls._shared.clear()

    @classmethod
    def shared(cls, workload: Workload) -> FragModel:
        """The process's model for ``workload`` (made on first use; the least recently made go past ``max_shared``)."""
        found = cls._shared.get(workload)
        if found is None:
            if len(cls._shared) >= cls.max_shared:
                del cls._shared[next(iter(cls._shared))]
            found = cls._shared[workload] = cls(workload)
        return found


def fgd_score(delta: float) -> int:
    """FGD's node score for a fragmentation change of ``delta`` milli-GPU, on the artifact's scale.

    ``int(100 · sigmoid(−delta / 1000))``, 0..100, higher is better — the integer score the FGD
    authors' Kubernetes plugin returns. The integer steps (about 40 milli-GPU near 0) make
    changes that small count as equal, and equals then go to the fullest node.
    """
    exponent = max(-50.0, min(50.0, delta / MILLI))
    return int(100.0 / (1.0 + math.exp(exponent)))


def take_one(free_desc: tuple[int, ...], value: int, milli: int) -> tuple[int, ...]:
    """``free_desc`` with one GPU at ``value`` giving ``milli``, still sorted largest first."""
    position = free_desc.index(value)
    rest = free_desc[:position] + free_desc[position + 1 :]
    left = value - milli
    insert = position
    while insert < len(rest) and rest[insert] > left:
        insert += 1
    return (*rest[:insert], left, *rest[insert:])


def model_pressure(workload: Workload, capacity_by_model: Mapping[str, int]) -> dict[str, float]:
    """How much of each GPU model's capacity the tasks restricted to a few models would need.

    A constraint set ``S`` with share ``d_S`` of the GPU demand spreads it over its models in
    proportion to their capacity; with the demand filling the fleet (capacity ``C``), model
    ``M`` is asked for ``Σ_{S ∋ M} d_S · C / C_S`` of its own capacity — above 1, the tasks
    that can run only there already want more than it has.
    """
    total = sum(capacity_by_model.values())
    pressure: dict[str, float] = {}
    for models, share in workload.constraints:
        capacity = sum(capacity_by_model.get(model, 0) for model in models)
        if capacity == 0:
            continue
        for model in models:
            if capacity_by_model.get(model, 0):
                pressure[model] = pressure.get(model, 0.0) + share * total / capacity
    return pressure


__all__ = [
    "DEFAULT_POPULARITY_THRESHOLD", "FragModel", "TaskShape", "TaskType", "Workload", "fgd_score", "model_pressure",
    "take_one", "task_shape",
]  # fmt: skip
