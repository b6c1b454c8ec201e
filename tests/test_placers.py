"""The placers on small hand-built fleets whose right answer is worked out in the comments.

Conventions of the fleets here: GPU milli is free milli-GPU per GPU (1000 = idle); a node's
``max_cpu``/``max_gpu`` normalisers are the fleet's largest CPU and GPU capacity.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import pytest

from master.scheduler import (
    MILLI,
    PLACERS,
    Fleet,
    FragModel,
    Gpu,
    LinkStats,
    MigSlot,
    NetworkLimits,
    Node,
    Placement,
    Request,
    TaskType,
    UnknownPlacer,
    Workload,
    fgd_score,
    fits,
    get_placer,
    model_pressure,
)
from master.scheduler.placers.base import IndexedPlacer
from master.scheduler.placers.fgd import Fgd
from shared.errors import ValidationFailed

ALL = tuple(PLACERS)
SCORING = tuple(name for name in PLACERS if name != "random")


def node(
    node_id: str,
    free: Sequence[int] = (MILLI,) * 8,
    *,
    model: str = "G2",
    cpu: int = 96_000,
    cpu_free: int | None = None,
    memory: int = 393_216,
    gpu_memory: int = 0,
    links: dict[str, LinkStats] | None = None,
    affinity: dict[str, int] | None = None,
) -> Node:
    gpus = [Gpu(i, uuid=f"{node_id}-gpu{i}", milli_free=milli, memory_mib=gpu_memory) for i, milli in enumerate(free)]
    return Node(node_id, model, gpus, cpu_milli=cpu, memory_mib=memory, cpu_milli_free=cpu_free, links=links,
                affinity=affinity)  # fmt: skip


def workload(*tasks: tuple[int, int, int, float], models: frozenset[str] = frozenset()) -> Workload:
    """Task types as (cpu_milli, num_gpu, gpu_milli, popularity)."""
    return Workload(tuple(TaskType(cpu, num, milli, models, p) for cpu, num, milli, p in tasks))


def place(name: str, request: Request, nodes: Sequence[Node], *, wl: Workload | None = None) -> Placement | None:
    return get_placer(name, seed=7, workload=wl or workload((0, 1, MILLI, 1.0))).place(request, nodes)


class TestFirstFit:
    def test_takes_the_first_node_that_fits_and_its_lowest_free_gpus(self) -> None:
        """Node a has no free GPU; b is the first with two, and its idle GPUs 0 and 2 are taken."""
        nodes = [node("a", (0, 0)), node("b", (MILLI, 0, MILLI, MILLI)), node("c", (MILLI,) * 4)]
        placement = place("first_fit", Request(num_gpu=2), nodes)
        assert placement is not None
        assert (placement.node_id, placement.gpu_indices) == ("b", (0, 2))
        assert placement.gpu_uuids == ("b-gpu0", "b-gpu2")

    def test_skips_nodes_short_of_cpu_or_memory(self) -> None:
        """a lacks CPU, b lacks memory, so the 1-GPU task with 4 CPUs and 64 GiB goes to c."""
        nodes = [node("a", cpu_free=3_000), node("b", memory=32_768), node("c")]
        placement = place("first_fit", Request(cpu_milli=4_000, memory_mib=65_536), nodes)
        assert placement is not None and placement.node_id == "c"


class TestBestFit:
    def test_prefers_the_node_left_fullest(self) -> None:
        """a: 0.5·96/96 + 0.5·8/8 = 1.0 free; b: 0.5·20/96 + 0.5·2/8 = 0.229 free — b wins."""
        nodes = [node("a"), node("b", (MILLI, MILLI, 0, 0, 0, 0, 0, 0), cpu_free=20_000)]
        placement = place("best_fit", Request(cpu_milli=4_000), nodes)
        assert placement is not None and placement.node_id == "b"

    def test_a_share_takes_the_gpu_it_fits_best(self) -> None:
        """Free 1000/600/300: a 250 share takes the 300 GPU, a 400 share the 600 one."""
        nodes = [node("a", (MILLI, 600, 300))]
        small = place("best_fit", Request(gpu_milli=250), nodes)
        large = place("best_fit", Request(gpu_milli=400), nodes)
        assert small is not None and small.gpu_indices == (2,)
        assert large is not None and large.gpu_indices == (1,)


class TestRandom:
    def test_picks_only_feasible_nodes_and_is_seeded(self) -> None:
        """Over 300 draws every node that fits is chosen and the full one never; a seed repeats its draws."""
        nodes = [node("full", (0,) * 8), node("a"), node("b"), node("c")]

        def draws(seed: int) -> list[str]:
            placer = get_placer("random", seed=seed)
            return [p.node_id for p in (placer.place(Request(), nodes) for _ in range(300)) if p is not None]

        counts = Counter(draws(1))
        assert set(counts) == {"a", "b", "c"} and min(counts.values()) > 60
        assert draws(1) == draws(1) and draws(1) != draws(2)


class TestUtilization:
    def test_prefers_the_most_allocated_aligned_node(self) -> None:
        """Request (0.1 CPU, 0.125 GPU) of the largest node. a is empty: dot = 0.1·1 + 0.125·1 = 0.225,
        score int(100·(1 − 0.1125)) = 88; b is half used: dot = 0.1125, score int(94.375) = 94 — b."""
        nodes = [node("a"), node("b", (MILLI,) * 4 + (0,) * 4, cpu_free=48_000)]
        placement = place("utilization", Request(cpu_milli=9_600), nodes)
        assert placement is not None and placement.node_id == "b"


class TestGpuPacking:
    def test_shares_go_to_partly_used_gpus_first(self) -> None:
        """a is idle: 33 − 2 = 31; b has a GPU with 400 free: 100 − 40//10 = 96 — b, on that GPU."""
        nodes = [node("a", (MILLI, MILLI)), node("b", (MILLI, 400))]
        placement = place("gpu_packing", Request(gpu_milli=300), nodes)
        assert placement is not None and (placement.node_id, placement.gpu_indices) == ("b", (1,))

    def test_whole_gpus_go_to_used_nodes_then_to_small_empty_ones(self) -> None:
        """Idle 8-GPU node 33 − 8 = 25, idle 2-GPU node 33 − 2 = 31, used node with idle GPUs 50 − 1 = 49."""
        empty_big, empty_small = node("big"), node("small", (MILLI, MILLI))
        used = node("used", (MILLI, MILLI, 0, 0))
        first = place("gpu_packing", Request(), [empty_big, empty_small, used])
        second = place("gpu_packing", Request(), [empty_big, empty_small])
        assert first is not None and first.node_id == "used"
        assert second is not None and second.node_id == "small"


class TestGpuClustering:
    def test_tasks_of_one_gpu_shape_go_together(self) -> None:
        """A share goes to the node running only shares (band 75), a whole GPU to the one running only 1-GPU tasks."""
        nodes = [
            node("shares", (MILLI, 500), affinity={"share-gpu": 1}),
            node("whole", (MILLI, 0), affinity={"1-gpu": 1}),
            node("idle", (MILLI, MILLI)),
        ]
        share = place("gpu_clustering", Request(gpu_milli=200), nodes)
        whole = place("gpu_clustering", Request(), nodes)
        assert share is not None and share.node_id == "shares"
        assert whole is not None and whole.node_id == "whole"

    def test_applying_a_placement_records_the_shape(self) -> None:
        """After a 2-GPU task lands, the node's affinity counts one ``2-gpu`` task."""
        fleet = Fleet([node("a")])
        placement = place("gpu_clustering", Request(num_gpu=2), fleet)
        assert placement is not None
        fleet.apply(placement)
        assert dict(fleet[0].affinity) == {"2-gpu": 1}


class TestFgdScore:
    def test_fragmentation_of_a_node_worked_by_hand(self) -> None:
        """Tasks A (500 milli, p .5) and B (1000 milli, p .5); free 1000/700/300.
        A cannot use the 300 GPU: F(A) = 300; B can use only the idle one: F(B) = 700 + 300 = 1000;
        F = 0.5·300 + 0.5·1000 = 650."""
        model = FragModel(workload((0, 1, 500, 0.5), (0, 1, MILLI, 0.5)))
        assert model.node_frag(node("n", (MILLI, 700, 300))) == pytest.approx(650)

    def test_a_node_short_of_cpu_or_of_the_model_is_all_fragment(self) -> None:
        """Task E needs 8 CPUs: with 6 left every free milli is fragment to it (2000); so for a task
        that runs only on V100M32, on a G2 node."""
        cpu_bound = FragModel(workload((8_000, 1, MILLI, 1.0)))
        assert cpu_bound.node_frag(node("n", (MILLI, MILLI), cpu_free=10_000)) == 0
        assert cpu_bound.node_frag(node("n", (MILLI, MILLI), cpu_free=6_000)) == 2_000
        other_model = FragModel(workload((0, 1, 500, 1.0), models=frozenset({"V100M32"})))
        assert other_model.node_frag(node("n", (MILLI, 300))) == 1_300

    def test_cpu_only_tasks_count_all_idle_gpu(self) -> None:
        """As in the artifact, a CPU-only task type sees a node's whole idle GPU as fragment."""
        model = FragModel(workload((4_000, 0, 0, 1.0)))
        assert model.node_frag(node("n", (MILLI, 250))) == 1_250

    def test_the_integer_score(self) -> None:
        """int(100 / (1 + e^(Δ/1000))): Δ = 0 → 50, 450 → 38 (38.9), −1000 → 73 (73.1), 2000 → 11 (11.9)."""
        assert [fgd_score(d) for d in (0, 450, -1_000, 2_000)] == [50, 38, 73, 11]

    def test_a_share_goes_where_it_fragments_least_not_where_it_fits_best(self) -> None:
        """Workload: 500-milli tasks only. Free 1000/700, a 250 share: on the idle GPU → 750/700, no
        GPU below 500, Δ = 0, score 50; on the 700 GPU → 1000/450, Δ = 450, score 38. FGD takes
        GPU 0 where best fit takes GPU 1."""
        wl = workload((0, 1, 500, 1.0))
        nodes = [node("n", (MILLI, 700))]
        fgd = place("fgd", Request(gpu_milli=250), nodes, wl=wl)
        best = place("best_fit", Request(gpu_milli=250), nodes)
        assert fgd is not None and fgd.gpu_indices == (0,)
        assert best is not None and best.gpu_indices == (1,)

    def test_chooses_the_node_whose_fragmentation_grows_least(self) -> None:
        """Same workload. On a (free 500/0) the share leaves 250 < 500: Δ = 250, score 43; on b (idle)
        it leaves 750/1000: Δ = 0, score 50 — FGD takes b, best fit takes the fuller a."""
        wl = workload((0, 1, 500, 1.0))
        nodes = [node("a", (500, 0)), node("b", (MILLI, MILLI))]
        fgd = place("fgd", Request(gpu_milli=250), nodes, wl=wl)
        best = place("best_fit", Request(gpu_milli=250), nodes)
        assert fgd is not None and fgd.node_id == "b"
        assert best is not None and best.node_id == "a"

    def test_equal_scores_go_to_the_fullest_node(self) -> None:
        """Workload of 1-GPU tasks: a whole GPU leaves no fragment on either node (score 50 both), so
        the fuller b (2 of 4 GPUs and half its CPU free) wins over the idle a."""
        nodes = [node("a", (MILLI,) * 4), node("b", (MILLI, MILLI, 0, 0), cpu_free=48_000)]
        placement = place("fgd", Request(), nodes)
        assert placement is not None and placement.node_id == "b"

    def test_a_cpu_task_avoids_starving_gpus_of_cpu(self) -> None:
        """Workload: 1-GPU tasks needing 8 CPUs. A 4-CPU task on a (10 CPUs, 2 idle GPUs) leaves 6:
        Δ = 2000, score 11; on b (40 CPUs) nothing changes: score 50 — b."""
        wl = workload((8_000, 1, MILLI, 1.0))
        nodes = [node("a", (MILLI, MILLI), cpu_free=10_000), node("b", (MILLI, MILLI), cpu_free=40_000)]
        placement = place("fgd", Request(num_gpu=0, cpu_milli=4_000), nodes, wl=wl)
        assert placement is not None and placement.node_id == "b" and placement.gpu_indices == ()


class TestFgdNet:
    def test_model_pressure_worked_by_hand(self) -> None:
        """G2 8000 and T4 2000 milli (C = 10000). 10 % of the demand runs only on T4, 20 % on T4 or G2:
        T4 = 0.1·10000/2000 + 0.2·10000/10000 = 0.7; G2 = 0.2."""
        wl = Workload((), ((frozenset({"T4"}), 0.1), (frozenset({"T4", "G2"}), 0.2)))
        assert model_pressure(wl, {"G2": 8_000, "T4": 2_000}) == pytest.approx({"T4": 0.7, "G2": 0.2})

    def test_keeps_a_scarce_model_for_the_tasks_that_need_it(self) -> None:
        """Half the demand runs only on T4, which has 2 of the fleet's 10 GPUs: pressure 0.5·10/2 = 2.5,
        25 points off. A whole GPU scores 50 on both nodes, so fgd takes the fuller T4 node; fgd_net
        (50 − 25 on T4, 50 − 0 on G2) keeps it free."""
        wl = Workload((TaskType(0, 1, MILLI, frozenset(), 1.0),), ((frozenset({"T4"}), 0.5),))
        nodes = [node("t4", (MILLI, 0), model="T4", cpu_free=48_000), node("g2")]
        fgd, net = place("fgd", Request(), nodes, wl=wl), place("fgd_net", Request(), nodes, wl=wl)
        assert fgd is not None and fgd.node_id == "t4"
        assert net is not None and net.node_id == "g2"
        only_t4 = place("fgd_net", Request(gpu_models=frozenset({"T4"})), nodes, wl=wl)
        assert only_t4 is not None and only_t4.node_id == "t4"

    def test_constraint_shares_count_every_task(self) -> None:
        """One T4-only 2-GPU task among nine unconstrained 1-GPU ones: 2000 of 11000 milli of demand."""
        built = Workload.from_requests([Request()] * 9 + [Request(num_gpu=2, gpu_models=frozenset({"T4"}))])
        [(models, share)] = built.constraints
        assert models == frozenset({"T4"}) and share == pytest.approx(2 / 11)


class TestWorkload:
    def test_keeps_the_popular_shapes_covering_95_percent(self) -> None:
        """20 tasks: 10 X, 6 Y, 3 Z, 1 W. X+Y+Z = 19 ≥ 0.95·20, so W is dropped and X, Y, Z get 10/19, 6/19, 3/19."""
        x, y, z, w = Request(), Request(gpu_milli=500), Request(num_gpu=2), Request(num_gpu=8)
        built = Workload.from_requests([x] * 10 + [y] * 6 + [z] * 3 + [w])
        assert [(t.num_gpu, t.gpu_milli) for t in built.tasks] == [(1, 1000), (1, 500), (2, 1000)]
        assert [t.popularity for t in built.tasks] == pytest.approx([10 / 19, 6 / 19, 3 / 19])

    def test_fgd_without_a_workload_learns_it_from_its_requests(self) -> None:
        """Asked to place shares of 300 milli, FGD measures against exactly that task type."""
        placer = Fgd()
        placer.place(Request(gpu_milli=300), [node("a")])
        assert [(t.gpu_milli, t.popularity) for t in placer.frag_model.workload.tasks] == [(300, 1.0)]


class TestGang:
    @pytest.mark.parametrize("name", ALL)
    def test_whole_gpus_of_one_request_land_on_one_host(self, name: str) -> None:
        """Four GPUs: two hosts with two idle each cannot take them; the host with four does, all four."""
        split = [node("a", (MILLI, MILLI, 0, 0)), node("b", (MILLI, MILLI, 0, 0))]
        assert place(name, Request(num_gpu=4), split) is None
        placement = place(name, Request(num_gpu=4), [*split, node("c", (MILLI,) * 4)])
        assert placement is not None
        assert placement.node_id == "c" and sorted(placement.gpu_indices) == [0, 1, 2, 3]

    @pytest.mark.parametrize("name", ALL)
    def test_a_whole_gpu_is_never_a_partly_used_one(self, name: str) -> None:
        """A GPU with 999 milli free is not free for a whole-GPU request."""
        assert place(name, Request(), [node("a", (999, 999))]) is None


class TestFractional:
    def test_a_share_needs_both_core_and_memory_on_one_gpu(self) -> None:
        """80 GiB GPUs: GPU 0 has 600 milli but 10 GiB free, GPU 1 has 300 milli and 40 GiB. A
        250-milli, 20 GiB share fits only GPU 1; a 500-milli one fits neither."""
        n = node("a", (MILLI, MILLI), gpu_memory=81_920)
        n.gpus[0].milli_free, n.gpus[0].memory_free_mib = 600, 10_240
        n.gpus[1].milli_free, n.gpus[1].memory_free_mib = 300, 40_960
        fleet = Fleet([Node("a", "A100", n.gpus, cpu_milli=96_000, memory_mib=393_216)])
        for name in ALL:
            placement = place(name, Request(gpu_milli=250, gpu_memory_mib=20_480), fleet)
            assert placement is not None and placement.gpu_indices == (1,), name
            assert place(name, Request(gpu_milli=500, gpu_memory_mib=20_480), fleet) is None, name

    def test_a_share_without_a_memory_figure_takes_its_proportion(self) -> None:
        """250 milli of an 80 GiB GPU takes a quarter of its memory: 20,480 MiB."""
        placement = place("best_fit", Request(gpu_milli=250), [node("a", (MILLI,), gpu_memory=81_920)])
        assert placement is not None and placement.gpu_memory_mib == 20_480

    @pytest.mark.parametrize("name", ALL)
    def test_shares_fill_a_gpu_and_never_overflow_it(self, name: str) -> None:
        """600 and 400 fill the one GPU; a further 100 finds no room."""
        fleet = Fleet([node("a", (MILLI,), gpu_memory=16_000)])
        placer = get_placer(name, seed=1, workload=workload((0, 1, 500, 1.0)))
        for milli in (600, 400):
            placement = placer.place(Request(gpu_milli=milli), fleet)
            assert placement is not None
            fleet.apply(placement)
        assert fleet[0].gpus[0].milli_free == 0 and fleet[0].gpus[0].memory_free_mib == 0
        assert placer.place(Request(gpu_milli=100), fleet) is None


class TestMig:
    def mig_node(self) -> Node:
        slots = [MigSlot("mig-a", "1g.10gb"), MigSlot("mig-b", "1g.10gb", free=False), MigSlot("mig-c", "3g.40gb")]
        gpus = [Gpu(0, uuid="gpu-0"), Gpu(1, uuid="gpu-1", mig=slots)]
        return Node("m", "A100", gpus, cpu_milli=64_000, memory_mib=262_144)

    @pytest.mark.parametrize("name", ALL)
    def test_a_mig_request_takes_a_free_slot_of_its_profile(self, name: str) -> None:
        """1g.10gb lands in the free slot mig-a of the MIG GPU; there is no 2g.20gb slot at all."""
        fleet = Fleet([self.mig_node()])
        placement = place(name, Request(mig_profile="1g.10gb"), fleet)
        assert placement is not None
        assert (placement.gpu_indices, placement.mig_instances) == ((1,), ("mig-a",))
        assert place(name, Request(mig_profile="2g.20gb"), fleet) is None
        fleet.apply(placement)
        assert place(name, Request(mig_profile="1g.10gb"), fleet) is None

    @pytest.mark.parametrize("name", ALL)
    def test_other_requests_never_use_a_mig_gpu(self, name: str) -> None:
        """Whole GPUs and shares use GPU 0 only; two whole GPUs do not fit."""
        fleet = [self.mig_node()]
        for request in (Request(), Request(gpu_milli=300)):
            placement = place(name, request, fleet)
            assert placement is not None and placement.gpu_indices == (0,)
        assert place(name, Request(num_gpu=2), fleet) is None


class TestGpuModel:
    @pytest.mark.parametrize("name", ALL)
    def test_a_model_constraint_is_kept(self, name: str) -> None:
        """``V100M16|V100M32`` never lands on the G2 node."""
        models = Request.parse_models("V100M16|V100M32")
        assert models == frozenset({"V100M16", "V100M32"})
        nodes = [node("g2"), node("v100", model="V100M32")]
        placement = place(name, Request(gpu_models=models), nodes)
        assert placement is not None and placement.node_id == "v100"
        assert place(name, Request(gpu_models=frozenset({"A100"})), nodes) is None


class TestNetwork:
    @pytest.mark.parametrize("name", ALL)
    def test_hosts_breaking_the_renters_limits_are_filtered_for_every_placer(self, name: str) -> None:
        """Limits 50 ms, 10 ms jitter, 1 % loss to eu: too slow, too jittery, too lossy and unmeasured hosts are out."""
        limits = NetworkLimits("eu", max_latency_ms=50, max_jitter_ms=10, max_loss_pct=1)
        nodes = [
            node("slow", links={"eu": LinkStats(120, 2, 0)}),
            node("jittery", links={"eu": LinkStats(20, 30, 0)}),
            node("lossy", links={"eu": LinkStats(20, 2, 5)}),
            node("unmeasured", links={"us": LinkStats(5, 1, 0)}),
            node("good", (MILLI,) * 2, links={"eu": LinkStats(30, 2, 0.5)}),
        ]
        placement = place(name, Request(network=limits), nodes)
        assert placement is not None and placement.node_id == "good"

    def test_a_region_without_limits_filters_nothing(self) -> None:
        """A renter who only names a region can still get an unmeasured host."""
        assert fits(node("a"), Request(network=NetworkLimits("eu")))

    def test_fgd_net_takes_the_nearest_of_equally_good_hosts(self) -> None:
        """Two identical idle hosts, 80 ms and 20 ms to eu: fgd_net takes the near one; an unmeasured one ranks last."""
        nodes = [
            node("far", links={"eu": LinkStats(80)}), node("unmeasured"), node("near", links={"eu": LinkStats(20)}),
        ]  # fmt: skip
        for order in (nodes, nodes[::-1]):
            placement = place("fgd_net", Request(network=NetworkLimits("eu")), order)
            assert placement is not None and placement.node_id == "near"

    def test_fragmentation_still_comes_first(self) -> None:
        """A near host where the share would fragment (score 43) loses to a far one where it would not (50)."""
        wl = workload((0, 1, 500, 1.0))
        nodes = [node("near", (500, 0), links={"eu": LinkStats(5)}), node("far", (MILLI, MILLI), links={"eu": LinkStats(300)})]
        placement = place("fgd_net", Request(gpu_milli=250, network=NetworkLimits("eu")), nodes, wl=wl)
        assert placement is not None and placement.node_id == "far"


def random_fleet(rng: random.Random, size: int) -> list[Node]:
    shapes = [("G2", 8, 96_000), ("T4", 2, 104_000), ("V100M32", 8, 96_000), ("P100", 2, 64_000)]
    nodes = []
    for i in range(size):
        model, gpus, cpu = rng.choice(shapes)
        free = [rng.choice((MILLI, MILLI, MILLI, 500, 250, 0)) for _ in range(gpus)]
        nodes.append(node(f"n{i}", free, model=model, cpu=cpu, cpu_free=rng.randrange(8_000, cpu + 1, 1_000)))
    return nodes


def random_request(rng: random.Random) -> Request:
    kind = rng.random()
    models = frozenset({"T4"}) if rng.random() < 0.1 else frozenset()
    if kind < 0.1:
        return Request(num_gpu=0, cpu_milli=rng.choice((2_000, 8_000)))
    if kind < 0.6:
        return Request(gpu_milli=rng.choice((200, 250, 500, 700)), cpu_milli=rng.choice((2_000, 4_000)), gpu_models=models)
    return Request(num_gpu=rng.choice((1, 1, 2, 4, 8)), cpu_milli=rng.choice((4_000, 12_000)), gpu_models=models)


class TestFleetIndexes:
    @pytest.mark.parametrize("name", SCORING)
    def test_incremental_placement_matches_placing_from_scratch(self, name: str) -> None:
        """Through 200 placements, a placer that keeps its heaps across a fleet's changes picks exactly
        what a fresh placer scoring every node picks."""
        rng = random.Random(3)
        fleet = Fleet(random_fleet(rng, 40))
        wl = workload((4_000, 1, 500, 0.5), (12_000, 1, MILLI, 0.4), (2_000, 0, 0, 0.1))
        kept = get_placer(name, seed=5, workload=wl)
        placed = 0
        for _ in range(200):
            request = random_request(rng)
            incremental = kept.place(request, fleet)
            scratch = get_placer(name, seed=5, workload=wl).place(request, list(fleet))
            assert incremental == scratch
            if incremental is not None:
                fleet.apply(incremental)
                placed += 1
        assert placed > 50

    @pytest.mark.parametrize("name", SCORING)
    def test_requests_short_of_host_memory_on_the_best_nodes_match_placing_from_scratch(
        self, name: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Host memory is checked when the heap's top is taken: with hosts of little memory free scoring best,
        a placer that gives up popping after 2 entries (and looks at the whole heap instead), and remembers
        the most memory a host in the heap has, still picks exactly what a fresh placer picks, None included."""
        monkeypatch.setattr(IndexedPlacer, "min_pops", 2)
        rng = random.Random(11)
        nodes = random_fleet(rng, 40)
        for position, each in enumerate(nodes):
            each.memory_mib_free = rng.choice((4_096, 16_384, 65_536, 262_144)) if position % 3 else 1_024
        fleet = Fleet(nodes)
        wl = workload((4_000, 1, 500, 0.5), (12_000, 1, MILLI, 0.4), (2_000, 0, 0, 0.1))
        kept = get_placer(name, seed=5, workload=wl)
        outcomes = Counter[bool]()
        for _ in range(300):
            request = replace(random_request(rng), memory_mib=rng.choice((512, 8_192, 32_768, 200_000, 300_000)))
            incremental = kept.place(request, fleet)
            assert incremental == get_placer(name, seed=5, workload=wl).place(request, list(fleet))
            outcomes[incremental is None] += 1
            if incremental is not None:
                fleet.apply(incremental)
        assert outcomes[True] > 20 and outcomes[False] > 50

    @pytest.mark.parametrize("name", ALL)
    def test_a_placer_that_fell_behind_a_trimmed_log_rescores_everything(self, name: str) -> None:
        """With a change log of 4 entries, a shape not placed for 6 changes still sees the fleet as it is
        (6 one-GPU tasks on 8 idle 2-GPU nodes leave a whole node however a placer packs or spreads)."""
        fleet = Fleet([node(f"n{i}", (MILLI, MILLI)) for i in range(8)], max_log=4)
        placer = get_placer(name, seed=2, workload=workload((0, 1, MILLI, 1.0)))
        assert placer.place(Request(num_gpu=2), fleet) is not None
        for _ in range(6):
            placement = placer.place(Request(), fleet)
            assert placement is not None
            fleet.apply(placement)
        assert fleet.changed_since(0) is None and fleet.change_count == 6
        whole = [n.node_id for n in fleet if n.full == 2]
        placement = placer.place(Request(num_gpu=2), fleet)
        assert whole and placement is not None and placement.node_id in whole

    def test_a_stale_placement_is_refused(self) -> None:
        """Applying the same placement twice would give one GPU twice: the node refuses the second."""
        fleet = Fleet([node("a", (MILLI, MILLI))])
        placement = place("first_fit", Request(), fleet)
        assert placement is not None
        fleet.apply(placement)
        with pytest.raises(ValidationFailed, match="not entirely free"):
            fleet.apply(placement)

    def test_release_gives_back_what_apply_took(self) -> None:
        """A share applied then released leaves the node as it was, and placeable again."""
        fleet = Fleet([node("a", (MILLI,), cpu_free=8_000)])
        placer = get_placer("best_fit")
        placement = placer.place(Request(gpu_milli=700, cpu_milli=8_000), fleet)
        assert placement is not None
        fleet.apply(placement)
        assert placer.place(Request(gpu_milli=200, cpu_milli=1_000), fleet) is None  # no CPU left
        fleet.release(placement)
        assert (fleet[0].free_desc, fleet[0].cpu_milli_free, dict(fleet[0].affinity)) == ((MILLI,), 8_000, {})
        assert placer.place(Request(gpu_milli=700, cpu_milli=8_000), fleet) == placement


class TestRegistry:
    def test_every_name_builds_its_placer(self) -> None:
        """``get_placer(name).name == name`` for every registered algorithm, fgd_net included."""
        assert {"first_fit", "best_fit", "random", "utilization", "fgd", "fgd_net"} <= set(PLACERS)
        assert all(get_placer(name).name == name for name in PLACERS)

    def test_an_unknown_name_lists_the_known_ones(self) -> None:
        """The error names every algorithm, so the operator can fix the setting."""
        with pytest.raises(UnknownPlacer) as raised:
            get_placer("tetris")
        assert all(name in raised.value.message for name in PLACERS)

    def test_requests_are_validated(self) -> None:
        """A share above one GPU or a MIG request for two slices is refused when built."""
        with pytest.raises(ValidationFailed):
            Request(gpu_milli=1_500)
        with pytest.raises(ValidationFailed):
            Request(num_gpu=2, mig_profile="1g.10gb")
