"""Teams in Debian's Chromium, against `gpumarket up` and its SMTP sink: an owner makes a team and invites a teammate
by mail; the teammate opens the mailed link signed out, signs in, comes back to it and joins; both act for the team
with the header's switcher; the teammate rents on the team's credit (refused on their own, which has none), and what one
does in the team's context (that rental, a registry login) the other sees in it,
never in their own. Removed from the team, the teammate's console falls back to the personal account, saying so.

Reuses the browser module's fixtures, helpers and marketplace (``tests/test_console_browser.py``'s `gpumarket up`).
"""

from __future__ import annotations

import re
import secrets
from typing import Any

import aiohttp
import pytest
from playwright.async_api import Browser, Page, expect

from tests import test_console_browser as browser_module
from tests.test_console_browser import ACTIVE, WAIT_MS, Console, Market, _console, _container_offer
from tests.test_console_join import PASSWORD, _link, _mail

pytestmark = pytest.mark.slow

market = browser_module.market
LAPTOP = {"width": 1366, "height": 800}
PHONE = {"width": 390, "height": 844}


async def _person(market: Market, name: str) -> str:
    """A renter signed up through the API with a verified address (from the mailed link); its address."""
    email = f"{name}-{secrets.token_hex(4)}@example.com"
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{market.api}/accounts", json={"email": email, "password": PASSWORD, "role": "renter"}
        ) as answer:
            assert answer.status == 202, await answer.text()
        token = _link(await _mail(market, email, "Verify your gpumarket address"), "verify").rsplit("/", 1)[1]
        async with http.post(f"{market.api}/accounts/verify", json={"token": token}) as answer:
            assert answer.status == 200, await answer.text()
    return email


async def _sign_in(page: Page, email: str) -> None:
    """Fill the sign-in page that is shown and sign in by password."""
    await page.get_by_label("Email").fill(email)
    await page.get_by_label("Password").fill(PASSWORD)
    await page.get_by_role("button", name="Sign in", exact=True).click()
    await expect(page.locator(".account-name")).to_have_text(email, timeout=WAIT_MS)


async def _in_page(page: Page, method: str, path: str, body: Any = None) -> Any:
    """A call through the console's own api() (the page's session, CSRF token and team context)."""
    return await page.evaluate(
        "async ([method, path, body]) => { const m = await import('/static/api.js');"
        " return m.api(method, path, body === null ? {} : { body }); }",
        [method, path, body],
    )


async def _team_header_sent(console: Console, path: str) -> str | None:
    """The Gpumarket-Team header of the page's next request to ``path``, as the browser sent it."""
    async with console.page.expect_request(
        lambda r: r.url.split("?")[0].endswith(f"/api/v1{path}")
    ) as request:
        await console.page.evaluate("() => window.dispatchEvent(new HashChangeEvent('hashchange'))")
    return (await request.value).headers.get("gpumarket-team")


async def test_an_owner_and_an_invited_teammate_act_for_their_team(browser: Browser, market: Market) -> None:
    owner_email, mate_email = await _person(market, "owner"), await _person(market, "mate")
    team_name = f"Acme ML {secrets.token_hex(3)}"

    owner = await _console(browser, market, viewport=LAPTOP)
    page = owner.page
    await owner.open("#/signin")
    await _sign_in(page, owner_email)
    await expect(page.locator("#team-context")).to_have_count(0)  # no team yet: no switcher
    await page.get_by_role("link", name="Teams").click()
    await page.get_by_role("button", name="Create team").click()
    await expect(page.get_by_role("alert")).to_have_text("Give the team a name.")
    await page.get_by_label("Team name").fill(team_name)
    await page.get_by_role("button", name="Create team").click()
    await expect(page.get_by_role("heading", name=f"Team {team_name}")).to_be_visible(timeout=WAIT_MS)
    team_id = page.url.rsplit("/", 1)[1]
    await page.get_by_label("Email").fill(mate_email)
    await page.get_by_label("Role", exact=True).select_option("member")
    await page.get_by_role("button", name="Invite", exact=True).click()
    await expect(page.locator("table.invitations")).to_contain_text(mate_email, timeout=WAIT_MS)
    await page.get_by_label("Email").fill(owner_email)
    await page.get_by_role("button", name="Invite", exact=True).click()  # the API's refusal, as one line
    await expect(page.get_by_role("alert")).to_contain_text("is a member of the team already")
    invitation = _link(
        await _mail(market, mate_email, f"You are invited to the team {team_name} on gpumarket"), "invite"
    )

    # The owner acts for the team: every call but the person's own carries the header.
    await page.locator("#team-context").select_option(team_id)
    await expect(page.locator("#context-banner")).to_contain_text(f"Acting for team {team_name} (owner)")
    await owner.go("#/billing")
    await page.locator("form.credit-form").get_by_role("button", name="$25.00").click()
    await page.locator("form.credit-form").get_by_role("button", name="Add credit").click()
    await expect(page.locator("#credit-result")).to_contain_text(
        "demo payment: no card charged", timeout=WAIT_MS
    )
    offer = await _container_offer(owner)
    hold = {"offer_id": offer["id"], "gpu_count": 1, "workload": {"kind": "hold"}}
    rental: dict[str, Any] = {}
    try:
        # The teammate opens the link signed out, signs in and comes back to it, joins and acts for the team.
        mate = await _console(browser, market, viewport=PHONE)
        mpage = mate.page
        await mpage.goto(invitation)
        await expect(mpage.get_by_role("heading", name="Join a team")).to_be_visible(timeout=WAIT_MS)
        await mpage.get_by_role("link", name="Sign in").click()
        await _sign_in(mpage, mate_email)
        await mpage.get_by_role("button", name="Join team").click()
        await expect(mpage.get_by_role("heading", name=f"Team {team_name}")).to_be_visible(timeout=WAIT_MS)
        await expect(mpage.locator("#context-banner")).to_contain_text(
            f"Acting for team {team_name} (member)"
        )
        await expect(mpage.locator("#team-context")).to_have_value(team_id)
        await expect(mpage.locator("table.members")).to_contain_text(owner_email)
        await expect(mpage.locator("table.members")).to_contain_text(mate_email)
        await expect(mpage.locator("table.invitations")).to_have_count(0)  # a member manages nobody
        assert await mate.fits_sideways("main")
        await mate.shot("teams-team-390")

        # The teammate rents on the team's credit (the owner's top-up): on their own, with none, they are refused.
        personal = await mpage.evaluate(
            "async (body) => { const m = await import('/static/api.js');"
            " try { await m.api('POST', '/rentals', { body, personal: true }); return null; } catch (e) { return e.code; } }",
            hold,
        )
        assert personal == "insufficient_credit"
        rental.update(await _in_page(mpage, "POST", "/rentals", hold))
        await mate.go("#/rentals")
        await expect(mpage.locator("a.rental-link", has_text=rental["id"])).to_be_visible(timeout=WAIT_MS)
        assert await _team_header_sent(mate, "/rentals") == team_id
        await owner.go("#/rentals")
        await expect(page.locator("a.rental-link", has_text=rental["id"])).to_be_visible(timeout=WAIT_MS)
        await mate.go("#/ssh-keys")
        registries = mpage.locator("#registries")
        await registries.get_by_label("Images under").fill("registry.example.com:5000/acme/")
        await registries.get_by_label("User name").fill("ci-bot")
        await registries.get_by_label("Password or access token").fill("s3cret-token")
        await registries.get_by_role("button", name="Add login").click()
        await expect(registries.locator("table.registry-credentials")).to_contain_text(
            "registry.example.com:5000/acme/", timeout=WAIT_MS
        )
        await expect(registries).not_to_contain_text("s3cret-token")
        assert await mate.fits_sideways("main")
        await mate.shot("teams-registries-390")

        # The owner sees the teammate's login in the team's context, and not in the personal one.
        await owner.go("#/ssh-keys")
        await expect(page.locator("table.registry-credentials")).to_contain_text("ci-bot", timeout=WAIT_MS)
        await page.locator("#team-context").select_option("")
        await expect(page.locator("#context-banner")).to_have_count(0)
        await expect(page.locator("table.registry-credentials")).to_contain_text(
            "No registry logins", timeout=WAIT_MS
        )
        await owner.go("#/rentals")
        await expect(page.locator("a.rental-link", has_text=rental["id"])).to_have_count(0)

        # The owner makes the teammate a billing member, then removes them; the teammate's console falls back.
        await owner.go(f"#/teams/{team_id}")
        row = page.locator("table.members tr", has_text=mate_email)
        await row.get_by_label(re.compile("^Role of")).select_option("billing")
        await row.get_by_role("button", name="Change").click()
        await expect(page.locator("#notice")).to_contain_text(
            f"{mate_email}'s role is billing now", timeout=WAIT_MS
        )
        await expect(
            page.locator("table.members tr", has_text=mate_email).get_by_label(re.compile("^Role of"))
        ).to_have_value("billing")
        await owner.shot("teams-team-1366")
        await (
            page.locator("table.members tr", has_text=mate_email).get_by_role("button", name="Remove").click()
        )
        await page.get_by_role("button", name="Yes, remove").click()
        await expect(page.locator("table.members")).not_to_contain_text(mate_email, timeout=WAIT_MS)

        await mate.go("#/rentals")
        await expect(mpage.locator("#notice")).to_contain_text(
            f"no longer a member of team {team_name}", timeout=WAIT_MS
        )
        await expect(mpage.locator("#context-banner")).to_have_count(0)
        await expect(mpage.locator("#team-context")).to_have_count(0)  # in no team any more
        await expect(mpage.locator("a.rental-link", has_text=rental["id"])).to_have_count(0)
        assert not mate.problems, mate.problems
        await mate.context.close()
    finally:
        if rental:  # the teammate rented: stop it
            await page.locator("#team-context").select_option(team_id)
            await _in_page(page, "DELETE", f"/rentals/{rental['id']}")
            for _ in range(int(WAIT_MS / 200)):
                if (await _in_page(page, "GET", f"/rentals/{rental['id']}"))["state"] not in ACTIVE:
                    break
                await page.wait_for_timeout(200)
        assert not owner.problems, owner.problems
        await owner.context.close()
