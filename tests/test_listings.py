"""Host listings (``PUT/GET /api/v1/hosts/{id}/listing``) and the tier price bounds.

API tests run on SQLite and on a fresh PostgreSQL database (``open_market`` of
``tests/test_offers.py``); the price-bounds loader is tested as a pure function.
"""

from __future__ import annotations

import asyncio
import tomllib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import func, select

from master.context import Master
from master.models import HostListing
from master.services.market.listings import (
    TIER_ORDER,
    ListingTerms,
    best_tier,
    load_price_bounds,
    parse_price_bounds,
    put_listing,
    window_time,
)
from master.services.market.tiers import Tier
from shared.errors import ConfigError, ValidationFailed
from tests.factories import create_principal, enroll_host
from tests.test_offers import A100, H100, Market, gpus, open_market

_BOUNDS = """
[tier.flagship]
min = "1.00"
default = "2.50"
max = "8.00"
[tier.datacenter]
min = "0.20"
default = "0.90"
max = "4.00"
[tier.prosumer]
min = "0.10"
default = "0.40"
max = "2.00"
[tier.consumer]
min = "0.03"
default = "0.15"
max = "1.00"
[tier.entry]
min = "0.01"
default = "0.05"
max = "0.50"
"""


@pytest.fixture
async def market(master: Master) -> AsyncIterator[Market]:
    async with open_market(master) as opened:
        yield opened


class TestPriceBounds:
    def test_packaged_bounds_cover_every_tier_in_decimals(self) -> None:
        """Every tier has exact-decimal bounds with min <= default <= max, and better tiers cost more."""
        bounds = load_price_bounds()
        assert load_price_bounds() is bounds  # loaded once
        for tier in Tier:
            limits = bounds[tier]
            assert all(isinstance(v, Decimal) for v in (limits.min, limits.default, limits.max))
            assert Decimal(0) < limits.min <= limits.default <= limits.max
        defaults = [bounds[t].default for t in TIER_ORDER]
        assert defaults == sorted(defaults, reverse=True)
        assert [b["tier"] for b in bounds.view()] == [t.value for t in TIER_ORDER]

    def test_a_well_formed_document_parses(self) -> None:
        """A document with all five tiers as decimal strings gives those exact amounts."""
        bounds = parse_price_bounds(tomllib.loads(_BOUNDS))
        assert (bounds[Tier.PROSUMER].min, bounds[Tier.PROSUMER].default, bounds[Tier.PROSUMER].max) == (
            Decimal("0.10"), Decimal("0.40"), Decimal("2.00"),
        )

    @pytest.mark.parametrize(
        ("change", "message"),
        [
            (('min = "0.10"', "min = 0.10"), "decimal string"),
            (('min = "0.10"', 'min = "cheap"'), "must be a plain amount like 0.45"),
            (('min = "0.10"', 'min = "0.1000001"'), "at most 6 decimals"),
            (('min = "0.10"', 'min = "-0.10"'), "no sign"),
            (('min = "0.10"', 'min = "0"'), "more than 0"),
            (('min = "0.10"', 'min = "1,5"'), "separators"),
            (('min = "0.10"', 'min = "0.50"'), "min <= default <= max"),
            (("[tier.entry]", "[tier.cheap]"), "unknown tiers: cheap"),
            (('[tier.entry]\nmin = "0.01"\ndefault = "0.05"\nmax = "0.50"', ""), "lack [tier.entry]"),
        ],
    )
    def test_a_bad_document_is_refused_naming_the_problem(self, change: tuple[str, str], message: str) -> None:
        """Floats, garbage, too many places, negative amounts, disorder and missing or unknown tiers are refused."""
        text = _BOUNDS.replace(change[0], change[1], 1)
        with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
            parse_price_bounds(tomllib.loads(text))

    def test_no_tier_table_is_refused(self) -> None:
        """A document without the [tier.*] tables is refused."""
        with pytest.raises(ConfigError, match="tier"):
            parse_price_bounds({})

    def test_best_tier_is_the_highest_present(self) -> None:
        """A host's best tier is its highest GPU tier; unclassified GPUs do not count."""
        assert best_tier(["prosumer", None, "flagship", "entry"]) is Tier.FLAGSHIP
        assert best_tier(["consumer", "datacenter"]) is Tier.DATACENTER
        assert best_tier([None]) is None and best_tier([]) is None

    def test_window_times_are_whole_seconds_in_a_fixed_form(self) -> None:
        """Stored window times are UTC to the second: starts rounded down, ends rounded up."""
        moment = datetime(2026, 3, 1, 12, 0, 5, 250000, tzinfo=UTC)
        assert window_time(moment) == "2026-03-01T12:00:05Z"
        assert window_time(moment, round_up=True) == "2026-03-01T12:00:06Z"
        assert window_time(moment.replace(microsecond=0), round_up=True) == "2026-03-01T12:00:05Z"


class TestPutListing:
    async def test_a_provider_lists_a_host_and_reads_it_back(self, market: Market) -> None:
        """The first PUT creates the listing (201); GET returns it with the tier's bounds, for renters too."""
        host_id = await market.host(gpus(2))
        body = await market.put_listing(host_id, price_per_gpu_hour="0.45", min_bid_per_gpu_hour="0.2", smallest_unit="milli:250")
        assert (body["host_id"], body["price_per_gpu_hour"], body["min_bid_per_gpu_hour"]) == (host_id, "0.450000", "0.200000")
        assert (body["smallest_unit"], body["verified"], body["tier"]) == ("milli:250", False, "prosumer")
        assert body["price_bounds"] == {"tier": "prosumer", "min": "0.100000", "default": "0.400000", "max": "2.000000"}
        status, again = await market.call("GET", f"/hosts/{host_id}/listing", market.renter_key)
        assert (status, again) == (200, body)

    async def test_repeating_a_put_changes_nothing(self, market: Market) -> None:
        """The same PUT again answers 200 with the same listing, ``updated_at`` included."""
        host_id = await market.host(gpus(1))
        terms: dict[str, Any] = {"price_per_gpu_hour": "0.3", "maintenance_windows": [
            {"start": (market.clock.now() + timedelta(days=2)).isoformat(), "end": (market.clock.now() + timedelta(days=2, hours=1)).isoformat()}
        ]}
        first = await market.put_listing(host_id, **terms)
        market.clock.advance(60)
        second = await market.put_listing(host_id, expect=200, **terms)
        assert first == second

    async def test_a_put_replaces_the_whole_listing(self, market: Market) -> None:
        """Fields a PUT leaves out go back to their defaults; ``updated_at`` moves."""
        host_id = await market.host(gpus(1))
        until = (market.clock.now() + timedelta(days=10)).isoformat()
        first = await market.put_listing(host_id, price_per_gpu_hour="0.3", min_bid_per_gpu_hour="0.1", smallest_unit="milli:500",
                                  available_until=until)
        market.clock.advance(60)
        second = await market.put_listing(host_id, expect=200, price_per_gpu_hour="0.25")
        assert (second["min_bid_per_gpu_hour"], second["smallest_unit"], second["available_until"]) == (None, "gpu", None)
        assert second["created_at"] == first["created_at"] and second["updated_at"] > first["updated_at"]

    async def test_the_price_is_bounded_by_the_hosts_best_gpu_tier(self, market: Market) -> None:
        """A host with an H100 and an RTX 4090 is priced within the flagship bounds, for every GPU."""
        host_id = await market.host([*gpus(1, H100, memory=81559), gpus(2)[1]])
        flagship = load_price_bounds()[Tier.FLAGSHIP]
        status, body = await market.call("PUT", f"/hosts/{host_id}/listing", market.provider_key, json={"price_per_gpu_hour": "0.5"})
        assert (status, body["code"]) == (422, "price_out_of_bounds")
        assert body["details"] == {"tier": "flagship", "min": str(flagship.min.quantize(Decimal("0.000001"))),
                                   "max": str(flagship.max.quantize(Decimal("0.000001")))}
        assert "flagship" in body["message"]
        await market.put_listing(host_id, price_per_gpu_hour=str(flagship.min))
        await market.put_listing(host_id, expect=200, price_per_gpu_hour=str(flagship.max))
        offers = (await market.offers())["items"]
        assert {o["price_per_gpu_hour"] for o in offers} == {str(flagship.max.quantize(Decimal("0.000001")))}
        assert len(offers) == 2

    @pytest.mark.parametrize(
        ("terms", "status", "code"),
        [
            ({"price_per_gpu_hour": "-0.5"}, 422, "invalid_price"),
            ({"price_per_gpu_hour": 0}, 422, "invalid_price"),
            ({"price_per_gpu_hour": "0.1234567"}, 422, "invalid_price"),
            ({"price_per_gpu_hour": "1e30"}, 422, "invalid_price"),
            ({"price_per_gpu_hour": "5"}, 422, "price_out_of_bounds"),
            ({"price_per_gpu_hour": "0.05"}, 422, "price_out_of_bounds"),
            ({"price_per_gpu_hour": "cheap"}, 422, "invalid_price"),  # shared/money.py's grammar, under the field's code
            ({"price_per_gpu_hour": "NaN"}, 422, "invalid_price"),
            ({"price_per_gpu_hour": "1,000"}, 422, "invalid_price"),
            ({"price_per_gpu_hour": " 0.3"}, 422, "invalid_price"),
            ({"price_per_gpu_hour": 0.3}, 422, "validation_failed"),  # a JSON float: its digits are gone; send "0.3"
            ({}, 422, "validation_failed"),
            ({"price_per_gpu_hour": "0.3", "colour": "red"}, 422, "validation_failed"),
            ({"price_per_gpu_hour": "0.3", "min_bid_per_gpu_hour": "0.31"}, 422, "invalid_min_bid"),
            ({"price_per_gpu_hour": "0.3", "min_bid_per_gpu_hour": "-1"}, 422, "invalid_min_bid"),
            ({"price_per_gpu_hour": "0.3", "smallest_unit": "half"}, 422, "invalid_smallest_unit"),
            ({"price_per_gpu_hour": "0.3", "smallest_unit": "milli:0"}, 422, "invalid_smallest_unit"),
            ({"price_per_gpu_hour": "0.3", "smallest_unit": "milli:1000"}, 422, "invalid_smallest_unit"),
            ({"price_per_gpu_hour": "0.3", "smallest_unit": "mig:1g.10gb"}, 422, "invalid_smallest_unit"),  # no MIG on a 4090
            ({"price_per_gpu_hour": "0.3", "available_until": "2020-01-01T00:00:00Z"}, 422, "invalid_available_until"),
            ({"price_per_gpu_hour": "0.3", "available_until": "2999-01-01T00:00:00"}, 422, "validation_failed"),  # no timezone
            ({"price_per_gpu_hour": "0.3", "maintenance_windows": [{"start": "2999-01-02T00:00:00Z", "end": "2999-01-01T00:00:00Z"}]},
             422, "invalid_maintenance_window"),
            ({"price_per_gpu_hour": "0.3", "maintenance_windows": [{"start": "2020-01-01T00:00:00Z", "end": "2020-01-02T00:00:00Z"}]},
             422, "invalid_maintenance_window"),
            ({"price_per_gpu_hour": "0.3", "maintenance_windows": [
                {"start": "2999-01-01T00:00:00Z", "end": "2999-01-01T02:00:00Z"},
                {"start": "2999-01-01T01:00:00Z", "end": "2999-01-01T03:00:00Z"},
            ]}, 422, "invalid_maintenance_window"),
            ({"price_per_gpu_hour": "0.3", "maintenance_windows": [
                {"start": f"2999-01-{d:02d}T00:00:00Z", "end": f"2999-01-{d:02d}T01:00:00Z"} for d in range(1, 31)
            ] * 2}, 422, "validation_failed"),  # more than 32
            ({"price_per_gpu_hour": "0.3", "verified": True}, 403, "forbidden"),
            ({"price_per_gpu_hour": "0.3", "verified": False}, 403, "forbidden"),
        ],
    )
    async def test_bad_terms_are_refused_and_change_nothing(
        self, market: Market, terms: dict[str, Any], status: int, code: str
    ) -> None:
        """Each broken rule is a clear 4xx with its own code, and the listing stays as it was."""
        host_id = await market.host(gpus(1))
        before = await market.put_listing(host_id, price_per_gpu_hour="0.33")
        got, body = await market.call("PUT", f"/hosts/{host_id}/listing", market.provider_key, json=terms)
        assert (got, body["code"]) == (status, code), body
        assert body["message"]
        _, after = await market.call("GET", f"/hosts/{host_id}/listing", market.provider_key)
        assert after == before

    async def test_a_body_that_is_not_json_is_400(self, market: Market) -> None:
        """A PUT whose body does not parse as JSON is 400 ``invalid_json``."""
        host_id = await market.host(gpus(1))
        status, body = await market.call("PUT", f"/hosts/{host_id}/listing", market.provider_key, data=b"{price")
        assert (status, body["code"]) == (400, "invalid_json")

    async def test_smallest_units_and_windows_are_normalised(self, market: Market) -> None:
        """MIG profiles need a MIG-capable GPU; windows are stored sorted, to the second, and may touch."""
        host_id = await market.host(gpus(1, A100, memory=81920, mig=False))
        base = (market.clock.now() + timedelta(days=1)).replace(microsecond=0)
        windows = [
            {"start": (base + timedelta(hours=2)).isoformat(), "end": (base + timedelta(hours=3)).isoformat()},
            {"start": (base + timedelta(microseconds=500)).isoformat(), "end": (base + timedelta(hours=2)).isoformat()},
        ]
        body = await market.put_listing(host_id, price_per_gpu_hour="1", smallest_unit="mig:1g.10gb", maintenance_windows=windows)
        assert body["smallest_unit"] == "mig:1g.10gb"
        assert [w["start"] for w in body["maintenance_windows"]] == [window_time(base), window_time(base + timedelta(hours=2))]
        body = await market.put_listing(host_id, expect=200, price_per_gpu_hour="1", smallest_unit="milli:050")
        assert body["smallest_unit"] == "milli:50"

    async def test_only_the_owner_or_an_admin_may_list(self, market: Market) -> None:
        """Another provider gets 404, a renter 403, an admin may; renters may read a listing."""
        host_id = await market.host(gpus(1))
        _, other_key = await create_principal(market.master, "provider-2", "provider")
        status, body = await market.call("PUT", f"/hosts/{host_id}/listing", other_key, json={"price_per_gpu_hour": "0.3"})
        assert (status, body["code"]) == (404, "host_not_found")
        status, body = await market.call("PUT", f"/hosts/{host_id}/listing", market.renter_key, json={"price_per_gpu_hour": "0.3"})
        assert (status, body["code"]) == (403, "forbidden")
        status, body = await market.call("GET", f"/hosts/{host_id}/listing", other_key)
        assert (status, body["code"]) == (404, "host_not_found")
        await market.put_listing(host_id, key=market.admin_key, price_per_gpu_hour="0.3")
        status, body = await market.call("GET", f"/hosts/{host_id}/listing", market.renter_key)
        assert (status, body["price_per_gpu_hour"]) == (200, "0.300000")

    async def test_verified_is_proven_never_set_and_kept_by_provider_puts(self, market: Market) -> None:
        """An admin's PUT of ``verified`` is refused, pointing to the GPU challenge; the flag the challenge set is kept
        by the provider's next PUT."""
        host_id = await market.host(gpus(1))
        await market.put_listing(host_id, price_per_gpu_hour="0.3")
        for value in (True, False):
            status, body = await market.call("PUT", f"/hosts/{host_id}/listing", market.admin_key,
                                             json={"price_per_gpu_hour": "0.3", "verified": value})  # fmt: skip
            assert (status, body["code"]) == (422, "verified_by_challenge")
            assert f"POST /api/v1/admin/hosts/{host_id}/verify" in body["message"]
        assert (await market.put_listing(host_id, key=market.admin_key, expect=200, price_per_gpu_hour="0.3"))["verified"] is False
        await market.prove(host_id)
        body = await market.put_listing(host_id, expect=200, price_per_gpu_hour="0.35")
        assert (body["verified"], body["price_per_gpu_hour"]) == (True, "0.350000")
        assert (await market.offers(q="verified=true"))["total"] == 1

    async def test_unknown_unclassified_and_revoked_hosts(self, market: Market) -> None:
        """Unknown host 404; a host before its first hello 409 ``host_not_classified``; a revoked host 409."""
        status, body = await market.call("PUT", "/hosts/h-nope/listing", market.provider_key, json={"price_per_gpu_hour": "0.3"})
        assert (status, body["code"]) == (404, "host_not_found")
        enrolled = await enroll_host(market.master, await market.provider())
        status, body = await market.call("PUT", f"/hosts/{enrolled}/listing", market.provider_key, json={"price_per_gpu_hour": "0.3"})
        assert (status, body["code"]) == (409, "host_not_classified")
        host_id = await market.host(gpus(1))
        status, _ = await market.call("POST", f"/hosts/{host_id}/revoke", market.provider_key)
        assert status == 200
        status, body = await market.call("PUT", f"/hosts/{host_id}/listing", market.provider_key, json={"price_per_gpu_hour": "0.3"})
        assert (status, body["code"]) == (409, "host_revoked")
        async with market.master.db.session() as session:
            assert await session.scalar(select(func.count()).select_from(HostListing)) == 0

    async def test_a_host_without_a_listing_is_404_listing_not_found(self, market: Market) -> None:
        """GET on an unlisted host says so and how to list it."""
        host_id = await market.host(gpus(1))
        status, body = await market.call("GET", f"/hosts/{host_id}/listing", market.provider_key)
        assert (status, body["code"]) == (404, "listing_not_found")
        assert "PUT" in body["message"]

    async def test_concurrent_first_puts_make_one_listing(self, market: Market) -> None:
        """Two PUTs racing to create a listing both succeed and leave exactly one row."""
        host_id = await market.host(gpus(1))
        results = await asyncio.gather(
            *(market.call("PUT", f"/hosts/{host_id}/listing", market.provider_key, json={"price_per_gpu_hour": p}) for p in ("0.3", "0.31"))
        )
        assert sorted(status for status, _ in results) == [200, 201], results
        async with market.master.db.session() as session:
            assert await session.scalar(select(func.count()).select_from(HostListing)) == 1

    async def test_price_bounds_are_published(self, market: Market) -> None:
        """GET /price-bounds lists every tier's min, default and max as decimal strings, best tier first."""
        status, body = await market.call("GET", "/price-bounds", market.renter_key)
        assert status == 200
        assert (body["currency"], body["unit"]) == ("USD", "GPU-hour")
        assert [b["tier"] for b in body["items"]] == [t.value for t in TIER_ORDER]
        assert all(Decimal(b["min"]) <= Decimal(b["default"]) <= Decimal(b["max"]) for b in body["items"])


class TestListingService:
    async def test_rules_hold_without_http(self, market: Market) -> None:
        """The service enforces the rules for any caller, not only the API's body validation."""
        host_id = await market.host(gpus(1))
        owner = await market.provider()
        now = market.clock.now()
        async with market.master.db.session() as session:
            with pytest.raises(ValidationFailed) as caught:
                await put_listing(session, owner, host_id, ListingTerms(Decimal("-1")), now=now)
            assert caught.value.code == "invalid_price"
            with pytest.raises(ValidationFailed) as caught:
                await put_listing(session, owner, host_id, ListingTerms(Decimal("0.3"), available_until=now), now=now)
            assert caught.value.code == "invalid_available_until"
            listing, created, tier = await put_listing(session, owner, host_id, ListingTerms(Decimal("0.3")), now=now)
            assert (listing.price_per_gpu_hour, created, tier) == (Decimal("0.3"), True, Tier.PROSUMER)
