"""Self-service accounts: sign up, verify the address, reset a password, sign out everywhere, read the audit log.

Every public route here is in the ``SIGN_IN`` rate class (the client address's sign-in bucket) and takes from the
bucket of the email address it acts on too (``ratelimits.limit_email``). The mail a route sends goes out before its
transaction commits: if the mail server refuses it, the answer is 503 ``mail_unavailable`` and nothing changed.
Sign-up and password resets answer the same whether the address has an account or not (docs/accounts.md).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.ext.asyncio import AsyncSession

from master.api.base import PAGING, RateClass, Route, listing, page, parse_body
from master.api.keys import MASTER
from master.api.middleware import SESSION, principal
from master.api.ratelimits import limit_email, request_address
from master.api.responses import EmailVerified, MailSent, PasswordReset, SignedOutEverywhere
from master.context import Master
from master.models import Account
from master.services import accounts
from shared import mail
from shared.errors import Forbidden

EMAIL = Field(min_length=3, max_length=254, description="Your email address.")
PASSWORD = Field(min_length=1, max_length=1024, description="At least password_min_length (10) characters; not a common one.")
TOKEN = Field(min_length=1, max_length=128, description="The token of the mailed link (after #/verify/ or #/reset/).")


class SignUp(BaseModel):
    model_config = ConfigDict(extra="forbid")

    email: str = EMAIL
    password: str = PASSWORD
    role: Literal["renter", "provider", "both"] = Field(description="renter: rent GPUs; provider: list your hosts' GPUs; both: "
                                                        "a renter account with a provider team of your own to switch to.")  # fmt: skip


class VerifyEmail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token: str = TOKEN


class ResetRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    email: str = EMAIL


class ResetConfirm(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token: str = TOKEN
    password: str = PASSWORD


class SignUpClosed(Forbidden):
    code = "sign_up_closed"


def _smtp(master: Master) -> str:
    if master.settings.smtp_url is None:
        raise mail.MailUnavailable("this marketplace sends no mail (no smtp_url is set), so it cannot mail you a link; ask its operator")
    return master.settings.smtp_url.get_secret_value()


async def send_mail(master: Master, message: mail.Mail | None) -> None:
    if message is not None:
        await mail.send(_smtp(master), master.settings.mail_from, message)


SENT = "we sent a link to that address; open it to go on (check the spam folder too)"


async def sign_up(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    if not master.settings.sign_up_enabled:
        raise SignUpClosed("this marketplace does not take sign-ups; ask its operator for an account")
    body = await parse_body(request, SignUp)
    await limit_email(request, body.email)  # (no mail server: 503 when the mail is sent, and the transaction rolls back)
    async with master.db.session() as session:
        message = await accounts.sign_up(session, email=body.email, password=body.password, role=body.role,
                                         settings=master.settings, now=master.clock.now(), address=request_address(request))  # fmt: skip
        await send_mail(master, message)
    return web.json_response({"status": SENT}, status=202)


async def verify(request: web.Request) -> web.Response:
    body = await parse_body(request, VerifyEmail)
    master = request.app[MASTER]
    async with master.db.session() as session:
        account = await accounts.verify_email(session, body.token, now=master.clock.now(), address=request_address(request))
        email = account.email or ""
    return web.json_response({"email": email, "verified": True})


async def resend(request: web.Request) -> web.Response:
    master, who = request.app[MASTER], principal(request)
    await limit_email(request, who.person_id)
    async with master.db.session() as session:
        message = await accounts.resend_verification(session, who.person_id, settings=master.settings,
                                                     now=master.clock.now(), address=request_address(request))  # fmt: skip
        if message is None:
            return web.json_response({"status": "nothing to verify: the address is verified already (or the account has none)"})
        await send_mail(master, message)
    return web.json_response({"status": SENT}, status=202)


async def request_reset(request: web.Request) -> web.Response:
    body = await parse_body(request, ResetRequest)
    master = request.app[MASTER]
    await limit_email(request, body.email)
    _smtp(master)  # before anything: an unknown address, which gets no mail, must answer as a known one
    async with master.db.session() as session:
        message = await accounts.request_reset(session, body.email, settings=master.settings, now=master.clock.now(),
                                               address=request_address(request))  # fmt: skip
        await send_mail(master, message)
    return web.json_response({"status": "if an account has that address, we sent it a link to choose a new password"}, status=202)


async def confirm_reset(request: web.Request) -> web.Response:
    body = await parse_body(request, ResetConfirm)
    master = request.app[MASTER]
    async with master.db.session() as session:
        _, ended = await accounts.reset_password(session, body.token, body.password, settings=master.settings,
                                                 now=master.clock.now(), address=request_address(request))  # fmt: skip
    return web.json_response({"reset": True, "sessions_ended": ended})


async def sign_out_everywhere(request: web.Request) -> web.Response:
    master, who = request.app[MASTER], principal(request)
    async with master.db.session() as session:
        ended = await accounts.sign_out_everywhere(session, who.person_id, now=master.clock.now(), address=request_address(request))
    response = web.json_response({"sessions_ended": ended})
    response.del_cookie(accounts.COOKIE, path="/")
    return response


class TotpCode(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str = Field(min_length=1, max_length=32, description="The code your authenticator app shows (or, to turn it off, "
                      "a recovery code).")  # fmt: skip


class ConsoleSessionRequired(Forbidden):
    code = "console_session_required"


def _session_only(request: web.Request) -> None:
    if SESSION not in request:
        raise ConsoleSessionRequired("a second factor is set up from a signed-in console session, never with an API key")


async def _with_account(request: web.Request, change: Callable[[AsyncSession, Account, datetime, str], Any]) -> Any:
    master, who = request.app[MASTER], principal(request)
    _session_only(request)
    async with master.db.session() as session:
        account = await session.get(Account, who.person_id, with_for_update=True)
        assert account is not None  # the session resolved it
        return change(session, account, master.clock.now(), request_address(request))


async def totp_state(request: web.Request) -> web.Response:
    master, who = request.app[MASTER], principal(request)
    async with master.db.session() as session:
        account = await session.get(Account, who.person_id)
        assert account is not None
        return web.json_response({"enabled": account.totp_secret is not None,
                                  "recovery_codes_left": len(account.totp_recovery or []) if account.totp_secret else 0})  # fmt: skip


async def totp_begin(request: web.Request) -> web.Response:
    answer = await _with_account(request, lambda session, account, now, address: accounts.totp_begin(
        account, key=accounts.secrets_key_of(request.app[MASTER].settings)))  # fmt: skip
    return web.json_response(answer, headers={"Cache-Control": "no-store"})


async def totp_confirm(request: web.Request) -> web.Response:
    body = await parse_body(request, TotpCode)
    codes = await _with_account(request, lambda session, account, now, address: accounts.totp_confirm(
        session, account, body.code, now=now, address=address, key=accounts.secrets_key_of(request.app[MASTER].settings)))  # fmt: skip
    return web.json_response({"enabled": True, "recovery_codes": codes}, headers={"Cache-Control": "no-store"})


async def totp_disable(request: web.Request) -> web.Response:
    body = await parse_body(request, TotpCode)
    await _with_account(request, lambda session, account, now, address: accounts.totp_disable(
        session, account, body.code, now=now, address=address, key=accounts.secrets_key_of(request.app[MASTER].settings)))  # fmt: skip
    return web.json_response({"enabled": False, "recovery_codes_left": 0})


async def audit_events(request: web.Request) -> web.Response:
    master, who = request.app[MASTER], principal(request)
    limit, offset = page(request)
    if who.team_role is not None and who.team_role not in accounts.teams.MANAGERS:
        raise accounts.teams.TeamRoleForbids(f"a team's security log is for its owners and admins; you are a {who.team_role}")
    async with master.db.session() as session:
        items, total = await accounts.audit_log(session, who.account_id, limit=limit, offset=offset)
    return listing(items, total, limit, offset)


ROUTES: tuple[Route, ...] = (
    Route("POST", "/accounts", sign_up, "Sign up with an email address and a password, as a renter or a provider. The "
          "address gets a verification link; the answer is the same whether it had an account already.",
          public=True, limit=RateClass.SIGN_IN, body=SignUp, response=MailSent, success=202, errors=(403, 422, 503)),
    Route("POST", "/accounts/verify", verify, "Verify an account's address with the token of its mailed link.",
          public=True, limit=RateClass.SIGN_IN, body=VerifyEmail, response=EmailVerified, errors=(400, 422)),
    Route("POST", "/accounts/verify/resend", resend, "Mail the signed-in account's address a new verification link "
          "(earlier ones stop working).", response=MailSent, success=202, also_success=(200,), errors=(401, 403, 503), scope="read"),
    Route("POST", "/password-resets", request_reset, "Mail a link to choose a new password to the account of an "
          "address; the answer is the same whether it has one or not.",
          public=True, limit=RateClass.SIGN_IN, body=ResetRequest, response=MailSent, success=202, errors=(422, 503)),
    Route("POST", "/password-resets/confirm", confirm_reset, "Set a new password with the token of a reset link: every "
          "console session of the account ends.",
          public=True, limit=RateClass.SIGN_IN, body=ResetConfirm, response=PasswordReset, errors=(400, 422)),
    Route("DELETE", "/sessions", sign_out_everywhere, "Sign out everywhere: end every console session of the account "
          "(API keys keep working).", response=SignedOutEverywhere, errors=(401, 403), scope="read"),
    Route("GET", "/account/totp", totp_state, "Whether the account signs in with a second factor (TOTP), and how many "
          "recovery codes are left.", errors=(401,)),
    Route("POST", "/account/totp", totp_begin, "Start setting up a second factor: a new secret (and its otpauth:// URI) to "
          "enter in an authenticator app. A console session only.", scope="read", errors=(401, 403, 409)),
    Route("POST", "/account/totp/confirm", totp_confirm, "Turn the second factor on with a code from the app: answers ten "
          "recovery codes, shown once. A console session only.", scope="read", body=TotpCode, errors=(400, 401, 403, 422)),
    Route("POST", "/account/totp/disable", totp_disable, "Turn the second factor off with a current code or a recovery "
          "code. A console session only.", scope="read", body=TotpCode, errors=(401, 403, 422)),
    Route("GET", "/audit-events", audit_events, "The account's security log, newest first: sign-ups, sign-ins (and "
          "failed ones), verified addresses, password resets, sign-outs everywhere; in a team's context, the team's "
          "(members invited, added, removed, roles changed; its owners and admins only).", query=PAGING, errors=(401,)),
)  # fmt: skip
