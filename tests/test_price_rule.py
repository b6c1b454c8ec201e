"""The renter's price first (``master.scheduler.price``): the cheapest feasible band, the placer within it, gangs, and
the tolerance's strict grammar."""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal

import pytest

from master.scheduler import (
    MILLI,
    PLACERS,
    Fleet,
    Gpu,
    LinkStats,
    NetworkLimits,
    Node,
    Placement,
    Request,
    get_placer,
)
from master.scheduler.gang import place_gang
from master.scheduler.price import (
    PriceFirst,
    band_limit,
    effective_tolerance,
    gang_band,
    parse_tolerance,
    prices_by_node,
)
from master.scheduler.price_simulate import TIER_PRICES, host_prices, simulate_prices
from master.scheduler.simulate import simulate
from master.scheduler.trace import TraceNode
from shared.errors import BadRequest

D = Decimal


def host(name: str, free: int, *, gpus: int = 2, model: str = "A100", links: dict[str, LinkStats] | None = None) -> Node:
    """``gpus`` GPUs of which the first ``free`` are idle and the rest fully taken."""
    taken = [Gpu(i, milli_free=MILLI if i < free else 0) for i in range(gpus)]
    return Node(name, model, taken, cpu_milli=64_000, memory_mib=256_000, links=links)


def priced(placer: str, tolerance: Decimal | None, prices: dict[str, Decimal]) -> PriceFirst:
    return PriceFirst(get_placer(placer), tolerance, prices_by_node(prices))


ONE = Request(num_gpu=1)


class Spy:
    """fgd_net, noting the size and capacity figures of each band it is shown."""

    name = "spy"

    def __init__(self) -> None:
        self.seen: list[tuple[int, dict[str, int]]] = []

    def place(self, request: Request, band: Sequence[Node]) -> Placement | None:
        assert isinstance(band, Fleet)
        self.seen.append((len(band), dict(band.capacity_by_model)))
        return get_placer("fgd_net").place(request, band)


class TestBand:
    def test_the_cheapest_is_the_cheapest_that_fits(self) -> None:
        """A full $0.15 host does not count: the cheapest *feasible* offer is the $0.40 one, not the free $0.90 A100."""
        nodes = [host("a100", 4, gpus=4), host("full-3060", 0, model="RTX 3060"), host("4090", 2, model="RTX 4090")]
        prices = {"a100": D("0.90"), "full-3060": D("0.15"), "4090": D("0.40")}
        for algorithm in sorted(PLACERS):
            placement = priced(algorithm, D("0.05"), prices).place(ONE, nodes)
            assert placement is not None and placement.node_id == "4090", algorithm
            assert placement.node_index == 2  # indexes the nodes given, as every placer's placements do

    def test_within_the_tolerance_the_placer_chooses(self) -> None:
        """Two near-equal prices: at 0 % the cheaper (empty) host; at 5 % FGD's choice, the half-used host, which keeps
        the empty one whole — as FGD does with no price rule."""
        nodes = [host("empty", 2), host("busy", 1)]
        prices = {"empty": D("0.40"), "busy": D("0.41")}
        assert get_placer("fgd").place(ONE, nodes).node_id == "busy"  # type: ignore[union-attr]
        cheapest = priced("fgd", D(0), prices).place(ONE, nodes)
        chosen = priced("fgd", D("0.05"), prices).place(ONE, nodes)
        outside = priced("fgd", D("0.02"), prices).place(ONE, nodes)  # 0.41 > 0.40 × 1.02 = 0.408
        assert (cheapest and cheapest.node_id, chosen and chosen.node_id, outside and outside.node_id) == ("empty", "busy", "empty")

    def test_no_tolerance_is_the_plain_placer(self) -> None:
        nodes = [host("empty", 2), host("busy", 1), host("dear", 2)]
        prices = {"empty": D("0.10"), "busy": D("5"), "dear": D("9")}
        for algorithm in ("first_fit", "best_fit", "fgd", "fgd_net"):
            assert priced(algorithm, None, prices).place(ONE, nodes) == get_placer(algorithm).place(ONE, nodes)

    def test_a_huge_tolerance_places_as_the_plain_placer(self) -> None:
        nodes = [host(f"h{i}", i % 3, gpus=2) for i in range(9)]
        prices = {f"h{i}": D(i + 1) / 10 for i in range(9)}
        for request in (ONE, Request(num_gpu=2), Request(num_gpu=1, gpu_milli=300)):
            plain = get_placer("fgd").place(request, nodes)
            assert priced("fgd", D(10), prices).place(request, nodes) == plain

    def test_the_band_is_exact_decimal_and_inclusive(self) -> None:
        """0.35 × 1.2 = 0.42 exactly: a 0.42 host is in the band (a binary float would make it 0.42 or a hair off)."""
        assert band_limit(D("0.35"), D("0.2")) == D("0.42")
        nodes = [host("cheap", 2), host("edge", 1), host("over", 1)]
        prices = {"cheap": D("0.35"), "edge": D("0.42"), "over": D("0.420001")}
        placement = priced("fgd", D("0.2"), prices).place(ONE, nodes)
        assert placement is not None and placement.node_id == "edge"

    def test_network_limits_count_before_the_price(self) -> None:
        """The cheapest host outside the renter's latency limit is no offer that meets the constraints."""
        far, near = {"eu": LinkStats(latency_ms=300)}, {"eu": LinkStats(latency_ms=10)}
        nodes = [host("far", 2, links=far), host("near", 2, links=near), host("dear", 2, links=near)]
        prices = {"far": D("0.10"), "near": D("0.50"), "dear": D("0.90")}
        request = Request(num_gpu=1, network=NetworkLimits(region="eu", max_latency_ms=50))
        placement = priced("fgd_net", D("0.05"), prices).place(request, nodes)
        assert placement is not None and placement.node_id == "near"

    def test_host_memory_counts_before_the_price(self) -> None:
        short = Node("short", "A100", 2, cpu_milli=64_000, memory_mib=1_000)
        nodes = [short, host("roomy", 2)]
        placement = priced("first_fit", D(0), {"short": D("0.1"), "roomy": D("0.2")}).place(Request(num_gpu=1, memory_mib=8_000), nodes)
        assert placement is not None and placement.node_id == "roomy"

    def test_nothing_feasible_is_none(self) -> None:
        nodes = [host("a", 0), host("b", 1)]
        assert priced("fgd", D("0.05"), {"a": D("0.1"), "b": D("0.2")}).place(Request(num_gpu=2), nodes) is None

    def test_a_placer_stricter_than_fits_gets_the_next_band(self) -> None:
        """Should the placer find nothing in the cheapest band, the next band up is tried, never a refusal the plain
        placer would not give."""

        class Picky:
            name = "picky"

            def place(self, request: Request, nodes: Sequence[Node]) -> Placement | None:
                return get_placer("first_fit").place(request, [n if n.node_id != "cheap" else host("x", 0) for n in nodes])

        nodes = [host("cheap", 2), host("mid", 2), host("dear", 2)]
        rule = PriceFirst(Picky(), D(0), prices_by_node({"cheap": D("0.1"), "mid": D("0.2"), "dear": D("0.3")}))
        placement = rule.place(ONE, nodes)
        assert placement is not None and placement.node_id == "mid" and placement.node_index == 1

    def test_the_band_sees_the_whole_fleets_capacity(self) -> None:
        """fgd_net's model pressure is the fleet's, not the band's: the band keeps the capacity figures of the nodes
        given (a Fleet's, or a plain list's as the placer would see it)."""
        for nodes in ([host("t4", 2, model="T4"), host("a100", 2), host("dear", 2)],
                      Fleet([host("t4", 2, model="T4"), host("a100", 2), host("dear", 2)])):  # fmt: skip
            spy = Spy()
            rule = PriceFirst(spy, D("0.6"), prices_by_node({"t4": D("0.2"), "a100": D("0.3"), "dear": D("0.9")}))
            assert rule.place(ONE, nodes) is not None
            assert spy.seen == [(2, {"T4": 2 * MILLI, "A100": 4 * MILLI})]

    def test_placements_index_the_nodes_given(self) -> None:
        fleet = Fleet([host("dear", 2), host("cheap", 2)])
        placement = priced("fgd", D(0), {"dear": D("0.9"), "cheap": D("0.1")}).place(ONE, fleet)
        assert placement is not None and placement.node_index == 1
        fleet.apply(placement)
        assert fleet[1].free_desc == (MILLI, 0)


class TestGang:
    def test_the_cheapest_set_by_its_dearest_member(self) -> None:
        """Three members: the set whose dearest host is cheapest, then the placer within the tolerance."""
        nodes = [host(name, 2) for name in ("a", "b", "c", "d", "e")]
        prices = [D("0.10"), D("0.90"), D("0.20"), D("0.30"), D("0.31")]
        request = Request(num_gpu=2)

        def solve(band: Sequence[Node]) -> list[Placement] | None:
            return place_gang(request, 3, list(band), placer=get_placer("fgd"))

        found = gang_band(nodes, prices, D(0), solve)
        assert found is not None
        assert sorted(p.node_id for p in found[1]) == ["a", "c", "d"]
        wide = gang_band(nodes, prices, D("0.05"), solve)  # 0.31 ≤ 0.30 × 1.05: e is in the band too
        assert wide is not None and sorted(wide[0]) == [0, 2, 3, 4]
        assert gang_band(nodes, prices, None, solve) is not None
        assert gang_band(nodes[:2], prices[:2], D(0), solve) is None


class TestEffectiveTolerance:
    def test_who_decides(self) -> None:
        default = D("0.05")
        assert effective_tolerance(None, default, names_model=False, names_offer=False) == default
        assert effective_tolerance(None, default, names_model=True, names_offer=False) is None  # a model: as before
        assert effective_tolerance(D("0.2"), default, names_model=True, names_offer=False) == D("0.2")  # asked: kept
        assert effective_tolerance(D("0.2"), default, names_model=False, names_offer=True) is None  # an offer is one node


class TestGrammar:
    @pytest.mark.parametrize(("value", "expected"), [
        ("0.05", D("0.05")), (".5", D("0.5")), ("0", D(0)), ("10", D(10)), ("10.0000", D(10)), (0, D(0)), (1, D(1)),
        (0.05, D("0.05")), (0.1, D("0.1")), (2.5, D("2.5")), (D("0.25"), D("0.25")),
    ])  # fmt: skip
    def test_good_values(self, value: object, expected: Decimal) -> None:
        assert parse_tolerance(value) == expected

    @pytest.mark.parametrize("value", [
        "-0.05", -1, "10.0001", 11, 1e400, float("nan"), float("inf"), "NaN", "nan", "Infinity", "1e-2", 1e-05, "0.00001",
        "0.05\n", " 0.05", "0.05\x00", "0,05", "٠.٥", "０.５", "", ".", "0..1", "+0.1", "0x1", True, False, [], {}, "9" * 40,
        10**100, D("NaN"), D("-0.1"), D("1E+400"),
    ])  # fmt: skip
    def test_bad_values_are_400(self, value: object) -> None:
        with pytest.raises(BadRequest) as caught:
            parse_tolerance(value)
        assert caught.value.code == "invalid_price_tolerance" and caught.value.http_status == 400
        assert "from 0 to 10" in caught.value.message


class TestOnTheTrace:
    """``price_simulate``: the FGD protocol with a price per host (a small synthetic fleet, seeded)."""

    NODES = [TraceNode(f"n{i}", 32_000, 128_000, 4, model) for i, model in enumerate(["T4", "V100M32", "P100", "G3"] * 6)]
    PODS = [Request(num_gpu=1, cpu_milli=4_000), Request(num_gpu=2, cpu_milli=8_000), Request(num_gpu=1, gpu_milli=500),
            Request(num_gpu=4, cpu_milli=8_000), Request(num_gpu=1, gpu_models=frozenset({"G3"}))]  # fmt: skip

    def test_prices_are_seeded_per_host_around_the_tier(self) -> None:
        prices = host_prices(self.NODES, seed=7)
        assert prices == host_prices(self.NODES, seed=7) and prices != host_prices(self.NODES, seed=8)
        for node, price in zip(self.NODES, prices, strict=True):
            base = TIER_PRICES[node.model]
            assert base * D("0.9") <= price <= base * D("1.1") and price == price.quantize(D("0.0001"))

    def test_the_plain_run_is_the_simulator(self) -> None:
        plain = simulate_prices(self.NODES, self.PODS, algorithm="fgd", tolerance=None, seed=3, stop_at_pct=100)
        reference = simulate(self.NODES, self.PODS, algorithm="fgd", seed=3, stop_at_pct=100)
        assert [p.allocated_pct for p in plain.curve] == [p.allocated_pct for p in reference.curve]
        assert plain.ruled == 0

    def test_the_rule_pays_less_while_there_is_room(self) -> None:
        plain = simulate_prices(self.NODES, self.PODS, algorithm="fgd_net", tolerance=None, seed=3, stop_at_pct=100)
        ruled = simulate_prices(self.NODES, self.PODS, algorithm="fgd_net", tolerance=D("0.05"), seed=3, stop_at_pct=100)
        again = simulate_prices(self.NODES, self.PODS, algorithm="fgd_net", tolerance=D("0.05"), seed=3, stop_at_pct=100)
        assert ruled.to_json() == again.to_json()  # deterministic
        assert ruled.ruled > 0 and ruled.ruled < ruled.pods  # the G3-only pods name a model: the plain placer
        half_plain, half_ruled = plain.at(40), ruled.at(40)
        assert half_plain is not None and half_ruled is not None
        assert half_ruled.mean_price < half_plain.mean_price
        cheapest = min(TIER_PRICES[m] for m in ("T4", "V100M32", "P100", "G3"))
        assert half_ruled.mean_price < float(cheapest) * 1.6
