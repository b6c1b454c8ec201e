"""The interactive API reference at ``/api/docs``: Swagger UI from a Python package, under the console's CSP.

The HTTP tests drive the real app; the browser test opens the page in Debian's Chromium (as the
console's browser tests do) and checks that Swagger UI renders every operation of the OpenAPI
document with no script error and no Content-Security-Policy violation. Chromium runs in its network namespace
(``tests/browserns.py``), through a proxy to the test server on the host's loopback.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from multidict import CIMultiDict
from playwright.async_api import async_playwright

from master.api.routes_docs import CONTENT_SECURITY_POLICY
from tests.apiclient import Api
from tests.browserns import BrowserNamespace


async def _get(api: Api, path: str, **headers: str) -> tuple[int, CIMultiDict[str], bytes]:
    async with api.client.get(path, headers=headers) as response:
        return response.status, response.headers.copy(), await response.read()


class TestServed:
    async def test_the_page_and_every_file_it_names_are_served_from_this_origin(self, api: Api) -> None:
        """``/api/docs`` is HTML naming only local files, each of which answers 200 with its type and the strict CSP."""
        status, headers, body = await _get(api, "/api/docs")
        assert status == 200
        assert headers["Content-Type"].startswith("text/html")
        assert headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
        html = body.decode()
        assert not re.search(r"https?://|//[a-z]", html), "the page names another origin"
        assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html), "an inline script (the CSP would block it)"
        assert "style=" not in html and "<style" not in html
        urls = re.findall(r'(?:src|href)="([^"]+)"', html)
        assert {"/api/docs/swagger-ui-bundle.js", "/api/docs/docs.js", "/api/docs/swagger-ui.css"} <= set(urls)
        types = {".js": "text/javascript", ".css": "text/css", ".png": "image/png"}
        for url in urls:
            status, headers, body = await _get(api, url)
            assert status == 200, url
            assert headers["Content-Type"].startswith(types[Path(url).suffix]), url
            assert len(body) > 0

    async def test_the_start_up_script_loads_this_masters_document(self, api: Api) -> None:
        """The page points Swagger UI at ``/api/v1/openapi.json`` (which answers without a key) and asks no outside validator."""
        _, _, page = await _get(api, "/api/docs/")
        assert 'data-spec-url="/api/v1/openapi.json"' in page.decode()
        _, _, script = await _get(api, "/api/docs/docs.js")
        assert "validatorUrl: null" in script.decode()
        assert not re.search(r"https?://", script.decode())
        status, _, _ = await _get(api, "/api/v1/openapi.json")
        assert status == 200

    async def test_a_repeat_with_the_etag_is_304_and_an_unknown_file_is_404(self, api: Api) -> None:
        """Files carry an ETag (a repeat is 304 without a body); a name the reference does not have is 404 JSON."""
        _, headers, _ = await _get(api, "/api/docs/swagger-ui.css")
        status, _, body = await _get(api, "/api/docs/swagger-ui.css", **{"If-None-Match": headers["ETag"]})
        assert (status, body) == (304, b"")
        status, headers, body = await _get(api, "/api/docs/index.j2")
        assert status == 404
        assert b"/api/docs" in body


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_swagger_ui_renders_every_operation_under_the_csp(api: Api, browser_netns: BrowserNamespace) -> None:
    """In Chromium, the reference shows one block per operation of the document, with no script error or CSP violation."""
    document = await (await api.client.get("/api/v1/openapi.json")).json()
    operations = sum(len(methods) for methods in document["paths"].values())
    base = str(api.client.make_url("/api/docs"))
    problems: list[str] = []
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=str(browser_netns.executable), args=browser_netns.args)
        try:
            page = await browser.new_page()
            page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: problems.append(f"uncaught: {e}"))
            outside: list[str] = []
            page.on("request", lambda r: None if r.url.startswith(base.split("/api/")[0]) or r.url.startswith("data:")
                    else outside.append(r.url))  # fmt: skip
            await page.goto(base)
            # A function, evaluated once: Playwright evaluates a bare expression again at each poll, which the page's CSP
            # (no 'unsafe-eval') refuses once it is no longer the first check (a failure whenever the page was slow).
            await page.wait_for_function("n => document.querySelectorAll('.opblock').length >= n", arg=operations, timeout=20_000)
            assert await page.locator(".opblock").count() == operations
            assert "gpumarket API" in (await page.locator(".info .title").inner_text())
        finally:
            await browser.close()
    violations = [p for p in problems if "Content Security Policy" in p or "uncaught" in p]
    assert not violations, violations
    assert not outside, outside
