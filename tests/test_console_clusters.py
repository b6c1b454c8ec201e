"""The console's Clusters tab in a real browser: rent a cluster through the form (the whole cluster's price shown
before confirming), watch its page (nodes with their host, region, state and GPUs; events), stop it.

On the marketplace of ``tests/test_console_browser.py`` (its `gpumarket up --agents 3`: three hosts of three GPU
models, so a hold cluster of 1 GPU per node, models mixed), with its browser and console helpers. Screenshots land in
``test-artifacts/console/``.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from playwright.async_api import Browser, expect

from tests import test_console_browser as browser_module
from tests.helpers import eventually
from tests.test_console_browser import API_POLL_S, WAIT_MS, Market, _console

pytestmark = pytest.mark.slow


# The browser module's marketplace, shared as in test_console_layout (hold workloads only here).
market = browser_module.market


def _per_hour(cluster: dict[str, Any]) -> Decimal:
    return sum((Decimal(m["price_per_gpu_hour"]) * len(m["gpu_uuids"]) for m in cluster["members"]), Decimal(0))


class TestClusters:
    async def test_rent_a_cluster_watch_its_nodes_and_stop_it(self, browser: Browser, market: Market) -> None:
        """The form prices the whole cluster from the offers before confirming; its page lists each node (name, host,
        region, state, GPUs) and the events, says a hold cluster has no private network, and stops it after a confirmation."""
        console = await _console(browser, market)
        await console.sign_in("renter")
        page = console.page
        await console.go("#/clusters")
        await expect(page.get_by_role("link", name="Clusters", exact=True)).to_have_attribute("aria-current", "page")
        await page.locator("#rent-cluster").click()
        dialog = page.locator("dialog.cluster-dialog")
        await dialog.get_by_label("Nodes", exact=True).fill("4")
        await dialog.get_by_label("Hold only (reserve GPUs, run nothing)").check()
        await dialog.locator("#review-cluster").click()
        # Four nodes of one model: the demo has three hosts, each of another model.
        await expect(dialog.locator(".error")).to_contain_text("of one model")
        await expect(dialog.locator("#confirm-cluster")).to_have_count(0)

        await dialog.get_by_label("Nodes", exact=True).fill("2")
        await dialog.get_by_label("Allow different GPU models on different nodes").check()
        await dialog.locator("#review-cluster").click()
        price = dialog.locator("#confirm-cluster-price")
        await expect(price).to_contain_text("per hour")
        low, high = Decimal(await price.get_attribute("data-low") or "nan"), Decimal(await price.get_attribute("data-high") or "nan")
        offers = (await console.api("renter", "/offers?limit=500"))["items"]
        per_host = sorted({o["host_id"]: Decimal(o["price_per_gpu_hour"]) for o in offers if o["num_gpus"] >= 1}.values())
        assert low <= high and low >= sum(per_host[:2]) - Decimal("0.000001"), (low, high, per_host)
        await expect(dialog.locator("#confirm-cluster-runs")).to_contain_text("Holds the GPUs")
        await console.view_shot("clusters-confirm")
        assert await console.fits_sideways("dialog")
        await dialog.locator("#confirm-cluster").click()

        await page.wait_for_url("**/#/clusters/c-*", timeout=WAIT_MS)
        cluster_id = page.url.rsplit("/", 1)[1]

        async def running() -> dict[str, Any] | None:
            view: dict[str, Any] = await console.api("renter", f"/clusters/{cluster_id}")
            return view if view["state"] == "running" else None

        cluster = await eventually(running, timeout=WAIT_MS / 1000, every=API_POLL_S, what="the cluster running")
        assert low <= _per_hour(cluster) <= high
        rows = page.locator("table.cluster-nodes tbody tr")
        await expect(rows).to_have_count(2)
        await expect(page.locator(".cluster-summary .badge").first).to_have_text("running", timeout=WAIT_MS)
        for rank, member in enumerate(cluster["members"]):
            host = await console.api("renter", f"/hosts/{member['host_id']}")
            row = rows.nth(rank)
            await expect(row.locator("td").nth(0)).to_have_text(f"node-{rank}")
            await expect(row.locator("td").nth(1)).to_have_text(member["rental_id"])
            await expect(row.locator("td").nth(2)).to_have_text(host["name"])
            await expect(row.locator("td").nth(3)).to_have_text(host["region"] or "—")
            await expect(row.locator("td").nth(4)).to_have_text("running", timeout=WAIT_MS)
            await expect(row.locator("td").nth(5)).to_have_text(f"1 × {member['gpu_model']}")
        await expect(page.locator("#cluster-network")).to_have_text("none: a hold cluster runs no container: it has no private network")
        await expect(page.locator("table.cluster-pairs")).to_contain_text("This cluster has no private network.")
        await expect(page.locator("#cluster-price")).to_contain_text("$")
        await expect(page.locator("table.events tbody")).to_contain_text("running")
        await console.shot("cluster-running")

        await console.go("#/clusters")
        link = page.locator(f"table.clusters a[href='#/clusters/{cluster_id}']")
        await expect(link).to_be_visible()
        await expect(page.locator("table.clusters tbody tr").first).to_contain_text("running")
        await link.click()

        await page.locator("#stop-cluster").click()
        await expect(page.locator(".confirm-text")).to_contain_text("All 2 nodes")
        await page.locator("#confirm-stop-cluster").click()

        async def stopped() -> bool:
            return bool((await console.api("renter", f"/clusters/{cluster_id}"))["state"] == "stopped")

        await eventually(stopped, timeout=WAIT_MS / 1000, every=API_POLL_S, what="the cluster stopped")
        await expect(page.locator(".cluster-summary .badge").first).to_have_text("stopped", timeout=WAIT_MS)
        await expect(page.locator("#stop-cluster")).to_have_count(0)
        assert not console.problems, console.problems
        await console.context.close()
