"""``gpumarket keys create|list|revoke``: the API keys of the account you are logged in as (``/api/v1/api-keys``).

A key made here is printed once (and never again: the marketplace keeps only its hash); give it only the scopes the
job needs (``--scope read --scope rent`` for a CI runner that rents), an expiry and the networks it runs from.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime, timedelta
from typing import Any

from gpumarket.renter.api import Client, UsageError
from gpumarket.renter.commands import command_group, finish
from gpumarket.renter.output import short_time, table

SCOPES = ("read", "rent", "billing", "provider", "admin")


def _days(text: str) -> int:
    try:
        days = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of days, got {text!r}") from None
    if not 1 <= days <= 3650:
        raise argparse.ArgumentTypeError("must be from 1 to 3650 days")
    return days


async def cmd_keys_create(args: argparse.Namespace, client: Client) -> int:
    body: dict[str, Any] = {"name": args.name}
    if args.scope:
        body["scopes"] = sorted(set(args.scope), key=SCOPES.index)
    if args.expires_in_days:
        body["expires_at"] = (datetime.now(UTC) + timedelta(days=args.expires_in_days)).isoformat(timespec="seconds")
    if args.allow:
        body["allowed_networks"] = args.allow
    made: dict[str, Any] = await client.request("POST", "/api-keys", json_body=body)
    if args.json:
        print(json.dumps(made, indent=2))
        return 0
    print(made["key"])
    expiry = f", expires {short_time(made['expires_at'])}" if made.get("expires_at") else ""
    networks = f", only from {', '.join(made['allowed_networks'])}" if made.get("allowed_networks") else ""
    scopes = "every scope" if made.get("all_scopes") else "scopes " + ", ".join(made["scopes"])
    print(f"made {made['name']} ({made['id']}): {scopes}{expiry}{networks}. Keep it now: it is not shown again.")
    return 0


async def cmd_keys_list(args: argparse.Namespace, client: Client) -> int:
    answer: dict[str, Any] = await client.request("GET", "/api-keys")
    items = answer["items"] if args.all else [k for k in answer["items"] if k["state"] == "active"]
    if args.json:
        print(json.dumps(items, indent=2))
        return 0
    if not items:
        print("no active keys (--all shows revoked and expired ones too)")
        return 0
    rows = [[k["id"], k["name"], k["prefix"] + "…", "all" if k["all_scopes"] else ",".join(k["scopes"]), k["state"],
             short_time(k["expires_at"]) if k["expires_at"] else "never", short_time(k["last_used_at"]) if k["last_used_at"] else "never"]
            for k in items]  # fmt: skip
    print(table(["ID", "NAME", "KEY", "SCOPES", "STATE", "EXPIRES", "LAST USED"], rows))
    return 0


async def cmd_keys_revoke(args: argparse.Namespace, client: Client) -> int:
    if not args.key_id.startswith("key-"):
        raise UsageError(f"KEY_ID is a key's id as `gpumarket keys list` shows it (key-…), not {args.key_id[:20]!r}")
    revoked: dict[str, Any] = await client.request("DELETE", f"/api-keys/{args.key_id}")
    if args.json:
        print(json.dumps(revoked, indent=2))
    else:
        print(f"revoked {revoked['name']} ({revoked['id']}, {revoked['prefix']}…): it works nowhere from now on")
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``keys create|list|revoke`` to ``gpumarket``'s subparsers."""
    formatter = argparse.RawDescriptionHelpFormatter
    keys = command_group(sub, "keys", help="your API keys: make scoped ones, list and revoke them",
                         description="The API keys of your account. A key may make and revoke keys with at most its own scopes.",
                         examples=["create ci-runner --scope read --scope rent --expires-in-days 30 --allow 203.0.113.0/24",
                                   "list", "revoke key-3f9a0c1d2b4e5f60"])  # fmt: skip
    create = keys.add_parser("create", help="make a key and print it (once)", formatter_class=formatter,
                             description="Make an API key. It is printed once: store it where the job that uses it can read it.")  # fmt: skip
    create.add_argument("name", metavar="NAME", help="what you call it, e.g. ci-runner")
    create.add_argument("--scope", action="append", choices=SCOPES, help="what it may do (repeat; default: every scope of the key you use)")
    create.add_argument("--expires-in-days", type=_days, metavar="DAYS", help="it stops working after DAYS days (default: never)")
    create.add_argument("--allow", action="append", metavar="CIDR", help="an address or network it may be used from (repeat; default: any)")
    finish(create, cmd_keys_create, json="the API's JSON, the key included")
    listing = keys.add_parser("list", help="your keys (never their secrets)", formatter_class=formatter,
                              description="Your active keys: id, name, prefix, scopes, expiry, last use.")
    listing.add_argument("--all", action="store_true", help="revoked and expired keys too")
    finish(listing, cmd_keys_list, json="the keys as JSON")
    revoke = keys.add_parser("revoke", help="revoke a key at once", formatter_class=formatter,
                             description="Revoke a key: it stops working at once on every master, with the console sessions opened with it.")  # fmt: skip
    revoke.add_argument("key_id", metavar="KEY_ID", help="the key's id (key-…), as `gpumarket keys list` shows it")
    finish(revoke, cmd_keys_revoke, json="the revoked key as JSON")
