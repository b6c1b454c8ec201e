"""Off-peak power limits end to end, in a real browser (docs/power.md): a provider opts a demo host in on its page,
the master's power-policy pass tells the host's simulated agent over its relay, the agent lowers the idle GPUs and
reports the energy it saves, and the Earnings page shows it.

Its own `gpumarket up --agents 3` with a power-policy pass every second and the browser and console helpers of
``tests/test_console_browser.py``. No rental in its history: every hour is off-peak. Screenshots land in
``test-artifacts/console/``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.async_api import Browser, expect

from tests.helpers import eventually
from tests.test_console_browser import WAIT_MS, Market, _console, running_market

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def market(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Market]:
    with running_market(tmp_path_factory, "power", extra_env={"GPUMARKET_POWER_INTERVAL": "1"}) as market:
        yield market


class TestPowerPolicy:
    async def test_a_provider_opts_a_host_in_and_sees_the_energy_it_saves(self, browser: Browser, market: Market) -> None:
        """60 % of each GPU's default: the host's GPUs are lowered to it within seconds (their telemetry says so),
        energy saved grows above 0, and the Earnings page shows it with a chart of 30 days."""
        console = await _console(browser, market)
        await console.sign_in("provider")
        hosts = await console.api("provider", "/hosts?limit=10")
        host = hosts["items"][0]
        await console.go(f"#/hosts/{host['id']}")
        await expect(console.page.locator("table.power-gpus")).to_be_visible(timeout=WAIT_MS)  # the host's GPUs, loaded
        form = console.page.locator("form.power-form")
        await form.get_by_label("Lower this host's idle GPUs off-peak").check()
        await form.get_by_label("Value").fill("60")
        await form.get_by_role("button", name="Save power policy").click()
        await expect(console.page.locator("table.power-gpus tbody tr").first).to_contain_text("W", timeout=WAIT_MS)

        async def lowered() -> dict[str, Any] | None:
            policy: dict[str, Any] = await console.api("provider", f"/hosts/{host['id']}/power-policy")
            assert "gpus" in policy, policy
            done = policy["gpus"] and all(g["target_w"] and g["limit_w"] == g["target_w"] for g in policy["gpus"])
            return policy if done and policy["energy_saved_wh"] > 0 else None

        # Asked twice a second: the provider's key has a rate limit, and the agent reports every 2 s anyway.
        policy = await eventually(lowered, timeout=WAIT_MS / 1000, every=0.5, what="the host's GPUs lowered and saving energy")
        assert policy["agent"]["state"] == "succeeded" and policy["off_peak_until"]
        await console.go("#/earnings")
        figure = console.page.locator('figure.chart-uplot[data-title="Energy saved per day"]')
        await figure.locator("canvas").first.wait_for(timeout=WAIT_MS)
        assert await figure.get_attribute("data-points") == "30"
        await expect(console.page.locator("#energy-saved-total")).to_have_text(re.compile(r"[1-9].* k?Wh$"))
        await console.shot("power-earnings")
        await console.go(f"#/hosts/{host['id']}")  # again, now that the agent has answered
        await expect(console.page.locator(".power-current")).to_contain_text("applied: 2 GPUs lowered", timeout=WAIT_MS)
        await console.shot("power-host")
        assert not console.problems, console.problems
        await console.context.close()
