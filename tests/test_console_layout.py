"""Every console page fits the screen and passes axe-core: at 1366×900, 1280×720 and a phone's 390×844.

For each page of each role (and the sign-in page) at each size, from the DOM: the page does not scroll
sideways (``scrollWidth <= clientWidth``), the page's primary action lies inside the viewport without
scrolling, no table cell breaks a word across two lines, every chart's text is drawn at least 11 px high
(its font size times the SVG's scale on screen), and axe-core (bundled by ``axe-playwright-python``, injected
through Playwright) finds no serious or critical violation. A full-page screenshot of each lands in
``test-artifacts/console/layout-<role>-<page>-<width>x<height>.png``.

One marketplace (``tests/test_console_browser.py``'s, shared with that module) serves the module, the worker's Chromium
its pages.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

import pytest
from playwright.async_api import Browser, expect

from tests import test_console_browser as browser_module
from tests.test_console_browser import POLL_MS, WAIT_MS, Console, Market, _console

# The browser module's marketplace serves this one too: the same `gpumarket up` when this module runs right after that
# one (as under pytest-xdist, where the two are one of ONE_WORKER_SCOPES), else one of its own.
market = browser_module.market

pytestmark = pytest.mark.slow

SIZES = [(1366, 900), (1280, 720), (390, 844)]
AXE_SCRIPT = (resources.files("axe_playwright_python") / "axe.min.js").read_text(encoding="utf-8")
MIN_CHART_TEXT_PX = 11.0


@dataclass(frozen=True)
class Page:
    name: str
    hash: str  # where it is ("#/offers"), with {rental}, {cluster}, {service} and {host} filled in
    primary: str  # a selector for its primary action (or, where it has none, what it is for)
    charts: int = 0  # charts it draws once loaded
    click: str | None = None  # a button to press first (what the page shows after it)


RENTER = [
    Page("offers", "#/offers", "table.offers tbody tr:first-child button"),
    Page("rentals", "#/rentals", "table tbody tr:first-child a[href^='#/rentals/']"),
    Page("rental", "#/rentals/{rental}", "#stop-rental", charts=4),
    Page("clusters", "#/clusters", "table.clusters tbody tr:first-child a[href^='#/clusters/']"),
    Page("cluster", "#/clusters/{cluster}", "#stop-cluster"),
    Page("services", "#/services", "#create-service"),
    Page("service", "#/services/{service}", "#delete-service", charts=4),
    # The New service dialog (its first field: the form scrolls inside the dialog to its Create button, as Rent's does).
    Page("service-new", "#/services", "dialog.service-dialog input[name=name]", click="#create-service"),
    Page("billing", "#/billing", "form.credit-form button[type=submit]"),
    Page("ssh-keys", "#/ssh-keys", "form button[type=submit]"),
    Page("api-keys", "#/api-keys", "form.key-form button[type=submit]"),
    # Its first card's action: sign-out-everywhere sits below the second factor and the passkeys (off a phone's first screen).
    Page("security", "#/security", "#totp-start"),
]
PROVIDER = [
    Page("hosts", "#/hosts", "table tbody tr:first-child a[href^='#/hosts/']"),
    Page("host", "#/hosts/{host}", "#go-to-listing", charts=4),
    Page("enroll", "#/enroll", "#create-token"),
    Page("enroll-token", "#/enroll", "#copy-command", click="#create-token"),  # the token and the install command
    Page("earnings", "#/earnings", "#earned-total"),
]
ADMIN = [
    Page("fleet", "#/fleet", "h1", charts=1),
    Page("offers", "#/offers", "table.offers tbody tr:first-child"),
    Page("rentals", "#/rentals", "table tbody tr:first-child a[href^='#/rentals/']"),
    Page("hosts", "#/hosts", "table tbody tr:first-child a[href^='#/hosts/']"),
    Page("services", "#/services", "table.services tbody tr:first-child a[href^='#/services/']"),
]

# What the page looks like from the DOM, in one evaluation: sideways scroll, the primary action's box, chart text
# drawn under 11 px, and words of table cells split over two lines (a word's range with boxes on two lines).
MEASURE = """([primary, minPx]) => {
  const doc = document.documentElement;
  const el = document.querySelector(primary);
  const box = el ? el.getBoundingClientRect() : null;
  const small = [];
  for (const text of document.querySelectorAll("svg text")) {
    const m = text.getScreenCTM();
    if (!m || !text.textContent.trim()) continue;
    const px = parseFloat(getComputedStyle(text).fontSize) * Math.hypot(m.a, m.b);
    if (px < minPx - 0.05) small.push(`${text.textContent.trim()} (${text.getAttribute("class")}): ${px.toFixed(1)} px`);
  }
  const split = [];
  const walker = document.createTreeWalker(document.querySelector("main"), NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (!node.parentElement.closest("td, th") || node.parentElement.closest(".visually-hidden")) continue;
    for (const word of node.textContent.matchAll(/[^\\s\\-\\/,:;·×…]+/g)) {
      const range = document.createRange();
      range.setStart(node, word.index);
      range.setEnd(node, word.index + word[0].length);
      const tops = new Set([...range.getClientRects()].filter((r) => r.width > 0).map((r) => Math.round(r.top)));
      if (tops.size > 1) split.push(word[0]);
    }
  }
  return {
    scrollWidth: doc.scrollWidth, clientWidth: doc.clientWidth, scrollY: window.scrollY,
    box: box && { left: box.left, top: box.top, right: box.right, bottom: box.bottom, width: box.width, height: box.height },
    viewport: { width: innerWidth, height: innerHeight }, small, split,
  };
}"""


def _api(market: Market, role: str, method: str, path: str, body: Any = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Authorization": f"Bearer {market.keys[role]}", "Content-Type": "application/json",
               "Idempotency-Key": str(uuid.uuid4())}  # fmt: skip
    request = urllib.request.Request(market.api + path, data=data, method=method, headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def places(market: Market, docker_image: str) -> Iterator[dict[str, str]]:
    """A running hold rental of the renter (its page, and a row in Rentals), a hold cluster of two nodes of 1 GPU (the
    demo's three hosts are of three models: mixed), a service of one replica (busybox's httpd) and a host of the
    provider; the rental, cluster and service are stopped at the end."""
    rental = _api(market, "renter", "POST", "/rentals", {"workload": {"kind": "hold"}, "gpu_count": 1})
    cluster = _api(market, "renter", "POST", "/clusters", {"node_count": 2, "gpus_per_node": 1, "allow_mixed": True})
    service = _api(market, "renter", "POST", "/services", {
        "name": "layout", "port": 8000, "min_replicas": 1, "max_replicas": 2,
        "workload": {"kind": "container", "image": docker_image, "command": ["httpd", "-f", "-p", "8000", "-h", "/tmp"], "ports": [8000]},
    })  # fmt: skip
    host = _api(market, "provider", "GET", "/hosts")["items"][0]["id"]
    try:
        yield {"rental": rental["id"], "cluster": cluster["id"], "service": service["id"], "host": host}
    finally:
        _api(market, "renter", "DELETE", f"/services/{service['id']}")
        _api(market, "renter", "DELETE", f"/clusters/{cluster['id']}")
        _api(market, "renter", "DELETE", f"/rentals/{rental['id']}")


async def _check(console: Console, role: str, page: Page, size: tuple[int, int], places: dict[str, str]) -> list[str]:
    """The problems of one page at one size (none: it fits, its primary action shows, axe is content)."""
    where = f"{role} {page.name} at {size[0]}×{size[1]}"
    await console.go(page.hash.format(**places))
    if page.click:
        await console.page.locator(page.click).click()
    primary = console.page.locator(page.primary).first
    await expect(primary).to_be_visible(timeout=WAIT_MS)
    if page.charts:
        await console.page.wait_for_function(
            "n => document.querySelectorAll('figure.chart svg text').length > 0"
            " && document.querySelectorAll('figure.chart').length >= n", arg=page.charts, timeout=WAIT_MS, polling=POLL_MS)  # fmt: skip
    # Every part the page loads has come (ui.js's loadInto shows a .loading placeholder until then): a late table is
    # measured too, however long it takes.
    await console.page.wait_for_function("() => !document.querySelector('main .loading')", timeout=WAIT_MS, polling=POLL_MS)
    await console.page.evaluate("() => window.scrollTo(0, 0)")
    seen = await console.page.evaluate(MEASURE, [page.primary, MIN_CHART_TEXT_PX])
    await console.shot(f"layout-{role}-{page.name}-{size[0]}x{size[1]}")
    problems = []
    if seen["scrollWidth"] > seen["clientWidth"]:
        problems.append(f"{where}: scrolls sideways ({seen['scrollWidth']} px wide in {seen['clientWidth']})")
    box, view = seen["box"], seen["viewport"]
    if not box or box["width"] == 0 or box["left"] < 0 or box["top"] < 0 or box["right"] > view["width"] or box["bottom"] > view["height"]:
        problems.append(f"{where}: the primary action {page.primary} is not inside the viewport: {box} in {view}")
    if seen["small"]:
        problems.append(f"{where}: chart text under {MIN_CHART_TEXT_PX} px: {seen['small'][:6]}")
    if seen["split"]:
        problems.append(f"{where}: table cells break words: {seen['split'][:8]}")
    if page.charts:
        count = await console.page.locator("figure.chart").count()
        assert count >= page.charts, f"{where}: {count} charts"
    problems += await _axe(console, where)
    return problems


async def _axe(console: Console, where: str) -> list[str]:
    """axe-core's serious and critical violations of the page as it is now (axe.min.js, 570 kB, is injected once per
    document: the console's pages are hash routes of one)."""
    if not await console.page.evaluate("() => typeof window.axe?.run === 'function'"):
        await console.page.evaluate(AXE_SCRIPT)
    result = await console.page.evaluate("() => axe.run(document, { resultTypes: ['violations'] })")
    return [
        f"{where}: axe {v['id']} ({v['impact']}): {v['help']} — {[n['target'] for n in v['nodes']][:4]}"
        for v in result["violations"]
        if v["impact"] in ("serious", "critical")
    ]


async def _pages(browser: Browser, market: Market, role: str, pages: list[Page], size: tuple[int, int],
                 places: dict[str, str]) -> list[str]:  # fmt: skip
    console = await _console(browser, market, viewport={"width": size[0], "height": size[1]})
    try:
        await console.sign_in(role)
        problems = []
        for page in pages:
            problems += await _check(console, role, page, size, places)
        return problems + console.problems
    finally:
        await console.context.close()


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
class TestLayout:
    async def test_the_sign_in_page_fits_and_passes_axe(self, browser: Browser, market: Market, size: tuple[int, int]) -> None:
        """The sign-in and sign-up pages: no sideways scroll, the submit button on screen, no serious axe violation."""
        console = await _console(browser, market, viewport={"width": size[0], "height": size[1]})
        await console.open()
        problems = await _check(console, "anyone", Page("signin", "#/", "form button[type=submit]"), size, {})
        problems += await _check(console, "anyone", Page("signup", "#/signup", "form button[type=submit]"), size, {})
        problems += console.problems
        assert not problems, "\n".join(problems)

    async def test_every_renter_page_fits_and_passes_axe(
        self, browser: Browser, market: Market, places: dict[str, str], size: tuple[int, int]
    ) -> None:
        """Marketplace, rentals, a rental with its charts, clusters, a cluster, services, a service with its charts and the
        New service dialog, billing and SSH keys fit the screen, show their primary
        action without scrolling, draw chart text at 11 px or more, split no word in a table and pass axe."""
        problems = await _pages(browser, market, "renter", RENTER, size, places)
        assert not problems, "\n".join(problems)

    async def test_every_provider_page_fits_and_passes_axe(
        self, browser: Browser, market: Market, places: dict[str, str], size: tuple[int, int]
    ) -> None:
        """Hosts, a host with its charts and listing form, enrollment and earnings: the same checks."""
        problems = await _pages(browser, market, "provider", PROVIDER, size, places)
        assert not problems, "\n".join(problems)

    async def test_every_admin_page_fits_and_passes_axe(
        self, browser: Browser, market: Market, places: dict[str, str], size: tuple[int, int]
    ) -> None:
        """The fleet overview with its chart, the marketplace, every rental, every host and every service: the same checks."""
        problems = await _pages(browser, market, "admin", ADMIN, size, places)
        assert not problems, "\n".join(problems)
