"""SSH keys (``/account/ssh-keys``): the public keys an account registers for SSH into its rentals.

Any signed-in account manages its own keys and only those (admins too); another account's key id
answers 404 as an unknown one. The rules live in ``master/services/accounts/ssh_keys.py``. Adding or deleting a
key reaches the account's live rentals at once (``master/services/accounts/access.py``): the commands are written
with the change and published after its commit.
"""

from __future__ import annotations

from aiohttp import web

from master.api.base import Route, parse_body
from master.api.keys import MASTER
from master.api.middleware import principal
from master.api.responses import SshKeyDeleted, SshKeyList, SshKeyView
from master.api.schemas import SshKeyCreate
from master.services import accounts, commands


async def list_ssh_keys(request: web.Request) -> web.Response:
    async with request.app[MASTER].db.session() as session:
        rows = await accounts.list_keys(session, principal(request).account_id)
        return web.json_response({"ssh_keys": [accounts.key_view(k) for k in rows]})


async def add_ssh_key(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    body = await parse_body(request, SshKeyCreate)
    async with master.db.session() as session:
        who = principal(request)
        key = await accounts.add_key(session, who.account_id, body.public_key, name=body.name, now=master.clock.now(),
                                     added_by=who.person if who.team_role else None)  # fmt: skip
        view = accounts.key_view(key)
        issued = await accounts.access_changed(session, principal(request).account_id, now=master.clock.now())
    await commands.publish(master, issued)
    return web.json_response(view, status=201)


async def delete_ssh_key(request: web.Request) -> web.Response:
    key_id = request.match_info["ssh_key_id"]
    master = request.app[MASTER]
    async with master.db.session() as session:
        await accounts.delete_key(session, principal(request).account_id, key_id)
        issued = await accounts.access_changed(session, principal(request).account_id, now=master.clock.now())
    await commands.publish(master, issued)
    return web.json_response({"id": key_id, "deleted": True})


ROUTES: tuple[Route, ...] = (
    Route("GET", "/account/ssh-keys", list_ssh_keys, "Your SSH public keys, oldest first: the keys SSH into your rentals accepts.",
          response=SshKeyList),
    Route("POST", "/account/ssh-keys", add_ssh_key, "Register an SSH public key (one line of a .pub file). 422 "
          "invalid_ssh_key, ssh_key_too_weak or private_key_pasted; 409 ssh_key_exists (the same key again: nothing "
          "changes, details.id names it) or too_many_ssh_keys (50 at most).",
          body=SshKeyCreate, response=SshKeyView, success=201, errors=(409, 422)),
    Route("DELETE", "/account/ssh-keys/{ssh_key_id}", delete_ssh_key, "Delete one of your SSH keys; SSH into your rentals, running ones included, "
          "stops accepting it within seconds, and open connections that logged in with it are closed.",
          response=SshKeyDeleted, errors=(404,)),
)
