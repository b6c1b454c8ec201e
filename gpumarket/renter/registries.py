"""``gpumarket registry login|list|remove``: credentials for private container registries.

A credential is for an image prefix (a registry, optionally with a path: ``registry.example.com:5000/myorg/``); a
rental whose image starts with it pulls with it. The marketplace keeps the password sealed and never shows it again;
it reaches the host only inside the start command of a rental that pulls such an image (docs/accounts.md). In a
team's context (``gpumarket team use``), the team's credentials.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from typing import Any

from gpumarket.renter.api import Client, UsageError
from gpumarket.renter.commands import command_group, finish
from gpumarket.renter.output import short_time, table


def _password(args: argparse.Namespace) -> str:
    if args.password_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
    elif sys.stdin is not None and sys.stdin.isatty():
        password = getpass.getpass(f"password or token for {args.username} at {args.prefix}: ")
    else:
        raise UsageError("give the password on stdin with --password-stdin (or run in a terminal to be asked)")
    if not password:
        raise UsageError("no password given")
    return password


async def cmd_registry_login(args: argparse.Namespace, client: Client) -> int:
    body = {"prefix": args.prefix, "username": args.username, "password": _password(args)}
    saved: dict[str, Any] = await client.request("POST", "/registry-credentials", json_body=body)
    if args.json:
        print(json.dumps(saved, indent=2))
    else:
        print(f"saved {saved['username']} for images under {saved['prefix']} ({saved['id']}); rentals of such images pull with it")
    return 0


async def cmd_registry_list(args: argparse.Namespace, client: Client) -> int:
    items = (await client.get("/registry-credentials"))["items"]
    if args.json:
        print(json.dumps(items, indent=2))
    elif not items:
        print("no registry credentials; add one with `gpumarket registry login PREFIX --username USER`")
    else:
        rows = [[c["id"], c["prefix"], c["username"], short_time(c["updated_at"]), short_time(c["last_used_at"]) if c["last_used_at"] else "never"]
                for c in items]  # fmt: skip
        print(table(["ID", "PREFIX", "USERNAME", "SAVED", "LAST USED"], rows))
    return 0


async def cmd_registry_remove(args: argparse.Namespace, client: Client) -> int:
    target = args.credential
    if not target.startswith("regc-"):
        items = (await client.get("/registry-credentials"))["items"]
        wanted = target.lower().rstrip("/") + "/"
        matches = [c["id"] for c in items if c["prefix"] == wanted]
        if not matches:
            raise UsageError(f"no credential for {target!r}; `gpumarket registry list` shows yours")
        target = matches[0]
    removed: dict[str, Any] = await client.request("DELETE", f"/registry-credentials/{target}")
    print(json.dumps(removed, indent=2) if args.json else f"removed {target}: rentals no longer pull with it")
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``registry login|list|remove`` to ``gpumarket``'s subparsers."""
    formatter = argparse.RawDescriptionHelpFormatter
    registry = command_group(sub, "registry", help="credentials for private container registries",
                             description="Credentials your rentals pull private images with, each for an image prefix. "
                             "The password is kept sealed and never shown again.",
                             examples=["login registry.example.com:5000/myorg/ --username robot",
                                       "list", "remove registry.example.com:5000/myorg/"])  # fmt: skip
    login = registry.add_parser("login", help="save a credential for an image prefix", formatter_class=formatter,
                                description="Save (or replace) the credential for images under PREFIX. The password is "
                                "asked for, or read from stdin with --password-stdin; never give it on the command line.")  # fmt: skip
    login.add_argument("prefix", metavar="PREFIX", help="a registry host, optionally with a path, e.g. registry.example.com:5000/myorg/")
    login.add_argument("--username", required=True, metavar="USER", help="the registry user (or robot account)")
    login.add_argument("--password-stdin", action="store_true", help="read the password or token from stdin")
    finish(login, cmd_registry_login, json="the saved credential as JSON (never its password)")
    listing = registry.add_parser("list", help="your credentials (never their passwords)", formatter_class=formatter,
                                  description="Your registry credentials: prefix, user, when saved and last used.")
    finish(listing, cmd_registry_list, json="the credentials as JSON")
    remove = registry.add_parser("remove", help="remove a credential", formatter_class=formatter,
                                 description="Remove a credential, by its id or its prefix.")
    remove.add_argument("credential", metavar="ID|PREFIX", help="the credential's id (regc-…) or prefix")
    finish(remove, cmd_registry_remove, json="the removal as JSON")
