"""Issue 40 in a real browser: the "✓ verified" badge on offers and in the Rent dialog, the "Verified hosts only"
filter, and the host page's figures (measured vs expected throughput as a bar) with a failed GPU's reason and what its
provider does about it (``console/static/verification.js``).

The test runs on the market of ``tests/test_console_browser.py`` (its ``TestVerification`` is this module's
``Verification``), so the suite starts no other ``gpumarket up`` for it; pytest collects nothing here. What the GPU
challenge flow writes (the GPUs' verification columns and the listing's flag) is written into the market's SQLite
database directly (``write_proofs``) and put back as it was at the end.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from playwright.async_api import expect
from sqlalchemy import create_engine, update
from sqlalchemy.orm import Session

from master.models import Gpu, HostListing

if TYPE_CHECKING:
    from playwright.async_api import Browser

    from tests.test_console_browser import Market

TOO_SLOW_ADVICE = "nvidia-smi -q -d PERFORMANCE"


def _engine(market: Market) -> Any:
    assert market.data_dir is not None
    return create_engine(f"sqlite:///{market.data_dir / 'gpumarket.db'}", connect_args={"timeout": 10})


def write_proofs(market: Market, host_id: str, outcomes: Mapping[int, str | None], *, tflops: float = 150.0) -> None:
    """Each GPU index's last challenge as the flow writes it (``passed`` an hour ago at ``tflops``, ``failed`` too
    slow twice in a row, None: never challenged), and the listing's flag: every GPU passed."""
    at = datetime.now(UTC) - timedelta(hours=1)
    engine = _engine(market)
    try:
        with Session(engine) as session, session.begin():
            for index, outcome in outcomes.items():
                passed = outcome == "passed"
                session.execute(update(Gpu).where(Gpu.host_id == host_id, Gpu.index == index).values(
                    verification_outcome=outcome, verified_at=at if outcome else None, verified_tflops=tflops if passed else None,
                    verified_vram_mib=Gpu.memory_total_mib if passed else None,
                    verification_reason="too_slow" if outcome == "failed" else None,
                    verification_failures=2 if outcome == "failed" else 0,
                ))  # fmt: skip
            every = all(o == "passed" for o in outcomes.values())
            session.execute(update(HostListing).where(HostListing.host_id == host_id).values(verified=every))
    finally:
        engine.dispose()


@contextmanager
def proofs(market: Market, written: Mapping[str, Mapping[int, str | None]]) -> Iterator[None]:
    """``write_proofs`` for each host, cleared again at the end (never challenged, the flag off)."""
    try:
        for host_id, outcomes in written.items():
            write_proofs(market, host_id, outcomes)
        yield
    finally:
        for host_id, outcomes in written.items():
            write_proofs(market, host_id, dict.fromkeys(outcomes))


class Verification:
    async def test_the_badge_the_filter_and_the_host_figures(self, browser: Browser, market: Market) -> None:
        """A host whose GPUs passed carries "✓ verified" on its offer and in the Rent dialog (with the bar), the
        filter keeps only it; its provider's page of another host whose GPU failed shows the reason and what to do."""
        from tests.test_console_browser import _console, _rent_button  # here: that module imports this one

        console = await _console(browser, market)
        page = console.page
        hosts = (await console.api("provider", "/hosts"))["items"]
        offered = {o["host_id"] for o in (await console.api("renter", "/offers?limit=500"))["items"]}
        proven = next(h for h in hosts if h["id"] in offered)
        failing = next(h for h in hosts if h["id"] != proven["id"])
        path = f"/hosts/{proven['id']}/listing"
        if (await console.api("provider", path)).get("code") == "listing_not_found":
            bounds = {b["tier"]: b for b in (await console.api("provider", "/price-bounds"))["items"]}
            listed = await console.api("provider", path, "PUT", {"price_per_gpu_hour": bounds[proven["tier"]]["default"]})
            assert listed["host_id"] == proven["id"], listed
        # The market's own challenges proved its hosts at enrollment: every other host is written never challenged, so
        # that only `proven` carries the badge (fresh run 40 saw another host's from its enrollment).
        written = {h["id"]: {g["index"]: None for g in h["gpus"]} for h in hosts}
        written.update({proven["id"]: {g["index"]: "passed" for g in proven["gpus"]},
                        failing["id"]: {g["index"]: "failed" for g in failing["gpus"]}})  # fmt: skip
        with proofs(market, written):
            offers = (await console.api("renter", "/offers?limit=500"))["items"]
            offer = next(o for o in offers if o["host_id"] == proven["id"])
            assert offer["verified"] is True, offer
            await console.sign_in("renter")
            await console.go("#/offers")
            row = page.locator(f'tr[data-offer-id="{offer["id"]}"]')
            await expect(row.locator(".badge.verified-yes")).to_have_text("✓ verified")
            others = [o for o in offers if o["host_id"] != proven["id"]]
            for other in others:
                await expect(page.locator(f'tr[data-offer-id="{other["id"]}"] .badge.verified-yes')).to_have_count(0)
            await page.get_by_label("Verified hosts only").check()
            await page.get_by_role("button", name="Search").click()
            await expect(page.locator("table.offers tbody tr")).to_have_count(len([o for o in offers if o["verified"]]))
            await expect(page.locator(".result-count")).to_contain_text("verified=true")
            await _rent_button(page, offer).click()
            dialog = page.locator("dialog.rent-dialog")
            await expect(dialog.locator(".proof-fact .badge.verified-yes")).to_be_visible()
            if offer["verification"]["tflops_expected"]:
                await expect(dialog.locator(".proof-fact meter")).to_have_attribute("value", "150")
            await console.shot("verified-rent-dialog")
            await dialog.get_by_role("button", name="Cancel").click()

            provider = await _console(browser, market)
            await provider.sign_in("provider")
            await provider.go(f"#/hosts/{failing['id']}")
            section = provider.page.locator(".host-proof")
            await expect(section.locator("table.proofs .badge.verified-failed")).to_have_count(len(failing["gpus"]))
            note = section.locator(".proof-failure").first
            await expect(note).to_contain_text("failed: too_slow")
            await expect(note).to_contain_text("2 times in a row")
            await expect(note).to_contain_text(TOO_SLOW_ADVICE)
            await provider.go(f"#/hosts/{proven['id']}")
            await expect(section.locator("table.proofs .badge.verified-yes")).to_have_count(len(proven["gpus"]))
            await expect(section).to_contain_text(re.compile("Every GPU passed"))
            if any(g["verification"]["tflops_expected"] for g in proven["gpus"]):
                await expect(section.locator("meter").first).to_have_attribute("aria-label", re.compile(r"150 of \d+ TFLOP/s expected"))
            await expect(section.locator(".proof-failure")).to_have_count(0)
            await provider.shot("verified-host")
            assert console.problems == [] and provider.problems == [], (console.problems, provider.problems)
