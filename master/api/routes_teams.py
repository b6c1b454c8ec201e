"""Teams: make one, invite people by mail, accept, change roles, remove members or leave (master/services/accounts/teams.py).

These routes act on the team their path names, for the person who calls (``Principal.person_id``), whatever
context the request is in; what a team owns (rentals, credit, SSH keys) is reached through the other routes in
the team's context (the ``Gpumarket-Team`` header). An invitation's mail goes out before its transaction commits:
a mail server that refuses it leaves no invitation behind (503 ``mail_unavailable``).
"""

from __future__ import annotations

from typing import Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from master.api.base import RateClass, Route, parse_body
from master.api.keys import MASTER
from master.api.middleware import principal
from master.api.ratelimits import limit_email, request_address
from master.api.routes_accounts import send_mail
from master.services import accounts, commands

RoleName = Literal["owner", "admin", "member", "billing"]
ROLE = Field(
    description="owner: everything; admin: rent, pay, manage members; member: rent; billing: pay and read, not rent."
)


class TeamCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, description="1 to 64 letters, digits, spaces, '.', '_', '@', '+' or '-'.")
    kind: Literal["renter", "provider"] = Field("renter", description="renter: the team rents GPUs; provider: it lists hosts.")


class InvitationCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    email: str = Field(min_length=3, max_length=254, description="The address to invite; only it can accept.")
    role: RoleName = ROLE


class InvitationAccept(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token: str = Field(
        min_length=1, max_length=128, description="The token of the mailed link (after #/invite/)."
    )


class RoleChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: RoleName = ROLE


async def create_team(request: web.Request) -> web.Response:
    body = await parse_body(request, TeamCreate)
    master = request.app[MASTER]
    async with master.db.session() as session:
        team = await accounts.teams.create_team(session, principal(request), body.name, now=master.clock.now(),
                                                address=request_address(request), kind=body.kind)  # fmt: skip
        view = await accounts.teams.team_view(
            session, team.id, principal(request).person_id, now=master.clock.now()
        )
    return web.json_response(view, status=201)


async def list_teams(request: web.Request) -> web.Response:
    async with request.app[MASTER].db.session() as session:
        items = await accounts.teams.list_teams(session, principal(request).person_id)
    return web.json_response({"items": items, "total": len(items)})


async def get_team(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    async with master.db.session() as session:
        view = await accounts.teams.team_view(
            session, request.match_info["team_id"], principal(request).person_id, now=master.clock.now()
        )
    return web.json_response(view)


async def invite(request: web.Request) -> web.Response:
    body = await parse_body(request, InvitationCreate)
    master = request.app[MASTER]
    await limit_email(request, body.email)
    async with master.db.session() as session:
        view, message = await accounts.teams.invite(
            session, request.match_info["team_id"], principal(request), email=body.email, role=body.role,
            settings=master.settings, now=master.clock.now(), address=request_address(request),
        )  # fmt: skip
        await send_mail(master, message)
    return web.json_response(view, status=201)


async def revoke_invitation(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    async with master.db.session() as session:
        await accounts.teams.revoke_invitation(session, request.match_info["team_id"], request.match_info["invitation_id"],
                                               principal(request), now=master.clock.now())  # fmt: skip
    return web.json_response({"id": request.match_info["invitation_id"], "revoked": True})


async def accept(request: web.Request) -> web.Response:
    body = await parse_body(request, InvitationAccept)
    master = request.app[MASTER]
    async with master.db.session() as session:
        view = await accounts.teams.accept(
            session, body.token, principal(request), now=master.clock.now(), address=request_address(request)
        )
    return web.json_response(view)


async def set_role(request: web.Request) -> web.Response:
    body = await parse_body(request, RoleChange)
    master = request.app[MASTER]
    async with master.db.session() as session:
        view = await accounts.teams.set_role(session, request.match_info["team_id"], request.match_info["account_id"], body.role,
                                             principal(request), now=master.clock.now(), address=request_address(request))  # fmt: skip
    return web.json_response(view)


async def remove_member(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    member = request.match_info["account_id"]
    async with master.db.session() as session:
        issued = await accounts.teams.remove_member(session, request.match_info["team_id"], member, principal(request),
                                                    now=master.clock.now(), address=request_address(request))  # fmt: skip
    await commands.publish(master, issued)
    return web.json_response({"account_id": member, "removed": True})


ROUTES: tuple[Route, ...] = (
    Route("POST", "/teams", create_team, "Make a team, with you as its owner. Act for it with the Gpumarket-Team header "
          "(its id); it has its own credit, rentals, clusters, services, SSH keys and invoices.",
          body=TeamCreate, success=201, verified=True, errors=(403, 409, 422)),
    Route("GET", "/teams", list_teams, "The teams you are a member of, with your role in each."),
    Route("GET", "/teams/{team_id}", get_team, "A team you are in: its members and roles, and (for owners and admins) "
          "its open invitations. 404 team_not_found for one you are not in.", errors=(404,)),
    Route("POST", "/teams/{team_id}/invitations", invite, "Invite an address to the team with a role (owners and "
          "admins; only owners invite owners). The address gets a link; an open invitation to it is replaced.",
          body=InvitationCreate, success=201, limit=RateClass.SIGN_IN, errors=(403, 404, 409, 422, 503)),
    Route("DELETE", "/teams/{team_id}/invitations/{invitation_id}", revoke_invitation, "Withdraw an invitation: its "
          "link stops working (owners and admins).", errors=(403, 404)),
    Route("POST", "/team-invitations/accept", accept, "Join a team with the token of an invitation mailed to your "
          "(verified) address.", body=InvitationAccept, verified=True, errors=(400, 403, 422)),
    Route("PATCH", "/teams/{team_id}/members/{account_id}", set_role, "Change a member's role (owners: anyone's; admins: "
          "anyone's but an owner's). A team keeps at least one owner (409 last_owner).",
          body=RoleChange, errors=(403, 404, 409, 422)),
    Route("DELETE", "/teams/{team_id}/members/{account_id}", remove_member, "Remove a member (owners and admins), or "
          "leave (your own id). The SSH keys they added to the team stop working at once; the API keys they made "
          "for it are revoked.", errors=(403, 404, 409)),
)  # fmt: skip
