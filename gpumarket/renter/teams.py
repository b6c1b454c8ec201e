"""``gpumarket team …``: teams you are in, their members, invitations, and which one your commands act for.

``team use NAME`` saves the team in the login file: every command after it acts for the team (its rentals, credit,
SSH keys; the ``Gpumarket-Team`` header), until ``team use personal``. ``--team NAME`` (or ``$GPUMARKET_TEAM``) does
the same for one command. The commands that manage a team name it with ``--team`` or act on the one in use.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from gpumarket.renter.api import Client, UsageError, default_config_path, read_config, save_login
from gpumarket.renter.commands import command_group, finish, team_id
from gpumarket.renter.output import short_time, table

ROLES = ("owner", "admin", "member", "billing")


def _print(args: argparse.Namespace, value: Any, text: str) -> None:
    print(json.dumps(value, indent=2) if args.json else text)


def _current(client: Client) -> str:
    if not client.login.team:
        raise UsageError("which team? give --team NAME, or choose one with `gpumarket team use NAME` (`gpumarket team list` shows yours)")
    return client.login.team


async def cmd_team_list(args: argparse.Namespace, client: Client) -> int:
    teams = (await client.request("GET", "/teams", personal=True, retry=True))["items"]
    if args.json:
        print(json.dumps(teams, indent=2))
        return 0
    if not teams:
        print("you are in no team; make one with `gpumarket team create NAME`")
        return 0
    rows = [["*" if team["id"] == client.login.team else "", team["name"], team["id"], team["kind"], team["role"], str(team["members"])]
            for team in teams]  # fmt: skip
    print(table(["", "NAME", "ID", "KIND", "YOUR ROLE", "MEMBERS"], rows))
    return 0


async def cmd_team_create(args: argparse.Namespace, client: Client) -> int:
    team = await client.request("POST", "/teams", json_body={"name": args.name, "kind": args.kind}, personal=True)
    _print(args, team, f"made team {team['name']} ({team['id']}), you are its owner; act for it with "
                       f"`gpumarket team use {team['name']!r}` and invite people with `gpumarket team invite EMAIL`")  # fmt: skip
    return 0


async def cmd_team_show(args: argparse.Namespace, client: Client) -> int:
    team = await client.request("GET", f"/teams/{_current(client)}", personal=True, retry=True)
    if args.json:
        print(json.dumps(team, indent=2))
        return 0
    print(f"team {team['name']} ({team['id']}); your role: {team['role']}")
    rows = [[m["name"], m["email"] or "", m["role"], m["account_id"], short_time(m["added_at"])] for m in team["members"]]
    print(table(["MEMBER", "EMAIL", "ROLE", "ACCOUNT", "SINCE"], rows))
    if team.get("invitations"):
        print("\nopen invitations:")
        print(table(["ID", "EMAIL", "ROLE", "EXPIRES"], [[i["id"], i["email"], i["role"], short_time(i["expires_at"])] for i in team["invitations"]]))
    return 0


async def cmd_team_invite(args: argparse.Namespace, client: Client) -> int:
    made = await client.request("POST", f"/teams/{_current(client)}/invitations", json_body={"email": args.email, "role": args.role},
                                personal=True)  # fmt: skip
    _print(args, made, f"invited {made['email']} as {made['role']} ({made['id']}): they join by opening the mailed link "
                       f"(or `gpumarket team accept LINK`) signed in with that address")  # fmt: skip
    return 0


async def cmd_team_accept(args: argparse.Namespace, client: Client) -> int:
    token = args.link.rsplit("/", 1)[-1].strip()
    if not token:
        raise UsageError("give the invitation's link from the mail (…/#/invite/TOKEN) or its token")
    team = await client.request("POST", "/team-invitations/accept", json_body={"token": token}, personal=True)
    _print(args, team, f"you joined team {team['name']} ({team['id']}) as {team['role']}; act for it with `gpumarket team use {team['name']!r}`")
    return 0


async def cmd_team_role(args: argparse.Namespace, client: Client) -> int:
    changed = await client.request("PATCH", f"/teams/{_current(client)}/members/{args.account_id}", json_body={"role": args.role},
                                   personal=True)  # fmt: skip
    _print(args, changed, f"{changed['account_id']} is now {changed['role']}")
    return 0


async def cmd_team_remove(args: argparse.Namespace, client: Client) -> int:
    removed = await client.request("DELETE", f"/teams/{_current(client)}/members/{args.account_id}", personal=True)
    _print(args, removed, f"removed {removed['account_id']}: the SSH keys they added to the team stop working, their keys for it are revoked")
    return 0


async def cmd_team_leave(args: argparse.Namespace, client: Client) -> int:
    team = _current(client)
    me = await client.request("GET", "/account", personal=True, retry=True)
    await client.request("DELETE", f"/teams/{team}/members/{me['id']}", personal=True)
    path: Path = args.config or default_config_path(os.environ)
    if read_config(path).get("team") == team:
        save_login(path, dataclasses.replace(client.login, team=None))
    _print(args, {"team_id": team, "left": True}, f"you left team {team}; your commands act for yourself again")
    return 0


def _save_team(args: argparse.Namespace, client: Client, team: str | None) -> Path:
    """Save ``team`` as the one commands act for, in the login file (where the login came from one)."""
    path: Path = args.config or default_config_path(os.environ)
    if read_config(path).get("api_key") != client.login.api_key:
        raise UsageError(f"your login is not saved in {path} (it comes from the environment); set $GPUMARKET_TEAM instead")
    save_login(path, dataclasses.replace(client.login, team=team))
    return path


async def cmd_team_use(args: argparse.Namespace, client: Client) -> int:
    chosen = await team_id(client, args.team_name)
    path = _save_team(args, client, chosen)
    text = f"commands act for team {args.team_name} ({chosen}) from now on" if chosen else "commands act for yourself from now on"
    _print(args, {"team_id": chosen}, f"{text} (saved in {path})")
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``team list|create|show|invite|accept|role|remove|leave|use`` to ``gpumarket``'s subparsers."""
    formatter = argparse.RawDescriptionHelpFormatter
    team = command_group(sub, "team", help="teams: share credit, rentals and SSH keys with others, each within a role",
                         description="Teams you are in. A team has its own credit, rentals, clusters, services, SSH keys and "
                         "invoices; its members act for it with `gpumarket team use NAME` (or --team NAME on one command). "
                         "Roles: owner (everything), admin (rent, pay, manage members), member (rent), billing (pay, read).",
                         examples=["create 'Acme ML'", "use 'Acme ML'", "invite bob@example.com --role member", "show",
                                   "accept https://gpumarket.example/#/invite/TOKEN", "use personal"])  # fmt: skip
    listing = team.add_parser("list", help="your teams and your role in each (* the one in use)", formatter_class=formatter,
                              description="The teams you are a member of; * marks the one your commands act for.")  # fmt: skip
    finish(listing, cmd_team_list, json="the teams as JSON")
    create = team.add_parser("create", help="make a team (you are its owner)", formatter_class=formatter,
                             description="Make a team with you as its owner. It starts with no credit.")
    create.add_argument("name", metavar="NAME", help="1 to 64 letters, digits, spaces, '.', '_', '@', '+' or '-'")
    create.add_argument("--kind", choices=("renter", "provider"), default="renter",
                        help="renter (default): the team rents GPUs; provider: it lists hosts")  # fmt: skip
    finish(create, cmd_team_create, json="the team as JSON")
    show = team.add_parser("show", help="the team's members and open invitations", formatter_class=formatter,
                           description="The team in use (or --team NAME): its members, their roles and (owners and admins) its open invitations.")  # fmt: skip
    finish(show, cmd_team_show, json="the team as JSON")
    invite = team.add_parser("invite", help="invite someone by email", formatter_class=formatter,
                             description="Mail an address a link to join the team with a role (owners and admins; only owners invite owners).")  # fmt: skip
    invite.add_argument("email", metavar="EMAIL", help="the address to invite; only it can accept")
    invite.add_argument("--role", choices=ROLES, default="member", help="their role (default member)")
    finish(invite, cmd_team_invite, json="the invitation as JSON")
    accept = team.add_parser("accept", help="join a team with an invitation's link", formatter_class=formatter,
                             description="Join the team of an invitation mailed to your (verified) address.")
    accept.add_argument("link", metavar="LINK", help="the mailed link (…/#/invite/TOKEN) or its token")
    finish(accept, cmd_team_accept, json="the team joined as JSON")
    role = team.add_parser("role", help="change a member's role", formatter_class=formatter,
                           description="Change a member's role (owners: anyone's; admins: anyone's but an owner's). A team keeps an owner.")  # fmt: skip
    role.add_argument("account_id", metavar="ACCOUNT", help="the member's account id, as `gpumarket team show` lists it")
    role.add_argument("role", choices=ROLES, metavar="ROLE", help="owner, admin, member or billing")
    finish(role, cmd_team_role, json="the change as JSON")
    remove = team.add_parser("remove", help="remove a member", formatter_class=formatter,
                             description="Remove a member (owners and admins): the SSH keys they added to the team stop working at once.")  # fmt: skip
    remove.add_argument("account_id", metavar="ACCOUNT", help="the member's account id, as `gpumarket team show` lists it")
    finish(remove, cmd_team_remove, json="the removal as JSON")
    leave = team.add_parser("leave", help="leave the team in use", formatter_class=formatter,
                            description="Leave the team in use (or --team NAME); your commands then act for yourself.")
    finish(leave, cmd_team_leave, json="the result as JSON")
    use = team.add_parser("use", help="act for a team from now on ('personal': yourself)", formatter_class=formatter,
                          description="Save which team your commands act for in the login file ('personal': yourself).")
    use.add_argument("team_name", metavar="TEAM", help="a team's name or id, or 'personal'")
    finish(use, cmd_team_use, json="the choice as JSON")
