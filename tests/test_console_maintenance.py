"""The provider console's maintenance windows in a real browser (``console/static/maintenance.js``).

The test runs on the market of ``tests/test_console_browser.py`` (its ``TestMaintenanceWindows`` is
this module's ``MaintenanceWindows``), so the suite starts no other ``gpumarket up`` for it; pytest
collects nothing here. The browser's time zone is Asia/Kolkata (UTC+05:30), so a time read as local
and one read as UTC differ. It uses the last host of the provider's list (``TestProvider`` lists the
first) and leaves the host with no windows.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from playwright.async_api import expect

if TYPE_CHECKING:
    from playwright.async_api import Browser

    from tests.test_console_browser import Market

ZONE = "Asia/Kolkata"  # UTC+05:30, no daylight saving time


class MaintenanceWindows:
    async def test_set_a_window_see_an_overlap_refused_then_clear_it(self, browser: Browser, market: Market) -> None:
        """A window set in UTC and one set in local time reach the API as those moments; an overlap and a backwards
        window show the API's message at the form and change nothing; the listing form's save keeps the windows;
        Clear removes each."""
        from tests.test_console_browser import _console  # here: that module imports this one

        console = await _console(browser, market, timezone_id=ZONE, locale="en-GB")  # en-GB: a 24-hour clock
        page = console.page
        await console.sign_in("provider")
        await expect(page.locator("a.host-link")).to_have_count(3)
        host_link = page.locator("a.host-link").last
        host_id = (await host_link.get_attribute("href") or "").rsplit("/", 1)[1]
        path = f"/hosts/{host_id}/listing"
        if (await console.api("provider", path)).get("code") == "listing_not_found":
            host = await console.api("provider", f"/hosts/{host_id}")
            bounds = {b["tier"]: b for b in (await console.api("provider", "/price-bounds"))["items"]}
            listed = await console.api("provider", path, "PUT", {"price_per_gpu_hour": bounds[host["tier"]]["default"]})
            assert listed["host_id"] == host_id, listed
        await host_link.click()
        section = page.locator("section.maintenance")
        form = section.locator("form.maintenance-form")
        await expect(form).to_be_visible()
        await expect(section.locator("table.maintenance-windows tbody")).to_contain_text("No maintenance windows")

        day = (datetime.now(UTC) + timedelta(days=1)).date().isoformat()
        start, end = form.get_by_label("Start"), form.get_by_label("End", exact=True)
        # In UTC (the default): 10:00 for the preset 2 hours, which fills the end.
        await expect(form.get_by_label("The times below are in")).to_have_value("utc")
        await start.fill(f"{day}T10:00")
        await form.get_by_label("Length").select_option("2")
        await expect(end).to_have_value(f"{day}T12:00")
        await form.get_by_role("button", name="Add window").click()
        await expect(page.locator("#notice")).to_contain_text("Maintenance window added")
        first = {"start": f"{day}T10:00:00Z", "end": f"{day}T12:00:00Z"}
        row = section.locator(f'tr[data-start="{first["start"]}"]')
        await expect(row).to_contain_text(f"{day} 10:00 UTC")
        await expect(row).to_contain_text("15:30")  # the same start in Kolkata
        assert (await console.api("provider", path))["maintenance_windows"] == [first]
        await expect(page.locator(".listing-current")).to_contain_text(first["start"])  # the listing's facts follow

        # Overlapping it: the API's refusal at the form, nothing added.
        await start.fill(f"{day}T11:00")
        await form.get_by_label("Length").select_option("4")
        await form.get_by_role("button", name="Add window").click()
        alert = form.locator("[role=alert]")
        await expect(alert).to_contain_text(f"overlaps the one from {first['start']} to {first['end']}")
        # Ending before it starts (a custom end).
        await form.get_by_label("Length").select_option("")
        await end.fill(f"{day}T09:00")
        await form.get_by_role("button", name="Add window").click()
        await expect(alert).to_contain_text("ends before it starts")
        assert (await console.api("provider", path))["maintenance_windows"] == [first]
        await expect(section.locator("table.maintenance-windows tbody tr")).to_have_count(1)

        # In local time: 20:00 in Kolkata is 14:30 UTC.
        await form.get_by_label("The times below are in").select_option("local")
        await start.fill(f"{day}T20:00")
        await form.get_by_label("Length").select_option("1")
        await form.get_by_role("button", name="Add window").click()
        await expect(alert).to_be_empty()
        second = {"start": f"{day}T14:30:00Z", "end": f"{day}T15:30:00Z"}
        await expect(section.locator(f'tr[data-start="{second["start"]}"]')).to_contain_text(f"{day} 14:30 UTC")
        assert (await console.api("provider", path))["maintenance_windows"] == [first, second]

        # The listing form's PUT sends the windows it now knows: saving it keeps both.
        await page.get_by_role("button", name="Save listing").click()
        await expect(page.locator("#notice")).to_contain_text("Listing saved")
        assert (await console.api("provider", path))["maintenance_windows"] == [first, second]
        await console.shot("maintenance")

        # Clear each: gone from the page and from the API.
        await row.get_by_role("button", name=re.compile("^Clear")).click()
        await expect(row).to_have_count(0)
        assert (await console.api("provider", path))["maintenance_windows"] == [second]
        await section.locator(f'tr[data-start="{second["start"]}"]').get_by_role("button", name=re.compile("^Clear")).click()
        await expect(section.locator("table.maintenance-windows tbody")).to_contain_text("No maintenance windows")
        assert (await console.api("provider", path))["maintenance_windows"] == []
        await page.get_by_role("button", name="Save listing").click()  # and the form does not bring one back
        await expect(page.locator("#notice")).to_contain_text("Listing saved")
        assert (await console.api("provider", path))["maintenance_windows"] == []
        assert console.problems == []
