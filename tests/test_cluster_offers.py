"""Cluster offers (``GET /api/v1/offers/clusters``): which groups of hosts could hold a cluster now, at what price.

The grouping is a pure function (``master.services.market.cluster_offers.group_cluster_offers``), checked here against
brute force over small random offer sets; the route is driven on SQLite and PostgreSQL (the ``api`` fixture) with
hosts of given models, regions, reliabilities and listed prices.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from master.scheduler import Node, Request, fits, get_placer
from master.scheduler.gang import place_gang
from master.services import host_links
from master.services.market.cluster_offers import (
    HostOffer,
    find_cluster_offers,
    group_cluster_offers,
    most_nodes,
)
from master.services.market.listings import money
from master.services.market.offers import OfferSearch, Sort, search_offer_prices, search_offers
from master.services.market.query import parse
from tests.apiclient import A100, RTX, Api, assert_error
from tests.test_gang import host as gang_host
from tests.test_rentals_market import set_host

# ---- the pure grouping ---------------------------------------------------------------------------


def offer(host: str, price: str, *, model: str = "X", region: str | None = "eu", reliability: float | None = None) -> HostOffer:
    return HostOffer(host, model, region, Decimal(price), reliability)


class TestGrouping:
    def test_one_group_per_model_and_region_with_enough_hosts_cheapest_first(self) -> None:
        """Two hosts of X in eu and two in us, one of Y in each: a group per region of X, one across regions of Y,
        cheapest first."""
        offers = [
            offer("a", "0.40"), offer("b", "0.50"), offer("c", "0.30", region="us"), offer("d", "0.35", region="us"),
            offer("e", "1.00", model="Y"), offer("f", "1.00", model="Y", region="us"),
        ]  # fmt: skip
        items = group_cluster_offers(offers, nodes=2, gpus_per_node=1, allow_mixed=False)
        assert [(i.gpu_name, i.region, i.hosts_available, i.price_per_hour) for i in items] == [
            ("X", "us", 2, Decimal("0.65")), ("X", "eu", 2, Decimal("0.90")), ("Y", None, 2, Decimal("2.00")),
        ]  # fmt: skip
        assert [h.host_id for h in items[0].hosts] == ["c", "d"]

    def test_across_regions_only_for_a_model_no_region_of_which_has_room(self) -> None:
        """X has a region with room: no cross-region group of X; Y has none: one across its regions, its region-less
        host included (a host of unknown region is in no region, but in the cross-region group)."""
        offers = [
            offer("a", "0.40"), offer("b", "0.50"), offer("c", "0.30", region="us"),
            offer("e", "1.00", model="Y"), offer("f", "1.10", model="Y", region="us"), offer("g", "0.90", model="Y", region=None),
        ]  # fmt: skip
        items = group_cluster_offers(offers, nodes=2, gpus_per_node=1, allow_mixed=False)
        assert [(i.gpu_name, i.region, i.regions, i.hosts_available) for i in items] == [
            ("X", "eu", ("eu",), 2), ("Y", None, ("eu", "us"), 3),
        ]  # fmt: skip
        assert items[1].price_per_hour == Decimal("1.90") and items[1].price_per_hour_max == Decimal("2.10")

    def test_mixed_models_group_per_region_then_across_all(self) -> None:
        """With models mixed a host counts once, at its cheapest offer for the cheapest set and its dearest for the
        dearest; across regions only when no region has room."""
        offers = [
            offer("a", "0.40"), offer("a", "0.90", model="Y"), offer("b", "0.50", model="Y"), offer("c", "0.30", region="us"),
        ]  # fmt: skip
        [eu] = group_cluster_offers(offers, nodes=2, gpus_per_node=2, allow_mixed=True)
        assert (eu.gpu_name, eu.region, eu.hosts_available) == (None, "eu", 2)
        assert (eu.price_per_hour, eu.price_per_hour_max) == (Decimal("1.80"), Decimal("2.80"))  # (0.40+0.50)×2, (0.90+0.50)×2
        assert [(h.host_id, h.gpu_name) for h in eu.hosts] == [("a", "X"), ("b", "Y")]
        [everywhere] = group_cluster_offers(offers, nodes=3, gpus_per_node=1, allow_mixed=True)
        assert (everywhere.region, everywhere.regions, everywhere.price_per_hour) == (None, ("eu", "us"), Decimal("1.20"))

    def test_equal_prices_prefer_the_more_reliable_host(self) -> None:
        offers = [offer("a", "0.40", reliability=0.9), offer("b", "0.40", reliability=None), offer("c", "0.40", reliability=0.99)]
        [item] = group_cluster_offers(offers, nodes=2, gpus_per_node=1, allow_mixed=False)
        assert [h.host_id for h in item.hosts] == ["c", "a"]

    def test_too_few_hosts_is_no_group_and_most_nodes_says_how_many(self) -> None:
        offers = [offer("a", "0.40"), offer("b", "0.50", region="us"), offer("c", "0.50", model="Y")]
        assert group_cluster_offers(offers, nodes=3, gpus_per_node=1, allow_mixed=False) == []
        assert most_nodes(offers, allow_mixed=False) == 2
        assert most_nodes(offers, allow_mixed=True) == 3
        assert most_nodes([], allow_mixed=True) == 0


MODELS = ("X", "Y")
REGIONS = ("eu", "us", None)
PRICES = [Decimal(n) / 100 for n in range(1, 60, 7)]


@st.composite
def offer_sets(draw: st.DrawFn) -> list[HostOffer]:
    """Up to 7 hosts, each in one region (or none) with an offer of one or both models at small prices."""
    offers = []
    for index in range(draw(st.integers(0, 7))):
        region = draw(st.sampled_from(REGIONS))
        for model in draw(st.sets(st.sampled_from(MODELS), min_size=1)):
            offers.append(HostOffer(f"h{index}", model, region, draw(st.sampled_from(PRICES))))
    return offers


class TestProperty:
    @settings(max_examples=400, deadline=None)
    @given(offer_sets(), st.integers(1, 4), st.integers(1, 3), st.booleans())
    def test_groups_and_prices_match_brute_force(self, offers: list[HostOffer], nodes: int, gpus: int, mixed: bool) -> None:
        """Each group is what gang placement could pick from (regions first, per model unless mixed), and its prices are
        the least and the most that any ``nodes`` distinct hosts of it cost, found by trying every set."""
        items = group_cluster_offers(offers, nodes=nodes, gpus_per_node=gpus, allow_mixed=mixed)
        expected: set[tuple[str | None, str | None]] = set()
        for model in {None if mixed else o.gpu_name for o in offers}:
            mine = [o for o in offers if mixed or o.gpu_name == model]
            rooms = {r for r in REGIONS if r is not None and len({o.host_id for o in mine if o.region == r}) >= nodes}
            expected |= {(model, r) for r in rooms}
            if not rooms and len({o.host_id for o in mine}) >= nodes:
                expected.add((model, None))
        assert {(i.gpu_name, i.region) for i in items} == expected
        assert [i.price_per_hour for i in items] == sorted(i.price_per_hour for i in items)
        for item in items:
            group = [o for o in offers if (mixed or o.gpu_name == item.gpu_name) and (item.region is None or o.region == item.region)]
            hosts = sorted({o.host_id for o in group})
            low = {h: min(o.price_per_gpu_hour for o in group if o.host_id == h) for h in hosts}
            high = {h: max(o.price_per_gpu_hour for o in group if o.host_id == h) for h in hosts}
            sets = list(itertools.combinations(hosts, nodes))
            assert item.hosts_available == len(hosts)
            assert item.price_per_hour == min(sum(low[h] for h in s) for s in sets) * gpus
            assert item.price_per_hour_max == max(sum(high[h] for h in s) for s in sets) * gpus
            assert len({h.host_id for h in item.hosts}) == nodes
            assert sum(h.price_per_gpu_hour for h in item.hosts) * gpus == item.price_per_hour
            assert (item.price_per_gpu_hour_min, item.price_per_gpu_hour_max) == (min(low.values()), max(high.values()))


class TestNetworkBounds:
    """With a cluster's network bounds, hosts measured apart are never in one set (``apart``), as in placement."""

    def test_the_cheapest_and_the_dearest_sets_skip_a_host_measured_apart(self) -> None:
        """a < b < c < d in price, a and b measured apart: the cheapest pair is a+c, the dearest d+c; and with a apart
        from every other host, b+c and d+c."""
        offers = [offer("a", "0.10"), offer("b", "0.20"), offer("c", "0.30"), offer("d", "0.40")]
        (item,) = group_cluster_offers(offers, nodes=2, gpus_per_node=1, allow_mixed=False, apart=apart_pairs(("a", "b")))
        assert ([h.host_id for h in item.hosts], item.price_per_hour, item.price_per_hour_max) == (["a", "c"], Decimal("0.40"), Decimal("0.70"))
        assert item.hosts_available == 4  # each host has room: the bounds choose among them
        (item,) = group_cluster_offers(offers, nodes=2, gpus_per_node=1, allow_mixed=False,
                                       apart=apart_pairs(("a", "b"), ("a", "c"), ("a", "d")))  # fmt: skip
        assert [h.host_id for h in item.hosts] == ["b", "c"]

    def test_a_region_with_no_set_within_the_bounds_gives_way_to_one_across_regions(self) -> None:
        """eu's two hosts are apart: eu has no room for 2 nodes, so the model's cross-region group is shown (placement
        spans regions only then), its set the cheapest that keeps the bounds; most_nodes counts what can be together."""
        offers = [offer("a", "0.10"), offer("b", "0.20"), offer("c", "0.50", region="us")]
        apart = apart_pairs(("a", "b"))
        assert [(i.region, [h.host_id for h in i.hosts]) for i in group_cluster_offers(offers, nodes=2, gpus_per_node=1,
                allow_mixed=False, apart=apart)] == [(None, ["a", "c"])]  # fmt: skip
        assert group_cluster_offers(offers, nodes=3, gpus_per_node=1, allow_mixed=False, apart=apart) == []
        assert (most_nodes(offers, allow_mixed=False), most_nodes(offers, allow_mixed=False, apart=apart)) == (3, 2)

    @settings(max_examples=300, deadline=None)
    @given(offer_sets(), st.integers(2, 4), st.booleans(), st.data())
    def test_no_set_holds_two_hosts_measured_apart_and_without_any_nothing_changes(
        self, offers: list[HostOffer], nodes: int, mixed: bool, data: st.DataObject
    ) -> None:
        hosts = sorted({o.host_id for o in offers})
        pairs = list(itertools.combinations(hosts, 2))
        measured_apart = data.draw(st.sets(st.sampled_from(pairs)) if pairs else st.just(set()))
        apart = apart_pairs(*measured_apart)
        items = group_cluster_offers(offers, nodes=nodes, gpus_per_node=1, allow_mixed=mixed, apart=apart)
        for item in items:
            assert not any(apart(x.host_id, y.host_id) for x, y in itertools.combinations(item.hosts, 2))
            assert len(item.hosts) == nodes
        plain = group_cluster_offers(offers, nodes=nodes, gpus_per_node=1, allow_mixed=mixed)
        assert group_cluster_offers(offers, nodes=nodes, gpus_per_node=1, allow_mixed=mixed, apart=apart_pairs()) == plain


def apart_pairs(*pairs: tuple[str, str]) -> Callable[[str, str], bool]:
    keys = {frozenset(p) for p in pairs}
    return lambda a, b: frozenset((a, b)) in keys


@st.composite
def gang_fleets(draw: st.DrawFn) -> tuple[list[Node], dict[str, Decimal], int, int, bool]:
    """Scheduler nodes of one model each (as ``tests/test_gang.py`` draws them), a price per host, nodes, GPUs per node, mixing."""
    nodes = [
        gang_host(f"n{i}", draw(st.integers(0, 4)), gpus=4, model=draw(st.sampled_from(MODELS)), region=draw(st.sampled_from(REGIONS)))
        for i in range(draw(st.integers(1, 7)))
    ]  # fmt: skip
    prices = {node.node_id: draw(st.sampled_from(PRICES)) for node in nodes}
    return nodes, prices, draw(st.integers(2, 4)), draw(st.integers(1, 3)), draw(st.booleans())


class TestAgreesWithGangPlacement:
    @settings(max_examples=300, deadline=None)
    @given(gang_fleets())
    def test_placement_lands_in_a_group_and_within_the_range_the_console_shows(
        self, fleet: tuple[list[Node], dict[str, Decimal], int, int, bool]
    ) -> None:
        """``place_gang`` (no RTTs) finds a set exactly when there are groups; its hosts are all in one group, whose region
        is theirs when they share one (else it spans regions), and what they cost lies between that group's cheapest and
        dearest set and so within the range the console shows (groups in one region first)."""
        nodes, prices, count, gpus, mixed = fleet
        request = Request(num_gpu=gpus)
        offers = [HostOffer(n.node_id, n.model, n.region, prices[n.node_id]) for n in nodes if fits(n, request)]
        items = group_cluster_offers(offers, nodes=count, gpus_per_node=gpus, allow_mixed=mixed)
        placements = place_gang(request, count, nodes, placer=get_placer("best_fit"), same_model=not mixed)
        if placements is None:
            assert items == []
            return
        members = [nodes[p.node_index] for p in placements]
        regions = {m.region for m in members}
        region = regions.pop() if len(regions) == 1 else None
        [item] = [i for i in items if i.gpu_name == (None if mixed else members[0].model) and i.region == region]
        cost = sum(prices[m.node_id] for m in members) * gpus
        assert item.price_per_hour <= cost <= item.price_per_hour_max
        shown = [i for i in items if i.region is not None] or items
        assert min(i.price_per_hour for i in shown) <= cost <= max(i.price_per_hour_max for i in shown)


# ---- the route -----------------------------------------------------------------------------------


async def offer_host(
    api: Api, price: str, *, gpus: int = 1, model: str = RTX, region: str | None = "eu-west", reliability: float | None = None
) -> str:
    """An online host of ``gpus`` GPUs of ``model`` in ``region``, listed at ``price`` per GPU-hour."""
    host_id, _ = await api.host(gpus, name=model)
    await set_host(api, host_id, region=region, reliability=reliability)
    status, body = await api.as_provider("PUT", f"/hosts/{host_id}/listing", json={"price_per_gpu_hour": price})
    assert status == 201, body
    return host_id


async def cluster_offers(api: Api, **params: Any) -> dict[str, Any]:
    status, body = await api.as_renter("GET", "/offers/clusters", params={k: str(v) for k, v in params.items()})
    assert status == 200, body
    return dict(body)


def summary(body: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(i["gpu_name"], i["region"], i["hosts_available"], i["price_per_hour"], i["price_per_hour_max"]) for i in body["items"]]


class TestRoute:
    async def test_one_item_per_model_and_region_with_the_cheapest_set(self, api: Api) -> None:
        """Three RTX hosts in eu-west, two in us-east, two A100 in eu-west and one in us-east: for 2 nodes, one item per
        model and region with two hosts or more, cheapest first, with the cheapest set's hosts."""
        eu = [await offer_host(api, p, reliability=0.99) for p in ("0.40", "0.50", "0.60")]
        us = [await offer_host(api, p, region="us-east") for p in ("0.30", "0.35")]
        for price in ("1.00", "1.20"):
            await offer_host(api, price, model=A100)
        await offer_host(api, "0.90", model=A100, region="us-east")
        body = await cluster_offers(api, nodes=2)
        assert summary(body) == [
            (RTX, "us-east", 2, "0.650000", "0.650000"),
            (RTX, "eu-west", 3, "0.900000", "1.100000"),
            (A100, "eu-west", 2, "2.200000", "2.200000"),
        ]
        first, second, _ = body["items"]
        assert [h["host_id"] for h in first["hosts"]] == us
        assert second["hosts"] == [
            {"host_id": eu[0], "gpu_name": RTX, "price_per_gpu_hour": "0.400000", "region": "eu-west", "reliability": 0.99},
            {"host_id": eu[1], "gpu_name": RTX, "price_per_gpu_hour": "0.500000", "region": "eu-west", "reliability": 0.99},
        ]
        assert (second["regions"], second["price_per_gpu_hour_min"], second["price_per_gpu_hour_max"]) == (["eu-west"], "0.400000", "0.600000")
        assert (body["total"], body["nodes"], body["gpus_per_node"], body["allow_mixed"]) == (3, 2, 1, False)
        assert (body["query"], body["max_nodes"], body["offers_considered"], body["truncated"]) == ("num_gpus>=1", 5, 8, False)

    async def test_a_cross_region_item_only_when_no_region_of_the_model_suffices(self, api: Api) -> None:
        """For 3 nodes: RTX has three in eu-west (no cross-region item); A100 has two in eu-west, one in us-east and one of
        no region: one item across regions, with every host of the model."""
        for price in ("0.40", "0.50", "0.60"):
            await offer_host(api, price)
        await offer_host(api, "0.30", region="us-east")
        for price, region in (("1.00", "eu-west"), ("1.20", "eu-west"), ("0.90", "us-east"), ("2.00", None)):
            await offer_host(api, price, model=A100, region=region)
        body = await cluster_offers(api, nodes=3)
        assert summary(body) == [(RTX, "eu-west", 3, "1.500000", "1.500000"), (A100, None, 4, "3.100000", "4.200000")]
        assert body["items"][1]["regions"] == ["eu-west", "us-east"]
        assert {h["region"] for h in body["items"][1]["hosts"]} == {"eu-west", "us-east"}
        # Four nodes: no region of either model has room; each spans its regions.
        body = await cluster_offers(api, nodes=4)
        assert summary(body) == [(RTX, None, 4, "1.800000", "1.800000"), (A100, None, 4, "5.100000", "5.100000")]
        assert (await cluster_offers(api, nodes=5))["items"] == []

    async def test_allow_mixed_groups_every_model_per_region_then_across_all(self, api: Api) -> None:
        """Models mixed: eu-west's RTX and A100 hosts make one group; across regions only when no region has room."""
        for price in ("0.40", "0.50"):
            await offer_host(api, price)
        await offer_host(api, "1.00", model=A100)
        await offer_host(api, "0.30", region="us-east")
        body = await cluster_offers(api, nodes=3, allow_mixed="true")
        assert summary(body) == [(None, "eu-west", 3, "1.900000", "1.900000")]
        assert {h["gpu_name"] for h in body["items"][0]["hosts"]} == {RTX, A100}
        body = await cluster_offers(api, nodes=4, allow_mixed="true")
        assert summary(body) == [(None, None, 4, "2.200000", "2.200000")]
        assert (body["allow_mixed"], body["max_nodes"]) == (True, 4)
        # Not mixed, three nodes: only the RTX hosts, across regions; four is more than any model has.
        body = await cluster_offers(api, nodes=3, allow_mixed="false")
        assert (summary(body), body["max_nodes"]) == ([(RTX, None, 3, "1.200000", "1.200000")], 3)
        assert (await cluster_offers(api, nodes=4))["items"] == []

    async def test_hosts_with_too_few_free_gpus_and_busy_gpus_are_left_out(self, api: Api) -> None:
        """Two GPUs per node: the one-GPU host is no candidate, nor a two-GPU host once a rental holds one of its GPUs."""
        pairs = [await offer_host(api, p, gpus=2) for p in ("0.40", "0.50", "0.45")]
        await offer_host(api, "0.10", gpus=1)
        body = await cluster_offers(api, nodes=3, gpus_per_node=2)
        assert summary(body) == [(RTX, "eu-west", 3, "2.700000", "2.700000")]  # (0.40 + 0.45 + 0.50) × 2
        assert body["query"] == "num_gpus>=2"
        status, rental = await api.as_renter("POST", "/rentals", json={"offer_id": f"{pairs[2]}:{RTX}", "gpu_count": 1})
        assert status == 201, rental
        body = await cluster_offers(api, nodes=3, gpus_per_node=2)
        assert (body["items"], body["max_nodes"]) == ([], 2)
        body = await cluster_offers(api, nodes=2, gpus_per_node=2)
        assert summary(body) == [(RTX, "eu-west", 2, "1.800000", "1.800000")]

    async def test_the_query_language_and_filter_parameters_narrow_the_hosts(self, api: Api) -> None:
        """q and the /offers filter parameters apply to every host, ANDed, and the answer echoes them."""
        for price, reliability in (("0.40", 0.99), ("0.50", 0.90), ("0.60", 0.99), ("0.70", 0.99)):
            await offer_host(api, price, reliability=reliability)
        body = await cluster_offers(api, nodes=2, q="price<=0.6")
        assert summary(body) == [(RTX, "eu-west", 3, "0.900000", "1.100000")]
        assert body["query"] == "price<=0.6 num_gpus>=1"
        body = await cluster_offers(api, nodes=2, q="reliability>=0.95", max_price="0.65")
        assert summary(body) == [(RTX, "eu-west", 2, "1.000000", "1.000000")]
        assert body["query"] == "reliability>=0.95 price<=0.65 num_gpus>=1"
        body = await cluster_offers(api, nodes=2, gpu_model="A100")
        assert body["items"] == [] and body["query"] == "gpu_name=A100 num_gpus>=1"
        body = await cluster_offers(api, nodes=2, region="us-east")
        assert body["items"] == []

    async def test_totals_are_exact_decimals(self, api: Api) -> None:
        """Six-decimal prices summed and multiplied by the GPUs per node without rounding: 3 × (0.100001 + 0.200002)."""
        for price in ("0.100001", "0.200002", "1.999999"):
            await offer_host(api, price, gpus=3)
        [item] = (await cluster_offers(api, nodes=2, gpus_per_node=3))["items"]
        assert Decimal(item["price_per_hour"]) == 3 * (Decimal("0.100001") + Decimal("0.200002"))
        assert Decimal(item["price_per_hour_max"]) == 3 * (Decimal("1.999999") + Decimal("0.200002"))
        assert (item["price_per_hour"], item["price_per_hour_max"]) == ("0.900009", "6.600003")

    async def test_paging(self, api: Api) -> None:
        """limit and offset page the items in price order; total counts them all."""
        for region, price in (("a", "0.10"), ("b", "0.20"), ("c", "0.30")):
            for _ in range(2):
                await offer_host(api, price, region=region)
        body = await cluster_offers(api, nodes=2, limit=1, offset=1)
        assert ([i["region"] for i in body["items"]], body["total"], body["limit"], body["offset"]) == (["b"], 3, 1, 1)
        body = await cluster_offers(api, nodes=2, offset=5)
        assert (body["items"], body["total"]) == ([], 3)

    @pytest.mark.parametrize(
        ("query", "code", "words"),
        [
            ("", "invalid_query", "'nodes' is required"),
            ("?nodes=", "invalid_query", "'nodes' is required"),
            ("?nodes=1", "invalid_query", "between 2 and 64"),
            ("?nodes=65", "invalid_query", "between 2 and 64"),
            ("?nodes=two", "invalid_query", "must be an integer"),
            ("?nodes=2&gpus_per_node=0", "invalid_query", "between 1 and 64"),
            ("?nodes=2&allow_mixed=yes", "invalid_query", "one of true, false"),
            ("?nodes=2&q=price<<1", "invalid_query", "price"),
            ("?nodes=2&max_price=cheap", "invalid_query", "max_price"),
            ("?nodes=2&num_gpus=2", "unknown_parameter", "'num_gpus'"),
        ],
    )
    async def test_bad_parameters_are_400_saying_which(self, api: Api, query: str, code: str, words: str) -> None:
        status, body = await api.as_renter("GET", f"/offers/clusters{query}")
        assert_error(status, body, 400, code)
        assert words in body["message"], body

    async def test_providers_and_admins_may_look_too(self, api: Api) -> None:
        """As GET /offers: the marketplace is public to every signed-in account."""
        await offer_host(api, "0.40")
        status, body = await api.as_provider("GET", "/offers/clusters", params={"nodes": "2"})
        assert (status, body["items"]) == (200, [])


class TestRouteNetworkBounds:
    async def test_hosts_measured_outside_the_bounds_are_not_in_one_set(self, api: Api) -> None:
        """Three RTX hosts in eu-west; the two cheapest were measured 9 ms apart (a cluster's private network), the third
        never with them. Without bounds the cheapest set is those two; within 5 ms it is the cheapest and the third, and
        the answer says which bounds it applied. Measured within 10 ms, they are together again."""
        hosts = [await offer_host(api, p) for p in ("0.40", "0.50", "0.60")]
        async with api.master.db.session() as session:
            await host_links.record(session, {host_links.pair(hosts[0], hosts[1]): host_links.Figures(rtt_ms=9.0)},
                                    cluster_id=None, at=api.master.clock.now())  # fmt: skip
        plain = await cluster_offers(api, nodes=2)
        assert ([h["host_id"] for h in plain["items"][0]["hosts"]], plain["network"]) == (hosts[:2], None)
        bounded = await cluster_offers(api, nodes=2, max_latency_ms=5, max_loss_pct=1)
        assert [h["host_id"] for h in bounded["items"][0]["hosts"]] == [hosts[0], hosts[2]]
        assert (bounded["items"][0]["price_per_hour"], bounded["network"]) == ("1.000000", {"max_latency_ms": 5.0, "max_loss_pct": 1.0})
        assert (bounded["max_nodes"], (await cluster_offers(api, nodes=3, max_latency_ms=5))["items"]) == (2, [])
        loose = await cluster_offers(api, nodes=2, max_latency_ms=10)
        assert [h["host_id"] for h in loose["items"][0]["hosts"]] == hosts[:2]

    @pytest.mark.parametrize(
        ("query", "words"),
        [
            ("max_latency_ms=0", "'max_latency_ms' must be above 0 and at most 10000"),
            ("max_latency_ms=10001", "at most 10000"),
            ("max_latency_ms=fast", "'max_latency_ms' must be a number"),
            ("max_latency_ms=nan", "must be a number"),
            ("min_mbit_s=inf", "must be a number"),
            ("max_loss_pct=-1", "'max_loss_pct' must be at least 0 and at most 100"),
        ],
    )
    async def test_bad_bounds_are_400_saying_which(self, api: Api, query: str, words: str) -> None:
        status, body = await api.as_renter("GET", f"/offers/clusters?nodes=2&{query}")
        assert_error(status, body, 400, "invalid_query")
        assert words in body["message"], body


class TestReading:
    async def test_offers_are_read_cheapest_first_in_pages_up_to_the_cap(self, api: Api) -> None:
        """With a cap below the matching offers, the cheapest are read (in pages) and the answer says it is truncated."""
        prices = ["0.40", "0.20", "0.50", "0.30", "0.60"]
        for price in prices:
            await offer_host(api, price)
        async with api.master.db.session() as session:
            found = await find_cluster_offers(session, parse(""), nodes=2, max_offers=3, page_size=2, now=api.master.clock.now())
            whole = await find_cluster_offers(session, parse(""), nodes=2, page_size=2, now=api.master.clock.now())
        assert (found.offers_considered, found.offers_matching, found.truncated) == (3, 5, True)
        [item] = found.items
        assert (item.hosts_available, item.price_per_hour, item.price_per_hour_max) == (3, Decimal("0.50"), Decimal("0.70"))
        assert (whole.offers_considered, whole.truncated, whole.items[0].price_per_hour_max) == (5, False, Decimal("1.10"))

    @pytest.mark.parametrize(
        ("query", "sort"), [("", Sort.PRICE), ("price<=0.5", Sort.PRICE), ("", Sort.SCORE), ("region=us-east num_gpus>=2", Sort.RELIABILITY)]
    )
    async def test_offer_prices_are_the_searchs_offers_reduced(self, api: Api, query: str, sort: Sort) -> None:
        """``search_offer_prices`` answers the same offers as ``search_offers``, in its order, page and total."""
        for price, gpus, region in (("0.40", 1, "eu-west"), ("0.45", 2, "us-east"), ("0.30", 3, "us-east"), ("0.60", 2, None)):
            await offer_host(api, price, gpus=gpus, region=region, reliability=float(price))
        await offer_host(api, "1.00", model=A100, gpus=2, region="us-east")
        async with api.master.db.session() as session:
            for limit, offset in ((50, 0), (2, 1), (2, 10)):
                search = OfferSearch(parse(query), sort=sort, limit=limit, offset=offset, now=api.master.clock.now())
                views, total = await search_offers(session, search)
                prices, price_total = await search_offer_prices(session, search)
                assert price_total == total
                assert [(p.host_id, p.gpu_name, p.num_gpus, money(p.price_per_gpu_hour), p.region, p.reliability) for p in prices] == [
                    (v["host_id"], v["gpu_name"], v["num_gpus"], v["price_per_gpu_hour"], v["region"], v["reliability"]) for v in views
                ]
