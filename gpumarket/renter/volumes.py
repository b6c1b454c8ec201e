"""``gpumarket volume create | list | show | delete``: volumes over ``/volumes`` (docs/volumes.md).

A volume is a disk of its own on one provider's host that outlives rentals: made once (``create`` waits until the host's
agent has made it), mounted by rentals, billed per GiB-hour of its size until deleted. Every action takes its name or
its id. In a team's context (``gpumarket team use``), the team's volumes.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Mapping
from typing import Any

from gpumarket.renter import renting
from gpumarket.renter.api import Client, CliError
from gpumarket.renter.commands import all_pages, command_group, finish, listed_already
from gpumarket.renter.options import positive_int
from gpumarket.renter.output import err, money, print_json, short_time, table

MAX_VOLUME_GIB = 64 * 1024  # shared.protocol.MAX_VOLUME_GIB (the CLI imports nothing of the master's)


def _size(text: str) -> int:
    value = positive_int(text)
    if value > MAX_VOLUME_GIB:
        raise argparse.ArgumentTypeError(f"a volume is 1 to {MAX_VOLUME_GIB} GiB, not {text}")
    return value


def _where(volume: Mapping[str, Any]) -> str:
    region = f" ({volume['region']})" if volume.get("region") else ""
    return f"host {volume['host_id']}{region}"


def _cost(volume: Mapping[str, Any]) -> str:
    return (f"{money(volume.get('price_per_gib_hour'), 'rate')}/GiB-hour, "
            f"{money(volume.get('cost_per_hour'), 'rate')}/h")  # fmt: skip


def _mounts(volume: Mapping[str, Any]) -> str:
    mounts = volume.get("mounted_by") or []
    return (
        ", ".join(f"{m['rental_id']}:{m['mount']}{' (ro)' if m.get('read_only') else ''}" for m in mounts)
        or "-"
    )


def _failed(volume: Mapping[str, Any]) -> CliError:
    return CliError(f"volume {volume['name']} ({volume['id']}) failed on {_where(volume)}: {volume.get('failure_code')}: "
                    f"{volume.get('failure_reason')}; delete it (`gpumarket volume delete {volume['id']}`) and make it on "
                    "another host (--host, or leave it out)")  # fmt: skip


# ---- create -------------------------------------------------------------------------------------


async def wait_ready(client: Client, volume: dict[str, Any], *, quiet: bool) -> dict[str, Any]:
    """The volume once its host's agent has answered (ready or failed); a progress line on stderr every few polls."""
    started = time.monotonic()
    shown = 0.0
    while volume["state"] == "creating":
        waited = time.monotonic() - started
        if not quiet and (shown == 0.0 or waited - shown >= 5):
            err(f"waiting for {_where(volume)} to make volume {volume['name']} ({waited:.0f} s)")
            shown = max(waited, 0.001)
        await asyncio.sleep(renting.POLL_INTERVAL_S)
        volume = await client.get(f"/volumes/{volume['id']}")
    return volume


async def cmd_create(args: argparse.Namespace, client: Client) -> int:
    body: dict[str, Any] = {"name": args.name, "size_gib": args.size}
    if args.host:
        body["host_id"] = args.host
    if args.region:
        body["region"] = args.region
    # One key per invocation: a retried HTTP call cannot make two volumes.
    volume: dict[str, Any] = await client.request("POST", "/volumes", json_body=body, headers={"Idempotency-Key": str(uuid.uuid4())},
                                                  retry=True)  # fmt: skip
    if not args.no_wait:
        volume = await wait_ready(client, volume, quiet=args.json)
    if args.json:
        print_json(volume)
        return 0 if volume["state"] != "failed" else 1
    if volume["state"] == "failed":
        raise _failed(volume)
    print(
        f"{volume['id']} {volume['name']} {volume['state']}: {volume['size_gib']} GiB on {_where(volume)}, {_cost(volume)}"
    )
    if volume["state"] == "creating":
        err(f"its host's agent is making it; `gpumarket volume show {volume['name']}` says when it is ready")
    else:
        err(f"`gpumarket rent --template demo --volume {volume['name']}:/data` mounts it at /data (the rental runs on its "
            f"host, {volume['host_id']}); `gpumarket volume delete {volume['name']}` deletes it (it is billed until then)")  # fmt: skip
    return 0


# ---- list, show ---------------------------------------------------------------------------------


async def cmd_list(args: argparse.Namespace, client: Client) -> int:
    items = await all_pages(client, "/volumes", {"deleted": "true"} if args.all else None)
    if listed_already(args, items, none="no volumes; `gpumarket volume create NAME --size GIB` makes one (`--all`: deleted ones too)",
                      none_at_all="no volumes yet; `gpumarket volume create NAME --size GIB` makes one"):  # fmt: skip
        return 0
    rows = [[v["id"], v["name"], v["state"], f"{v['size_gib']} GiB", v["host_id"], v.get("region") or "-",
             money(v.get("cost_per_hour"), "rate"), _mounts(v)] for v in items]  # fmt: skip
    print(table(["ID", "NAME", "STATE", "SIZE", "HOST", "REGION", "$/H", "MOUNTED BY"], rows))
    return 0


async def cmd_show(args: argparse.Namespace, client: Client) -> int:
    volume: dict[str, Any] = await client.get(f"/volumes/{args.volume}")
    if args.json:
        print_json(volume)
        return 0
    lines = [
        f"{volume['id']} {volume['name']} {volume['state']}",
        f"size       {volume['size_gib']} GiB (a hard limit: writes past it fail with 'No space left on device')",
        f"host       {_where(volume)}",
        f"price      {_cost(volume)} while it exists, mounted or not",
        f"mounted by {_mounts(volume)}",
        f"created    {short_time(volume.get('created_at'))} UTC"
        + (f", ready {short_time(volume['ready_at'])} UTC" if volume.get("ready_at") else "")
        + (f", deleted {short_time(volume['deleted_at'])} UTC" if volume.get("deleted_at") else ""),
    ]  # fmt: skip
    if volume.get("failure_code"):
        lines.append(f"failure    {volume['failure_code']}: {volume.get('failure_reason')}")
    if volume.get("delete_after"):
        lines.append(f"unpaid     since {short_time(volume.get('unpaid_since'))} UTC: deleted at {short_time(volume['delete_after'])} "
                     "UTC unless credit is added (`gpumarket credit add`)")  # fmt: skip
    events = volume.get("events") or []
    if events:
        lines += ["", "events (UTC):"] + [
            f"  {short_time(e.get('at'))}  {e.get('to')}: {e.get('cause')}" for e in events
        ]
    print("\n".join(lines))
    return 0


# ---- delete -------------------------------------------------------------------------------------


async def cmd_delete(args: argparse.Namespace, client: Client) -> int:
    volume: dict[str, Any] = await client.request("DELETE", f"/volumes/{args.volume}")
    if args.json:
        print_json(volume)
        return 0
    print(f"{volume['id']} {volume['name']} {volume['state']}: billing stopped; its files are "
          + ("gone" if volume["state"] == "deleted" else "deleted when its host's agent confirms"))  # fmt: skip
    return 0


# ---- parsers ------------------------------------------------------------------------------------

CREATE_EPILOG = """\
A volume is a disk of its own on one provider's host: SIZE GiB, a hard limit, kept when rentals
end, after the agent restarts and after the host reboots, until you delete it. It is lost with
the host's disk: keep what you cannot lose elsewhere too. It is billed per GiB-hour of its size,
whether a rental mounts it or not, at the host's storage price when it was made.

Where: --host H puts it on that host; else the cheapest host with room, in --region when given
(`gpumarket offers` shows each host's storage price and GiB free). It waits, with progress on
stderr, until the host's agent has made it (--no-wait does not); exit status 1 if it failed.

examples:
  gpumarket volume create data --size 100
  gpumarket volume create ckpt-0 --size 50 --region eu-west
  gpumarket volume create weights --size 200 --host h-0123456789abcdef --no-wait"""


def _ref_action(actions: argparse._SubParsersAction[argparse.ArgumentParser], name: str, *, help: str, description: str,
                examples: list[str]) -> argparse.ArgumentParser:  # fmt: skip
    parser = actions.add_parser(name, help=help, description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="examples:\n" + "\n".join(f"  gpumarket volume {name} {e}" for e in examples))  # fmt: skip
    parser.add_argument(
        "volume", metavar="VOLUME", help="the volume's name or id (vol-…; `gpumarket volume list` shows them)"
    )
    return parser


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    """Add ``volume`` and its actions to ``gpumarket``'s subparsers; returns its actions' subparsers (``open`` and
    ``copy`` join them: ``gpumarket/renter/volumefiles.py``)."""
    formatter = argparse.RawDescriptionHelpFormatter
    actions = command_group(sub, "volume", help="disks that outlive rentals: create, list, show, delete, open, copy",
                            description="Volumes: a disk of its own on one host, kept across rentals and billed per "
                            "GiB-hour until deleted (docs/volumes.md).",
                            examples=["create data --size 100", "list", "show data", "open data", "copy data data-copy", "delete data"])  # fmt: skip
    create = actions.add_parser("create", help="make a volume and wait until it is ready", formatter_class=formatter,
                                description="Make a volume NAME of --size GiB on one host.", epilog=CREATE_EPILOG)  # fmt: skip
    create.add_argument(
        "name", metavar="NAME", help="1 to 64 of a-z, 0-9, '-', '_', '.', starting with a letter or digit"
    )
    create.add_argument(
        "--size", type=_size, required=True, metavar="GIB", help="its size in GiB (a hard limit)"
    )
    where = create.add_mutually_exclusive_group()
    where.add_argument("--host", metavar="H", help="the host it lives on (its id)")
    where.add_argument("--region", metavar="R", help="the cheapest host with room in this region")
    create.add_argument(
        "--no-wait", action="store_true", help="return at once, while its host's agent makes it"
    )
    finish(create, cmd_create, json="the volume's JSON")

    listing = actions.add_parser("list", help="your volumes", formatter_class=formatter,
                                 description="Your volumes, newest first: state, size, host, cost per hour, the rentals "
                                 "that mount them.", epilog="examples:\n  gpumarket volume list\n  gpumarket volume list --all --json")  # fmt: skip
    listing.add_argument("--all", action="store_true", help="deleted volumes too")
    finish(listing, cmd_list, json="the volumes' JSON")

    show = _ref_action(actions, "show", help="one volume: host, price, mounts and events",
                       description="One volume: its size, host, price, the rentals that mount it and what happened to it.",
                       examples=["data", "vol-0123456789abcdef --json"])  # fmt: skip
    finish(show, cmd_show, json="the volume's JSON")

    delete = _ref_action(actions, "delete", help="delete a volume and its files (asks nothing)",
                         description="Delete a volume: billing stops at once, and its files are deleted on its host. It "
                         "asks nothing: what was on it is gone. A rental that mounts it must be stopped first.",
                         examples=["data", "vol-0123456789abcdef"])  # fmt: skip
    finish(delete, cmd_delete, json="the volume's JSON")
    return actions
