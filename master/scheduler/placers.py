"""Placement: which host, and which GPUs on it, a request gets.

The model
=========

A :class:`Node` is one host: its GPU model, its GPUs (each with free milli-GPU
``0..1000``, free memory when known, MIG slots when MIG mode is on), its free CPU
(milli-CPU) and memory (MiB), and optionally its measured network to each renter
region. A :class:`Request` asks for ``num_gpu`` GPUs of ``gpu_milli`` each (1000 =
whole GPUs, which all land on one host; below 1000 = a fractional share of one GPU
within its core and memory), an optional set of acceptable models (the trace's
``gpu_spec`` ``"A|B"``), CPU and memory, optionally a MIG profile, and optionally
network limits to the renter's region. ``num_gpu == 0`` is a CPU-only task (the
trace has them; rentals never do).

Every :class:`Placer` answers ``place(request, nodes) -> Placement | None`` and never
changes the nodes: the caller applies a placement (``Fleet.apply``) once it has
claimed it. Every placer honours the same hard constraints, checked by
:func:`fits`: model, CPU, memory, GPU capacity (whole GPUs must be entirely free;
a share needs a GPU with enough free milli and memory), MIG slot, and the
request's network limits — a limit the renter sets is a constraint, never a
preference, whichever algorithm is configured. Algorithms differ only in which
feasible node and GPUs they prefer.

Algorithms (``PLACERS``)
========================

Scores are "higher is better"; the algorithms marked *integer* score on the 0–100 integer
scale of the FGD authors' Kubernetes plugins, whose steps make near-equal placements equal.

``first_fit``       the first feasible node in the given order, its lowest-index GPUs (Greedy).
``best_fit``        the node left with the least free CPU and GPU,
                    ``0.5·cpu_free/max_cpu + 0.5·gpu_free/max_gpu`` smallest (the artifact's BestFit).
``random``          a uniformly random feasible node (seeded).
``utilization``     dot-product packing, *integer*: ``int(100·(1 − ⟨free, demand⟩/2))`` with both
                    vectors ``(cpu, gpu)`` normalised by the largest node — Tetris's alignment score
                    (Grandl et al., SIGCOMM 2014) as a most-allocated rule, as the FGD paper's
                    DotProd baseline runs it.
``gpu_packing``     *integer*: partly used GPUs first, then idle GPUs of used nodes, then empty
                    nodes (the artifact's GpuPacking).
``gpu_clustering``  *integer*: nodes running only tasks of the same GPU shape first, then mixed
                    ones, then empty ones (the artifact's GpuClustering).
``fgd``             *integer*: Fragmentation Gradient Descent (Weng et al., USENIX ATC 2023), below.
``fgd_net``         our default: ``fgd`` less a penalty for GPU models that tasks restricted to
                    few models crowd (:func:`model_pressure`), and among equally scored
                    placements the host with the lowest latency to the renter's region.

Equal scores go to the fullest node — the smallest share of its CPU and GPU free
(``Node.free_share``) — which keeps empty hosts whole for gang requests, then to a
pseudo-random one, deterministic in ``(seed, position, version)``. Within the chosen
node a share takes the best-fitting GPU (the least free milli that fits; ``first_fit``:
the lowest index; ``fgd``: the GPU FGD scored best), whole GPUs the lowest-index idle
ones, and a MIG request the GPU with the fewest free slots that has one of its profile.

FGD
===

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

Speed
=====

A :class:`Fleet` (a ``Sequence[Node]``) logs which nodes changed. A placer keeps,
per distinct request shape, a heap of the feasible nodes' scores for the fleet it
last saw and rescores only the nodes changed since — so one decision costs the
changes since that shape was last placed, not the fleet size. Given a plain list,
``place`` wraps it in a fresh ``Fleet`` and scores every node once. FGD also caches
scores by node state, which recur.

Imports ``shared.errors`` only; no database, no I/O.
"""

from __future__ import annotations

import heapq
import math
import random
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, overload

from shared.errors import ConfigError, ValidationFailed

MILLI = 1000  # milli-GPU in one GPU

# The workload's most popular task types that together make up this share are FGD's target.
DEFAULT_POPULARITY_THRESHOLD = 0.95
# fgd_net ranks equally good placements by latency to the renter's region up to this much.
MAX_LATENCY_MS = 1000.0
# fgd_net: FGD score points (about 40 milli-GPU of fragment each) per unit of a model's pressure.
SCARCITY_WEIGHT = 10.0


class UnknownPlacer(ConfigError):
    code = "unknown_placer"


# ---- the model -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LinkStats:
    """A host's measured network to one region (agent speed test: mean RTT, jitter, loss)."""

    latency_ms: float
    jitter_ms: float = 0.0
    loss_pct: float = 0.0


@dataclass(frozen=True, slots=True)
class NetworkLimits:
    """The renter's region and the worst network it accepts; ``None`` means no limit on that figure."""

    region: str
    max_latency_ms: float | None = None
    max_jitter_ms: float | None = None
    max_loss_pct: float | None = None

    @property
    def limited(self) -> bool:
        return not (self.max_latency_ms is None and self.max_jitter_ms is None and self.max_loss_pct is None)

    def allows(self, link: LinkStats | None) -> bool:
        """Whether a host with ``link`` to the region keeps every limit; an unmeasured host keeps none."""
        if link is None:
            return not self.limited
        return not (
            (self.max_latency_ms is not None and link.latency_ms > self.max_latency_ms)
            or (self.max_jitter_ms is not None and link.jitter_ms > self.max_jitter_ms)
            or (self.max_loss_pct is not None and link.loss_pct > self.max_loss_pct)
        )


@dataclass(slots=True, eq=False)
class MigSlot:
    """One MIG instance that exists on a GPU (the agent reports them), free or taken."""

    instance: str
    profile: str
    free: bool = True


@dataclass(slots=True, eq=False)
class Gpu:
    """One GPU of a node. ``memory_mib == 0`` means its memory is not tracked (the trace)."""

    index: int
    uuid: str = ""
    milli_free: int = MILLI
    memory_mib: int = 0
    memory_free_mib: int = -1  # -1: in proportion to milli_free
    mig: list[MigSlot] | None = None  # None: MIG mode off

    def __post_init__(self) -> None:
        if not 0 <= self.milli_free <= MILLI:
            raise ValidationFailed(f"GPU {self.index}: milli_free must be 0..{MILLI}, not {self.milli_free}")
        if self.memory_free_mib < 0:
            self.memory_free_mib = self.memory_mib * self.milli_free // MILLI


def gpu_shape(request: Request) -> str:
    """The GPU-shape class GpuClustering groups by: ``share-gpu``, ``N-gpu``, ``mig:PROFILE`` or ``no-gpu``."""
    if request.num_gpu == 0:
        return "no-gpu"
    if request.mig_profile is not None:
        return f"mig:{request.mig_profile}"
    if request.gpu_milli < MILLI:
        return "share-gpu"
    return f"{request.num_gpu}-gpu"


@dataclass(frozen=True, slots=True)
class Request:
    """What a rental (or a trace pod) asks for; see the module docstring."""

    num_gpu: int = 1
    gpu_milli: int = MILLI
    gpu_memory_mib: int = 0  # per GPU, for shares on GPUs whose memory is tracked; 0 = proportional to gpu_milli
    gpu_models: frozenset[str] = frozenset()  # empty: any model
    cpu_milli: int = 0
    memory_mib: int = 0
    mig_profile: str | None = None
    network: NetworkLimits | None = None
    # Everything but host memory: what the placers' scores depend on (host memory only filters).
    shape_key: tuple[object, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_gpu < 0 or self.cpu_milli < 0 or self.memory_mib < 0 or self.gpu_memory_mib < 0:
            raise ValidationFailed("num_gpu, cpu_milli, memory_mib and gpu_memory_mib cannot be negative")
        if self.num_gpu == 0:
            object.__setattr__(self, "gpu_milli", 0)
        elif not 0 < self.gpu_milli <= MILLI:
            raise ValidationFailed(f"gpu_milli must be 1..{MILLI} when GPUs are requested, not {self.gpu_milli}")
        if self.mig_profile is not None and self.num_gpu != 1:
            raise ValidationFailed("a MIG request asks for exactly one slice (num_gpu=1)")
        object.__setattr__(
            self,
            "shape_key",
            (self.num_gpu, self.gpu_milli, self.gpu_memory_mib, self.gpu_models, self.cpu_milli, self.mig_profile,
             self.network),
        )  # fmt: skip

    @staticmethod
    def parse_models(spec: str | None) -> frozenset[str]:
        """The trace's ``gpu_spec`` (``"V100M16|V100M32"``; empty = any) as a set of models."""
        if not spec:
            return frozenset()
        return frozenset(part.strip() for part in spec.split("|") if part.strip())

    @property
    def gpu_milli_total(self) -> int:
        return self.num_gpu * self.gpu_milli


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request goes: one node, and its GPUs (device indices, uuids) with what each gives."""

    request: Request
    node_id: str
    node_index: int  # position in the sequence given to ``place``
    gpu_indices: tuple[int, ...]
    gpu_uuids: tuple[str, ...]
    gpu_milli: int  # per GPU
    gpu_memory_mib: int  # per GPU; 0 where memory is not tracked
    mig_instances: tuple[str, ...] = ()


class Node:
    """One host's free resources, and the summaries the placers read (kept in step by ``allocate``)."""

    __slots__ = (
        "_by_index", "affinity", "cpu_milli", "cpu_milli_free", "free_desc", "free_share", "free_total", "full",
        "gpu_count", "gpus", "links", "memory_mib", "memory_mib_free", "memory_tracked", "mig_free", "model", "node_id",
        "version",
    )  # fmt: skip

    def __init__(
        self,
        node_id: str,
        model: str,
        gpus: Sequence[Gpu] | int,
        *,
        cpu_milli: int,
        memory_mib: int,
        cpu_milli_free: int | None = None,
        memory_mib_free: int | None = None,
        links: Mapping[str, LinkStats] | None = None,
        affinity: Mapping[str, int] | None = None,
    ) -> None:
        self.node_id = node_id
        self.model = model
        self.gpus: list[Gpu] = [Gpu(i) for i in range(gpus)] if isinstance(gpus, int) else list(gpus)
        self.cpu_milli = cpu_milli
        self.memory_mib = memory_mib
        self.cpu_milli_free = cpu_milli if cpu_milli_free is None else cpu_milli_free
        self.memory_mib_free = memory_mib if memory_mib_free is None else memory_mib_free
        self.links: Mapping[str, LinkStats] = dict(links or {})
        # GPU shapes of the tasks running here (GpuClustering's affinity); kept by allocate/release.
        self.affinity: Counter[str] = Counter(affinity or {})
        self.version = 0
        self._by_index = {gpu.index: gpu for gpu in self.gpus}
        if len(self._by_index) != len(self.gpus):
            raise ValidationFailed(f"node {node_id}: two GPUs share an index")
        self.free_desc: tuple[int, ...] = ()
        self.free_total = self.full = self.gpu_count = 0
        self.free_share = 1.0
        self.memory_tracked = False
        self.mig_free: dict[str, int] = {}
        self._summarise()

    def __repr__(self) -> str:
        return (
            f"Node({self.node_id!r}, {self.model!r}, free={list(self.free_desc)}, "
            f"cpu={self.cpu_milli_free}/{self.cpu_milli}, mem={self.memory_mib_free}/{self.memory_mib})"
        )

    def _summarise(self) -> None:
        shared = [gpu for gpu in self.gpus if gpu.mig is None]
        self.gpu_count = len(shared)
        self.free_desc = tuple(sorted((gpu.milli_free for gpu in shared), reverse=True))
        self.free_total = sum(self.free_desc)
        self.full = sum(1 for gpu in shared if gpu.milli_free == MILLI)
        self.memory_tracked = any(gpu.memory_mib > 0 for gpu in shared)
        # The share of its capacity a node has free (CPU and GPU weighing half each): equal scores
        # go to the fullest node, which keeps empty hosts whole for gang requests.
        cpu_share = self.cpu_milli_free / self.cpu_milli if self.cpu_milli > 0 else 0.0
        gpu_share = self.free_total / (self.gpu_count * MILLI) if self.gpu_count else 0.0
        self.free_share = 0.5 * cpu_share + 0.5 * gpu_share
        mig_free: dict[str, int] = {}
        for gpu in self.gpus:
            for slot in gpu.mig or ():
                if slot.free:
                    mig_free[slot.profile] = mig_free.get(slot.profile, 0) + 1
        self.mig_free = mig_free

    def gpu(self, index: int) -> Gpu:
        return self._by_index[index]

    @property
    def gpu_milli_capacity(self) -> int:
        return self.gpu_count * MILLI

    def share_memory(self, request: Request, gpu: Gpu) -> int:
        """GPU memory a share of ``request`` takes on ``gpu``: as asked, or its milli's proportion of the GPU."""
        if gpu.memory_mib == 0:
            return 0
        if request.gpu_milli >= MILLI:
            return gpu.memory_mib
        return request.gpu_memory_mib or gpu.memory_mib * request.gpu_milli // MILLI

    def gpu_takes(self, request: Request, gpu: Gpu) -> bool:
        """Whether ``gpu`` (not in MIG mode) can give one GPU of ``request``."""
        if gpu.mig is not None or gpu.milli_free < request.gpu_milli:
            return False
        if request.gpu_milli >= MILLI:
            return gpu.milli_free == MILLI
        return gpu.memory_free_mib >= self.share_memory(request, gpu)

    def _apply(self, placement: Placement, sign: int) -> None:
        request = placement.request
        if sign > 0:
            self._check(placement)
        self.cpu_milli_free -= sign * request.cpu_milli
        self.memory_mib_free -= sign * request.memory_mib
        if placement.mig_instances:
            wanted = set(placement.mig_instances)
            for gpu in self.gpus:
                for slot in gpu.mig or ():
                    if slot.instance in wanted:
                        slot.free = sign < 0
        else:
            for index in placement.gpu_indices:
                gpu = self._by_index[index]
                gpu.milli_free -= sign * placement.gpu_milli
                gpu.memory_free_mib -= sign * placement.gpu_memory_mib
        if request.num_gpu:
            shape = gpu_shape(request)
            self.affinity[shape] += sign
            if self.affinity[shape] <= 0:
                del self.affinity[shape]
        self.version += 1
        self._summarise()

    def _check(self, placement: Placement) -> None:
        """Refuse a placement this node cannot give (a stale one): never hand out one GPU twice."""
        request = placement.request
        problem = None
        if request.cpu_milli > self.cpu_milli_free or request.memory_mib > self.memory_mib_free:
            problem = "not enough CPU or memory left"
        elif placement.mig_instances:
            free = {slot.instance for gpu in self.gpus for slot in gpu.mig or () if slot.free}
            if not set(placement.mig_instances) <= free:
                problem = "the MIG instance is taken"
        else:
            for index in placement.gpu_indices:
                gpu = self._by_index.get(index)
                if gpu is None or gpu.mig is not None:
                    problem = f"it has no GPU {index} outside MIG mode"
                elif placement.gpu_milli >= MILLI and gpu.milli_free != MILLI:
                    problem = f"GPU {index} is not entirely free"
                elif gpu.milli_free < placement.gpu_milli:
                    problem = f"GPU {index} has not {placement.gpu_milli} milli free"
                elif gpu.memory_mib and gpu.memory_free_mib < placement.gpu_memory_mib:
                    problem = f"GPU {index} has not {placement.gpu_memory_mib} MiB free"
        if problem is not None:
            raise ValidationFailed(f"cannot place on node {self.node_id}: {problem}")

    def allocate(self, placement: Placement) -> None:
        """Take what ``placement`` gives. Go through ``Fleet.apply`` when the node is in a fleet."""
        self._apply(placement, +1)

    def release(self, placement: Placement) -> None:
        """Give back what ``allocate(placement)`` took."""
        self._apply(placement, -1)


class Fleet(Sequence[Node]):
    """Nodes, plus a log of which changed, so placers can keep their scores up to date cheaply.

    Change nodes only through ``apply``/``release`` here: a node changed behind the fleet's
    back drops out of the placers' heaps until it changes again through the fleet. The log
    keeps at most ``max_log`` changes (default 4 × nodes + 1024); a placer that has not looked
    since the oldest one kept rescores every node, as it would after that many changes anyway.
    """

    def __init__(self, nodes: Iterable[Node], *, max_log: int | None = None) -> None:
        self._nodes = list(nodes)
        self._log: list[int] = []  # positions of the changed nodes, oldest first
        self._dropped = 0  # changes dropped from the front of the log
        self._max_log = max_log if max_log is not None else 4 * len(self._nodes) + 1024
        self.max_cpu_milli = max((node.cpu_milli for node in self._nodes), default=0) or 1
        self.max_gpu_milli = max((node.gpu_milli_capacity for node in self._nodes), default=0) or 1
        self.capacity_by_model: Counter[str] = Counter()
        self.positions_by_model: dict[str, list[int]] = {}
        for position, node in enumerate(self._nodes):
            self.capacity_by_model[node.model] += node.gpu_milli_capacity
            self.positions_by_model.setdefault(node.model, []).append(position)

    def candidates(self, request: Request) -> Iterable[int]:
        """Positions of the nodes whose model the request accepts (all of them when it names none)."""
        if not request.gpu_models:
            return range(len(self._nodes))
        # Sorted: a frozenset's order of strings changes from one process to the next.
        return sorted(p for model in request.gpu_models for p in self.positions_by_model.get(model, ()))

    @overload
    def __getitem__(self, index: int) -> Node: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Node]: ...
    def __getitem__(self, index: int | slice) -> Node | Sequence[Node]:
        return self._nodes[index]

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self._nodes)

    @property
    def nodes(self) -> list[Node]:
        return self._nodes

    @property
    def change_count(self) -> int:
        """How many changes the fleet has had."""
        return self._dropped + len(self._log)

    def changed_since(self, count: int) -> list[int] | None:
        """Positions of the nodes changed after the first ``count`` changes (repeats included),
        or ``None`` when the log no longer reaches back that far."""
        start = count - self._dropped
        return None if start < 0 else self._log[start:]

    def apply(self, placement: Placement) -> None:
        self._nodes[placement.node_index].allocate(placement)
        self._logged(placement.node_index)

    def release(self, placement: Placement) -> None:
        self._nodes[placement.node_index].release(placement)
        self._logged(placement.node_index)

    def _logged(self, position: int) -> None:
        self._log.append(position)
        if len(self._log) > self._max_log:
            drop = len(self._log) // 2
            del self._log[:drop]
            self._dropped += drop


def fits(node: Node, request: Request) -> bool:
    """The hard constraints every placer honours (see the module docstring)."""
    return request.memory_mib <= node.memory_mib_free and fits_shape(node, request)


def fits_shape(node: Node, request: Request) -> bool:
    """``fits`` but for host memory, the one constraint no score depends on."""
    if request.cpu_milli > node.cpu_milli_free:
        return False
    if request.gpu_models and node.model not in request.gpu_models:
        return False
    if request.network is not None and not request.network.allows(node.links.get(request.network.region)):
        return False
    count = request.num_gpu
    if count == 0:
        return True
    if request.mig_profile is not None:
        return node.mig_free.get(request.mig_profile, 0) > 0
    if request.gpu_milli >= MILLI:
        return node.full >= count
    if count > len(node.free_desc) or node.free_desc[count - 1] < request.gpu_milli:
        return False
    if not node.memory_tracked:
        return True
    return sum(1 for gpu in node.gpus if node.gpu_takes(request, gpu)) >= count


# ---- the workload FGD measures fragmentation against --------------------------------------------


TaskShape = tuple[int, int, int, frozenset[str]]  # (cpu_milli, num_gpu, gpu_milli, gpu_models)


def task_shape(request: Request) -> TaskShape:
    return (request.cpu_milli, request.num_gpu, request.gpu_milli, request.gpu_models)


@dataclass(frozen=True, slots=True)
class TaskType:
    """One task shape of the target workload and its share of the tasks."""

    cpu_milli: int
    num_gpu: int
    gpu_milli: int
    gpu_models: frozenset[str]
    popularity: float


@dataclass(frozen=True, slots=True)
class Workload:
    """The target workload: task types with popularities summing to 1.

    ``constraints`` is, for each set of GPU models some tasks are restricted to, that set's share
    of the workload's GPU demand — counted over *all* tasks, not only the popular types, since a
    rare constraint can still claim a scarce model (``fgd_net`` uses it).
    """

    tasks: tuple[TaskType, ...]
    constraints: tuple[tuple[frozenset[str], float], ...] = ()

    @classmethod
    def from_requests(
        cls, requests: Iterable[Request], *, popularity_threshold: float = DEFAULT_POPULARITY_THRESHOLD
    ) -> Workload:
        """The most popular shapes covering ``popularity_threshold`` of ``requests``, renormalised.

        Shapes are ``(cpu, num_gpu, gpu_milli, models)``, as the FGD artifact's
        ``GetTypicalPods`` counts them (memory plays no part in fragmentation).
        """
        counts: Counter[TaskShape] = Counter(task_shape(r) for r in requests if r.mig_profile is None)
        return cls.from_counts(counts, popularity_threshold=popularity_threshold)

    @classmethod
    def from_counts(
        cls, counts: Mapping[TaskShape, int], *, popularity_threshold: float = DEFAULT_POPULARITY_THRESHOLD
    ) -> Workload:
        """As ``from_requests``, from how many tasks of each shape there were."""
        total = sum(counts.values())
        if total == 0:
            return cls(())
        demand: Counter[frozenset[str]] = Counter()
        for (_, num_gpu, milli, models), count in counts.items():
            demand[models] += num_gpu * milli * count
        all_demand = sum(demand.values())
        constraints = tuple(
            sorted(((models, gpu / all_demand) for models, gpu in demand.items() if models and gpu), key=lambda c: sorted(c[0]))
        )
        # Most popular first; equal counts in a fixed order so the workload does not depend on input order.
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0][0], item[0][2], item[0][1], sorted(item[0][3])))
        chosen: list[tuple[TaskShape, int]] = []
        covered = 0
        for shape, count in ranked:
            if covered >= popularity_threshold * total:
                break
            chosen.append((shape, count))
            covered += count
        tasks = tuple(TaskType(cpu, num, milli, models, count / covered) for (cpu, num, milli, models), count in chosen)
        return cls(tasks, constraints)


class FragModel:
    """FGD's expected fragmentation of a node against a workload, cached by node state.

    A node's fragmentation depends only on its model, which task types its free CPU
    can hold (a bucket among the types' CPU needs) and its sorted free GPU milli, so
    that triple is the cache key.
    """

    # A few models per process, by workload, so runs against one workload share the caches
    # (they memoise pure functions of the workload; nothing else is kept).
    _shared: ClassVar[dict[Workload, FragModel]] = {}
    max_shared: ClassVar[int] = 4

    def __init__(self, workload: Workload, *, max_cache: int = 2_000_000) -> None:
        self.workload = workload
        self._max_cache = max_cache
        self._cache: dict[tuple[str, int, tuple[int, ...]], float] = {}
        # FGD's scores by (model, free CPU, sorted free GPU, request CPU, GPUs, milli).
        self.scores: dict[tuple[object, ...], tuple[int, int | None] | None] = {}
        self._per_model: dict[str, tuple[float, list[int], list[tuple[int, list[tuple[int, int, float]]]]]] = {}

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

    def frag(self, model: str, cpu_free: int, free_desc: tuple[int, ...]) -> float:
        """Expected fragmented milli-GPU of a node in this state (``free_desc`` sorted, largest first)."""
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
        return self.frag(node.model, node.cpu_milli_free, node.free_desc)

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


def _take_one(free_desc: tuple[int, ...], value: int, milli: int) -> tuple[int, ...]:
    """``free_desc`` with one GPU at ``value`` giving ``milli``, still sorted largest first."""
    position = free_desc.index(value)
    rest = free_desc[:position] + free_desc[position + 1 :]
    left = value - milli
    insert = position
    while insert < len(rest) and rest[insert] > left:
        insert += 1
    return (*rest[:insert], left, *rest[insert:])


# ---- placers -------------------------------------------------------------------------------------


class Placer(Protocol):
    """Chooses a node and GPUs for a request, or ``None`` when nothing feasible is left."""

    @property
    def name(self) -> str: ...

    def place(self, request: Request, nodes: Sequence[Node]) -> Placement | None: ...


class PlacerFactory(Protocol):
    def __call__(self, *, seed: int = 0, workload: Workload | None = None) -> Placer: ...


# A score (higher is better) and the GPU choice it was computed for (algorithm-specific; None = default).
Scored = tuple[float, object]
_Entry = tuple[float, float, int, int, int]  # (-score, free share, tie-break, position, node version)


class _Heap:
    __slots__ = ("entries", "seen")

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.seen = 0


class _Members:
    __slots__ = ("members", "seen", "where")

    def __init__(self) -> None:
        self.members: list[int] = []
        self.where: dict[int, int] = {}
        self.seen = 0


class _IndexedPlacer:
    """The shared machinery: per request shape, the feasible nodes' scores for the last fleet seen."""

    name: ClassVar[str] = ""
    # How many request shapes keep an index; past that the least recently used go.
    max_indexes: ClassVar[int] = 4096

    def __init__(self, *, seed: int = 0, workload: Workload | None = None) -> None:
        self.seed = seed
        self._fleet: Fleet | None = None
        self._heaps: dict[tuple[object, ...], _Heap] = {}

    # -- what subclasses provide --

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        """How much this algorithm likes placing ``request`` on the feasible ``node`` (None: not at all)."""
        raise NotImplementedError

    def choose_gpus(self, node: Node, request: Request, choice: object) -> list[Gpu]:
        """The GPUs of ``node`` that ``request`` gets (default: best fit for shares, lowest index for whole)."""
        return _best_fit_gpus(node, request)

    # -- the machinery --

    def _bind(self, fleet: Fleet) -> None:
        if self._fleet is not fleet:
            self._fleet = fleet
            self._heaps.clear()

    def _score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        if not fits_shape(node, request):
            return None
        if request.mig_profile is not None:
            return _mig_score(node, position, request, first=self.name == "first_fit")
        return self.score(node, position, request, fleet)

    def _entries(self, positions: Iterable[int], request: Request, fleet: Fleet) -> list[_Entry]:
        """Heap entries for the nodes at ``positions`` that can take ``request``."""
        nodes, seed, score, entries = fleet.nodes, self.seed, self._score, []
        models = request.gpu_models
        cpu = request.cpu_milli
        gpu = 0 if request.mig_profile is not None else request.gpu_milli_total
        for position in positions:
            node = nodes[position]
            # The cheap part of ``fits_shape`` first: most nodes a busy fleet has fail it.
            if node.free_total < gpu or node.cpu_milli_free < cpu or (models and node.model not in models):
                continue
            scored = score(node, position, request, fleet)
            if scored is not None:
                version = node.version
                entries.append((-scored[0], node.free_share, hash((seed, position, version)), position, version))
        return entries

    def _refresh(self, request: Request, fleet: Fleet) -> list[_Entry]:
        """The heap for the request's shape (host memory aside), brought up to date with the fleet."""
        key = request.shape_key
        index = self._heaps.get(key)
        nodes = fleet.nodes
        count = fleet.change_count
        changed = None if index is None else fleet.changed_since(index.seen)
        if index is None or changed is None or len(changed) > len(nodes):
            if index is None and len(self._heaps) >= self.max_indexes:
                del self._heaps[next(iter(self._heaps))]
            index = self._heaps[key] = _Heap()
            index.seen = count
            index.entries = self._entries(fleet.candidates(request), request, fleet)
            heapq.heapify(index.entries)
            return index.entries
        if changed:
            heap = index.entries
            for entry in self._entries(dict.fromkeys(changed), request, fleet):
                heapq.heappush(heap, entry)
            index.seen = count
            if len(heap) > 4 * len(nodes) + 64:  # drop stale entries before they pile up
                heap[:] = [entry for entry in heap if nodes[entry[3]].version == entry[4]]
                heapq.heapify(heap)
        # Keep recently used shapes at the end of the dict (the LRU order).
        self._heaps[key] = self._heaps.pop(key)
        return index.entries

    def best_position(self, request: Request, fleet: Fleet) -> int | None:
        heap = self._refresh(request, fleet)
        nodes = fleet.nodes
        memory = request.memory_mib
        short_of_memory: list[_Entry] = []  # current, but not for this request: put back afterwards
        found = None
        while heap:
            _, _, _, position, version = heap[0]
            node = nodes[position]
            if node.version != version:
                heapq.heappop(heap)
            elif node.memory_mib_free < memory:
                short_of_memory.append(heapq.heappop(heap))
            else:
                found = position
                break
        for entry in short_of_memory:
            heapq.heappush(heap, entry)
        return found

    def place(self, request: Request, nodes: Sequence[Node]) -> Placement | None:
        fleet = nodes if isinstance(nodes, Fleet) else Fleet(nodes)
        self._bind(fleet)
        position = self.best_position(request, fleet)
        if position is None:
            return None
        node = fleet[position]
        scored = self._score(node, position, request, fleet)  # again, for the winner only: its GPU choice
        return self._placement(node, position, request, None if scored is None else scored[1])

    def _placement(self, node: Node, position: int, request: Request, choice: object) -> Placement:
        if request.mig_profile is not None:
            gpu, slot = _mig_slot(node, request.mig_profile, first=self.name == "first_fit")
            return Placement(request, node.node_id, position, (gpu.index,), (gpu.uuid,), 0, 0, (slot.instance,))
        if request.num_gpu == 0:
            return Placement(request, node.node_id, position, (), (), 0, 0)
        gpus = self.choose_gpus(node, request, choice)
        memory = node.share_memory(request, gpus[0])
        return Placement(
            request, node.node_id, position, tuple(gpu.index for gpu in gpus), tuple(gpu.uuid for gpu in gpus),
            request.gpu_milli, memory,
        )  # fmt: skip


def _best_fit_gpus(node: Node, request: Request) -> list[Gpu]:
    usable = [gpu for gpu in node.gpus if node.gpu_takes(request, gpu)]
    if request.gpu_milli < MILLI:
        usable.sort(key=lambda gpu: gpu.milli_free)  # stable: lowest index among equals
    return usable[: request.num_gpu]


def _first_gpus(node: Node, request: Request) -> list[Gpu]:
    return [gpu for gpu in node.gpus if node.gpu_takes(request, gpu)][: request.num_gpu]


def _mig_slot(node: Node, profile: str, *, first: bool) -> tuple[Gpu, MigSlot]:
    """The GPU with a free ``profile`` slot that has the fewest free slots (``first``: the lowest index)."""
    best: tuple[int, Gpu, MigSlot] | None = None
    for gpu in node.gpus:
        slots = gpu.mig or []
        slot = next((s for s in slots if s.free and s.profile == profile), None)
        if slot is None:
            continue
        if first:
            return gpu, slot
        free = sum(1 for s in slots if s.free)
        if best is None or free < best[0]:
            best = (free, gpu, slot)
    if best is None:
        raise LookupError(f"node {node.node_id} has no free {profile} slot")
    return best[1], best[2]


def _mig_score(node: Node, position: int, request: Request, *, first: bool) -> Scored:
    if first:
        return -float(position), None
    # Pack slices: the node with the fewest free MIG slots left.
    return -float(sum(node.mig_free.values())), None


class FirstFit(_IndexedPlacer):
    """The first feasible node in the given order, its lowest-index GPUs (Greedy)."""

    name = "first_fit"

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        return -float(position), None

    def choose_gpus(self, node: Node, request: Request, choice: object) -> list[Gpu]:
        return _first_gpus(node, request)


class BestFit(_IndexedPlacer):
    """The node left with the least free CPU and GPU: minimise ``0.5·cpu_free/max_cpu + 0.5·gpu_free/max_gpu``.

    The request's own share of both is the same for every node, so it drops out.
    """

    name = "best_fit"

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        return -(0.5 * node.cpu_milli_free / fleet.max_cpu_milli + 0.5 * node.free_total / fleet.max_gpu_milli), None


class RandomFit(_IndexedPlacer):
    """A uniformly random feasible node (seeded); shares best-fit within it."""

    name = "random"

    def __init__(self, *, seed: int = 0, workload: Workload | None = None) -> None:
        super().__init__(seed=seed, workload=workload)
        self._rng = random.Random(seed)
        self._sets: dict[tuple[object, int], _Members] = {}

    def _bind(self, fleet: Fleet) -> None:
        if self._fleet is not fleet:
            self._sets.clear()
        super()._bind(fleet)

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        return 0.0, None  # only the chosen node is ever scored: for its GPU choice

    def best_position(self, request: Request, fleet: Fleet) -> int | None:
        key = (request.shape_key, request.memory_mib)
        index = self._sets.get(key)
        nodes = fleet.nodes
        count = fleet.change_count
        changed = None if index is None else fleet.changed_since(index.seen)
        if index is None or changed is None:
            if index is None and len(self._sets) >= self.max_indexes:
                del self._sets[next(iter(self._sets))]
            index = self._sets[key] = _Members()
            index.members = [position for position in fleet.candidates(request) if fits(nodes[position], request)]
            index.where = {position: slot for slot, position in enumerate(index.members)}
            index.seen = count
        elif changed:
            members, where = index.members, index.where
            for position in dict.fromkeys(changed):
                ok = fits(nodes[position], request)
                if ok and position not in where:
                    where[position] = len(members)
                    members.append(position)
                elif not ok and position in where:
                    slot = where.pop(position)
                    last = members.pop()
                    if last != position:
                        members[slot] = last
                        where[last] = slot
            index.seen = count
        if not index.members:
            return None
        return index.members[self._rng.randrange(len(index.members))]


class Utilization(_IndexedPlacer):
    """Dot-product packing: the node whose free resources align least with the request.

    ``dot = ⟨(cpu_free/max_cpu, gpu_free/max_gpu), (cpu/max_cpu, gpu/max_gpu)⟩``, normalised by
    the largest node, scored ``int(100 · (1 − dot/2))``, higher first — the Tetris alignment
    score (Grandl et al., SIGCOMM 2014) turned into a most-allocated rule, on the integer scale
    the FGD paper's DotProd baseline uses (its "merge" form: a node's GPUs count as one pool).
    Shares go to the best-fitting GPU.
    """

    name = "utilization"

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        max_cpu, max_gpu = fleet.max_cpu_milli, fleet.max_gpu_milli
        dot = (node.cpu_milli_free / max_cpu) * (request.cpu_milli / max_cpu) + (node.free_total / max_gpu) * (
            request.gpu_milli_total / max_gpu
        )
        return float(int(100 * (1 - dot / 2))), None


class GpuPacking(_IndexedPlacer):
    """Fill shared GPUs first, then idle GPUs of used nodes, then empty nodes (FGD's GpuPacking).

    Scores, as the artifact computes them (integers, higher first): using only partly
    used GPUs ``100 − Σ free%/10`` (at least 50); using idle GPUs of a used node
    ``50 − idle GPUs used`` (at least 33); an entirely idle node ``33 − its GPUs``.
    CPU-only tasks score 0 everywhere (so go to the fullest node).
    """

    name = "gpu_packing"

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        if request.num_gpu == 0:
            return 0.0, None
        if node.full == node.gpu_count:
            return float(max(100 // 3 - node.full, node.full)), None
        chosen = _best_fit_gpus(node, request)
        if len(chosen) < request.num_gpu:
            return None
        idle_used = sum(1 for gpu in chosen if gpu.milli_free == MILLI)
        if idle_used:
            return float(max(100 // 2 - idle_used, 100 // 3)), None
        free_pct = sum(gpu.milli_free * 100 // MILLI for gpu in chosen)
        return float(max(100 - free_pct // 10, 100 // 2)), None


class GpuClustering(_IndexedPlacer):
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


class Fgd(_IndexedPlacer):
    """Fragmentation Gradient Descent: the placement that adds the least expected fragmentation.

    Without a ``workload`` it measures against the requests it has been asked to place so far.
    """

    name = "fgd"
    max_cached_scores: ClassVar[int] = 1_000_000

    def __init__(self, *, seed: int = 0, workload: Workload | None = None) -> None:
        super().__init__(seed=seed, workload=workload)
        self._learn = workload is None
        self._seen: Counter[TaskShape] = Counter()
        self.frag_model = FragModel(Workload(())) if workload is None else FragModel.shared(workload)

    def place(self, request: Request, nodes: Sequence[Node]) -> Placement | None:
        if self._learn and request.mig_profile is None:
            self._seen[task_shape(request)] += 1
            self.frag_model = FragModel(Workload.from_counts(self._seen))
            self._fleet = None  # scores against the old workload are stale
        return super().place(request, nodes)

    def frag_delta(self, node: Node, request: Request) -> tuple[float, int | None] | None:
        """The least fragmentation increase ``request`` can cause on ``node``, and the GPU free value it uses."""
        model = self.frag_model
        before = model.frag(node.model, node.cpu_milli_free, node.free_desc)
        cpu_after = node.cpu_milli_free - request.cpu_milli
        if request.num_gpu == 0:
            return model.frag(node.model, cpu_after, node.free_desc) - before, None
        milli = request.gpu_milli
        free_desc = node.free_desc
        if milli >= MILLI:
            count = request.num_gpu
            after = free_desc[count:] + (0,) * count
            return model.frag(node.model, cpu_after, after) - before, None
        if request.num_gpu > 1:  # several shares: best fit for all of them
            after = free_desc
            for gpu in _best_fit_gpus(node, request):
                after = _take_one(after, gpu.milli_free, milli)
            return model.frag(node.model, cpu_after, after) - before, None
        if node.memory_tracked:
            values = sorted({gpu.milli_free for gpu in node.gpus if node.gpu_takes(request, gpu)}, reverse=True)
        else:
            values = sorted({free for free in free_desc if free >= milli}, reverse=True)
        best: tuple[float, int | None] | None = None
        for value in values:
            delta = model.frag(node.model, cpu_after, _take_one(free_desc, value, milli)) - before
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
        key = (node.model, node.cpu_milli_free, node.free_desc, request.cpu_milli, request.num_gpu, request.gpu_milli)
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
        return _best_fit_gpus(node, request)


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


class FgdNet(Fgd):
    """Our default: FGD that also keeps scarce GPU models for the tasks that need them, and prefers near hosts.

    Score = ``fgd_score`` − ``SCARCITY_WEIGHT`` · pressure of the node's model
    (:func:`model_pressure`) for GPU requests; then, among equal scores, the lowest latency
    to the renter's region (unmeasured hosts last), then the fullest node. A task that can
    run anywhere thus avoids the models that constrained tasks crowd (in the trace's
    ``gpuspec33`` variant, T4 nodes, wanted by 17 % of the demand while holding 13.5 % of the
    GPUs), unless FGD sees a real fragmentation gain. Without model constraints in the
    workload and without a region in the request, it places exactly as ``fgd``. The renter's
    network limits filter hosts for every placer (``fits``).
    """

    name = "fgd_net"

    def __init__(self, *, seed: int = 0, workload: Workload | None = None) -> None:
        super().__init__(seed=seed, workload=workload)
        self._pressure: dict[str, float] = {}

    def _bind(self, fleet: Fleet) -> None:
        if self._fleet is not fleet:
            self._pressure = model_pressure(self.frag_model.workload, fleet.capacity_by_model)
        super()._bind(fleet)

    def score(self, node: Node, position: int, request: Request, fleet: Fleet) -> Scored | None:
        found = self.fgd(node, request)
        if found is None:
            return None
        value = float(found[0])
        if request.num_gpu:
            value -= SCARCITY_WEIGHT * self._pressure.get(node.model, 0.0)
        if request.network is not None:
            link = node.links.get(request.network.region)
            # Less than one step of the integer FGD score: latency only decides between equals.
            latency = MAX_LATENCY_MS if link is None else min(link.latency_ms, MAX_LATENCY_MS)
            value -= 0.5 * latency / MAX_LATENCY_MS
        return value, found[1]


PLACERS: dict[str, PlacerFactory] = {
    "first_fit": FirstFit,
    "best_fit": BestFit,
    "random": RandomFit,
    "utilization": Utilization,
    "gpu_packing": GpuPacking,
    "gpu_clustering": GpuClustering,
    "fgd": Fgd,
    "fgd_net": FgdNet,
}
DEFAULT_PLACER = "fgd_net"


def get_placer(name: str, *, seed: int = 0, workload: Workload | None = None) -> Placer:
    """A new placer of algorithm ``name`` (see ``PLACERS``); ``workload`` matters to ``fgd``/``fgd_net`` only."""
    factory = PLACERS.get(name)
    if factory is None:
        raise UnknownPlacer(f"unknown placement algorithm {name!r}; choose one of: {', '.join(PLACERS)}")
    return factory(seed=seed, workload=workload)


__all__ = [
    "DEFAULT_PLACER", "MILLI", "PLACERS", "Fleet", "FragModel", "Gpu", "LinkStats", "MigSlot", "NetworkLimits", "Node",
    "Placement", "Placer", "PlacerFactory", "Request", "TaskType", "UnknownPlacer", "Workload", "fits", "get_placer",
    "gpu_shape",
]  # fmt: skip
