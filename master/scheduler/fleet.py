"""The placement model: hosts, their GPUs, requests, placements, and the hard constraints.

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

A :class:`Fleet` (a ``Sequence[Node]``) logs which nodes changed, so the placers can keep
their scores up to date by rescoring only those (see ``master.scheduler.placers.base``).

Imports ``shared.errors`` only; no database, no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import overload

from shared.errors import ValidationFailed

MILLI = 1000  # milli-GPU in one GPU


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
        "region", "state", "version",
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
        region: str | None = None,
    ) -> None:
        self.node_id = node_id
        self.model = model
        # Where the host is (its relay's region); None: not known. Gang placement keeps a cluster in one.
        self.region = region
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
        self.state: str | None = None
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
        # Everything but links, affinity, host memory and the position that a placer's score can read, on a node
        # whose GPUs are plain (no MIG, memory untracked): nodes in equal states score alike (placers/base.py).
        # A string, because a string keeps its hash: a placer looks up every node's state in a full scan.
        plain = not self.memory_tracked and self.gpu_count == len(self.gpus)
        self.state = f"{self.model}\0{self.cpu_milli}\0{self.cpu_milli_free}\0{self.free_desc}" if plain else None

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


__all__ = [
    "MILLI", "Fleet", "Gpu", "LinkStats", "MigSlot", "NetworkLimits", "Node", "Placement", "Request", "fits",
    "fits_shape", "gpu_shape",
]  # fmt: skip
