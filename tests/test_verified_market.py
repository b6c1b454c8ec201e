"""Issue 40's market surface: what each GPU proved by the GPU challenge, in the host views and the offers, and the
``verified`` filter (``verified=true`` and the query language) over verified, never-challenged, failed and stale hosts.

Each test runs on SQLite and on a fresh PostgreSQL database through the real aiohttp app. The challenge flow's
writes (the ``Gpu`` verification columns and ``HostListing.verified``) are made directly (``Market.prove``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from master.context import Master
from master.models import Gpu, Host, HostListing
from master.services.market import (
    VERIFICATION_MAX_AGE,
    expected_tflops,
    load_price_bounds,
    parse,
    row_conditions,
)
from tests.test_offers import Market, gpus, open_market

RTX_4090_EXPECTED = 198.0  # 330 dense fp16 tensor TFLOP/s × 0.6 sustained (docs/verification-measurements.md)


@pytest.fixture
async def market(master: Master) -> AsyncIterator[Market]:
    async with open_market(master) as opened:
        yield opened


@dataclass
class Hosts:
    proven: str  # 2× RTX 4090, listed, both passed an hour ago at 150 and 170 TFLOP/s
    never: str  # 1× RTX 4090, listed, never challenged
    failed: str  # 1× RTX 4090, listed, failed: too_slow, twice in a row
    stale: str  # 1× RTX 4090, listed, passed 8 days ago; the flag not cleared yet
    unlisted: str  # 1× RTX 4090, not listed, passed an hour ago (no flag: the flow lists it first)


@pytest.fixture
async def hosts(market: Market) -> Hosts:
    made = Hosts(*[await market.host(gpus(2 if n == 0 else 1)) for n in range(5)])
    for host_id in (made.proven, made.never, made.failed, made.stale):
        await market.put_listing(host_id, price_per_gpu_hour="0.3")
    await market.prove(made.proven)
    await _set_tflops(market, made.proven, {0: 150.0, 1: 170.0})
    await market.prove(made.failed, "failed", reason="too_slow", failures=2)
    await market.prove(made.stale, age=VERIFICATION_MAX_AGE + timedelta(days=1), flag=True)
    await market.prove(made.unlisted)
    return made


async def _set_tflops(market: Market, host_id: str, by_index: dict[int, float]) -> None:
    async with market.master.db.session() as session:
        for index, tflops in by_index.items():
            await session.execute(update(Gpu).where(Gpu.host_id == host_id, Gpu.index == index).values(verified_tflops=tflops))


class TestVerifiedFilter:
    @pytest.mark.parametrize(
        ("params", "expected"),
        [
            ({"verified": "true"}, {"proven"}),
            ({"q": "verified=true"}, {"proven"}),
            ({"q": "verified = true"}, {"proven"}),
            ({"verified": "false"}, {"never", "failed", "stale", "unlisted"}),
            ({"q": "verified!=true"}, {"never", "failed", "stale", "unlisted"}),
        ],
    )
    async def test_only_hosts_proven_recently_are_verified(
        self, market: Market, hosts: Hosts, params: dict[str, str], expected: set[str]
    ) -> None:
        """Verified: the challenge's flag and every GPU passed within the max age. A stale pass, a failure, a host
        never challenged and an unlisted host (no flag) are not."""
        names = {v: k for k, v in vars(hosts).items()}
        assert {names[h] for h in await market.offered(**params)} == expected

    async def test_a_stale_host_is_verified_again_once_it_passes(self, market: Market, hosts: Hosts) -> None:
        await market.prove(hosts.stale)  # a new pass, an hour ago
        assert set(await market.offered(verified="true")) == {hosts.proven, hosts.stale}

    async def test_the_clock_makes_a_pass_stale(self, market: Market, hosts: Hosts) -> None:
        """Nothing is written: the master's clock passing the max age is enough."""
        market.clock.advance(VERIFICATION_MAX_AGE.total_seconds())
        assert await market.offered(verified="true") == []


class TestPlacementFilter:
    async def test_a_rentals_verified_requirement_takes_the_same_hosts(self, market: Market, hosts: Hosts) -> None:
        """Placement's conditions over GPU rows (``row_conditions``) apply the offers' rule: the stale host too is out."""
        bounds = load_price_bounds()
        async with market.master.db.session() as session:
            wanted = await row_conditions(session, parse("verified=true"), bounds=bounds, now=market.clock.now())
            rows = await session.scalars(
                select(Gpu.host_id).join(Host, Host.id == Gpu.host_id).outerjoin(HostListing, HostListing.host_id == Gpu.host_id)
                .where(*wanted).distinct()
            )  # fmt: skip
            assert set(rows.all()) == {hosts.proven}


class TestOfferFigures:
    async def test_each_offer_carries_its_gpus_proof(self, market: Market, hosts: Hosts) -> None:
        offers = {o["host_id"]: o for o in (await market.offers(limit="50"))["items"]}
        proven = offers[hosts.proven]
        assert proven["verified"] is True
        summary = proven["verification"]
        assert (summary["verified"], summary["gpus_passed"], summary["gpus_failed"]) == (True, 2, 0)
        assert (summary["tflops_min"], summary["tflops_median"], summary["tflops_expected"]) == (150.0, 160.0, RTX_4090_EXPECTED)
        assert summary["verified_at"] == (market.clock.now() - timedelta(hours=1)).isoformat()
        failed = offers[hosts.failed]["verification"]
        assert (offers[hosts.failed]["verified"], failed["gpus_passed"], failed["gpus_failed"], failed["tflops_min"]) == (False, 0, 1, None)
        never = offers[hosts.never]["verification"]
        assert (never["verified"], never["gpus_passed"], never["verified_at"], never["tflops_expected"]) == (False, 0, None, RTX_4090_EXPECTED)
        stale = offers[hosts.stale]["verification"]
        assert (stale["verified"], stale["gpus_passed"], stale["tflops_min"]) == (False, 1, 100.0)


class TestHostViews:
    async def test_each_gpu_shows_what_it_proved(self, market: Market, hosts: Hosts) -> None:
        status, body = await market.call("GET", f"/hosts/{hosts.proven}", market.provider_key)
        assert status == 200, body
        assert body["verified"] is True
        first = body["gpus"][0]["verification"]
        assert first == {
            "outcome": "passed", "verified_at": (market.clock.now() - timedelta(hours=1)).isoformat(), "fresh": True,
            "tflops": 150.0, "tflops_expected": RTX_4090_EXPECTED, "vram_mib": body["gpus"][0]["memory_total_mib"],
            "reason": None, "failures_in_a_row": 0,
        }  # fmt: skip

    async def test_a_failed_gpu_shows_its_reason_and_failures(self, market: Market, hosts: Hosts) -> None:
        status, body = await market.call("GET", "/hosts", market.provider_key, params={"limit": "50"})
        assert status == 200, body
        views = {h["id"]: h for h in body["items"]}
        failed = views[hosts.failed]
        assert failed["verified"] is False
        proof = failed["gpus"][0]["verification"]
        assert (proof["outcome"], proof["reason"], proof["failures_in_a_row"], proof["fresh"], proof["tflops"]) == (
            "failed", "too_slow", 2, False, None)
        stale = views[hosts.stale]["gpus"][0]["verification"]
        assert (stale["outcome"], stale["fresh"], views[hosts.stale]["verified"]) == ("passed", False, False)
        never = views[hosts.never]["gpus"][0]["verification"]
        assert (never["outcome"], never["verified_at"], never["fresh"]) == (None, None, False)


def test_expected_throughput_comes_from_the_model_table() -> None:
    """Sustained bf16 tensor throughput for tensor-core models, fp32 for the others; unknown models have none."""
    assert expected_tflops("rtx-4090") == RTX_4090_EXPECTED
    assert expected_tflops("rtx-4090", "fp32") == round(82.6 * 0.8, 1)
    assert expected_tflops("gtx-1080") == round(8.9 * 0.8, 1)
    assert expected_tflops("no-such-gpu") is None and expected_tflops(None) is None
