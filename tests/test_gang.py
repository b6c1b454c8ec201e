"""Gang placement (``master.scheduler.gang.place_gang``): distinct hosts, all or nothing, one region,
RTT, one model, the cases where placing members one at a time fails, and a brute-force property test."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from master.scheduler import MILLI, PLACERS, Fleet, Gpu, Node, Placement, Request, fits, get_placer
from master.scheduler.gang import Rtt, place_gang
from master.scheduler.gang_simulate import (
    MODES,
    Cluster,
    place_one_at_a_time,
    simulate_clusters,
    with_clusters,
)
from shared.errors import ValidationFailed

ALL_PLACERS = sorted(PLACERS)


def host(name: str, free: int, *, gpus: int = 8, model: str = "A100", region: str | None = "eu") -> Node:
    """A host with ``gpus`` GPUs of which the first ``free`` are idle and the rest fully taken."""
    taken = [Gpu(i, milli_free=MILLI if i < free else 0) for i in range(gpus)]
    return Node(name, model, taken, cpu_milli=64_000, memory_mib=256_000, region=region)


def snapshot(nodes: Sequence[Node]) -> list[tuple[object, ...]]:
    return [
        (n.node_id, tuple(g.milli_free for g in n.gpus), n.cpu_milli_free, n.memory_mib_free, n.version)
        for n in nodes
    ]


def table(pairs: dict[frozenset[str], float]) -> Rtt:
    """An RTT function from a table of host pairs; pairs not in it are unknown."""
    return lambda a, b: pairs.get(frozenset((a, b)))


def hosts_of(placements: Sequence[Placement]) -> list[str]:
    return [placement.node_id for placement in placements]


FOUR = Request(num_gpu=4)


class TestPlaceGang:
    @pytest.mark.parametrize("algorithm", ALL_PLACERS)
    def test_every_member_gets_a_host_of_its_own(self, algorithm: str) -> None:
        """Three 4-GPU members on hosts that could each take two land on three distinct hosts, with whole GPUs."""
        nodes = [host(f"h{i}", 8) for i in range(4)]
        placements = place_gang(FOUR, 3, nodes, placer=get_placer(algorithm))
        assert placements is not None and len(placements) == 3
        assert len(set(hosts_of(placements))) == 3
        for placement in placements:
            assert nodes[placement.node_index].node_id == placement.node_id
            assert len(placement.gpu_indices) == 4 and placement.gpu_milli == MILLI

    @pytest.mark.parametrize("algorithm", ALL_PLACERS)
    def test_all_or_nothing_and_the_nodes_are_left_as_they_were(self, algorithm: str) -> None:
        """Two hosts fit a 4-GPU member, so a cluster of three gets nothing; a cluster of two gets both; no node changes."""
        nodes = [host("h0", 8), host("h1", 4), host("h2", 3), host("h3", 3)]
        before = snapshot(nodes)
        assert place_gang(FOUR, 3, nodes, placer=get_placer(algorithm)) is None
        placements = place_gang(FOUR, 2, nodes, placer=get_placer(algorithm))
        assert placements is not None and sorted(hosts_of(placements)) == ["h0", "h1"]
        assert snapshot(nodes) == before

    @pytest.mark.parametrize("algorithm", ALL_PLACERS)
    def test_one_region_is_preferred_over_a_cheaper_split(self, algorithm: str) -> None:
        """Two half-full hosts in two regions (the packing placers' favourites) lose to two empty hosts of one region."""
        nodes = [
            host("us-1", 4, region="us"), host("asia-1", 4, region="asia"),
            host("eu-1", 8, region="eu"), host("eu-2", 8, region="eu"),
        ]  # fmt: skip
        placements = place_gang(FOUR, 2, nodes, placer=get_placer(algorithm))
        assert placements is not None and sorted(hosts_of(placements)) == ["eu-1", "eu-2"]

    def test_the_regions_are_split_only_when_no_region_has_room(self) -> None:
        nodes = [host("us-1", 4, region="us"), host("eu-1", 8, region="eu"), host("eu-2", 2, region="eu")]
        placements = place_gang(FOUR, 2, nodes, placer=get_placer("best_fit"))
        assert placements is not None and sorted(hosts_of(placements)) == ["eu-1", "us-1"]

    def test_the_placer_decides_within_the_region(self) -> None:
        """best_fit packs: of three hosts in one region, the two fullest that fit take the members."""
        nodes = [host("a", 8), host("b", 5), host("c", 4), host("d", 6)]
        placements = place_gang(FOUR, 2, nodes, placer=get_placer("best_fit"))
        assert placements is not None and sorted(hosts_of(placements)) == ["b", "c"]


class TestRtt:
    NODES = ("a", "b", "c", "d")

    def nodes(self) -> list[Node]:
        return [host(name, 8) for name in self.NODES]

    @pytest.mark.parametrize("algorithm", ALL_PLACERS)
    def test_the_smallest_worst_rtt_wins(self, algorithm: str) -> None:
        """Of four hosts, the triple c, b, d has the smallest worst RTT (7 ms); a is far from all of them."""
        rtt = table({
            frozenset("ab"): 40, frozenset("ac"): 30, frozenset("ad"): 35,
            frozenset("bc"): 5, frozenset("bd"): 7, frozenset("cd"): 6,
        })  # fmt: skip
        placements = place_gang(FOUR, 3, self.nodes(), placer=get_placer(algorithm), rtt_ms=rtt)
        assert placements is not None and sorted(hosts_of(placements)) == ["b", "c", "d"]

    def test_the_limit_is_hard_and_an_unknown_rtt_never_keeps_it(self) -> None:
        rtt = table({frozenset("ab"): 12, frozenset("bc"): 20, frozenset("ac"): 9})  # d's RTTs are unknown
        placer = get_placer("fgd")
        pair = place_gang(FOUR, 2, self.nodes(), placer=placer, rtt_ms=rtt, max_rtt_ms=10)
        assert pair is not None and sorted(hosts_of(pair)) == ["a", "c"]
        assert place_gang(FOUR, 3, self.nodes(), placer=placer, rtt_ms=rtt, max_rtt_ms=15) is None
        triple = place_gang(FOUR, 3, self.nodes(), placer=placer, rtt_ms=rtt, max_rtt_ms=20)
        assert triple is not None and sorted(hosts_of(triple)) == ["a", "b", "c"]
        assert place_gang(FOUR, 2, self.nodes(), placer=placer, rtt_ms=rtt, max_rtt_ms=8) is None

    def test_a_limit_without_rtts_is_refused(self) -> None:
        with pytest.raises(ValidationFailed, match="max_rtt_ms needs rtt_ms"):
            place_gang(FOUR, 2, self.nodes(), placer=get_placer("fgd"), max_rtt_ms=10)

    @pytest.mark.parametrize("algorithm", ALL_PLACERS)
    def test_of_two_regions_the_one_with_the_closer_hosts_wins(self, algorithm: str) -> None:
        """us's pair is half full (the packing placers' favourite) but 25 ms apart; eu's is 4 ms apart."""
        nodes = [
            host("a", 4, region="us"),
            host("b", 4, region="us"),
            host("c", 8, region="eu"),
            host("d", 8, region="eu"),
        ]
        rtt = table({frozenset("ab"): 25, frozenset("cd"): 4, frozenset("ac"): 90, frozenset("ad"): 90,
                     frozenset("bc"): 90, frozenset("bd"): 90})  # fmt: skip
        placements = place_gang(FOUR, 2, nodes, placer=get_placer(algorithm), rtt_ms=rtt)
        assert placements is not None and sorted(hosts_of(placements)) == ["c", "d"]

    def test_a_region_beats_a_shorter_rtt_across_regions(self) -> None:
        nodes = [host("a", 8, region="eu"), host("b", 8, region="eu"), host("c", 8, region="us")]
        rtt = table({frozenset("ab"): 30, frozenset("ac"): 2, frozenset("bc"): 2})
        placements = place_gang(FOUR, 2, nodes, placer=get_placer("fgd"), rtt_ms=rtt)
        assert placements is not None and sorted(hosts_of(placements)) == ["a", "b"]


class TestModels:
    @pytest.mark.parametrize("algorithm", ALL_PLACERS)
    def test_one_model_unless_mixing_is_allowed(self, algorithm: str) -> None:
        nodes = [host("a", 8, model="A100"), host("h", 8, model="H100"), host("h2", 2, model="H100")]
        placer = get_placer(algorithm)
        assert place_gang(FOUR, 2, nodes, placer=placer) is None
        mixed = place_gang(FOUR, 2, nodes, placer=placer, same_model=False)
        assert mixed is not None and sorted(hosts_of(mixed)) == ["a", "h"]

    def test_only_models_the_request_accepts(self) -> None:
        nodes = [host("a", 8, model="A100"), host("h", 8, model="H100"), host("v", 8, model="V100")]
        request = Request(num_gpu=4, gpu_models=frozenset({"A100", "H100"}))
        mixed = place_gang(request, 2, nodes, placer=get_placer("fgd"), same_model=False)
        assert mixed is not None and sorted(hosts_of(mixed)) == ["a", "h"]

    def test_shares_and_mig_requests_are_refused(self) -> None:
        with pytest.raises(ValidationFailed, match="whole GPUs"):
            place_gang(Request(num_gpu=1, gpu_milli=500), 2, [], placer=get_placer("fgd"))
        with pytest.raises(ValidationFailed, match="at least one node"):
            place_gang(FOUR, 0, [], placer=get_placer("fgd"))


def one_at_a_time(request: Request, count: int, nodes: list[Node], algorithm: str) -> list[str] | None:
    """Members placed one at a time with the plain placer, each on a host not used yet and of the first one's model."""
    chosen: list[str] = []
    member = request
    for _ in range(count):
        free = [node for node in nodes if node.node_id not in chosen]
        placement = get_placer(algorithm).place(member, free)
        if placement is None:
            return None
        chosen.append(placement.node_id)
        member = Request(num_gpu=request.num_gpu, gpu_models=frozenset({free[placement.node_index].model}))
    return chosen


class TestWhereOneAtATimeFails:
    def test_the_first_member_on_the_placers_favourite_model_leaves_no_second(self) -> None:
        """best_fit puts member one on the half-full A100 host; no other A100 host has room, the H100s do."""
        nodes = [host("a", 4, model="A100"), host("a2", 2, model="A100"), host("h1", 8, model="H100"),
                 host("h2", 8, model="H100")]  # fmt: skip
        assert one_at_a_time(FOUR, 2, nodes, "best_fit") is None
        placements = place_gang(FOUR, 2, nodes, placer=get_placer("best_fit"))
        assert placements is not None and sorted(hosts_of(placements)) == ["h1", "h2"]

    def test_one_at_a_time_splits_the_regions_that_gang_placement_keeps_whole(self) -> None:
        """Hosts 4, 4, 3, 3 free in two regions: one at a time, best fit takes the 4-free host of each region."""
        nodes = [host("eu-4", 4, region="eu"), host("eu-3", 3, region="eu"),
                 host("us-4", 4, region="us"), host("us-3", 3, region="us"), host("eu-8", 8, region="eu")]  # fmt: skip
        greedy = one_at_a_time(FOUR, 2, nodes, "best_fit")
        assert greedy is not None and {name.split("-")[0] for name in greedy} == {"eu", "us"}
        placements = place_gang(FOUR, 2, nodes, placer=get_placer("best_fit"))
        assert placements is not None and sorted(hosts_of(placements)) == ["eu-4", "eu-8"]

    def test_the_first_member_far_from_every_other_host_fails_the_rtt_limit(self) -> None:
        """best_fit's favourite host (4 free) is 50 ms from the rest; gang placement takes the two close ones."""
        nodes = [host("x", 4), host("y", 8), host("z", 8)]
        rtt = table({frozenset(("x", "y")): 50, frozenset(("x", "z")): 50, frozenset(("y", "z")): 3})
        first = get_placer("best_fit").place(FOUR, nodes)
        assert first is not None and first.node_id == "x"
        placements = place_gang(FOUR, 2, nodes, placer=get_placer("best_fit"), rtt_ms=rtt, max_rtt_ms=10)
        assert placements is not None and sorted(hosts_of(placements)) == ["y", "z"]


# ---- property: place_gang finds a set exactly when brute force does, and keeps the preference order ----

REGIONS = ("eu", "us", None)
MODELS = ("A100", "H100")


@st.composite
def fleets(
    draw: st.DrawFn,
) -> tuple[list[Node], Request, int, bool, dict[frozenset[str], float], float | None, str]:
    size = draw(st.integers(1, 7))
    nodes = [
        host(f"n{i}", draw(st.integers(0, 4)), gpus=4, model=draw(st.sampled_from(MODELS)),
             region=draw(st.sampled_from(REGIONS)))
        for i in range(size)
    ]  # fmt: skip
    request = Request(num_gpu=draw(st.integers(1, 3)))
    count = draw(st.integers(1, 4))
    pairs = {
        frozenset((a.node_id, b.node_id)): draw(st.sampled_from((1.0, 5.0, 10.0, 20.0, 50.0)))
        for a, b in itertools.combinations(nodes, 2)
        if draw(st.booleans()) or draw(st.booleans())  # a quarter of the pairs unmeasured
    }
    limit = draw(st.sampled_from((None, 5.0, 10.0, 20.0)))
    return nodes, request, count, draw(st.booleans()), pairs, limit, draw(st.sampled_from(ALL_PLACERS))


def worst(names: Sequence[str], pairs: dict[frozenset[str], float]) -> float:
    return max(
        (pairs.get(frozenset(pair), math.inf) for pair in itertools.combinations(names, 2)), default=0.0
    )


def feasible(nodes: Sequence[Node], members: Sequence[Node], request: Request, same_model: bool,
             pairs: dict[frozenset[str], float], limit: float | None) -> bool:  # fmt: skip
    if len({node.node_id for node in members}) != len(members) or not all(
        fits(node, request) for node in members
    ):
        return False
    if same_model and len({node.model for node in members}) > 1:
        return False
    return limit is None or worst([node.node_id for node in members], pairs) <= limit


def one_region(members: Sequence[Node]) -> bool:
    return members[0].region is not None and len({node.region for node in members}) == 1


class TestProperty:
    @settings(max_examples=300, deadline=None)
    @given(fleets(), st.booleans())
    def test_a_set_is_found_whenever_one_exists_and_is_the_most_preferred(
        self,
        fleet: tuple[list[Node], Request, int, bool, dict[frozenset[str], float], float | None, str],
        with_rtt: bool,
    ) -> None:
        nodes, request, count, same_model, pairs, limit, algorithm = fleet
        if not with_rtt:
            pairs, limit = (
                {frozenset(pair): 0.0 for pair in itertools.combinations([n.node_id for n in nodes], 2)},
                None,
            )
        sets = [
            list(c)
            for c in itertools.combinations(nodes, count)
            if feasible(nodes, c, request, same_model, pairs, limit)
        ]
        before = snapshot(nodes)
        placements = place_gang(
            request, count, nodes, placer=get_placer(algorithm, seed=3), same_model=same_model,
            rtt_ms=table(pairs) if with_rtt else None, max_rtt_ms=limit,
        )  # fmt: skip
        assert snapshot(nodes) == before
        if not sets:
            assert placements is None
            return
        assert placements is not None and len(placements) == count
        members = [nodes[placement.node_index] for placement in placements]
        assert [node.node_id for node in members] == hosts_of(placements)
        assert feasible(nodes, members, request, same_model, pairs, limit)
        for placement, node in zip(placements, members, strict=True):
            assert len(placement.gpu_indices) == request.num_gpu
            assert all(node.gpu(index).milli_free == MILLI for index in placement.gpu_indices)
        best_tier = [s for s in sets if one_region(s)] or sets
        assert one_region(members) == one_region(best_tier[0])
        if with_rtt:
            assert worst(hosts_of(placements), pairs) == min(
                worst([n.node_id for n in s], pairs) for s in best_tier
            )


# ---- the simulator's cluster mode (master.scheduler.gang_simulate), on a small synthetic fleet ----


def synthetic_fleet() -> list[Node]:
    """24 hosts of 8 GPUs, half A100 and half H100, all empty (regions are drawn by the simulator)."""
    return [host(f"n{i}", 8, model="A100" if i % 2 else "H100", region=None) for i in range(24)]


SYNTHETIC_PODS = [
    Request(num_gpu=8, cpu_milli=16_000, memory_mib=32_000),
    Request(num_gpu=4, cpu_milli=8_000, memory_mib=16_000),
    Request(num_gpu=1, cpu_milli=4_000, memory_mib=8_000),
    Request(num_gpu=1, gpu_milli=500, cpu_milli=2_000, memory_mib=4_000),
    Request(num_gpu=3, cpu_milli=4_000, memory_mib=8_000),
]


class TestClusterSimulation:
    def test_tasks_of_an_even_number_of_whole_gpus_become_two_node_clusters(self) -> None:
        tasks = with_clusters(SYNTHETIC_PODS, share=1.0, seed=1)
        assert tasks[0] == Cluster(Request(num_gpu=4, cpu_milli=8_000, memory_mib=16_000), 2)
        assert tasks[1] == Cluster(Request(num_gpu=2, cpu_milli=4_000, memory_mib=8_000), 2)
        assert tasks[2:] == SYNTHETIC_PODS[2:]  # one GPU, a share, an odd count: left alone
        assert with_clusters(SYNTHETIC_PODS, share=0.0, seed=1) == SYNTHETIC_PODS
        assert sum(task.gpu_milli_total for task in tasks) == sum(
            pod.gpu_milli_total for pod in SYNTHETIC_PODS
        )

    @pytest.mark.parametrize("algorithm", ["best_fit", "fgd"])
    def test_both_modes_replay_the_same_workload_and_gang_keeps_clusters_in_a_region(
        self, algorithm: str
    ) -> None:
        results = {
            mode: simulate_clusters(
                synthetic_fleet(), SYNTHETIC_PODS, algorithm=algorithm, mode=mode, regions=3, seed=5
            )
            for mode in MODES
        }
        gang, greedy = results["gang"], results["one_at_a_time"]
        assert gang.clusters == greedy.clusters > 0 and gang.tasks == greedy.tasks > 0
        assert gang.clusters_placed > 0 and greedy.clusters_placed > 0
        assert gang.clusters_placed <= gang.clusters and greedy.clusters_placed <= greedy.clusters
        for result in results.values():
            assert 0 < result.allocated_pct <= 100 and result.fragmented_pct >= 0
            assert result.cluster_gpus <= result.allocated_pct * result.gpus / 100 + 1e-6
        # With room in every region early on, gang placement splits no cluster there; one at a time does.
        assert gang.clusters_split < greedy.clusters_split
        assert simulate_clusters(synthetic_fleet(), SYNTHETIC_PODS, algorithm=algorithm, mode="gang", regions=3,
                                 seed=5) == gang  # fmt: skip

    def test_a_rolled_back_cluster_leaves_the_fleet_as_it_was(self) -> None:
        """One free 4-GPU host of each model: node one fits, node two cannot (one model), so node one is released."""
        nodes = [host("a", 4, model="A100"), host("h", 4, model="H100")]
        free_before = [tuple(gpu.milli_free for gpu in node.gpus) for node in nodes]
        signs: list[int] = []
        placed = place_one_at_a_time(
            Cluster(FOUR, 2), Fleet(nodes), get_placer("best_fit"), get_placer("best_fit"),
            lambda placement, sign: signs.append(sign),
        )  # fmt: skip
        assert placed is None and signs == [+1, -1]
        assert [tuple(gpu.milli_free for gpu in node.gpus) for node in nodes] == free_before

    def test_one_at_a_time_puts_each_node_on_a_host_of_its_own(self) -> None:
        """The placer's favourite after node one is the same host (4 GPUs still free): node two goes elsewhere."""
        nodes = [host("a", 8), host("b", 8)]
        placed = place_one_at_a_time(
            Cluster(FOUR, 2), Fleet(nodes), get_placer("best_fit"), get_placer("best_fit"), lambda p, s: None
        )
        assert placed is not None and sorted(hosts_of(placed)) == ["a", "b"]

    def test_bad_arguments_are_refused(self) -> None:
        with pytest.raises(ValidationFailed, match="share"):
            with_clusters(SYNTHETIC_PODS, share=1.5, seed=1)
        with pytest.raises(ValidationFailed, match="regions"):
            simulate_clusters(synthetic_fleet(), SYNTHETIC_PODS, algorithm="fgd", mode="gang", regions=0)
