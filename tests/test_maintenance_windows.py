"""One maintenance window at a time: ``POST /hosts/{id}/maintenance-windows`` and ``DELETE …/{start}``.

API tests on SQLite and PostgreSQL (``open_market`` of ``tests/test_offers.py``, manual clock);
the console's use of these routes is ``tests/test_console_maintenance.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta, timezone
from typing import Any
from urllib.parse import quote

import pytest

from master.context import Master
from master.services.market.listings import MAX_MAINTENANCE_WINDOWS, window_time
from tests.factories import create_principal
from tests.test_offers import Market, gpus, open_market


@pytest.fixture
async def market(master: Master) -> AsyncIterator[Market]:
    async with open_market(master) as opened:
        yield opened


def _window(market: Market, start_h: float, end_h: float) -> dict[str, str]:
    now = market.clock.now()
    return {"start": (now + timedelta(hours=start_h)).isoformat(), "end": (now + timedelta(hours=end_h)).isoformat()}


async def _add(market: Market, host_id: str, window: dict[str, str], key: str | None = None) -> tuple[int, Any]:
    return await market.call("POST", f"/hosts/{host_id}/maintenance-windows", key or market.provider_key, json=window)


async def _clear(market: Market, host_id: str, start: str, key: str | None = None) -> tuple[int, Any]:
    return await market.call("DELETE", f"/hosts/{host_id}/maintenance-windows/{quote(start, safe='')}", key or market.provider_key)


async def _listed(market: Market, **terms: Any) -> str:
    host_id = await market.host(gpus(1))
    await market.put_listing(host_id, price_per_gpu_hour="0.45", min_bid_per_gpu_hour="0.2", smallest_unit="milli:250", **terms)
    return host_id


class TestAddWindow:
    async def test_a_window_is_added_and_the_other_terms_stay(self, market: Market) -> None:
        """POST adds the window (201, the listing back, sorted among the others); price, bid and unit are unchanged."""
        host_id = await _listed(market, maintenance_windows=[_window(market, 10, 12)])
        status, body = await _add(market, host_id, _window(market, 2, 4))
        assert status == 201, body
        now = market.clock.now()
        assert body["maintenance_windows"] == [
            {"start": window_time(now + timedelta(hours=2)), "end": window_time(now + timedelta(hours=4))},
            {"start": window_time(now + timedelta(hours=10)), "end": window_time(now + timedelta(hours=12))},
        ]
        assert (body["price_per_gpu_hour"], body["min_bid_per_gpu_hour"], body["smallest_unit"]) == ("0.450000", "0.200000", "milli:250")
        status, read = await market.call("GET", f"/hosts/{host_id}/listing", market.renter_key)
        assert (status, read["maintenance_windows"]) == (200, body["maintenance_windows"])

    async def test_the_host_is_not_offered_during_an_added_window(self, market: Market) -> None:
        """A window open now, added by POST, takes the host off the offers; clearing it brings the host back."""
        host_id = await _listed(market)
        assert host_id in await market.offered()
        window = _window(market, -1, 1)
        status, body = await _add(market, host_id, window)
        assert status == 201, body
        assert host_id not in await market.offered()
        status, body = await _clear(market, host_id, body["maintenance_windows"][0]["start"])
        assert (status, body["maintenance_windows"]) == (200, [])
        assert host_id in await market.offered()

    @pytest.mark.parametrize(
        ("window", "message"),
        [
            ((5, 3), "ends before it starts"),
            ((5, 5), "ends before it starts"),
            ((-3, -1), "already over"),
            ((11, 13), "overlaps the one from"),
            ((9, 20), "overlaps the one from"),
        ],
    )
    async def test_a_bad_window_is_refused_with_its_reason(self, market: Market, window: tuple[float, float], message: str) -> None:
        """Backwards, empty, past and overlapping windows are 422 invalid_maintenance_window naming why; nothing changes."""
        host_id = await _listed(market, maintenance_windows=[_window(market, 10, 12)])
        _, before = await market.call("GET", f"/hosts/{host_id}/listing", market.provider_key)
        status, body = await _add(market, host_id, _window(market, *window))
        assert (status, body["code"]) == (422, "invalid_maintenance_window")
        assert message in body["message"]
        _, after = await market.call("GET", f"/hosts/{host_id}/listing", market.provider_key)
        assert after == before

    async def test_touching_windows_are_fine(self, market: Market) -> None:
        """A window ending where another starts is no overlap."""
        host_id = await _listed(market, maintenance_windows=[_window(market, 10, 12)])
        status, body = await _add(market, host_id, _window(market, 8, 10))
        assert (status, len(body["maintenance_windows"])) == (201, 2)

    async def test_windows_already_over_are_dropped_and_do_not_count(self, market: Market) -> None:
        """A window that ended is no longer stored after the next write, so it neither overlaps nor counts."""
        host_id = await _listed(market, maintenance_windows=[_window(market, 1, 2)])
        market.clock.advance(3 * 3600)
        status, body = await _add(market, host_id, _window(market, 1, 2))
        assert (status, len(body["maintenance_windows"])) == (201, 1)

    async def test_at_most_the_limit(self, market: Market) -> None:
        """The 33rd upcoming window is refused."""
        host_id = await _listed(market, maintenance_windows=[_window(market, 2 * i + 1, 2 * i + 2) for i in range(MAX_MAINTENANCE_WINDOWS)])
        status, body = await _add(market, host_id, _window(market, 200, 201))
        assert (status, body["code"]) == (422, "invalid_maintenance_window")
        assert f"at most {MAX_MAINTENANCE_WINDOWS}" in body["message"]

    async def test_a_host_without_a_listing_is_404_and_others_hosts_too(self, market: Market) -> None:
        """Before the first listing: 404 listing_not_found; another provider: host_not_found; a renter: 403; an admin may."""
        host_id = await market.host(gpus(1))
        status, body = await _add(market, host_id, _window(market, 2, 3))
        assert (status, body["code"]) == (404, "listing_not_found")
        await market.put_listing(host_id, price_per_gpu_hour="0.45")
        _, other_key = await create_principal(market.master, "provider-2", "provider")
        status, body = await _add(market, host_id, _window(market, 2, 3), key=other_key)
        assert (status, body["code"]) == (404, "host_not_found")
        status, body = await _add(market, host_id, _window(market, 2, 3), key=market.renter_key)
        assert (status, body["code"]) == (403, "forbidden")
        status, body = await _add(market, host_id, _window(market, 2, 3), key=market.admin_key)
        assert (status, len(body["maintenance_windows"])) == (201, 1)
        status, body = await _clear(market, host_id, body["maintenance_windows"][0]["start"], key=market.admin_key)
        assert (status, body["maintenance_windows"]) == (200, [])

    async def test_a_naive_time_is_refused(self, market: Market) -> None:
        """Times without a timezone are 422 validation_failed."""
        host_id = await _listed(market)
        status, body = await _add(market, host_id, {"start": "2099-01-01T00:00:00", "end": "2099-01-01T01:00:00"})
        assert (status, body["code"]) == (422, "validation_failed")


class TestClearWindow:
    async def test_clearing_one_window_keeps_the_others(self, market: Market) -> None:
        """DELETE by start (in any offset) removes that window only and bumps updated_at."""
        host_id = await _listed(market, maintenance_windows=[_window(market, 2, 3), _window(market, 5, 6)])
        _, before = await market.call("GET", f"/hosts/{host_id}/listing", market.provider_key)
        market.clock.advance(60)
        first, second = before["maintenance_windows"]
        start_in_cet = (market.clock.now() - timedelta(minutes=1) + timedelta(hours=2)).astimezone(timezone(timedelta(hours=1))).isoformat()
        status, body = await _clear(market, host_id, start_in_cet)
        assert status == 200, body
        assert body["maintenance_windows"] == [second]
        assert first not in body["maintenance_windows"] and body["updated_at"] > before["updated_at"]
        assert body["price_per_gpu_hour"] == before["price_per_gpu_hour"]

    async def test_an_unknown_start_is_404_and_a_malformed_one_400(self, market: Market) -> None:
        """No window starts then: 404 maintenance_window_not_found; not a time: 400 invalid_maintenance_window."""
        host_id = await _listed(market, maintenance_windows=[_window(market, 2, 3)])
        status, body = await _clear(market, host_id, "2099-01-01T00:00:00Z")
        assert (status, body["code"]) == (404, "maintenance_window_not_found")
        for bad in ("tomorrow", "2099-01-01T00:00:00"):
            status, body = await _clear(market, host_id, bad)
            assert (status, body["code"]) == (400, "invalid_maintenance_window"), bad
        _, after = await market.call("GET", f"/hosts/{host_id}/listing", market.provider_key)
        assert len(after["maintenance_windows"]) == 1
