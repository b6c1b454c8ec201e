"""The console's Services tab in a real browser: make a service through the dialog (its token shown once, copied),
see it listed, open it (charts over time from /stats, cost so far, replicas, events), set its bounds, rotate its token,
delete it; and the pages at a phone's width.

On the marketplace of ``tests/test_console_browser.py`` (its `gpumarket up --agents 3` with a container engine
answering, shared by the console's browser modules that run one after the other): the replica runs the busybox test image's httpd
(``tests/dockerengine.py``). The gateway's figures are rows of ``service_stats``, written here into the marketplace's
SQLite database as the gateway's stats loop writes them, so that requests, errors and latency have points to draw.
Screenshots land in ``test-artifacts/console/``.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from playwright.async_api import Browser, Page, expect
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from master.models import ServiceStat
from shared.money import format_usd
from tests import test_console_browser as browser_module
from tests.test_console_browser import POLL_MS, WAIT_MS, Market, _console

pytestmark = pytest.mark.slow

BUCKET_S = 5  # service_stats_bucket_s, the master's default
# Figures of the seeded buckets, newest first: requests, errors, retries and a latency histogram (counts per bucket of
# gateway/stats.py's bounds: 1, 2, 5, 10, 20, 50, 100, 200, 500 ms, …).
SEEDED = [(40 + 10 * i, i % 3, i % 2, [0, 0, 0, 0, 5, 20 + i, 10, 4, 1]) for i in range(12)]


# The browser module's marketplace, shared as in test_console_layout: a container engine answers (the replicas run
# the test image).
market = browser_module.market


def seed_stats(market: Market, service_id: str, since: datetime) -> int:
    """Write the gateway's figures for ``service_id`` (one master's rows), a bucket each from ``since``'s to now's (at
    most ``len(SEEDED)``, newest first); the requests in all."""
    assert market.data_dir is not None

    def bucket(at: datetime) -> datetime:
        return datetime.fromtimestamp(at.timestamp() // BUCKET_S * BUCKET_S, tz=UTC)

    newest, oldest = bucket(datetime.now(UTC)), bucket(since)
    engine = create_engine(f"sqlite:///{market.data_dir / 'gpumarket.db'}", connect_args={"timeout": 10})
    requests = 0
    try:
        with Session(engine) as session, session.begin():
            for i, (count, errors, retries, hist) in enumerate(SEEDED):
                at = newest - timedelta(seconds=BUCKET_S * i)
                if at < oldest:
                    break
                session.add(ServiceStat(service_id=service_id, bucket_at=at, node="test-gateway", requests=count, errors=errors,
                                        retries=retries, inflight_sum=3.0 * (i + 1), inflight_samples=BUCKET_S, inflight_peak=i + 1,
                                        latency_hist=hist))  # fmt: skip
                requests += count
    finally:
        engine.dispose()
    return requests


async def chart_points(page: Page, title: str) -> int:
    return int(await page.locator(f'figure.chart[data-title="{title}"]').get_attribute("data-points") or 0)


async def clipboard(page: Page) -> str:
    return str(await page.evaluate("navigator.clipboard.readText()"))


class TestServices:
    async def test_make_watch_scale_rotate_and_delete_a_service(self, browser: Browser, market: Market, docker_image: str) -> None:
        """The dialog refuses a bad name at its field, then makes the service and shows its token once (copied to the
        clipboard) with the endpoint; the service's page draws its replicas, requests, latency and errors over time
        from /stats, its cost, replica and events; the bounds form moves its bounds, "Rotate token" shows a new token,
        the list shows it with its endpoint to copy, and Delete after a confirmation deletes it."""
        console = await _console(browser, market, viewport={"width": 1366, "height": 900}, permissions=["clipboard-read", "clipboard-write"])
        await console.sign_in("renter")
        page = console.page
        await console.go("#/services")
        await expect(page.get_by_role("link", name="Services", exact=True)).to_have_attribute("aria-current", "page")
        await expect(page.locator("table.services")).to_contain_text("No services yet")

        await page.locator("#create-service").click()
        dialog = page.locator("dialog.service-dialog")
        name = dialog.get_by_label("Name", exact=True)
        await name.fill("Echo")
        await dialog.get_by_label("Custom image").check()
        await dialog.get_by_label("Image", exact=True).fill(docker_image)
        await dialog.get_by_label("Command (optional)").fill('["sh", "-c", "echo ok > /tmp/health && httpd -f -p 8000 -h /tmp"]')
        await dialog.get_by_label("Port", exact=True).fill("8000")
        await dialog.get_by_label("Health check path").fill("/health")
        await dialog.get_by_label("Most replicas").fill("2")
        await dialog.get_by_label("Requests in flight per replica").fill("2")
        await dialog.locator("#make-service").click()
        await expect(name).to_have_attribute("aria-invalid", "true")
        await expect(dialog.locator(".field-error").first).to_contain_text("lower-case letters")
        await expect(dialog.locator("#service-token")).to_have_count(0)
        await name.fill("echo")
        tolerance = dialog.get_by_label("Price tolerance, % (optional)")
        await tolerance.fill("5.555")  # percent with two decimals at most
        await dialog.locator("#make-service").click()
        await expect(tolerance).to_have_attribute("aria-invalid", "true")
        await expect(dialog.locator(".field-error:not([hidden])")).to_contain_text("price tolerance in percent")
        await tolerance.fill("7.5")
        await dialog.locator("#make-service").click()

        token_el = dialog.locator("#service-token")
        await expect(token_el).to_contain_text("gms_")
        token = (await token_el.inner_text()).strip()
        await expect(dialog.locator("#token-warning")).to_contain_text("shown only this once")
        service_id = (await dialog.locator("#made-service-id").inner_text()).strip()
        service: dict[str, Any] = await console.api("renter", f"/services/{service_id}")
        assert token.startswith(service["token_prefix"]) and "token" not in service
        assert {k: service["workload"].get(k) for k in ("kind", "image", "ports", "command")} == {"kind": "container", "image": docker_image, "ports": [8000],
                                       "command": ["sh", "-c", "echo ok > /tmp/health && httpd -f -p 8000 -h /tmp"]}  # fmt: skip
        assert (service["min_replicas"], service["max_replicas"], service["scaling"]["target"]) == (1, 2, 2.0)
        assert service["price_tolerance"] == "0.075"  # 7.5 % as the API's fraction
        await expect(dialog.locator("#token-endpoint")).to_have_text(service["endpoint_url"])
        await expect(dialog.locator("#token-base-url")).to_have_text(service["endpoint_url"] + "v1")
        await dialog.get_by_role("button", name="Copy the service token").click()
        await expect(dialog.locator(".copy-status").first).to_have_text("Copied to the clipboard.")
        assert await clipboard(page) == token
        await console.view_shot("services-token")
        assert await console.fits_sideways("dialog")
        await dialog.locator("#open-service").click()

        await page.wait_for_url(f"**/#/services/{service_id}", timeout=WAIT_MS)
        await expect(page.locator("h1")).to_have_text("Service echo")
        await expect(page.locator(".service-summary .badge").first).to_have_text("active")
        await expect(page.locator("#service-endpoint")).to_have_text(service["endpoint_url"])
        await expect(page.locator("#service-token-prefix")).to_have_text(f"{service['token_prefix']}…")
        await expect(page.locator("main")).to_contain_text("any model per replica, the cheapest within 7.5 %")
        requests = seed_stats(market, service_id, since=datetime.fromisoformat(service["created_at"]))
        await expect(page.locator("#stats-note")).to_contain_text(f"{requests} requests", timeout=WAIT_MS)
        stats = await console.api("renter", f"/services/{service_id}/stats?minutes=60")
        made = datetime.fromisoformat(service["created_at"])
        lived = [p for p in stats["points"] if datetime.fromisoformat(p["at"]) + timedelta(seconds=stats["step_s"]) > made]
        latencies = sum((p["p50_ms"] is not None) + (p["p99_ms"] is not None) for p in lived)
        assert latencies > 0
        assert await chart_points(page, "Latency") == latencies  # p50 and p99 where a bucket had requests
        # Every point since the service was made: live and ready, requests/s, errors and retries (zero where none).
        slots = await chart_points(page, "Requests per second")
        first = int(await page.locator('figure.chart[data-title="Replicas"]').get_attribute("data-first") or 0)
        assert 0 < slots < 60 * 60 // stats["step_s"]
        assert datetime.fromtimestamp(first / 1000, tz=UTC) > made - timedelta(seconds=stats["step_s"])
        assert await chart_points(page, "Replicas") == await chart_points(page, "Errors and retries") == 2 * slots
        # The replica runs and its health check passed through the gateway (the autoscaler's probe): live and ready.
        await expect(page.locator('figure.chart[data-title="Replicas"] svg')).to_have_attribute(
            "aria-label", "Replicas, latest: Live 1, Ready 1.", timeout=WAIT_MS)  # fmt: skip
        await expect(page.locator("table.service-events tbody")).to_contain_text("ready", timeout=WAIT_MS)
        replica = page.locator("table.service-replicas tbody tr")
        await expect(replica).to_have_count(1)
        rental_id = service["replica_rentals"][0]["rental_id"]
        await expect(replica.locator("a.rental-link")).to_have_attribute("href", f"#/rentals/{rental_id}")
        await expect(replica.locator("td").nth(1)).to_have_text("running", timeout=WAIT_MS)
        await expect(page.locator("table.service-events tbody")).to_contain_text("created with 1 to 2 replicas")
        cost = page.locator("#service-cost")
        await expect(cost).to_have_attribute("data-amount", re.compile(r"^\d+\.\d+$"))
        assert (await cost.inner_text()).strip() == format_usd(await cost.get_attribute("data-amount"), "total")
        await console.shot("service-running")

        # Bounds: 2 to 3; the autoscaler's target moves into them at once (an event says by whom).
        await page.get_by_label("Fewest").fill("2")
        await page.get_by_label("Most", exact=True).fill("3")
        await page.locator("#scale-service").click()
        await expect(page.locator("#notice")).to_contain_text("keeps 2 to 3 replicas")
        await expect(page.locator("table.service-events tbody")).to_contain_text("bounds set to 2..3")
        scaled = await console.api("renter", f"/services/{service_id}")
        assert (scaled["min_replicas"], scaled["max_replicas"], scaled["desired_replicas"]) == (2, 3, 2)
        await page.get_by_label("Fewest").fill("4")
        await page.locator("#scale-service").click()
        await expect(page.locator(".scale-form .field-error:not([hidden])")).to_have_text("Enter a whole number, at least 1 and at least the fewest.")

        # A new token: shown once, different, and the old one no longer the service's.
        await page.locator("#rotate-token").click()
        await expect(page.locator(".confirm-text")).to_contain_text("stops working at once")
        await page.locator("#confirm-rotate-token").click()
        new_token = page.locator("#service-token")
        await expect(new_token).to_contain_text("gms_")
        rotated = (await new_token.inner_text()).strip()
        assert rotated != token
        assert rotated.startswith((await console.api("renter", f"/services/{service_id}"))["token_prefix"])
        await expect(page.locator("table.service-events tbody")).to_contain_text("token replaced")
        await console.view_shot("service-token-rotated")
        await page.locator("#hide-token").click()
        await expect(page.locator("#service-token")).to_have_count(0)

        # The list: its row, the endpoint to copy, the cost.
        await console.go("#/services")
        row = page.locator("table.services tbody tr").first
        await expect(row.locator("a.service-link")).to_have_attribute("href", f"#/services/{service_id}")
        await expect(row).to_contain_text("active")
        await expect(row.locator(".service-ready")).to_have_text(re.compile(r"^[0-2] / 2$"))  # the second one may be starting
        await expect(row.locator("code.endpoint-path")).to_have_text(f"/svc/{service_id}/")
        await row.get_by_role("button", name="Copy the endpoint URL of echo").click()
        await expect(row.locator(".copy-status")).to_have_text("Copied to the clipboard.")
        assert await clipboard(page) == service["endpoint_url"]
        await console.shot("services")
        await row.locator("a.service-link").click()

        await page.locator("#delete-service").click()
        await expect(page.locator(".confirm-text")).to_contain_text("its endpoint closes")
        await page.locator("#confirm-delete-service").click()
        await expect(page.locator("#notice")).to_contain_text("Service echo is deleted.")
        await expect(page.locator("table.service-events tbody")).to_contain_text("deleted by")
        await expect(page.locator(".service-summary .badge").first).to_have_text("deleted")
        assert not await page.locator("#delete-service, #rotate-token, #scale-service").count()
        gone = await console.api("renter", f"/services/{service_id}")
        assert gone["state"] == "deleted" and gone["replica_rentals"][0]["state"] in ("stopping", "stopped")
        await console.go("#/services")
        await expect(page.locator("table.services")).to_contain_text("No services yet")
        assert not console.problems, console.problems
        await console.context.close()

    async def test_a_service_whose_image_cannot_be_had_says_why_folds_its_failures_and_tries_again(
        self, browser: Browser, market: Market
    ) -> None:
        """Issue 39, point 2: an image no registry gives this offline marketplace. The service's page says why its
        replica did not start and when the next comes, counts the failed replicas ("Show 1 failed" lists them), the
        Rentals page folds them into one row for the service, and "Try again now" resumes it."""
        console = await _console(browser, market, viewport={"width": 1366, "height": 900})
        await console.sign_in("renter")
        page = console.page
        made = await console.api("renter", "/services", method="POST", body={
            "name": "nopull", "workload": {"kind": "container", "image": "gpumarket-test/no-such-image:404", "ports": [8000]},
            "port": 8000, "min_replicas": 1, "max_replicas": 1})  # fmt: skip
        service_id = made["id"]
        await console.go(f"#/services/{service_id}")
        failure = page.locator("#service-failure")
        await expect(failure).to_contain_text(re.compile(r"\d+ replicas? in a row since"), timeout=WAIT_MS)
        view = await console.api("renter", f"/services/{service_id}")
        code = view["failure"]["code"]
        assert code in ("image_pull_failed", "image_not_found") and view["replicas"]["failed"] >= 1, view
        await expect(failure.locator("code")).to_have_text(code)
        await expect(page.locator(".service-summary")).to_contain_text(re.compile("Not starting|Failing"))  # 3 failures: failing
        toggle = page.locator("#toggle-failed-replicas")
        await expect(toggle).to_have_text(re.compile(r"^Show \d+ failed$"))
        await toggle.click()
        await expect(toggle).to_have_attribute("aria-pressed", "true")
        await expect(page.locator("table.service-replicas tbody")).to_contain_text(code)
        await console.shot("service-not-starting")

        await console.go("#/rentals")
        folded = page.locator("table.rentals a.folded-replicas")
        await expect(folded).to_have_count(1)
        await expect(folded).to_contain_text(f"of service {service_id}")
        await expect(folded).to_have_attribute("href", f"#/services/{service_id}")
        await page.get_by_label("List services' failed replicas one by one").check()
        await expect(folded).to_have_count(0)

        await console.go(f"#/services/{service_id}")
        await page.locator("#resume-service").click()
        await expect(page.locator("#notice")).to_contain_text("replicas are rented again")
        await expect(page.locator("table.service-events tbody")).to_contain_text("resumed by")
        await console.api("renter", f"/services/{service_id}", method="DELETE")
        assert not console.problems, console.problems
        await console.context.close()

    async def test_the_pages_fit_a_phone(self, browser: Browser, market: Market, docker_image: str) -> None:
        """At 390×844 the list, the dialog with its token and the service's page with its charts do not scroll sideways."""
        console = await _console(browser, market, viewport={"width": 390, "height": 844})
        await console.sign_in("renter")
        page = console.page
        await console.go("#/services")
        await page.locator("#create-service").click()
        dialog = page.locator("dialog.service-dialog")
        await dialog.get_by_label("Name", exact=True).fill("phone")
        await dialog.get_by_label("Custom image").check()
        await dialog.get_by_label("Image", exact=True).fill(docker_image)
        await dialog.get_by_label("Command (optional)").fill("httpd -f -p 8000 -h /tmp")
        await dialog.get_by_label("Port", exact=True).fill("8000")
        await dialog.get_by_label("Fewest replicas").fill("0")
        assert await console.fits_sideways("dialog")
        await dialog.locator("#make-service").click()
        await expect(dialog.locator("#service-token")).to_contain_text("gms_")
        assert await console.fits_sideways("dialog")
        await console.view_shot("services-token-phone")
        await dialog.locator("#open-service").click()
        await expect(page.locator("#service-cost")).to_be_visible()
        await page.wait_for_function("() => +document.querySelector('figure.chart[data-title=Replicas]').dataset.points > 0",
                                     polling=POLL_MS)
        assert await console.fits_sideways("main")
        await console.shot("service-phone")
        service_id = page.url.rsplit("/", 1)[1]
        await console.go("#/services")
        await expect(page.locator("table.services a.service-link")).to_have_count(1)
        assert await console.fits_sideways("main")
        await console.shot("services-phone")
        await console.api("renter", f"/services/{service_id}", method="DELETE")
        assert not console.problems, console.problems
        await console.context.close()
