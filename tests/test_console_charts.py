"""The console's charts in a real browser: spend, earnings, occupancy and the marketplace per day (uPlot), and the
rental page's live charts clipped to the rental's own time.

On the marketplace of ``tests/test_console_browser.py`` (its `gpumarket up --agents 3`, shared by the console's
browser modules that run one after the other; hold rentals only here), with its browser and console helpers. Screenshots land in ``test-artifacts/console/``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from playwright.async_api import Browser, ViewportSize, expect

from tests import test_console_browser as browser_module
from tests.helpers import eventually
from tests.test_console_browser import (
    API_POLL_S,
    POLL_MS,
    WAIT_MS,
    Console,
    Market,
    _console,
)

pytestmark = pytest.mark.slow

PHONE: ViewportSize = {"width": 390, "height": 844}



# The browser module's marketplace (telemetry every 2 s, rating every second), shared as in test_console_layout.
market = browser_module.market


async def _figure_points(console: Console, title: str) -> int:
    """Wait until the figure titled ``title`` has drawn its canvas; its data-points."""
    figure = console.page.locator(f'figure.chart-uplot[data-title="{title}"]')
    await figure.locator("canvas").first.wait_for(timeout=WAIT_MS)
    return int(await figure.get_attribute("data-points") or -1)


async def _fits(console: Console) -> bool:
    """Nothing scrolls sideways and every day chart's canvas is within its figure."""
    return bool(await console.page.evaluate(
        """() => document.documentElement.scrollWidth <= innerWidth && [...document.querySelectorAll("figure.chart-uplot")]
             .every(f => { const c = f.querySelector("canvas"); return c && c.getBoundingClientRect().right <= f.getBoundingClientRect().right + 1; })"""
    ))  # fmt: skip


async def _smallest_chart_text(console: Console) -> float:
    """The smallest font size (px) of a day chart's legend and the axes' font."""
    return float(await console.page.evaluate(
        """() => Math.min(...[...document.querySelectorAll("figure.chart-uplot .u-legend, figure.chart-uplot .chart-caption")]
             .map(e => parseFloat(getComputedStyle(e).fontSize)))"""
    ))  # fmt: skip


async def _hold_rental(console: Console) -> dict[str, Any]:
    """A running hold rental of one GPU, on a host that reported telemetry for a while before it."""
    offer = (await console.api("renter", "/offers"))["items"][0]
    host_id = offer["host_id"]

    async def samples_before() -> bool:
        return (
            len((await console.api("renter", f"/hosts/{host_id}/metrics?resolution=raw&limit=10"))["items"])
            >= 3
        )

    await eventually(
        samples_before, timeout=WAIT_MS / 1000, every=API_POLL_S, what="three samples of the host before the rental"
    )
    rental = await console.api(
        "renter", "/rentals", "POST", {"offer_id": offer["id"], "workload": {"kind": "hold"}}
    )
    assert "id" in rental, rental

    async def running() -> dict[str, Any] | None:
        view: dict[str, Any] = await console.api("renter", f"/rentals/{rental['id']}")
        return view if view["state"] == "running" and view.get("started_at") else None

    result: dict[str, Any] = await eventually(running, timeout=WAIT_MS / 1000, every=API_POLL_S, what="the rental running")
    return result


class TestCharts:
    async def test_rental_chart_draws_no_sample_from_before_the_rental_started(
        self, browser: Browser, market: Market
    ) -> None:
        """Regression: the rental page's charts showed the host's samples from before the rental started."""
        console = await _console(browser, market)
        await console.sign_in("renter")
        rental = await _hold_rental(console)
        started = datetime.fromisoformat(rental["started_at"]).timestamp() * 1000
        await console.go(f"#/rentals/{rental['id']}")
        page = console.page
        await page.wait_for_function(
            "() => { const c = [...document.querySelectorAll('.telemetry .chart-line')]; return c.length === 4 && c.every(e => +e.dataset.points > 0); }",
            timeout=WAIT_MS * 2, polling=POLL_MS,
        )  # fmt: skip
        firsts = [
            float(await c.get_attribute("data-first") or "nan")
            for c in await page.locator(".telemetry .chart-line").all()
        ]
        assert all(first >= started for first in firsts), (firsts, started)
        # The host's stream did send older samples (its backlog): they are what the page left out.
        host_samples = (
            await console.api("renter", f"/hosts/{rental['host_id']}/metrics?resolution=raw&limit=500")
        )["items"]
        assert any(datetime.fromisoformat(s["sampled_at"]).timestamp() * 1000 < started for s in host_samples)
        await console.shot("charts-rental-window")
        assert not console.problems, console.problems
        await console.api("renter", f"/rentals/{rental['id']}", "DELETE")
        await console.context.close()

    async def test_spend_earnings_occupancy_and_marketplace_charts(
        self, browser: Browser, market: Market
    ) -> None:
        """Each role's day charts draw one point per day and series, fit a phone's width, with text of 11 px or more."""
        console = await _console(browser, market)
        await console.sign_in("renter")
        rental = await _hold_rental(console)

        async def charged() -> bool:
            spend = await console.api("renter", "/account/spend?days=30")
            return any(r["rental_id"] == rental["id"] and r["amount"] != "0.000000" for r in spend["rentals"])

        await eventually(charged, timeout=WAIT_MS / 1000, every=API_POLL_S, what="the rental's first charge")
        await console.go("#/billing")
        assert await _figure_points(console, "Spend per day") == 30
        await console.page.locator("table.spend-per-rental").get_by_text(rental["id"]).wait_for()
        assert await _smallest_chart_text(console) >= 11
        await console.shot("charts-spend")
        await console.api("renter", f"/rentals/{rental['id']}", "DELETE")
        await console.context.close()

        provider = await _console(browser, market, viewport=PHONE)
        await provider.sign_in("provider")
        await provider.go("#/earnings")
        earnings = await provider.api("provider", "/provider/earnings?days=30")
        occupancy = await provider.api("provider", "/provider/occupancy?days=7")
        assert earnings["hosts"] and len(occupancy["gpus"]) >= 3
        assert await _figure_points(provider, "Earnings per day") == 30 * (1 + min(7, len(earnings["hosts"])))
        assert await _figure_points(provider, "Occupancy per GPU") == 7 * min(8, len(occupancy["gpus"]))
        # The demand forecast: its chart, and a row per model and region the API forecasts (or the empty line).
        forecast = await provider.api("provider", "/demand-forecast?hours=24")
        await expect(provider.page.locator("figure.demand-chart")).to_have_count(1)
        if forecast["series"]:
            await expect(provider.page.locator("table.demand tbody tr")).to_have_count(len(forecast["series"]))
        else:
            await expect(provider.page.locator("#demand-title ~ div")).to_contain_text("nothing to forecast yet")
        assert await _fits(provider), "a chart is wider than a phone's screen"
        assert await _smallest_chart_text(provider) >= 11
        await provider.shot("charts-earnings-390")
        assert not provider.problems, provider.problems
        await provider.context.close()

        admin = await _console(browser, market)
        await admin.sign_in("admin")
        await admin.go("#/fleet")
        for title in ("GMV per day", "Fleet occupancy", "Hosts online"):
            expected = 30 if title == "Fleet occupancy" else 60  # GMV and fees; the mean and the most hosts
            assert await _figure_points(admin, title) == expected, title
        market_view = await admin.api("admin", "/admin/marketplace?days=30")
        assert market_view["days"][-1]["hosts_online_max"] == 3
        await admin.shot("charts-marketplace")
        await admin.page.set_viewport_size(PHONE)
        await admin.page.wait_for_timeout(300)
        assert await _fits(admin), "a chart is wider than a phone's screen"
        await admin.shot("charts-marketplace-390")
        assert not admin.problems + console.problems, admin.problems + console.problems
        await admin.context.close()
