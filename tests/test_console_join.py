"""A stranger joins in Debian's Chromium, against `gpumarket up` and the SMTP sink it runs: signs up, reads the
verification mail, verifies, signs in by password, adds credit with the demo provider, makes a scoped API key and uses it
from the CLI, turns on a second factor, signs out everywhere, resets a forgotten password from the mailed link and signs
in with a recovery code; adds a passkey with Chromium's virtual authenticator and signs in with it.

Reuses the browser module's fixtures, helpers and marketplace (``tests/test_console_browser.py``'s `gpumarket up`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import secrets
import subprocess
import sys
from email import message_from_bytes, policy
from email.message import EmailMessage
from pathlib import Path

import pyotp
import pytest
from playwright.async_api import Browser, expect

from tests import test_console_browser as browser_module
from tests.test_console_browser import WAIT_MS, Market, _console

pytestmark = pytest.mark.slow

market = browser_module.market
PASSWORD = "four unrelated words here"


async def _mail(market: Market, to: str, subject: str) -> EmailMessage:
    """The newest message the marketplace's SMTP sink kept for ``to`` with ``subject`` (up's data dir, mail/*.eml)."""
    assert market.data_dir is not None
    folder = Path(market.data_dir) / "mail"
    for _ in range(int(WAIT_MS / 100)):
        for path in sorted(folder.glob("*.eml"), reverse=True) if folder.is_dir() else []:
            message = message_from_bytes(path.read_bytes(), policy=policy.default)
            if isinstance(message, EmailMessage) and message["To"] == to and message["Subject"] == subject:
                return message
        await asyncio.sleep(0.1)
    raise AssertionError(f"no mail {subject!r} to {to} in {folder}")


def _link(message: EmailMessage, purpose: str) -> str:
    body = message.get_body(preferencelist=("plain",))
    assert body is not None
    found = re.search(rf"https?://\S+/#/{purpose}/\S+", body.get_content())
    assert found, body.get_content()
    return found.group(0)


async def test_a_stranger_signs_up_verifies_adds_credit_and_signs_out_everywhere(browser: Browser, market: Market) -> None:
    console = await _console(browser, market)
    page = console.page
    email = f"newcomer-{secrets.token_hex(4)}@example.com"
    await console.open("#/signin")
    await page.get_by_role("link", name="Create an account").click()
    await page.get_by_label("Email").fill(email)
    await page.get_by_label("Password").fill("password1234")  # one of the most common: refused, saying so
    await page.get_by_role("button", name="Create account").click()
    await expect(page.get_by_role("alert")).to_contain_text("one of the most common passwords")
    await page.get_by_label("Password").fill(PASSWORD)
    await page.get_by_role("button", name="Create account").click()
    await expect(page.locator("#signup-sent")).to_contain_text("sent a link to that address", timeout=WAIT_MS)
    await console.shot("join-check-your-mail")
    mail = await _mail(market, email, "Verify your gpumarket address")

    await page.get_by_role("link", name="Sign in").click()
    await page.get_by_label("Email").fill(email)
    await page.get_by_label("Password").fill(PASSWORD)
    await page.get_by_role("button", name="Sign in", exact=True).click()
    await expect(page.locator(".account-name")).to_have_text(email, timeout=WAIT_MS)
    banner = page.locator("#verify-banner")
    await expect(banner).to_contain_text("Verify your email address to rent GPUs")
    await console.shot("join-unverified")

    await page.goto(_link(mail, "verify"))
    await expect(page.locator("#verify-status")).to_contain_text(f"{email} is verified", timeout=WAIT_MS)
    await console.go("#/billing")
    await expect(banner).to_have_count(0)
    await page.locator("form.credit-form").get_by_role("button", name="$25.00").click()
    await page.locator("form.credit-form").get_by_role("button", name="Add credit").click()
    await expect(page.locator("#credit-result")).to_contain_text("demo payment: no card charged", timeout=WAIT_MS)

    await console.go("#/api-keys")
    await page.get_by_label("Name").fill("laptop-cli")
    await page.get_by_label("rent: rentals, clusters, services, SSH keys").check()
    await page.get_by_role("button", name="Make key").click()
    key = (await page.locator("#new-api-key").text_content(timeout=WAIT_MS) or "").strip()
    assert key.startswith("gmk_")
    await expect(page.locator("#api-key-list")).to_contain_text("laptop-cli")
    await console.shot("join-api-keys")
    env = {**os.environ, "GPUMARKET_API_URL": market.base, "GPUMARKET_API_KEY": key, "XDG_CONFIG_HOME": str(Path(market.data_dir or ".") / "cli-home")}
    listed = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "gpumarket", "keys", "list"], env=env, capture_output=True,
                                     text=True, timeout=60)  # fmt: skip
    assert listed.returncode == 0 and "laptop-cli" in listed.stdout and "read,rent" in listed.stdout, listed.stderr
    refused = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "gpumarket", "credit", "add", "5"], env=env,
                                      capture_output=True, text=True, timeout=60)  # fmt: skip
    assert refused.returncode == 1 and "scope_missing" in refused.stderr  # no billing scope

    # The CLI signs in through this browser: it shows a link and a code, the page approves it with read only.
    home = Path(market.data_dir or ".") / "cli-browser-home"
    login = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpumarket", "login", "--api", market.base, "--browser",
        env={k: v for k, v in env.items() if k != "GPUMARKET_API_KEY"} | {"XDG_CONFIG_HOME": str(home)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert login.stderr is not None
    line = (await asyncio.wait_for(login.stderr.readline(), WAIT_MS / 1000)).decode()
    found = re.search(r"open (\S+) in a browser", line)
    assert found, line
    await page.goto(found.group(1))
    await expect(page.locator("#device-client")).to_contain_text("gpumarket CLI on", timeout=WAIT_MS)
    await page.get_by_label("rent: rentals, clusters, services, SSH keys").uncheck()
    await page.get_by_label("billing: credit, spend cap, invoices").uncheck()
    await page.get_by_role("button", name="Approve").click()
    await expect(page.get_by_role("heading", name="Approved")).to_be_visible(timeout=WAIT_MS)
    out, errors = await asyncio.wait_for(login.communicate(), 60)
    assert login.returncode == 0 and email.encode() in out, errors

    await console.go("#/security")
    log = page.locator("ul.audit")
    for kind in ("signed up", "signed in", "email verified", "api key created"):
        await expect(log).to_contain_text(kind)
    await page.get_by_role("button", name="Turn on a second factor").click()
    secret = (await page.locator("#totp-secret").text_content(timeout=WAIT_MS) or "").replace(" ", "")
    await page.get_by_label("Code from the app").fill(pyotp.TOTP(secret).now())
    await page.get_by_role("button", name="Confirm").click()
    await expect(page.locator("#recovery-codes code")).to_have_count(10, timeout=WAIT_MS)
    recovery = [code.strip() for code in await page.locator("#recovery-codes code").all_text_contents()]
    await console.shot("join-security")
    await page.get_by_role("button", name="Sign out everywhere").click()
    await expect(page.get_by_role("heading", name="Sign in to gpumarket")).to_be_visible(timeout=WAIT_MS)
    await console.go("#/billing")
    await expect(page.get_by_role("heading", name="Sign in to gpumarket")).to_be_visible()

    await page.get_by_role("link", name="Forgot your password?").click()
    await page.get_by_label("Email").fill(email)
    await page.get_by_role("button", name="Mail me a link").click()
    await expect(page.get_by_role("status").filter(has_text="an account has that address")).to_be_visible(timeout=WAIT_MS)
    reset = await _mail(market, email, "Reset your gpumarket password")
    await page.goto(_link(reset, "reset"))
    await page.get_by_label("New password").fill("a different set of words")
    await page.get_by_role("button", name="Set the password").click()
    await expect(page.get_by_role("status").filter(has_text="Your password is set")).to_be_visible(timeout=WAIT_MS)
    await page.get_by_label("Email").fill(email)
    await page.get_by_label("Password").fill("a different set of words")
    await page.get_by_role("button", name="Sign in", exact=True).click()
    await expect(page.get_by_role("alert")).to_contain_text("second factor", timeout=WAIT_MS)  # the reset left it on
    await page.get_by_label("Code from your authenticator app").fill(recovery[0])
    await page.get_by_role("button", name="Sign in", exact=True).click()
    await expect(page.locator(".account-name")).to_have_text(email, timeout=WAIT_MS)
    assert not console.problems, console.problems
    await console.context.close()


async def test_a_person_adds_a_passkey_and_signs_in_with_it(browser: Browser, market: Market) -> None:
    """Chromium's virtual authenticator (CTAP2, resident keys, user verification) as the device: a new account adds a
    passkey on #/security, signs out, and signs back in with it, no email typed. The console is opened at
    ``localhost``: `gpumarket up`'s relying party (its public URL's loopback address as a name; an IP address is never
    an RP id), which the browser namespace's proxy reaches as it does 127.0.0.1."""
    local = dataclasses.replace(market, base=market.base.replace("://127.0.0.1:", "://localhost:"))
    assert local.base.startswith("http://localhost:"), market.base
    console = await _console(browser, local)
    page = console.page
    cdp = await console.context.new_cdp_session(page)
    await cdp.send("WebAuthn.enable")
    added = await cdp.send("WebAuthn.addVirtualAuthenticator", {"options": {
        "protocol": "ctap2", "transport": "internal", "hasResidentKey": True, "hasUserVerification": True,
        "isUserVerified": True}})  # fmt: skip
    email = f"passkey-{secrets.token_hex(4)}@example.com"
    await console.open("#/signup")
    await page.get_by_label("Email").fill(email)
    await page.get_by_label("Password").fill(PASSWORD)
    await page.get_by_role("button", name="Create account").click()
    await expect(page.locator("#signup-sent")).to_contain_text("sent a link to that address", timeout=WAIT_MS)
    await page.get_by_role("link", name="Sign in").click()
    await page.get_by_label("Email").fill(email)
    await page.get_by_label("Password").fill(PASSWORD)
    await page.get_by_role("button", name="Sign in", exact=True).click()
    await expect(page.locator(".account-name")).to_have_text(email, timeout=WAIT_MS)

    await console.go("#/security")
    passkeys = page.locator("#passkeys")
    await expect(passkeys).to_contain_text("No passkeys yet.", timeout=WAIT_MS)
    await page.get_by_label("Name of the new passkey").fill("virtual laptop")
    await page.get_by_role("button", name="Add a passkey").click()
    await expect(page.locator("#passkey-list .passkey-name")).to_have_text(["virtual laptop"], timeout=WAIT_MS)
    await expect(passkeys).to_contain_text("never used")
    credentials = await cdp.send("WebAuthn.getCredentials", {"authenticatorId": added["authenticatorId"]})
    assert [c["isResidentCredential"] for c in credentials["credentials"]] == [True]
    await console.shot("join-passkeys")

    await page.locator("#sign-out").click()
    await expect(page.get_by_role("heading", name="Sign in to gpumarket")).to_be_visible(timeout=WAIT_MS)
    await page.get_by_role("button", name="Sign in with a passkey").click()
    await expect(page.locator(".account-name")).to_have_text(email, timeout=WAIT_MS)
    await console.go("#/security")
    await expect(passkeys).to_contain_text("last used", timeout=WAIT_MS)
    await expect(page.locator("ul.audit")).to_contain_text("passkey added")
    await expect(page.locator("ul.audit")).to_contain_text("method: passkey")
    # At 127.0.0.1, which is no RP id, the page says where passkeys work instead of failing in the browser's prompt.
    await page.goto(f"{market.base}/#/signin")
    await page.get_by_role("button", name="Sign in with a passkey").click()
    await expect(page.get_by_role("alert").filter(has_text="Passkeys work")).to_contain_text(local.base, timeout=WAIT_MS)
    assert not console.problems, console.problems
    await console.context.close()
