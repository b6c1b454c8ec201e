"""Private registry credentials (``master/services/accounts/registries.py``): add (or replace) one per image prefix,
list them (never their secrets), remove one. The console's account page and ``gpumarket registry`` call these.
Another account's credential answers 404 as an unknown one."""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from master.api.base import Route, parse_body
from master.api.keys import MASTER
from master.api.middleware import principal
from master.api.ratelimits import request_address
from master.services import accounts

_PRINTABLE = r"^[^\x00-\x1f\x7f]+$"


class RegistryCredentialCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefix: str = Field(min_length=1, max_length=255, pattern=_PRINTABLE, description="The images it is for: a registry "
                        "host and optionally a path, e.g. registry.example.com:5000/myorg/ (docker.io/myorg/ for Docker Hub). "
                        "A rental's image gets the credential of the longest prefix it is under.")  # fmt: skip
    username: str = Field(
        min_length=1, max_length=255, pattern=_PRINTABLE, description="The registry login's user name."
    )
    password: str = Field(min_length=1, max_length=4096, pattern=_PRINTABLE, description="Its password or access token: "
                          "stored sealed, never shown again.")  # fmt: skip


class RegistryCredentialView(BaseModel):
    id: str
    prefix: str
    username: str
    created_at: str
    updated_at: str
    last_used_at: str | None


class RegistryCredentialList(BaseModel):
    items: list[RegistryCredentialView]
    total: int


async def add_credential(request: web.Request) -> web.Response:
    body = await parse_body(request, RegistryCredentialCreate)
    master, who = request.app[MASTER], principal(request)
    async with master.db.session() as session:
        row, created = await accounts.add_registry_credential(
            session, who.account_id, prefix=body.prefix, username=body.username, password=body.password,
            settings=master.settings, now=master.clock.now(), address=request_address(request),
        )  # fmt: skip
        view = accounts.registry_credential_view(row)
    return web.json_response(view, status=201 if created else 200, headers={"Cache-Control": "no-store"})


async def list_credentials(request: web.Request) -> web.Response:
    master, who = request.app[MASTER], principal(request)
    async with master.db.session() as session:
        items = await accounts.list_registry_credentials(session, who.account_id)
    return web.json_response({"items": items, "total": len(items)})


async def remove_credential(request: web.Request) -> web.Response:
    master, who = request.app[MASTER], principal(request)
    async with master.db.session() as session:
        view = await accounts.remove_registry_credential(session, who.account_id, request.match_info["credential_id"],
                                                         now=master.clock.now(), address=request_address(request))  # fmt: skip
    return web.json_response(view)


ROUTES: tuple[Route, ...] = (
    Route("POST", "/registry-credentials", add_credential, "Store a login to a private registry for the images under a "
          "prefix (201; 200 when it replaces the prefix's login, as docker login does). Sealed at rest, never shown again, "
          "sent to a host only inside the start command of a rental whose image is under it. 503 secrets_key_unset on "
          "a master without the secrets_key setting.", scope="rent", body=RegistryCredentialCreate,
          response=RegistryCredentialView, success=201, also_success=(200,), errors=(401, 403, 409, 422, 503)),
    Route("GET", "/registry-credentials", list_credentials, "The account's registry credentials (never their secrets): "
          "prefix, user name, when added, changed and last sent with a start.", scope="rent",
          response=RegistryCredentialList, errors=(401, 403)),
    Route("DELETE", "/registry-credentials/{credential_id}", remove_credential, "Remove a registry credential: rentals "
          "started from now on pull without it.", scope="rent", response=RegistryCredentialView, errors=(401, 403, 404)),
)  # fmt: skip
