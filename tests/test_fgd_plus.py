"""``fgd_plus`` (issue 43): where it places otherwise than FGD, and why, on hand-built nodes."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from master.scheduler import MILLI, Gpu, Node, Placement, Request, TaskType, Workload, get_placer
from master.scheduler.placers.fgd_plus import CPU_WEIGHT, FILL_WEIGHT, MEMORY_WEIGHT


def node(
    node_id: str, free: Sequence[int], *, cpu: int = 96_000, cpu_free: int | None = None, memory: int = 393_216,
    memory_free: int | None = None,
) -> Node:
    gpus = [Gpu(i, uuid=f"{node_id}-gpu{i}", milli_free=milli) for i, milli in enumerate(free)]
    return Node(node_id, "G2", gpus, cpu_milli=cpu, memory_mib=memory, cpu_milli_free=cpu_free,
                memory_mib_free=memory_free)  # fmt: skip


def place(name: str, request: Request, nodes: Sequence[Node], workload: Workload) -> Placement | None:
    return get_placer(name, seed=7, workload=workload).place(request, nodes)


class TestCompleteWorkload:
    def test_complete_puts_back_the_shapes_the_threshold_left_out(self) -> None:
        """20 tasks: 10 X, 6 Y, 3 Z, 1 W. The typical set is X, Y, Z (19 of 20); complete() gives all four by count."""
        x, y, z, w = Request(), Request(gpu_milli=500), Request(num_gpu=2), Request(num_gpu=8)
        built = Workload.from_requests([x] * 10 + [y] * 6 + [z] * 3 + [w])
        assert [(t.num_gpu, t.gpu_milli) for t in built.tasks] == [(1, 1000), (1, 500), (2, 1000)]
        complete = built.complete()
        assert [(t.num_gpu, t.gpu_milli) for t in complete.tasks] == [(1, 1000), (1, 500), (2, 1000), (8, 1000)]
        assert [t.popularity for t in complete.tasks] == pytest.approx([10 / 20, 6 / 20, 3 / 20, 1 / 20])
        assert complete.constraints == built.constraints

    def test_complete_keeps_each_shapes_host_memory_and_the_typical_set_does_not(self) -> None:
        """10 + 9 one-GPU tasks of 1 and 2 GiB, one 8-GPU task: FGD's typical set is the one-GPU shape (19 of 20,
        memory not counted); complete() has three shapes, each with its memory."""
        requests = [Request(memory_mib=1_024)] * 10 + [Request(memory_mib=2_048)] * 9 + [Request(num_gpu=8)]
        built = Workload.from_requests(requests)
        assert [(t.num_gpu, t.memory_mib, t.popularity) for t in built.tasks] == [(1, 0, 1.0)]
        complete = built.complete()
        assert [(t.num_gpu, t.memory_mib) for t in complete.tasks] == [(1, 1_024), (1, 2_048), (8, 0)]
        assert [t.popularity for t in complete.tasks] == pytest.approx([10 / 20, 9 / 20, 1 / 20])

    def test_a_workload_without_a_tail_is_already_complete(self) -> None:
        built = Workload((TaskType(0, 1, 500, frozenset(), 1.0),))
        assert built.complete() is built


class TestFgdPlus:
    def test_keeps_a_whole_gpu_for_a_shape_outside_the_typical_set(self) -> None:
        """96 tasks want 500 milli, 4 a whole GPU: the typical set (95 %) is the 500-milli shape alone.

        A 500 share on a node with free 1000/500. Against the typical set both GPUs leave no fragment
        (1000 → 500/500, or 500 → 1000/0: nothing under 500 but a 0), Δ = 0 each, and FGD takes the first,
        the idle GPU 0. Against every shape the whole-GPU tasks (p .04) count too: before, the 500 GPU is
        fragment to them (F = .04·500 = 20); 500/500 makes both fragment (F = 40, Δ = +20), 1000/0 none
        (F = 0, Δ = −20). fgd_plus takes GPU 1 and keeps the whole GPU a 1-GPU task needs.
        """
        requests = [Request(gpu_milli=500, cpu_milli=1_000)] * 96 + [Request(cpu_milli=1_000)] * 4
        workload = Workload.from_requests(requests)
        assert [t.gpu_milli for t in workload.tasks] == [500]
        share = Request(gpu_milli=500, cpu_milli=1_000)
        fgd = place("fgd", share, [node("n", (MILLI, 500))], workload)
        plus = place("fgd_plus", share, [node("n", (MILLI, 500))], workload)
        assert fgd is not None and fgd.gpu_indices == (0,)
        assert plus is not None and plus.gpu_indices == (1,)

    def test_a_fuller_node_wins_over_one_a_step_better_by_fgd(self) -> None:
        """Workload: 500-milli tasks. A 480 share on idle a (4 GPUs, all CPU free) leaves 520: Δ = 0, score 50;
        on b (free 500/0/0/0, no CPU free) it leaves 20 under 500: Δ = 20, score 49. FGD takes a. fgd_plus
        subtracts FILL_WEIGHT (5) × the free share: a 50 − 5·1 = 45, b 49 − 5·0.0625 = 48.69 — it takes b."""
        assert FILL_WEIGHT == 5.0
        workload = Workload((TaskType(0, 1, 500, frozenset(), 1.0),))
        nodes = [node("a", (MILLI,) * 4), node("b", (500, 0, 0, 0), cpu_free=0)]
        fgd = place("fgd", Request(gpu_milli=480), nodes, workload)
        plus = place("fgd_plus", Request(gpu_milli=480), nodes, workload)
        assert fgd is not None and fgd.node_id == "a"
        assert plus is not None and plus.node_id == "b"

    def test_does_not_strand_gpus_for_want_of_host_memory(self) -> None:
        """Workload: 1-GPU tasks asking 64 GiB of host memory. A CPU-only task asking 40 GiB: FGD does not count
        memory, sees Δ = 0 on both nodes and takes the fuller a (half its CPU used), leaving a 60 GiB for its two
        idle GPUs — both now fragment to every task of the workload (Δ = +2000, score 11). fgd_plus counts it and
        takes b (200 GiB free: Δ = 0, score 50; less the fill term, 48 against a's 9.5)."""
        workload = Workload.from_requests([Request(memory_mib=65_536)])
        nodes = [
            node("a", (MILLI, MILLI), cpu_free=48_000, memory_free=102_400),
            node("b", (MILLI, MILLI), memory_free=204_800),
        ]
        cpu_task = Request(num_gpu=0, cpu_milli=4_000, memory_mib=40_960)
        fgd = place("fgd", cpu_task, nodes, workload)
        plus = place("fgd_plus", cpu_task, nodes, workload)
        assert fgd is not None and fgd.node_id == "a"
        assert plus is not None and plus.node_id == "b"

    def test_a_task_heavy_in_memory_for_its_gpu_goes_where_memory_is_plentiful(self) -> None:
        """Workload: 1-GPU tasks (no memory counted). A 1-GPU task asking 128 GiB: FGD sees Δ = 0 on both and
        takes the fuller a (8 GPUs, 384 GiB, half used). fgd_plus: on a it takes 1/8 of the GPU but 1/3 of the
        memory — 10 × 0.208 = 2.08 points off, with the fill term (5 × free share 0.5) 50 − 2.5 − 2.08 = 45.4; on
        b (2 GPUs, 512 GiB, half its CPU used: free share 0.75) a quarter of the memory for half the GPU costs
        nothing: 50 − 3.75 = 46.25. It takes b, leaving a's 48 GiB per GPU to tasks that need no more."""
        assert (MEMORY_WEIGHT, CPU_WEIGHT) == (10.0, 10.0)
        workload = Workload((TaskType(0, 1, MILLI, frozenset(), 1.0),))
        nodes = [
            node("a", (MILLI,) * 4 + (0,) * 4, cpu_free=48_000),
            node("b", (MILLI, MILLI), cpu_free=48_000, memory=524_288),
        ]
        heavy = Request(memory_mib=131_072)
        fgd = place("fgd", heavy, nodes, workload)
        plus = place("fgd_plus", heavy, nodes, workload)
        assert fgd is not None and fgd.node_id == "a"
        assert plus is not None and plus.node_id == "b"

    def test_learns_the_complete_workload_from_its_requests(self) -> None:
        """Without a workload it measures against every shape it was asked to place, rare ones included."""
        placer = get_placer("fgd_plus")
        nodes = [node("a", (MILLI,) * 8)]
        for request in [Request(gpu_milli=300)] * 19 + [Request(num_gpu=8)]:
            placer.place(request, nodes)
        tasks = placer.frag_model.workload.tasks  # type: ignore[attr-defined]
        assert sorted((t.num_gpu, t.gpu_milli) for t in tasks) == [(1, 300), (8, 1000)]
        assert sorted(t.popularity for t in tasks) == pytest.approx([1 / 20, 19 / 20])


def test_memory_aware_fragmentation_matches_the_definition() -> None:
    # The tabulated memory-aware fragmentation (groups by GPU milli, a table per CPU and memory bucket) equals the
    # sum over task types it stands for, on states across the thresholds.
    import random

    from master.scheduler.fragmentation import FragModel

    tasks = (
        TaskType(0, 0, 0, frozenset(), 0.1, 4_096), TaskType(4_000, 1, MILLI, frozenset(), 0.2, 48_000),
        TaskType(8_000, 2, MILLI, frozenset(), 0.1, 16_000), TaskType(2_000, 1, 500, frozenset(), 0.15, 8_000),
        TaskType(2_000, 1, 500, frozenset(), 0.05, 64_000), TaskType(1_000, 1, 250, frozenset({"T4"}), 0.1, 2_000),
        TaskType(16_000, 8, MILLI, frozenset(), 0.05, 300_000), TaskType(6_000, 1, 800, frozenset(), 0.25, 30_000),
    )  # fmt: skip
    model = FragModel(Workload(tasks))
    assert model.memory_aware
    rng = random.Random(7)
    for _ in range(400):
        gpu_model = rng.choice(("T4", "A10"))
        free_desc = tuple(sorted((rng.choice((0, 100, 250, 499, 500, 800, MILLI)) for _ in range(rng.choice((1, 2, 8)))), reverse=True))
        cpu_free, memory_free = rng.randrange(0, 20_000), rng.randrange(-1_000, 400_000)
        expected = 0.0
        for task in tasks:
            total = sum(free_desc)
            if task.gpu_milli == 0 or (task.gpu_models and gpu_model not in task.gpu_models):
                expected += task.popularity * total
                continue
            fitting = sum(1 for free in free_desc if free >= task.gpu_milli)
            usable = task.cpu_milli <= cpu_free and task.memory_mib <= memory_free and fitting >= task.num_gpu
            expected += task.popularity * (sum(f for f in free_desc if f < task.gpu_milli) if usable else total)
        assert model.frag(gpu_model, cpu_free, free_desc, memory_free) == pytest.approx(expected, abs=1e-9)
