"""API keys an account manages (``master/services/accounts/keys.py``): make one (its secret shown once), list them,
revoke one. The console's *API keys* page and ``gpumarket keys`` call these."""

from __future__ import annotations

from datetime import UTC, datetime

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from master.api.base import RateClass, Route, parse_body
from master.api.keys import MASTER
from master.api.middleware import SESSION, principal
from master.api.ratelimits import request_address
from master.api.times import UtcTime
from master.services import accounts
from shared.errors import Forbidden

ScopeName = accounts.Scope


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=100, pattern=r"^[^\x00-\x1f\x7f]+$", description="What you call it, e.g. ci-runner.")
    scopes: list[ScopeName] | None = Field(None, min_length=1, max_length=5, description="What it may do: read, rent, billing, "
                                           "provider, admin (within your role). Left out: every scope (and at most those of the key you call with).")  # fmt: skip
    expires_at: UtcTime | None = Field(None, description="When it stops working (RFC 3339, with a time zone); left out: never.")
    allowed_networks: list[str] | None = Field(None, min_length=1, max_length=20, description="Addresses or networks (CIDR) it "
                                               "may be used from; left out: any.")  # fmt: skip


def _utc(moment: datetime | None) -> datetime | None:
    return None if moment is None else moment.astimezone(UTC)


def _granted(who: accounts.Principal) -> frozenset[str] | None:
    """What a new key may hold at most: the calling key's scopes, within the caller's role in a team it acts for."""
    if who.team_role is None:
        return who.scopes
    return (who.scopes or accounts.ALL_SCOPES) & accounts.teams.rights(who)


def _scopes(body: KeyCreate, who: accounts.Principal) -> list[str] | None:
    """The scopes asked for; left out: every scope, or in a team's context every right of the caller's role there."""
    if body.scopes:
        return [scope.value for scope in body.scopes]
    granted = _granted(who) if who.team_role is not None else None
    return None if granted is None else [scope.value for scope in accounts.Scope if scope in granted]


async def create_key(request: web.Request) -> web.Response:
    body = await parse_body(request, KeyCreate)
    master, who = request.app[MASTER], principal(request)
    async with master.db.session() as session:
        row, secret = await accounts.make_api_key(
            session, who.person_id, name=body.name.strip(), scopes=_scopes(body, who),
            expires_at=_utc(body.expires_at), allowed_networks=body.allowed_networks, now=master.clock.now(),
            granted_by=_granted(who), address=request_address(request), team_id=who.account_id if who.team_role else None,
        )  # fmt: skip
        view = accounts.api_key_view(row, now=master.clock.now())
    return web.json_response({**view, "key": secret}, status=201, headers={"Cache-Control": "no-store"})


async def list_keys(request: web.Request) -> web.Response:
    master, who = request.app[MASTER], principal(request)
    async with master.db.session() as session:
        items = await accounts.list_api_keys(session, who.person_id, now=master.clock.now())
    return web.json_response({"items": items, "total": len(items)})


async def revoke_key(request: web.Request) -> web.Response:
    master, who = request.app[MASTER], principal(request)
    async with master.db.session() as session:
        view = await accounts.revoke_api_key(session, who.person_id, request.match_info["key_id"], now=master.clock.now(),
                                             revoked_by=(who.key_id, who.scopes), address=request_address(request))  # fmt: skip
    return web.json_response(view)


class DeviceStart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    client_name: str = Field(min_length=1, max_length=100, pattern=r"^[^\x00-\x1f\x7f]+$",
                             description="What asks, as the approval page shows it, e.g. gpumarket CLI on laptop.")  # fmt: skip


class DeviceToken(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device_code: str = Field(min_length=1, max_length=128)


class DeviceApprove(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scopes: list[ScopeName] | None = Field(None, min_length=1, max_length=5, description="The key's scopes; left out: every scope.")


class ConsoleSessionOnly(Forbidden):
    code = "console_session_required"


def _console_only(request: web.Request) -> None:
    if SESSION not in request:
        raise ConsoleSessionOnly("approve a sign-in from the console, signed in: an API key cannot approve one")


async def device_start(request: web.Request) -> web.Response:
    body = await parse_body(request, DeviceStart)
    master = request.app[MASTER]
    async with master.db.session() as session:
        started = await accounts.devices.start(session, client_name=body.client_name.strip(), now=master.clock.now())
    base = (master.settings.public_url or f"http://{request.host}").rstrip("/")
    return web.json_response({**started, "verification_uri": f"{base}/#/device",
                              "verification_uri_complete": f"{base}/#/device/{started['user_code']}"},
                             headers={"Cache-Control": "no-store"})  # fmt: skip


async def device_token(request: web.Request) -> web.Response:
    body = await parse_body(request, DeviceToken)
    master = request.app[MASTER]
    async with master.db.session() as session:
        made = await accounts.devices.exchange(session, body.device_code, now=master.clock.now(), address=request_address(request))
    return web.json_response(made, headers={"Cache-Control": "no-store"})


async def device_describe(request: web.Request) -> web.Response:
    _console_only(request)
    master = request.app[MASTER]
    async with master.db.session() as session:
        return web.json_response(await accounts.devices.describe(session, request.match_info["user_code"], now=master.clock.now()))


async def device_approve(request: web.Request) -> web.Response:
    _console_only(request)
    body = await parse_body(request, DeviceApprove)
    master, who = request.app[MASTER], principal(request)
    async with master.db.session() as session:
        approved = await accounts.devices.approve(session, request.match_info["user_code"], who.person_id,
                                                  scopes=[scope.value for scope in body.scopes] if body.scopes else None,
                                                  now=master.clock.now())  # fmt: skip
    return web.json_response(approved)


ROUTES: tuple[Route, ...] = (
    Route("POST", "/api-keys", create_key, "Make an API key: named, with scopes, an optional expiry and networks. Its "
          "secret is in this answer only.", scope="read", body=KeyCreate, success=201, errors=(401, 403, 422)),
    Route("GET", "/api-keys", list_keys, "The account's API keys (never their secrets): name, prefix, scopes, state, "
          "expiry, networks, last use.", errors=(401,)),
    Route("DELETE", "/api-keys/{key_id}", revoke_key, "Revoke an API key: it stops working at once, on every master, "
          "with the console sessions opened with it.", scope="read", errors=(401, 403, 404)),
    Route("POST", "/device-codes", device_start, "A CLI's sign-in through the browser (RFC 8628): a device code to poll "
          "with and a user code to approve in the console at verification_uri.", public=True, limit=RateClass.SIGN_IN,
          body=DeviceStart, errors=(422,)),
    Route("POST", "/device-codes/token", device_token, "Poll for the API key of an approved sign-in (400 "
          "authorization_pending until then, expired_token after): the key once.", public=True, body=DeviceToken,
          errors=(400, 422)),
    Route("GET", "/device-codes/{user_code}", device_describe, "The sign-in waiting for a user code: which client asks. "
          "A console session only.", errors=(401, 403, 404)),
    Route("POST", "/device-codes/{user_code}/approve", device_approve, "Approve a CLI's sign-in with the scopes its key "
          "may have. A console session only.", scope="read", body=DeviceApprove, errors=(401, 403, 404, 422)),
)  # fmt: skip
