"""API keys an account manages (``master/services/accounts/keys.py``): make one (its secret shown once), list them,
revoke one. The console's *API keys* page and ``gpumarket keys`` call these."""

from __future__ import annotations

from datetime import UTC, datetime

from aiohttp import web
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from master.api.base import Route, parse_body
from master.api.keys import MASTER
from master.api.middleware import principal
from master.api.ratelimits import request_address
from master.services import accounts

ScopeName = accounts.Scope


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=100, pattern=r"^[^\x00-\x1f\x7f]+$", description="What you call it, e.g. ci-runner.")
    scopes: list[ScopeName] | None = Field(None, min_length=1, max_length=5, description="What it may do: read, rent, billing, "
                                           "provider, admin (within your role). Left out: every scope (and at most those of the key you call with).")  # fmt: skip
    expires_at: AwareDatetime | None = Field(None, description="When it stops working (with a time zone); left out: never.")
    allowed_networks: list[str] | None = Field(None, min_length=1, max_length=20, description="Addresses or networks (CIDR) it "
                                               "may be used from; left out: any.")  # fmt: skip


def _utc(moment: datetime | None) -> datetime | None:
    return None if moment is None else moment.astimezone(UTC)


async def create_key(request: web.Request) -> web.Response:
    body = await parse_body(request, KeyCreate)
    master, who = request.app[MASTER], principal(request)
    async with master.db.session() as session:
        row, secret = await accounts.make_api_key(
            session, who.account_id, name=body.name.strip(), scopes=[scope.value for scope in body.scopes] if body.scopes else None,
            expires_at=_utc(body.expires_at), allowed_networks=body.allowed_networks, now=master.clock.now(),
            granted_by=who.scopes, address=request_address(request),
        )  # fmt: skip
        view = accounts.api_key_view(row, now=master.clock.now())
    return web.json_response({**view, "key": secret}, status=201, headers={"Cache-Control": "no-store"})


async def list_keys(request: web.Request) -> web.Response:
    master, who = request.app[MASTER], principal(request)
    async with master.db.session() as session:
        items = await accounts.list_api_keys(session, who.account_id, now=master.clock.now())
    return web.json_response({"items": items, "total": len(items)})


async def revoke_key(request: web.Request) -> web.Response:
    master, who = request.app[MASTER], principal(request)
    async with master.db.session() as session:
        view = await accounts.revoke_api_key(session, who.account_id, request.match_info["key_id"], now=master.clock.now(),
                                             revoked_by=(who.key_id, who.scopes), address=request_address(request))  # fmt: skip
    return web.json_response(view)


ROUTES: tuple[Route, ...] = (
    Route("POST", "/api-keys", create_key, "Make an API key: named, with scopes, an optional expiry and networks. Its "
          "secret is in this answer only.", scope="read", body=KeyCreate, success=201, errors=(401, 403, 422)),
    Route("GET", "/api-keys", list_keys, "The account's API keys (never their secrets): name, prefix, scopes, state, "
          "expiry, networks, last use.", errors=(401,)),
    Route("DELETE", "/api-keys/{key_id}", revoke_key, "Revoke an API key: it stops working at once, on every master, "
          "with the console sessions opened with it.", scope="read", errors=(401, 403, 404)),
)  # fmt: skip
