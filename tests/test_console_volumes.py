"""The console's Volumes page (``#/volumes``) in a real browser: a bad name refused at its field, a volume made through
the form and made for real by a demo host's agent (a loop-mounted disk: `gpumarket up` runs as root here), listed with
its host and cost, deleted after a confirmation; and the page at a phone's width.

On the marketplace of ``tests/test_console_browser.py`` (its `gpumarket up --agents 3`, shared by the console's
browser modules), whose demo hosts lend storage to volumes (``gpumarket/demo.py``). Screenshots land in
``test-artifacts/console/``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from playwright.async_api import Browser, expect

from tests import test_console_browser as browser_module
from tests.helpers import eventually
from tests.test_console_browser import (
    API_POLL_S,
    START_S,
    WAIT_MS,
    Console,
    Market,
    _console,
    _rent_button,
    _until_ended,
)

pytestmark = pytest.mark.slow

market = browser_module.market


async def lending_hosts(console: Console) -> list[dict[str, Any]]:
    """The demo hosts' offers once they lend storage (their listings are made after their first speed test)."""

    async def found() -> list[dict[str, Any]] | None:
        offers = (await console.api("renter", "/offers?limit=50"))["items"]
        lending = [o for o in offers if o.get("volume_gib_free") and o.get("volumes_kept")]
        return lending or None

    return list(
        await eventually(
            found, timeout=START_S, every=API_POLL_S, what="demo hosts that lend storage to volumes"
        )
    )


class TestVolumes:
    async def test_make_see_and_delete_a_volume(self, browser: Browser, market: Market) -> None:
        console = await _console(browser, market, viewport={"width": 1366, "height": 900})
        await console.sign_in("renter")
        page = console.page
        cheapest = min(await lending_hosts(console), key=lambda o: float(o["storage_price_per_gib_hour"]))
        await console.go("#/volumes")
        await expect(page.get_by_role("link", name="Volumes", exact=True)).to_have_attribute(
            "aria-current", "page"
        )
        await expect(page.locator("table.volumes")).to_contain_text("No volumes yet")

        name = page.get_by_label("Name", exact=True)
        await name.fill("Data")
        await page.get_by_label("Size, GiB").fill("1")
        await page.locator("#create-volume").click()
        await expect(name).to_have_attribute("aria-invalid", "true")
        await expect(page.locator(".volume-form .field-error").first).to_contain_text("lower-case letters")
        assert (await console.api("renter", "/volumes"))["total"] == 0

        await name.fill("data")
        await page.locator("#create-volume").click()
        await expect(page.locator("#notice")).to_contain_text("Volume data is creating on host")
        row = page.locator("table.volumes tbody tr").first
        await expect(row.locator(".volume-name")).to_have_text("data")
        # Its host's agent made it, for real.
        await expect(row.locator(".badge")).to_have_text("ready", timeout=WAIT_MS)
        [volume] = (await console.api("renter", "/volumes"))["items"]
        assert volume["state"] == "ready" and volume["size_gib"] == 1
        cheapest_price = cheapest["storage_price_per_gib_hour"]
        assert volume["price_per_gib_hour"] == cheapest_price  # no host named: the cheapest
        await expect(row).to_contain_text(volume["host_id"])
        await expect(row).to_contain_text("per GiB-hour")
        await console.shot("volumes")

        try:
            await row.get_by_role("button", name="Delete").click()
            await expect(row.locator(".confirm-text")).to_contain_text("Delete data (1 GiB)?")
            await row.get_by_role("button", name="Keep it").click()
            await expect(row.get_by_role("button", name="Delete")).to_be_visible()
            await row.get_by_role("button", name="Delete").click()
            await row.locator(f"#confirm-delete-{volume['id']}").click()
            await expect(page.locator("#notice")).to_contain_text("Volume data is deleting: billing stopped.")
            # Its agent deleted it.
            await expect(page.locator("table.volumes")).to_contain_text("No volumes yet", timeout=WAIT_MS)
        finally:
            # The market as it was found.
            await console.api("renter", f"/volumes/{volume['id']}", method="DELETE")
        assert (await console.api("renter", f"/volumes/{volume['id']}"))["state"] == "deleted"
        assert not console.problems, console.problems
        await console.context.close()

    async def test_the_rent_dialog_mounts_a_volume_of_that_host_and_one_writer_only(self, browser: Browser, market: Market) -> None:
        """The Rent dialog offers the renter's ready volumes on the offer's host: ticked, the confirmation names it,
        the rental mounts it; a second rental asking it read-write is refused, naming the first."""
        console = await _console(browser, market, viewport={"width": 1366, "height": 900})
        await console.sign_in("renter")
        page = console.page
        # A host with two free GPUs: the second rental is refused for its volume, not for want of a GPU.
        offer = max(await lending_hosts(console), key=lambda o: int(o["num_gpus"]))
        assert offer["num_gpus"] >= 2, offer
        made = await console.api("renter", "/volumes", method="POST", body={"name": "dialog-data", "size_gib": 1, "host_id": offer["host_id"]})
        rentals: list[str] = []
        try:

            async def ready() -> bool:
                return bool((await console.api("renter", f"/volumes/{made['id']}"))["state"] == "ready")

            await eventually(ready, timeout=WAIT_MS / 1000, every=API_POLL_S, what="the volume made")
            for attempt in range(2):
                await console.go("#/offers")
                await _rent_button(page, offer).click()
                dialog = page.get_by_role("dialog")
                await dialog.get_by_role("radio", name=re.compile("^demo")).check()  # runs offline (base pulls ubuntu)
                await dialog.get_by_label("Mount dialog-data (1 GiB)").check()
                await expect(dialog.get_by_label("Mount point of dialog-data")).to_have_value("/data")
                await dialog.get_by_role("button", name="Review price").click()
                await expect(dialog.locator("#confirm-volumes")).to_have_text("dialog-data at /data.")
                if attempt == 0:
                    await console.view_shot("rent-dialog-volume")
                    async with page.expect_request(lambda r: r.method == "POST" and r.url.endswith("/api/v1/rentals")) as sent:
                        await dialog.get_by_role("button", name="Confirm and rent").click()
                    posted = (await sent.value).post_data_json
                    assert posted is not None and posted["volumes"] == [{"name": "dialog-data", "mount": "/data"}]
                    await page.wait_for_url("**#/rentals/r-*")
                    rentals.append(page.url.rsplit("/", 1)[1])
                else:
                    await dialog.get_by_role("button", name="Confirm and rent").click()
                    alert = dialog.get_by_role("alert")
                    await expect(alert).to_contain_text("mounted read-write")
                    await expect(alert).to_have_attribute("data-code", "volume_in_use")
                    await expect(alert).to_contain_text(rentals[0])
            rental = await console.api("renter", f"/rentals/{rentals[0]}")
            assert rental["state"] in ("starting", "running") and rental["host_id"] == offer["host_id"]
            assert rental["volumes"] == [{"name": "dialog-data", "mount": "/data", "read_only": False}], rental
            assert not console.problems, console.problems
        finally:
            for rental_id in rentals:
                await console.api("renter", f"/rentals/{rental_id}", method="DELETE")
                await _until_ended(console, rental_id)
            await console.api("renter", f"/volumes/{made['id']}", method="DELETE")
            await console.context.close()

    async def test_the_page_fits_a_phone(self, browser: Browser, market: Market) -> None:
        console = await _console(browser, market, viewport={"width": 390, "height": 844})
        await console.sign_in("renter")
        await console.go("#/volumes")
        await expect(console.page.locator("#create-volume")).to_be_visible()
        await expect(console.page.locator("table.volumes")).to_be_visible()
        assert await console.fits_sideways("body")
        await console.shot("volumes-phone")
        assert not console.problems, console.problems
        await console.context.close()
