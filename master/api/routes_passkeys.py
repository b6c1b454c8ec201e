"""Passkeys (WebAuthn, ``master/services/accounts/passkeys.py``): a signed-in person adds, lists and removes them; anyone
signs in with one.

Adding and removing one is for a console session opened by password or passkey (``403 console_session_required``
otherwise): a session opened with an API key has only that key's scopes, and a passkey it added would sign in with all
of them. Signing in is public and in the ``SIGN_IN`` rate class, as ``POST /sessions`` is; it opens the same session
(cookie and CSRF token). The service returns its refusals so that a used challenge's deletion, and a failed sign-in's
audit record, commit before the error is answered.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from master.api.base import RateClass, Route, parse_body
from master.api.keys import MASTER
from master.api.middleware import SESSION, principal
from master.api.ratelimits import request_address
from master.api.responses import ConsoleSession, PasskeyDeleted, PasskeyList, PasskeyView
from master.api.routes_accounts import ConsoleSessionRequired
from master.api.routes_console import session_opened
from master.models import Account, Passkey
from master.services import accounts
from shared.errors import GpumarketError

CREDENTIAL = Field(description="The PublicKeyCredential navigator.credentials answered, as JSON (its toJSON(): id, "
                   "rawId, type and response, its binary fields base64url).")  # fmt: skip
NO_STORE = {"Cache-Control": "no-store"}


class PasskeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=100, description='What you call it ("laptop", "phone").')
    credential: dict[str, Any] = CREDENTIAL


class PasskeySignIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    credential: dict[str, Any] = CREDENTIAL


def _signed_in_person(request: web.Request) -> str:
    """The account of a console session opened by password or passkey; 403 for an API key or a key's session."""
    if SESSION not in request or principal(request).key_id is not None:
        raise ConsoleSessionRequired("passkeys are added and removed from a console session signed in with your password or "
                                     "a passkey, never with an API key")  # fmt: skip
    return principal(request).person_id


def _raise(outcome: Any) -> None:
    if isinstance(outcome, GpumarketError):
        raise outcome


async def list_passkeys(request: web.Request) -> web.Response:
    master, who = request.app[MASTER], principal(request)
    async with master.db.session() as session:
        return web.json_response({"passkeys": await accounts.passkeys.list_passkeys(session, who.person_id)})


async def passkey_registration_options(request: web.Request) -> web.Response:
    account_id, master = _signed_in_person(request), request.app[MASTER]
    async with master.db.session() as session:
        account = await session.get(Account, account_id)
        assert account is not None  # the session resolved it
        options = await accounts.passkeys.registration_options(
            session, account, settings=master.settings, now=master.clock.now()
        )
    return web.json_response(options, headers=NO_STORE)


async def add_passkey(request: web.Request) -> web.Response:
    account_id, master = _signed_in_person(request), request.app[MASTER]
    body = await parse_body(request, PasskeyCreate)
    async with master.db.session() as session:  # the used challenge's deletion commits, whatever the answer
        added = await accounts.passkeys.register(session, account_id, body.credential, body.name, settings=master.settings,
                                        now=master.clock.now(), address=request_address(request))  # fmt: skip
        answer = accounts.passkeys.view(added) if isinstance(added, Passkey) else None
    _raise(added)
    return web.json_response(answer, status=201)


async def delete_passkey(request: web.Request) -> web.Response:
    account_id, master = _signed_in_person(request), request.app[MASTER]
    passkey_id = request.match_info["passkey_id"]
    async with master.db.session() as session:
        await accounts.passkeys.delete_passkey(
            session, account_id, passkey_id, now=master.clock.now(), address=request_address(request)
        )
    return web.json_response({"id": passkey_id, "deleted": True})


async def passkey_sign_in_options(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    async with master.db.session() as session:
        options = await accounts.passkeys.sign_in_options(
            session, settings=master.settings, now=master.clock.now()
        )
    return web.json_response(options, headers=NO_STORE)


async def passkey_sign_in(request: web.Request) -> web.Response:
    body = await parse_body(request, PasskeySignIn)
    master = request.app[MASTER]
    async with (
        master.db.session() as session
    ):  # the challenge's deletion and a failure's audit record commit first
        opened = await accounts.passkeys.sign_in(session, body.credential, settings=master.settings, now=master.clock.now(),
                                        address=request_address(request))  # fmt: skip
    if isinstance(opened, GpumarketError):
        raise opened
    token, signed_in = opened
    return session_opened(request, token, signed_in)


ROUTES: tuple[Route, ...] = (
    Route("GET", "/account/passkeys", list_passkeys, "Your passkeys, oldest first: name, when added and last used (never "
          "the key).", response=PasskeyList, errors=(401,)),
    Route("POST", "/account/passkeys/options", passkey_registration_options, "Start adding a passkey: the options for the "
          "browser's navigator.credentials.create (a challenge good once, for passkey_challenge_ttl_s). A console session "
          "opened by password or passkey only.", scope="read", errors=(401, 403, 503)),
    Route("POST", "/account/passkeys", add_passkey, "Add a passkey: the browser's answer to the options, verified against "
          "the challenge, the relying party and the console's origin. A console session opened by password or passkey only.",
          scope="read", body=PasskeyCreate, response=PasskeyView, success=201, errors=(400, 401, 403, 409, 422, 503)),
    Route("DELETE", "/account/passkeys/{passkey_id}", delete_passkey, "Remove one of your passkeys: it signs in no more. "
          "A console session opened by password or passkey only.", scope="read", response=PasskeyDeleted,
          errors=(401, 403, 404)),
    Route("POST", "/sessions/passkey/options", passkey_sign_in_options, "Start signing in with a passkey: the options for "
          "navigator.credentials.get, naming no account (the authenticator offers the passkeys it holds for this site).",
          public=True, limit=RateClass.SIGN_IN, errors=(503,)),
    Route("POST", "/sessions/passkey", passkey_sign_in, "Sign in to the web console with a passkey's answer to the options: "
          "the same session as POST /sessions (cookie and CSRF token). It counts as two factors: no TOTP code is asked.",
          public=True, limit=RateClass.SIGN_IN, body=PasskeySignIn, response=ConsoleSession, success=201,
          errors=(400, 401, 422, 503)),
)  # fmt: skip
