"""The offer search (``GET /api/v1/offers``): prices, filters, the query language, sorts, paging.

Each test runs on SQLite and on a fresh PostgreSQL database, through the real aiohttp app.
Hosts are made by feeding hellos as the ingestor would, then given a region, a reliability
score and a network measurement directly in the database; listings go through the API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from sqlalchemy import event, update

from master.api.base import API
from master.app import create_app
from master.context import Master
from master.models import Gpu, Host, HostListing
from master.services.accounts.core import Principal, authenticate
from master.services.market import offers
from master.services.market.listings import load_price_bounds
from master.services.market.offers import OfferSearch, Sort
from master.services.market.query import parse
from master.services.market.tiers import Tier
from shared import protocol
from tests.factories import create_principal, gpu_info, online_host
from tests.helpers import ManualClock

RTX = "NVIDIA GeForce RTX 4090"
A100 = "NVIDIA A100-SXM4-80GB"
H100 = "NVIDIA H100 80GB HBM3"


def gpus(count: int, name: str = RTX, *, memory: int = 24564, cc: str = "8.9", cuda: str = "12.4", mig: bool | None = None) -> list[protocol.GpuInfoModel]:
    return [
        gpu_info(i, name=name, memory=memory).model_copy(
            update={"compute_capability": cc, "cuda_driver_version": cuda, "mig_mode": mig}
        )
        for i in range(count)
    ]


@dataclass
class Market:
    """The running app, a renter, a provider and an admin, and the master's manual clock."""

    master: Master
    client: TestClient[Any, Any]
    clock: ManualClock
    renter_key: str
    provider_key: str
    admin_key: str

    async def call(self, method: str, path: str, key: str, **kwargs: Any) -> tuple[int, Any]:
        async with self.client.request(method, API + path, headers={"Authorization": f"Bearer {key}"}, **kwargs) as response:
            assert response.content_type == "application/json", await response.text()
            return response.status, await response.json()

    async def offers(self, **params: str) -> dict[str, Any]:
        status, body = await self.call("GET", "/offers", self.renter_key, params=params)
        assert status == 200, body
        assert isinstance(body, dict)
        return body

    async def offered(self, **params: str) -> list[str]:
        """The host ids of the matching offers, in the order given."""
        return [o["host_id"] for o in (await self.offers(**params))["items"]]

    async def host(
        self, gpu_list: list[protocol.GpuInfoModel], *, region: str | None = None, reliability: float | None = None,
        download: float | None = None, upload: float | None = None,
    ) -> str:
        provider = await self.provider()
        host_id = await online_host(self.master, provider, gpu_list)
        network = None if download is None else {"download_mbps": download, "upload_mbps": upload}
        async with self.master.db.session() as session:
            await session.execute(
                update(Host).where(Host.id == host_id).values(region=region, reliability=reliability, latest_network=network)
            )
        return host_id

    async def put_listing(self, host_id: str, *, key: str | None = None, expect: int = 201, **terms: Any) -> dict[str, Any]:
        status, body = await self.call("PUT", f"/hosts/{host_id}/listing", key or self.provider_key, json=terms)
        assert status == expect, body
        assert isinstance(body, dict)
        return body

    async def prove(
        self, host_id: str, outcome: str | None = "passed", *, age: timedelta = timedelta(hours=1), tflops: float | None = 100.0,
        reason: str | None = None, failures: int = 0, flag: bool | None = None,
    ) -> None:
        """Write what the GPU challenge flow writes: every GPU of the host's outcome, time, figures, and the listing's
        ``verified`` (by default: the outcome passed and the listing exists)."""
        at = self.clock.now() - age
        proven = outcome == "passed"
        async with self.master.db.session() as session:
            await session.execute(update(Gpu).where(Gpu.host_id == host_id).values(
                verification_outcome=outcome, verified_at=at if outcome is not None else None,
                verified_tflops=tflops if proven else None, verified_vram_mib=Gpu.memory_total_mib if proven else None,
                verification_reason=None if proven else reason, verification_failures=failures,
            ))  # fmt: skip
            await session.execute(update(HostListing).where(HostListing.host_id == host_id).values(verified=proven if flag is None else flag))

    async def provider(self) -> Principal:
        """The provider account, as the API sees it."""
        async with self.master.db.session() as session:
            return await authenticate(session, self.provider_key)


@asynccontextmanager
async def open_market(master: Master) -> AsyncIterator[Market]:
    """The app on loopback with a renter, a provider and an admin; the master's clock made manual."""
    clock = ManualClock(datetime.now(UTC).replace(microsecond=0))
    master.clock = clock
    _, renter_key = await create_principal(master, "renter-1", "renter")
    _, provider_key = await create_principal(master, "provider-1", "provider")
    _, admin_key = await create_principal(master, "admin-1", "admin")
    client: TestClient[Any, Any] = TestClient(TestServer(create_app(master, background=False)))
    await client.start_server()
    try:
        yield Market(master, client, clock, renter_key, provider_key, admin_key)
    finally:
        await client.close()


@pytest.fixture
async def market(master: Master) -> AsyncIterator[Market]:
    async with open_market(master) as opened:
        yield opened


@dataclass
class Fleet:
    """Four hosts that differ in every filtered attribute."""

    rtx_pair: str  # 2× RTX 4090, eu-west, 0.99, 900/500 Mbps, listed at 0.35, proven by the GPU challenge
    rtx_single: str  # 1× RTX 4090, us-east, 0.95, 100/50 Mbps, unlisted (prosumer default 0.40)
    a100s: str  # 4× A100 80GB, eu-west, no reliability yet, no network, listed at 1.20
    h100: str  # 1× H100, ap-south, 0.999, 2000/2000 Mbps, unlisted (flagship default 2.50)


@pytest.fixture
async def fleet(market: Market) -> Fleet:
    rtx_pair = await market.host(gpus(2, cuda="12.4"), region="eu-west", reliability=0.99, download=900, upload=500)
    rtx_single = await market.host(gpus(1, cuda="12.10"), region="us-east", reliability=0.95, download=100, upload=50)
    a100s = await market.host(gpus(4, A100, memory=81920, cc="8.0", cuda="11.8", mig=False), region="eu-west")
    h100 = await market.host(gpus(1, H100, memory=81559, cc="9.0", cuda="12.9"), region="ap-south", reliability=0.999,
                             download=2000, upload=2000)
    await market.put_listing(rtx_pair, price_per_gpu_hour="0.35")
    await market.prove(rtx_pair)  # the GPU challenge passed on both, an hour ago
    await market.put_listing(a100s, price_per_gpu_hour="1.2", min_bid_per_gpu_hour="0.6", smallest_unit="mig:1g.10gb")
    return Fleet(rtx_pair, rtx_single, a100s, h100)


class TestOfferPrices:
    async def test_unlisted_hosts_are_offered_at_their_tier_default_price(self, market: Market) -> None:
        """A host nobody listed is offered, unverified and by whole GPUs, at its GPUs' tier default price."""
        host_id = await market.host(gpus(2))
        [offer] = (await market.offers())["items"]
        default = load_price_bounds()[Tier.PROSUMER].default
        assert (offer["host_id"], offer["tier"], offer["num_gpus"]) == (host_id, "prosumer", 2)
        assert Decimal(offer["price_per_gpu_hour"]) == default
        assert (offer["listed"], offer["verified"], offer["smallest_unit"]) == (False, False, "gpu")
        assert (offer["min_bid_per_gpu_hour"], offer["available_until"], offer["maintenance_windows"]) == (None, None, [])
        assert offer["price_per_score"] == pytest.approx(float(default) / offer["performance_score"])

    async def test_a_listed_host_is_offered_at_its_price_with_its_terms(self, market: Market) -> None:
        """A listing sets the offer's price, minimum bid, smallest unit, end date and upcoming windows."""
        host_id = await market.host(gpus(1, A100, memory=81920, mig=False))
        until = market.clock.now() + timedelta(days=30)
        window = {"start": (market.clock.now() + timedelta(days=1)).isoformat(), "end": (market.clock.now() + timedelta(days=1, hours=2)).isoformat()}
        await market.put_listing(host_id, price_per_gpu_hour="1.25", min_bid_per_gpu_hour="0.5", smallest_unit="mig:1g.10gb",
                          available_until=until.isoformat(), maintenance_windows=[window])
        [offer] = (await market.offers())["items"]
        assert (offer["price_per_gpu_hour"], offer["min_bid_per_gpu_hour"]) == ("1.250000", "0.500000")
        assert (offer["listed"], offer["smallest_unit"]) == (True, "mig:1g.10gb")
        assert datetime.fromisoformat(offer["available_until"]) == until
        assert [datetime.fromisoformat(offer["maintenance_windows"][0][k]) for k in ("start", "end")] == [
            datetime.fromisoformat(window["start"]), datetime.fromisoformat(window["end"])
        ]

    async def test_offers_keep_the_fields_renters_rely_on(self, fleet: Fleet, market: Market) -> None:
        """Every offer carries model, count, memory, versions, region, state, tier, score, reliability and speeds."""
        body = await market.offers()
        by_host = {o["host_id"]: o for o in body["items"]}
        pair = by_host[fleet.rtx_pair]
        assert pair["id"] == f"{fleet.rtx_pair}:{RTX}"
        assert (pair["gpu_name"], pair["num_gpus"], pair["vram_mib"]) == (RTX, 2, 24564)
        assert (pair["compute_capability"], pair["cuda_driver_version"]) == ("8.9", "12.4")
        assert (pair["region"], pair["host_state"], pair["tier"]) == ("eu-west", "online", "prosumer")
        assert (pair["reliability"], pair["download_mbps"], pair["upload_mbps"]) == (0.99, 900, 500)
        assert pair["performance_score"] > 0 and pair["needs_review"] is False and pair["verified"] is True
        assert by_host[fleet.a100s]["reliability"] is None and by_host[fleet.a100s]["download_mbps"] is None
        assert body["total"] == 4


class TestOfferFilters:
    async def test_the_issue_example_query(self, fleet: Fleet, market: Market) -> None:
        """``gpu_name=RTX_4090 num_gpus>=2 reliability>0.98 price<=0.5`` finds the listed pair of 4090s only."""
        body = await market.offers(q="gpu_name=RTX_4090 num_gpus>=2 reliability>0.98 price<=0.5")
        assert [o["host_id"] for o in body["items"]] == [fleet.rtx_pair]
        assert body["query"] == "gpu_name=RTX_4090 num_gpus>=2 reliability>0.98 price<=0.5"

    @pytest.mark.parametrize(
        ("param", "value", "query", "expected"),
        [
            ("gpu_model", "RTX 4090", "gpu_name=RTX_4090", {"rtx_pair", "rtx_single"}),
            ("num_gpus", "2", "num_gpus>=2", {"rtx_pair", "a100s"}),
            ("min_vram_gib", "80", "vram>=80", {"a100s", "h100"}),
            ("min_compute_capability", "8.9", "compute_capability>=8.9", {"rtx_pair", "rtx_single", "h100"}),
            ("min_cuda_driver_version", "12.9", "cuda_driver_version>=12.9", {"rtx_single", "h100"}),
            ("min_price", "1", "price>=1", {"a100s", "h100"}),
            ("max_price", "0.40", "price<=0.40", {"rtx_pair", "rtx_single"}),
            ("region", "eu-west", "region=eu-west", {"rtx_pair", "a100s"}),
            ("tier", "prosumer", "tier=prosumer", {"rtx_pair", "rtx_single"}),
            ("min_reliability", "0.98", "reliability>=0.98", {"rtx_pair", "h100"}),
            ("min_download_mbps", "500", "download_mbps>=500", {"rtx_pair", "h100"}),
            ("min_upload_mbps", "1000", "upload_mbps>=1000", {"h100"}),
            ("verified", "true", "verified=true", {"rtx_pair"}),
            ("verified", "false", "verified=false", {"rtx_single", "a100s", "h100"}),
        ],
    )
    async def test_each_filter_parameter_matches_its_query_term(
        self, fleet: Fleet, market: Market, param: str, value: str, query: str, expected: set[str]
    ) -> None:
        """A filter given as its own parameter finds the same offers as the same filter in ``q``."""
        wanted = {getattr(fleet, name) for name in expected}
        by_param = await market.offers(**{param: value})
        by_query = await market.offers(q=query)
        assert {o["host_id"] for o in by_param["items"]} == wanted
        assert {o["host_id"] for o in by_query["items"]} == wanted
        assert by_param["total"] == by_query["total"] == len(wanted)
        assert by_param["query"] == by_query["query"]

    async def test_full_width_model_words_match_their_ascii_model(self, fleet: Fleet, market: Market) -> None:
        """"ＲＴＸ ４０９０" (full-width) is RTX 4090 after NFKC, as a parameter and in ``q``; the echoed query says RTX_4090."""
        for params in ({"gpu_model": "\uff32\uff34\uff38 \uff14\uff10\uff19\uff10"}, {"q": "gpu_name=\uff32\uff34\uff38_\uff14\uff10\uff19\uff10"},
                       {"gpu_model": "rtx\u30004090"}):  # fmt: skip
            body = await market.offers(**params)
            assert {o["host_id"] for o in body["items"]} == {fleet.rtx_pair, fleet.rtx_single}, params
            assert body["query"] == "gpu_name=RTX_4090" or body["query"] == "gpu_name=rtx_4090", body["query"]

    @pytest.mark.parametrize(
        ("params", "why"),
        [
            ({"gpu_model": "\u2605\u2605\u2605"}, "no letter or digit"),  # ★★★
            ({"gpu_model": "   "}, "no letter or digit"),
            ({"gpu_model": "\u200b"}, "no letter or digit"),  # a zero-width space
            ({"gpu_model": "R\u0422\u0425 4090"}, "not ASCII"),  # Cyrillic Т and Х: not the RTX 4090
            ({"q": "gpu_name=\u2605\u2605\u2605"}, "no letter or digit"),
            ({"q": "gpu_name=R\u0422\u0425_4090"}, "not ASCII"),
        ],
    )
    async def test_a_model_filter_that_means_nothing_is_400_never_every_offer(
        self, fleet: Fleet, market: Market, params: dict[str, str], why: str
    ) -> None:
        """Regression (issue 21): a model filter with no ASCII word matched every GPU; now 400 ``invalid_query`` saying why."""
        status, body = await market.call("GET", "/offers", market.renter_key, params=params)
        assert (status, body["code"]) == (400, "invalid_query"), body
        assert why in body["message"] and next(iter(params)) in body["message"], body

    async def test_price_filters_take_the_money_grammar(self, fleet: Fleet, market: Market) -> None:
        """``max_price`` refuses separators, foreign digits, signs and padding with 400 naming the parameter."""
        for text in ("0,40", "\u0660.\u0664", "+0.4", " 0.4", "0.4\u00a0", "4e-1", "NaN"):
            status, body = await market.call("GET", "/offers", market.renter_key, params={"max_price": text})
            assert (status, body["code"]) == (400, "invalid_query"), (text, body)
            assert "max_price" in body["message"]

    async def test_score_and_price_per_score_filter(self, fleet: Fleet, market: Market) -> None:
        """``score`` and ``price_per_score`` compare the performance score and price / score."""
        by_host = {o["host_id"]: o for o in (await market.offers())["items"]}
        h100_score = by_host[fleet.h100]["performance_score"]
        assert set(await market.offered(min_score=str(h100_score - 0.5))) == {fleet.h100}
        assert set(await market.offered(q=f"score<{h100_score - 0.5}")) == {fleet.rtx_pair, fleet.rtx_single, fleet.a100s}
        best_value = min(o["price_per_score"] for o in by_host.values())
        cheapest = {h for h, o in by_host.items() if o["price_per_score"] == best_value}
        assert set(await market.offered(q=f"price_per_score<={best_value + 1e-9:.10f}")) == cheapest
        assert set(await market.offered(max_price_per_score=f"{best_value + 1e-9:.10f}")) == cheapest

    async def test_versions_compare_as_numbers_not_text(self, market: Market) -> None:
        """Compute capability 12.0 is above 8.9 and CUDA 12.10 above 12.9, although they sort lower as text."""
        blackwell = await market.host(gpus(1, "NVIDIA GeForce RTX 5090", memory=32607, cc="12.0", cuda="12.10"))
        ada = await market.host(gpus(1, cc="8.9", cuda="12.9"))
        assert await market.offered(q="compute_capability>8.9") == [blackwell]
        assert await market.offered(q="compute_capability<=8.9") == [ada]
        assert await market.offered(q="cuda_driver_version>12.9") == [blackwell]
        assert set(await market.offered(q="cuda_driver_version>=12")) == {blackwell, ada}

    async def test_alternatives_exclusions_and_ranges(self, fleet: Fleet, market: Market) -> None:
        """``a|b`` is any of them, ``!=`` none of them, and two terms on one field make a range."""
        assert set(await market.offered(q="gpu_name=A100|H100")) == {fleet.a100s, fleet.h100}
        assert set(await market.offered(q="gpu_name!=RTX_4090")) == {fleet.a100s, fleet.h100}
        assert set(await market.offered(q="region=us-east|'ap-south'")) == {fleet.rtx_single, fleet.h100}
        assert set(await market.offered(q="tier!=prosumer|flagship")) == {fleet.a100s}
        assert set(await market.offered(q="price>=0.36 price<=1.2")) == {fleet.rtx_single, fleet.a100s}
        assert set(await market.offered(q="num_gpus=1|4")) == {fleet.rtx_single, fleet.a100s, fleet.h100}
        assert await market.offered(q="gpu_name=A10") == []  # an A100 is not an A10

    async def test_unknown_values_fail_comparisons_except_not_equal(self, fleet: Fleet, market: Market) -> None:
        """A host with no reliability score yet fails ``reliability>=0`` but passes ``reliability!=0.99``."""
        assert fleet.a100s not in await market.offered(q="reliability>=0")
        assert fleet.a100s not in await market.offered(q="download_mbps<1000000")
        assert set(await market.offered(q="reliability!=0.99")) == {fleet.rtx_single, fleet.a100s, fleet.h100}

    async def test_vram_is_whole_gib_and_vram_mib_exact(self, fleet: Fleet, market: Market) -> None:
        """A 24564 MiB card counts as 24 GiB; ``vram_mib`` compares NVML's figure exactly."""
        assert set(await market.offered(q="vram=24")) == {fleet.rtx_pair, fleet.rtx_single}
        assert set(await market.offered(q="vram_mib>=24565 vram_mib<81920")) == {fleet.h100}

    async def test_filters_combine_with_parameters_and_q(self, fleet: Fleet, market: Market) -> None:
        """Parameters and ``q`` are ANDed, and the response echoes them all as one normalised query."""
        body = await market.offers(q="region=eu-west", num_gpus="3", max_price="2")
        assert [o["host_id"] for o in body["items"]] == [fleet.a100s]
        assert body["query"] == "region=eu-west num_gpus>=3 price<=2"


class TestOfferAvailability:
    async def test_taken_gpus_and_hosts_out_of_service_are_not_offered(self, market: Market) -> None:
        """Rented GPUs are left out of their host's offer, and an offline host is not offered."""
        busy = await market.host(gpus(3))
        offline = await market.host(gpus(1))
        status, rental = await market.call("POST", "/rentals", market.renter_key, json={"gpu_count": 2})
        assert status == 201, rental
        async with market.master.db.session() as session:
            await session.execute(update(Host).where(Host.id == offline).values(state="offline"))
        body = await market.offers()
        assert [(o["host_id"], o["num_gpus"]) for o in body["items"]] == [(rental["host_id"], 1)] and rental["host_id"] == busy

    async def test_a_listing_past_its_end_date_is_not_offered(self, market: Market) -> None:
        """After ``available_until`` the host disappears from the offers."""
        host_id = await market.host(gpus(1))
        await market.put_listing(host_id, price_per_gpu_hour="0.3", available_until=(market.clock.now() + timedelta(hours=1)).isoformat())
        assert await market.offered() == [host_id]
        market.clock.advance(3600)
        assert await market.offered() == []

    async def test_a_host_is_not_offered_during_its_maintenance_windows(self, market: Market) -> None:
        """During a maintenance window the host is hidden; before and after it, it is offered with the window shown."""
        host_id = await market.host(gpus(1))
        start = market.clock.now() + timedelta(hours=1)
        windows = [{"start": start.isoformat(), "end": (start + timedelta(hours=2)).isoformat()}]
        await market.put_listing(host_id, price_per_gpu_hour="0.3", maintenance_windows=windows)
        [offer] = (await market.offers())["items"]
        assert len(offer["maintenance_windows"]) == 1
        market.clock.advance(3600)
        assert await market.offered() == []
        market.clock.advance(2 * 3600)
        [offer] = (await market.offers())["items"]
        assert offer["maintenance_windows"] == []  # over: no longer shown


class TestOfferSorting:
    async def test_default_is_best_score_first(self, fleet: Fleet, market: Market) -> None:
        """Without ``sort`` offers come best score first, and the response says so."""
        body = await market.offers()
        scores = [o["performance_score"] for o in body["items"]]
        assert scores == sorted(scores, reverse=True)
        assert body["items"][0]["host_id"] == fleet.h100
        assert (body["sort"], body["order"]) == ("score", "desc")

    async def test_price_sorts_cheapest_first_and_reverses(self, fleet: Fleet, market: Market) -> None:
        """``sort=price`` is cheapest first; ``order=desc`` dearest first."""
        assert await market.offered(sort="price") == [fleet.rtx_pair, fleet.rtx_single, fleet.a100s, fleet.h100]
        assert await market.offered(sort="price", order="desc") == [fleet.h100, fleet.a100s, fleet.rtx_single, fleet.rtx_pair]

    async def test_price_per_performance_sorts_best_value_first(self, fleet: Fleet, market: Market) -> None:
        """``sort=price_per_performance`` orders by price / score, lowest first."""
        items = (await market.offers(sort="price_per_performance"))["items"]
        ratios = [o["price_per_score"] for o in items]
        assert ratios == sorted(ratios)
        assert {o["host_id"] for o in items} == {fleet.rtx_pair, fleet.rtx_single, fleet.a100s, fleet.h100}

    async def test_reliability_sorts_most_reliable_first_with_unscored_last(self, fleet: Fleet, market: Market) -> None:
        """``sort=reliability`` puts the unscored host last in either direction."""
        assert await market.offered(sort="reliability") == [fleet.h100, fleet.rtx_pair, fleet.rtx_single, fleet.a100s]
        assert await market.offered(sort="reliability", order="asc") == [fleet.rtx_single, fleet.rtx_pair, fleet.h100, fleet.a100s]

    async def test_pages_follow_the_sort_and_total_counts_all(self, fleet: Fleet, market: Market) -> None:
        """Paging through a sorted search visits every offer once, in order, with the full total each time (past the end too)."""
        seen: list[str] = []
        for offset in (0, 3):
            body = await market.offers(sort="price", limit="3", offset=str(offset))
            assert (body["total"], body["limit"], body["offset"]) == (4, 3, offset)
            seen += [o["host_id"] for o in body["items"]]
        assert seen == [fleet.rtx_pair, fleet.rtx_single, fleet.a100s, fleet.h100]
        past_the_end = await market.offers(sort="price", limit="3", offset="10")
        assert (past_the_end["items"], past_the_end["total"]) == ([], 4)


class TestOfferErrors:
    @pytest.mark.parametrize(
        ("query", "position"),
        [
            ("gpu_name=RTX_4090 num_gpus>=two", 29),
            ("colour=red", 1),
            ("price<=", 8),
            ("price<=-1", 8),
            ("num_gpus>=0", 11),
            ("tier>prosumer", 5),
            ("region='eu-west", 8),
            ("price<=0.5reliability>0.9", 8),
        ],
    )
    async def test_a_query_that_does_not_parse_is_400_with_its_position(self, market: Market, query: str, position: int) -> None:
        """A bad ``q`` is 400 ``invalid_query`` whose message and details name the position and what was expected."""
        status, body = await market.call("GET", "/offers", market.renter_key, params={"q": query})
        assert status == 400, body
        assert body["code"] == "invalid_query"
        assert body["details"]["position"] == position
        assert body["details"]["expected"]
        assert f"position {position}" in body["message"]

    @pytest.mark.parametrize(
        "params",
        [
            {"sort": "cheapest"},
            {"order": "up"},
            {"max_price": "-1"},
            {"max_price": "abc"},
            {"min_reliability": "high"},
            {"verified": "maybe"},
            {"tier": "legendary"},
            {"num_gpus": "0"},
            {"min_compute_capability": "eight"},
            {"q": "x" * 2001},
        ],
    )
    async def test_bad_parameters_are_400_invalid_query(self, market: Market, params: dict[str, str]) -> None:
        """Every malformed filter, sort or order parameter is 400 ``invalid_query`` naming the parameter."""
        status, body = await market.call("GET", "/offers", market.renter_key, params=params)
        assert status == 400, body
        assert body["code"] == "invalid_query"
        assert next(iter(params)) in body["message"]


class TestOfferSearchCost:
    async def test_the_search_runs_the_same_queries_for_any_fleet_size(self, market: Market) -> None:
        """The search's statements do not grow with the number of hosts (no per-host queries): the page's statement and
        its GPUs' challenge proofs (one for the page), and one more for the model names when a query names a model."""
        search = OfferSearch([], sort=Sort.PRICE, limit=500, now=market.clock.now())
        filtered = OfferSearch(
            parse("gpu_name=RTX_4090 price<=1 num_gpus>=1"),
            limit=500, now=market.clock.now(),
        )
        counts: list[tuple[int, int]] = []
        for hosts in (1, 6):
            while len((await market.offers(limit="500"))["items"]) < hosts:
                host_id = await market.host(gpus(2))
                await market.put_listing(host_id, price_per_gpu_hour="0.3")
            counts.append((await self._statements(market, search, hosts), await self._statements(market, filtered, hosts)))
        assert counts[0] == counts[1] == (2, 3)

    @staticmethod
    async def _statements(market: Market, search: OfferSearch, expected: int) -> int:
        executed: list[str] = []

        def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            executed.append(statement)

        engine = market.master.db.engine.sync_engine
        event.listen(engine, "before_cursor_execute", record)
        try:
            async with market.master.db.session() as session:
                items, total = await offers.search_offers(session, search)
        finally:
            event.remove(engine, "before_cursor_execute", record)
        assert len(items) == total == expected
        # Only the search's own statements: not a pool's liveness ping or a new connection's set-up.
        return len([s for s in executed if any(table in s for table in ("offer_summary", "gpus", "hosts"))])


class TestListingRows:
    async def test_deleting_a_host_deletes_its_listing(self, market: Market) -> None:
        """The listing belongs to its host: it goes when the host row goes."""
        host_id = await market.host(gpus(1))
        await market.put_listing(host_id, price_per_gpu_hour="0.3")
        async with market.master.db.session() as session:
            host = await session.get(Host, host_id)
            assert host is not None
            await session.delete(host)
        async with market.master.db.session() as session:
            assert await session.get(HostListing, host_id) is None
