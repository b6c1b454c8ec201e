"""Strangers sign up, prove their address, sign in by password, reset it, and sign out everywhere.

Real aiohttp app on SQLite and PostgreSQL (the ``api`` fixture), a real SMTP server on loopback (``MailSink``,
aiosmtpd) that the master mails through ``smtp_url``, and an aiohttp client with a cookie jar as the browser. The
links are read from the mails as a person would.
"""

from __future__ import annotations

import socket
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import pyotp
import pytest
from pydantic import SecretStr
from sqlalchemy import func, select

from gpumarket.mailsink import MailSink, Received
from master.api.base import API
from master.models import Account, AuditEvent
from master.services.accounts import passwords
from master.services.accounts.sessions import COOKIE, CSRF_HEADER
from tests.apiclient import Api, assert_error
from tests.helpers import ManualClock

EMAIL = "Alice.Renter@Example.com"
STORED = "alice.renter@example.com"
PASSWORD = "correct horse battery staple"


async def post(api: Api, path: str, body: Any, *, csrf: str | None = None) -> tuple[int, Any]:
    headers = {CSRF_HEADER: csrf} if csrf else {}
    async with api.client.post(API + path, json=body, headers=headers) as response:
        return response.status, await response.json()


async def call(api: Api, method: str, path: str, *, csrf: str | None = None, **kwargs: Any) -> tuple[int, Any]:
    headers = {CSRF_HEADER: csrf} if csrf else {}
    async with api.client.request(method, API + path, headers=headers, **kwargs) as response:
        return response.status, await response.json()


def token_of(mail: Received, purpose: str) -> str:
    [link] = [link for link in mail.links() if f"/#/{purpose}/" in link]
    assert link.startswith("http://console.test/#/")
    return link.rsplit("/", 1)[1]


async def sign_up(api: Api, sink: MailSink, email: str = EMAIL, role: str = "renter") -> Received:
    before = len(sink.messages)
    status, body = await post(api, "/accounts", {"email": email, "password": PASSWORD, "role": role})
    assert status == 202, body
    return await sink.wait_for(email, after=before)


async def sign_in(api: Api, email: str = EMAIL, password: str = PASSWORD) -> tuple[int, Any]:
    return await post(api, "/sessions", {"email": email, "password": password})


async def audit_kinds(api: Api, email: str) -> list[str]:
    async with api.master.db.session() as session:
        account_id = await session.scalar(select(Account.id).where(Account.email == email.lower()))
        rows = await session.scalars(select(AuditEvent.kind).where(AuditEvent.account_id == account_id).order_by(AuditEvent.at, AuditEvent.id))
        return list(rows.all())


class TestSignUp:
    async def test_sign_up_verify_and_then_rent(self, api: Api, sink: MailSink) -> None:
        """A new renter signs in at once but may rent only once the mailed link verified its address; the link works once."""
        mail = await sign_up(api, sink)
        assert mail.subject == "Verify your gpumarket address" and mail.to == [STORED]
        status, session = await sign_in(api)
        assert status == 201, session
        assert session["account"] == {"id": session["account"]["id"], "name": STORED, "role": "renter", "email_verified": False}
        csrf = session["csrf_token"]

        status, body = await call(api, "POST", "/rentals", csrf=csrf, json={"gpu_count": 1})
        assert_error(status, body, 403, "email_not_verified")
        assert "/accounts/verify/resend" in body["message"]

        token = token_of(mail, "verify")
        status, body = await post(api, "/accounts/verify", {"token": token})
        assert (status, body) == (200, {"email": STORED, "verified": True})
        status, body = await post(api, "/accounts/verify", {"token": token})
        assert_error(status, body, 400, "invalid_link")

        status, current = await call(api, "GET", "/sessions/current")
        assert current["account"]["email_verified"] is True
        status, body = await call(api, "POST", "/rentals", csrf=csrf, json={"gpu_count": 1})
        assert body.get("code") != "email_not_verified" and status != 403, body
        assert await audit_kinds(api, EMAIL) == ["signed_up", "signed_in", "email_verified"]

    async def test_a_provider_may_not_enrol_a_host_before_verifying(self, api: Api, sink: MailSink) -> None:
        await sign_up(api, sink, "bob@example.org", role="provider")
        _, session = await sign_in(api, "bob@example.org")
        status, body = await call(api, "POST", "/enrollment-tokens", csrf=session["csrf_token"], json={})
        assert_error(status, body, 403, "email_not_verified")

    async def test_an_address_that_has_an_account_gets_the_same_answer_and_a_mail_that_says_so(self, api: Api, sink: MailSink) -> None:
        """Sign-up does not tell a stranger whether an address has an account: only the address's owner learns it."""
        await sign_up(api, sink)
        before = len(sink.messages)
        status, body = await post(api, "/accounts", {"email": EMAIL.upper(), "password": "another long passphrase", "role": "provider"})
        first_status, first = 202, body
        assert (status, body) == (first_status, first)
        mail = await sink.wait_for(STORED, after=before)
        assert mail.subject == "You already have a gpumarket account" and not [link for link in mail.links() if "/#/verify/" in link]
        async with api.master.db.session() as session:
            assert await session.scalar(select(func.count()).select_from(Account).where(Account.email == STORED)) == 1
        status, _ = await sign_in(api, EMAIL, "another long passphrase")
        assert status == 401  # the first password stays

    async def test_a_verification_link_can_be_asked_again_and_the_old_one_stops(self, api: Api, sink: MailSink) -> None:
        first = await sign_up(api, sink)
        _, session = await sign_in(api)
        before = len(sink.messages)
        status, body = await call(api, "POST", "/accounts/verify/resend", csrf=session["csrf_token"])
        assert status == 202, body
        second = await sink.wait_for(STORED, after=before)
        status, body = await post(api, "/accounts/verify", {"token": token_of(first, "verify")})
        assert_error(status, body, 400, "invalid_link")
        assert (await post(api, "/accounts/verify", {"token": token_of(second, "verify")}))[0] == 200
        status, body = await call(api, "POST", "/accounts/verify/resend", csrf=session["csrf_token"])
        assert status == 200 and "verified already" in body["status"]

    @pytest.mark.parametrize(
        ("email", "password", "code"),
        [
            ("carol@example.com", "short", "weak_password"),
            ("carol@example.com", "password1234", "weak_password"),  # one of the most common
            ("carol@example.com", "Carol@Example.com", "weak_password"),  # the address itself
            ("carol@example.com", "a long pass\x00phrase here", "invalid_character"),  # the body reader's, 400
            ("carol@example.com\n", PASSWORD, "invalid_email"),
            ("carol@xn--80ak6aa92e.com", PASSWORD, "invalid_email"),  # аррӏе.com: Cyrillic letters that read as apple.com
            ("carol@éxample.com", PASSWORD, "invalid_email"),
            ("carol", PASSWORD, "invalid_email"),
            ("carol@example.com", PASSWORD, "validation_failed"),  # role "admin" below
        ],
    )
    async def test_a_bad_address_or_a_weak_password_is_422_and_makes_nothing(
        self, api: Api, sink: MailSink, email: str, password: str, code: str
    ) -> None:
        role = "admin" if code == "validation_failed" else "renter"
        status, body = await post(api, "/accounts", {"email": email, "password": password, "role": role})
        assert_error(status, body, 400 if code == "invalid_character" else 422, code)
        assert password not in body["message"]
        async with api.master.db.session() as session:
            assert await session.scalar(select(func.count()).select_from(Account).where(Account.email.is_not(None))) == 0
        assert sink.messages == []

    async def test_when_the_mail_server_is_down_sign_up_is_503_and_can_be_tried_again(self, api: Api, sink: MailSink) -> None:
        with socket.socket() as unused:
            unused.bind(("127.0.0.1", 0))
            port = unused.getsockname()[1]
        api.master.settings.smtp_url = SecretStr(f"smtp://user:hunter2-secret@127.0.0.1:{port}")
        status, body = await post(api, "/accounts", {"email": EMAIL, "password": PASSWORD, "role": "renter"})
        assert_error(status, body, 503, "mail_unavailable")
        assert "hunter2" not in body["message"]
        api.master.settings.smtp_url = SecretStr(sink.url)
        mail = await sign_up(api, sink)
        assert mail.subject == "Verify your gpumarket address"

    async def test_without_a_mail_server_sign_up_says_so(self, api: Api) -> None:
        api.master.settings.smtp_url = None
        status, body = await post(api, "/accounts", {"email": EMAIL, "password": PASSWORD, "role": "renter"})
        assert_error(status, body, 503, "mail_unavailable")

    async def test_sign_up_can_be_closed(self, api: Api, sink: MailSink) -> None:
        api.master.settings.sign_up_enabled = False
        status, body = await post(api, "/accounts", {"email": EMAIL, "password": PASSWORD, "role": "renter"})
        assert_error(status, body, 403, "sign_up_closed")


class TestSignIn:
    async def test_a_wrong_password_and_an_unknown_address_answer_the_same(self, api: Api, sink: MailSink) -> None:
        await sign_up(api, sink)
        wrong = await sign_in(api, EMAIL, "not the password at all")
        unknown = await sign_in(api, "nobody@example.com", PASSWORD)
        malformed = await sign_in(api, "not an address", PASSWORD)
        assert wrong == unknown == malformed
        assert_error(*wrong, 401, "invalid_credentials")
        assert COOKIE not in api.client.session.cookie_jar.filter_cookies(api.client.make_url("/"))
        assert await audit_kinds(api, EMAIL) == ["signed_up", "sign_in_failed"]

    async def test_a_hash_made_under_older_settings_is_made_again_at_sign_in(self, api: Api, sink: MailSink) -> None:
        await sign_up(api, sink)
        async with api.master.db.session() as session:
            before = await session.scalar(select(Account.password_hash).where(Account.email == STORED))
        assert before is not None and before.startswith("$argon2id$")
        api.master.settings.password_hash_time_cost += 1
        assert (await sign_in(api))[0] == 201
        async with api.master.db.session() as session:
            after = await session.scalar(select(Account.password_hash).where(Account.email == STORED))
        assert after != before and f"t={api.master.settings.password_hash_time_cost}" in str(after)
        assert (await sign_in(api))[0] == 201

    async def test_sign_in_takes_either_a_password_or_a_key(self, api: Api) -> None:
        for body in ({"email": EMAIL}, {"password": PASSWORD}, {"email": EMAIL, "password": PASSWORD, "api_key": api.renter_key}, {}):
            status, answer = await post(api, "/sessions", body)
            assert_error(status, answer, 422, "validation_failed")


class TestResetAndSignOut:
    async def test_a_reset_link_sets_a_new_password_and_ends_every_session(self, api: Api, sink: MailSink) -> None:
        await sign_up(api, sink)
        assert (await sign_in(api))[0] == 201
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as other_browser:
            url = str(api.client.make_url(API + "/sessions"))
            async with other_browser.post(url, json={"email": EMAIL, "password": PASSWORD}) as response:
                assert response.status == 201

            before = len(sink.messages)
            unknown = await post(api, "/password-resets", {"email": "nobody@example.com"})
            known = await post(api, "/password-resets", {"email": EMAIL})
            assert unknown == known and known[0] == 202
            mail = await sink.wait_for(STORED, after=before)
            # The unknown address gets a mail too (the time of the answer tells nothing), with no link that resets.
            nobody = await sink.wait_for("nobody@example.com", after=before)
            assert "no account has it" in nobody.body and not [link for link in nobody.links() if "/#/reset/" in link]
            token = token_of(mail, "reset")

            status, body = await post(api, "/password-resets/confirm", {"token": token, "password": "password1234"})
            assert_error(status, body, 422, "weak_password")  # and the link still works:
            status, body = await post(api, "/password-resets/confirm", {"token": token, "password": "a brand new passphrase"})
            assert (status, body) == (200, {"reset": True, "sessions_ended": 2})
        status, body = await call(api, "GET", "/sessions/current")
        assert_error(status, body, 401, "not_signed_in")
        assert (await post(api, "/password-resets/confirm", {"token": token, "password": "yet another passphrase"}))[0] == 400
        assert (await sign_in(api))[0] == 401
        status, session = await sign_in(api, EMAIL, "a brand new passphrase")
        assert status == 201 and session["account"]["email_verified"] is True  # the reset proved the address

    async def test_sign_out_everywhere_ends_every_session_of_the_account_only(self, api: Api, sink: MailSink) -> None:
        await sign_up(api, sink)
        _, session = await sign_in(api)
        renter_session = await post(api, "/sessions", {"api_key": api.renter_key})  # another account's, in this jar now
        assert renter_session[0] == 201
        _, session = await sign_in(api)
        status, body = await call(api, "DELETE", "/sessions", csrf=session["csrf_token"])
        assert (status, body) == (200, {"sessions_ended": 2})
        status, body = await call(api, "GET", "/sessions/current")
        assert_error(status, body, 401, "not_signed_in")
        status, _ = await api.as_renter("GET", "/account")
        assert status == 200  # API keys, and other accounts' sessions, are not touched
        kinds = await audit_kinds(api, EMAIL)
        assert kinds[-1] == "signed_out_everywhere"

    async def test_the_audit_log_is_the_accounts_own_and_holds_no_secret(self, api: Api, sink: MailSink) -> None:
        mail = await sign_up(api, sink)
        await post(api, "/accounts/verify", {"token": token_of(mail, "verify")})
        await sign_in(api, EMAIL, "wrong password here")
        _, session = await sign_in(api)
        status, log = await call(api, "GET", "/audit-events")
        assert status == 200 and log["total"] == 4
        assert [item["kind"] for item in log["items"]] == ["signed_in", "sign_in_failed", "email_verified", "signed_up"]
        assert all(item["address"] == "127.0.0.1" for item in log["items"])
        text = str(log)
        assert PASSWORD not in text and token_of(mail, "verify") not in text and session["csrf_token"] not in text
        status, other = await api.as_renter("GET", "/audit-events")
        assert (status, other["total"]) == (200, 0)


async def test_the_password_hash_is_argon2id_with_the_settings_parameters(api: Api) -> None:
    stored = await passwords.hash_password(PASSWORD, api.master.settings)
    settings = api.master.settings
    assert stored.startswith(f"$argon2id$v=19$m={settings.password_hash_memory_kib},t={settings.password_hash_time_cost},p=4$")
    assert await passwords.verify_password(stored, PASSWORD, settings) == (True, None)
    assert (await passwords.verify_password(stored, PASSWORD + "x", settings))[0] is False
    assert (await passwords.verify_password(None, PASSWORD, settings))[0] is False



class TestSecondFactor:
    clock: ManualClock

    async def _enable(self, api: Api, sink: MailSink) -> tuple[str, list[str], str]:
        """Sign up, verify, sign in and turn TOTP on (the master's clock stopped: the codes' steps are the test's to
        choose); returns the secret, the recovery codes and the CSRF token."""
        api.master.clock = self.clock = ManualClock(datetime.now(UTC))
        mail = await sign_up(api, sink)
        await post(api, "/accounts/verify", {"token": token_of(mail, "verify")})
        _, session = await sign_in(api)
        csrf = session["csrf_token"]
        status, begun = await post(api, "/account/totp", {}, csrf=csrf)
        assert status == 200 and begun["otpauth_uri"].startswith("otpauth://totp/gpumarket:alice.renter%40example.com?")
        status, body = await post(api, "/account/totp/confirm", {"code": "000000"}, csrf=csrf)
        assert_error(status, body, 401, "invalid_totp")
        assert (await call(api, "GET", "/account/totp"))[1] == {"enabled": False, "recovery_codes_left": 0}
        status, body = await post(api, "/account/totp/confirm", {"code": pyotp.TOTP(begun["secret"]).at(self.clock.now())}, csrf=csrf)
        assert status == 200 and body["enabled"] is True and len(set(body["recovery_codes"])) == 10
        return begun["secret"], body["recovery_codes"], csrf

    async def test_a_password_sign_in_then_needs_the_code_and_a_code_works_once(self, api: Api, sink: MailSink) -> None:
        secret, _, _ = await self._enable(api, sink)
        status, body = await sign_in(api)
        assert_error(status, body, 401, "totp_required")
        wrong = await post(api, "/sessions", {"email": EMAIL, "password": "not the password", "totp_code": "123456"})
        assert_error(*wrong, 401, "invalid_credentials")  # the code is not even looked at
        status, body = await post(api, "/sessions", {"email": EMAIL, "password": PASSWORD, "totp_code": "000000"})
        assert_error(status, body, 401, "invalid_totp")
        now = pyotp.TOTP(secret).at(self.clock.now())
        status, body = await post(api, "/sessions", {"email": EMAIL, "password": PASSWORD, "totp_code": now})
        assert_error(status, body, 401, "invalid_totp")  # the code that turned it on: used once already
        code = pyotp.TOTP(secret).at(self.clock.now() + timedelta(seconds=30))  # the next step's: a phone a little ahead
        status, body = await post(api, "/sessions", {"email": EMAIL, "password": PASSWORD, "totp_code": pyotp.TOTP(secret).at(
            self.clock.now() + timedelta(seconds=90))})  # three steps ahead: too far
        assert_error(status, body, 401, "invalid_totp")
        assert (await post(api, "/sessions", {"email": EMAIL, "password": PASSWORD, "totp_code": code}))[0] == 201
        status, body = await post(api, "/sessions", {"email": EMAIL, "password": PASSWORD, "totp_code": code})
        assert_error(status, body, 401, "invalid_totp")  # seen once: not again
        kinds = await audit_kinds(api, EMAIL)
        assert kinds.count("sign_in_failed") == 5 and "totp_enabled" in kinds

    async def test_a_recovery_code_signs_in_once_and_turns_the_factor_off(self, api: Api, sink: MailSink) -> None:
        _, codes, _ = await self._enable(api, sink)
        assert (await post(api, "/sessions", {"email": EMAIL, "password": PASSWORD, "totp_code": codes[0]}))[0] == 201
        status, body = await post(api, "/sessions", {"email": EMAIL, "password": PASSWORD, "totp_code": codes[0]})
        assert_error(status, body, 401, "invalid_totp")
        _, session = await post(api, "/sessions", {"email": EMAIL, "password": PASSWORD, "totp_code": codes[1].upper()})
        assert (await call(api, "GET", "/account/totp"))[1] == {"enabled": True, "recovery_codes_left": 8}
        status, body = await post(api, "/account/totp/disable", {"code": codes[2]}, csrf=session["csrf_token"])
        assert (status, body) == (200, {"enabled": False, "recovery_codes_left": 0})
        assert (await sign_in(api))[0] == 201
        assert "totp_disabled" in await audit_kinds(api, EMAIL)

    async def test_an_api_key_cannot_turn_a_second_factor_on(self, api: Api) -> None:
        status, body = await api.as_renter("POST", "/account/totp", json={})
        assert_error(status, body, 403, "console_session_required")
