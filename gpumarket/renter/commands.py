"""The renter's commands (``gpumarket login | offers | rent | rentals | logs | stop | account``) and their parsers.

``offers`` lives in ``offers.py``; what ``rent`` asks for and the wait until it runs in ``renting.py``; what every command writes (errors, tables, amounts, JSON) in ``output.py``; the
argument types and option groups they share in ``options.py``; ``cluster``, ``service``, ``credit``, ``ssh`` and
the file copies in modules of their own. Each command is a coroutine over a ``Client``; ``run`` turns a ``CliError`` into one line on
stderr and its exit status, and execs the program a command left in ``args.exec_argv`` (``ssh``). Tables go to stdout, progress to stderr, ``--json`` prints the API's JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import getpass
import os
import socket
import sys
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpumarket.renter import renting
from gpumarket.renter.api import (
    ApiError,
    Client,
    CliError,
    Login,
    UsageError,
    default_config_path,
    load_login,
    normalize_url,
    save_login,
)
from gpumarket.renter.offers import OFFERS_EPILOG, cmd_offers
from gpumarket.renter.options import (
    add_network_bounds,
    common_options,
    failover_seconds,
    limit,
    non_negative_int,
    port,
    positive_int,
    usd,
)
from gpumarket.renter.outcome import ENDED_STATES, failed, print_rental_outcome
from gpumarket.renter.output import err, money, money_column, print_json, short_time, table
from gpumarket.renter.renting import (
    add_interruptible_options,
    add_price_tolerance_option,
    add_volume_option,
    rental_body,
    wait_for,
)

# Rentals fetched per page, and pages at most, for `rentals`.
PAGE_SIZE, MAX_PAGES = 500, 20
ACTIVE_STATES = ("pending", "starting", "running", "stopping")
TEMPLATES_HINT = "base, pytorch, jupyter, vllm (GET /api/v1/templates lists them all)"

Command = Callable[[argparse.Namespace, Client], Coroutine[Any, Any, int]]


def run(args: argparse.Namespace) -> None:
    """Run the parsed command's coroutine; a ``CliError`` is one line on stderr and its exit status."""
    environ = os.environ
    args.rental_id = getattr(args, "rental_id", None)  # `rent` sets it once the rental exists
    try:
        if args.renter_func is None:
            code = asyncio.run(cmd_login(args, environ))
        else:
            login = load_login(args.config, environ)
            command: Command = args.renter_func

            async def main() -> int:
                chosen = login
                if getattr(args, "team", None):
                    async with Client(login, timeout=args.timeout) as client:
                        chosen = dataclasses.replace(login, team=await team_id(client, args.team))
                async with Client(chosen, timeout=args.timeout) as client:
                    return await command(args, client)

            code = asyncio.run(main())
        exec_argv: list[str] | None = getattr(args, "exec_argv", None)
        if exec_argv and not code:
            _exec(exec_argv)
    except CliError as exc:
        err(f"gpumarket: {exc.message}")
        raise SystemExit(exc.status) from None
    except BrokenPipeError:  # `gpumarket logs R | head`: the reader has gone, which is fine
        with contextlib.suppress(OSError, ValueError):  # no "Exception ignored" when Python flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0) from None
    except KeyboardInterrupt:
        rental_id, cluster_id = args.rental_id, getattr(args, "cluster_id", None)
        if cluster_id:
            err(f"\nstopped waiting; cluster {cluster_id} keeps going: see it with `gpumarket cluster show {cluster_id}`, "
                 f"stop it with `gpumarket cluster stop {cluster_id}`")  # fmt: skip
        elif rental_id:
            err(f"\nstopped waiting; rental {rental_id} keeps going: see it with `gpumarket rentals`, "
                 f"stop it with `gpumarket stop {rental_id}`")  # fmt: skip
        raise SystemExit(130) from None
    if code:
        raise SystemExit(code)


def _exec(argv: list[str]) -> None:
    """Become ``argv`` (``ssh``, ``scp``): its exit status and terminal are the user's."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(argv[0], argv)
    except OSError as exc:
        raise CliError(f"cannot run {argv[0]} ({exc.strerror or exc}); install OpenSSH's client (apt install openssh-client)") from None


def _what(rental: Mapping[str, Any]) -> str:
    if rental.get("template"):
        return f"template {rental['template']}"
    workload = rental.get("workload") or {}
    kind = workload.get("kind", "hold")
    if kind == "container":
        return str(workload.get("image", "container"))
    if kind == "process":
        return " ".join(workload.get("argv") or ["process"])[:40]
    return str(kind)


# ---- login --------------------------------------------------------------------------------------


async def team_id(client: Client, text: str) -> str | None:
    """The id of the team named ``text`` (a name or an id) among the caller's; ``None`` for 'personal'."""
    if text == "personal":
        return None
    teams = (await client.request("GET", "/teams", personal=True, retry=True))["items"]
    for team in teams:
        if text in (team["id"], team["name"]):
            return str(team["id"])
    names = ", ".join(repr(team["name"]) for team in teams) or "none"
    raise UsageError(f"you are in no team {text!r} (yours: {names}); make one with `gpumarket team create NAME`")


def _read_key(args: argparse.Namespace) -> str:
    if args.key:
        return str(args.key).strip()
    if sys.stdin is not None and not sys.stdin.isatty():
        key = sys.stdin.readline().strip()
    else:
        key = getpass.getpass("API key (from the console's account page): ").strip()
    if not key:
        raise UsageError("no API key given: pass it on stdin, at the prompt, or with --key")
    return key


async def _browser_key(api_url: str, args: argparse.Namespace) -> str:
    """A new API key through the console (the device flow, docs/accounts.md): show the link and the code, then poll
    until the signed-in user approves it there."""
    if args.key:
        raise UsageError("--browser makes a new key: leave out --key")
    async with Client(Login(api_url, ""), timeout=args.timeout) as client:
        started = await client.request("POST", "/device-codes", json_body={"client_name": f"gpumarket CLI on {socket.gethostname()[:60]}"})
        minutes = started["expires_in"] // 60
        err(f"open {started['verification_uri_complete']} in a browser signed in to the console and approve the code "
            f"{started['user_code']} (waiting up to {minutes} min; Ctrl-C stops)")  # fmt: skip
        while True:
            await asyncio.sleep(started["interval"])
            try:
                made = await client.request("POST", "/device-codes/token", json_body={"device_code": started["device_code"]})
            except ApiError as exc:
                if exc.code == "authorization_pending":
                    continue
                if exc.code in ("expired_token", "device_code_not_found"):  # the API's hint lacks the URL: say it whole
                    raise CliError(f"this sign-in has expired or was used ({exc.code}); run "
                                   f"`gpumarket login --api {api_url} --browser` again") from None  # fmt: skip
                raise
            return str(made["key"])


async def cmd_login(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    path: Path = args.config or default_config_path(environ)
    url = args.api or environ.get("GPUMARKET_API_URL")
    if not url:
        raise UsageError("which API? give --api URL, e.g. `gpumarket login --api https://gpumarket.example`")
    api_url = normalize_url(url)
    login = Login(api_url, await _browser_key(api_url, args) if args.browser else _read_key(args))
    async with Client(login, timeout=args.timeout) as client:
        account = await client.get("/account")
    save_login(path, login)
    print(f"logged in to {login.api_url} as {account['name']} ({account['role']}, account {account['id']}); saved to {path}")
    return 0


# ---- offers -------------------------------------------------------------------------------------


# ---- rent ---------------------------------------------------------------------------------------


def _queued_note(rental: Mapping[str, Any]) -> str:
    standing = rental.get("queue") or {}
    return f" (queued {standing['position']}/{standing['length']})" if standing else " (queued)"


async def cmd_rent(args: argparse.Namespace, client: Client) -> int:
    body = rental_body(args)
    # One key per invocation: a retried HTTP call of this invocation cannot rent twice; another invocation rents again.
    key = str(uuid.uuid4())
    rental: dict[str, Any] = await client.request("POST", "/rentals", json_body=body, headers={"Idempotency-Key": key}, retry=True)
    args.rental_id = rental["id"]  # for Ctrl-C while waiting
    if not args.no_wait:
        try:
            rental = await wait_for(client, rental["id"], ("running",), quiet=args.json)
        except CliError as exc:  # the rental exists all the same: say which
            raise CliError(f"rental {rental['id']} was created, but waiting for it failed: {exc.message}") from None
    if args.json:
        print_json(rental)
    else:
        await print_rental_outcome(client, rental)
    return 1 if failed(rental) else 0


# ---- rentals, logs, stop ------------------------------------------------------------------------


async def all_pages(client: Client, path: str, params: Mapping[str, str | int] | None = None) -> list[dict[str, Any]]:
    """Every item of a paged list (``/rentals``, ``/clusters``, ``/services``), up to ``MAX_PAGES`` pages."""
    items: list[dict[str, Any]] = []
    for page in range(MAX_PAGES):
        body = await client.get(path, {**(params or {}), "limit": PAGE_SIZE, "offset": page * PAGE_SIZE})
        items.extend(body["items"])
        if len(items) >= body["total"] or not body["items"]:
            break
    return items


async def all_rentals(client: Client) -> list[dict[str, Any]]:
    return await all_pages(client, "/rentals")


def listed_already(args: argparse.Namespace, items: Sequence[Mapping[str, Any]], *, none: str, none_at_all: str) -> bool:
    """Whether a list command has printed all it prints: the items' JSON with ``--json``, or, when there are none, what
    to do (``none_at_all`` with ``--all``)."""
    if args.json:
        print_json({"items": items, "total": len(items)})
        return True
    if not items:
        print(none_at_all if args.all else none)
        return True
    return False


async def cmd_rentals(args: argparse.Namespace, client: Client) -> int:
    items = await all_rentals(client)
    if not args.all:
        items = [r for r in items if r["state"] in ACTIVE_STATES]
    if listed_already(args, items, none="no active rentals; `--all` shows ended ones too, `gpumarket rent` makes one",
                      none_at_all="no rentals yet"):  # fmt: skip
        return 0
    host_ids = sorted({r["host_id"] for r in items if r.get("host_id")})
    regions = dict(zip(host_ids, await asyncio.gather(*(_region(client, h) for h in host_ids)), strict=True))
    prices = money_column([r.get("price_per_hour") for r in items], "rate")
    charged = money_column([r.get("charged") for r in items])
    rows = [
        [
            r["id"], r["state"] + (_queued_note(r) if r.get("queued") else ""), _gpus(r), r.get("gpu_model") or "-",
            regions.get(r.get("host_id") or "", "-"), _what(r), price, paid, short_time(r.get("started_at")),
        ]
        for r, price, paid in zip(items, prices, charged, strict=True)
    ]  # fmt: skip
    print(table(["ID", "STATE", "GPUS", "MODEL", "REGION", "RUNS", "$/H", "CHARGED", "STARTED (UTC)"], rows))
    return 0


async def _region(client: Client, host_id: str) -> str:
    try:
        return str((await client.get(f"/hosts/{host_id}")).get("region") or "-")
    except CliError:
        return "-"  # a host gone from view: the table shows the rental all the same


def _gpus(rental: Mapping[str, Any]) -> str:
    if rental.get("mig_profile"):
        return f"mig {rental['mig_profile']}"
    milli = rental.get("gpu_milli") or 1000
    return f"{milli / 1000:g}" if milli != 1000 else str(rental.get("gpu_count", "-"))


async def cmd_logs(args: argparse.Namespace, client: Client) -> int:
    offset: int = args.since_offset
    out = sys.stdout
    while True:
        body = await client.get(f"/rentals/{args.rental}/logs", {"offset": offset})
        if body["offset"] > offset:
            err(f"(output before byte {body['offset']} was pruned)")
        data: str = body["data"]
        if data:
            out.flush()
            out.buffer.write(data.encode())
            out.buffer.flush()
        moved = body["next_offset"] != offset
        offset = body["next_offset"]
        if moved:
            continue
        if not args.follow or body["state"] in ENDED_STATES:
            return 0
        await asyncio.sleep(renting.POLL_INTERVAL_S)


async def cmd_stop(args: argparse.Namespace, client: Client) -> int:
    rental: dict[str, Any] = await client.request("DELETE", f"/rentals/{args.rental}")
    if args.wait and rental["state"] not in ENDED_STATES:
        rental = await wait_for(client, rental["id"], ENDED_STATES)
    if args.json:
        print_json(rental)
    else:
        print(f"{rental['id']} {rental['state']}" + ("" if rental["state"] in ENDED_STATES else "; the GPUs are freed once the host confirms"))
    return 0


# ---- account ------------------------------------------------------------------------------------


async def cmd_account(args: argparse.Namespace, client: Client) -> int:
    account: dict[str, Any] = await client.get("/account")
    if args.json:
        print_json(account)
        return 0
    credit, quota = account.get("credit") or {}, account.get("quota") or {}
    lines = [f"{account['name']} ({account['role']}), account {account['id']}"]
    if credit:
        left = f", lasts {credit['hours_left']} h at that rate" if credit.get("hours_left") is not None else ""
        cap = f"{money(credit['monthly_spend_cap'])} a month" if credit.get("monthly_spend_cap") else "none"
        lines += [
            f"balance        {money(credit.get('balance'))}",
            f"burn rate      {money(credit.get('burn_rate_per_hour'), 'rate')}/h{left}",
            f"spend cap      {cap}; spent this month {money(credit.get('spent_this_month'))}",
        ]
    if quota:
        max_gpus = f"of at most {quota['max_gpus']}" if quota.get("max_gpus") else "(no quota)"
        max_spend = f"of at most {money(quota['max_spend_per_hour'], 'rate')}/h" if quota.get("max_spend_per_hour") else "(no quota)"
        lines += [
            f"GPUs held      {quota.get('used_gpus')} {max_gpus}",
            f"rentals cost   {money(quota.get('spend_per_hour'), 'rate')}/h {max_spend}",
        ]
    earnings = account.get("earnings")
    if earnings:
        lines.append(f"earnings       {money(earnings.get('earned_total'))} in all: {money(earnings.get('payable'))} to be paid, "
                     f"{money(earnings.get('paid_out'))} paid in {earnings.get('payouts', 0)} payouts")  # fmt: skip
    print("\n".join(lines))
    return 0


# ---- parsers ------------------------------------------------------------------------------------


LOGIN_EPILOG = """\
The key is read from stdin when it is not a terminal, else prompted for without echo; --key
works too but shows in the process list. GPUMARKET_API_URL and GPUMARKET_API_KEY, when set,
override the saved login for every command.

With --browser no key is typed: the command prints a link and a code, you approve it in the console
(signed in), and it saves the new key the console made (the scopes you chose there).

examples:
  gpumarket login --api https://gpumarket.example
  gpumarket login --api https://gpumarket.example --browser
  echo "$KEY" | gpumarket login --api http://127.0.0.1:8080"""

RENT_EPILOG = f"""\
Without --template or --image the rental holds the GPUs and runs nothing (--hold says so).
Templates: {TEMPLATES_HINT}.
It waits until the rental runs, with a progress line on stderr (Ctrl-C stops waiting, not
the rental), then prints the rental's id and state, the web address of each port it declared
(for about two minutes: `gpumarket open RENTAL PORT` makes a new one) and on stderr the commands
that reach it; exit status 1 if it failed, with the failure's code and whose it is. Each
invocation rents anew: it sends its own Idempotency-Key, so a retried call of the same
invocation never rents twice.

examples:
  gpumarket rent --gpus 2 --model 'RTX 4090' --template pytorch
  gpumarket rent 'h_abc:NVIDIA GeForce RTX 4090' --image ubuntu:24.04 --command 'sleep infinity'
  gpumarket rent --image python:3.12 --command 'python -m http.server 8000' --port 8000 --env DEBUG=1
  gpumarket rent --interruptible --bid 0.20 --max-price 0.30 --no-wait
  gpumarket rent --model A100 --mig 3g.40gb
  gpumarket rent --template pytorch --restart-on-failure --failover-after 120
  gpumarket rent --template demo --volume data:/data   (on the volume's host; docs/volumes.md)"""


def set_command(parser: argparse.ArgumentParser, command: Command | None) -> None:
    parser.set_defaults(func=run, renter_func=command)


def finish(parser: argparse.ArgumentParser, command: Command, *, json: str | None = None) -> None:
    """A renter command's last options: ``--json`` ("print ``json``"), the login file and the timeout; and what it runs."""
    if json is not None:
        parser.add_argument("--json", action="store_true", help=f"print {json}")
    common_options(parser)
    set_command(parser, command)


def command_group(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, *, help: str, description: str,
                  examples: Sequence[str]) -> argparse._SubParsersAction[argparse.ArgumentParser]:  # fmt: skip
    """``gpumarket NAME ACTION …`` (``cluster``, ``service``): its parser, whose epilog lists ``examples`` (each after
    ``gpumarket NAME``), and the subparsers its actions go in."""
    group = sub.add_parser(name, help=help, description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="examples:\n" + "\n".join(f"  gpumarket {name} {example}" for example in examples))  # fmt: skip
    return group.add_subparsers(dest=f"{name}_action", required=True, metavar="ACTION")


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the renter's commands to ``gpumarket``'s subparsers; each runs through ``run``."""
    formatter = argparse.RawDescriptionHelpFormatter

    login = sub.add_parser("login", help="save the API URL and your API key", formatter_class=formatter, epilog=LOGIN_EPILOG,
                           description="Check an API key against the master and save it with the API's URL in a file "
                           "only you can read (0600).")  # fmt: skip
    login.add_argument("--api", metavar="URL", help="the master's URL, e.g. https://gpumarket.example (default: $GPUMARKET_API_URL)")
    login.add_argument("--key", metavar="KEY", help="the API key (better: on stdin or at the prompt)")
    login.add_argument("--browser", action="store_true", help="make a new key by approving this sign-in in the console instead")
    common_options(login)
    set_command(login, None)  # cmd_login: no saved login needed

    offers = sub.add_parser("offers", help="GPUs you can rent now", formatter_class=formatter, epilog=OFFERS_EPILOG,
                            description="List offers (per host and GPU model) with price per GPU-hour, region, tier, "
                            "reliability, how the host isolates workloads and whether the GPU challenge proved its GPUs.")  # fmt: skip
    offers.add_argument("query", nargs="*", metavar="QUERY", help="query language terms, e.g. 'vram>=24 price<=0.5'")
    offers.add_argument("--sort", choices=("score", "price", "price_per_performance", "reliability"),
                        help="score (default, best first), price (cheapest first), price_per_performance or reliability")  # fmt: skip
    offers.add_argument("--gpus", type=positive_int, metavar="N", help="at least N free GPUs on one host (with --nodes: per node)")
    offers.add_argument("--nodes", type=positive_int, metavar="N",
                        help="price a cluster of N nodes (2 to 64), each on a host of its own: the groups of hosts that "
                        "could hold it now, with the whole cluster's price per hour")  # fmt: skip
    offers.add_argument("--allow-mixed", action="store_true", help="with --nodes: nodes may have different GPU models")
    add_network_bounds(offers, prefix="with --nodes: ")
    offers.add_argument("--isolated", action="store_true", help="only hosts that isolate renters' workloads")
    offers.add_argument("--verified", action="store_true", help="only hosts the platform's GPU challenge proved (verified=true)")
    offers.add_argument("--limit", type=limit, default=50, metavar="N", help="at most N offers (default 50, at most 500)")
    finish(offers, cmd_offers, json="the API's JSON")

    rent = sub.add_parser("rent", help="rent GPUs and wait until the rental runs", formatter_class=formatter, epilog=RENT_EPILOG,
                          description="Rent GPUs from an offer, or from any host matching --model / --max-price / --where, "
                          "running a template, an image, or nothing (a hold).")  # fmt: skip
    rent.add_argument("offer_id", nargs="?", metavar="OFFER_ID", help="an offer from `gpumarket offers` (host_id:gpu_name)")
    rent.add_argument("--gpus", type=positive_int, default=1, metavar="N", help="whole GPUs on one host (default 1)")
    rent.add_argument("--mig", metavar="PROFILE", help="one MIG instance of this profile (e.g. 3g.40gb) instead of whole GPUs: "
                      "`gpumarket offers` lists the free ones (MIG)")
    rent.add_argument("--model", metavar="M", help="GPU model words, e.g. 'RTX 4090' or 'A100 80GB'")
    rent.add_argument("--max-price", type=usd, metavar="USD", help="at most this price per GPU-hour")
    rent.add_argument("--where", metavar="QUERY", help="other offer filters in the query language, e.g. 'vram>=24 reliability>0.98'")
    what = rent.add_mutually_exclusive_group()
    what.add_argument("--template", metavar="NAME", help=f"run a template: {TEMPLATES_HINT}")
    what.add_argument("--image", metavar="REF", help="run this container image, e.g. ubuntu:24.04")
    what.add_argument("--hold", action="store_true", help="run nothing: hold the GPUs (the default)")
    rent.add_argument("--command", metavar="CMD", help="with --image: the command, replacing the image's entrypoint ('python train.py')")
    rent.add_argument("--port", type=port, action="append", default=[], metavar="P", help="with --image: a TCP port the workload serves (repeatable)")
    rent.add_argument("--env", action="append", default=[], metavar="K=V", help="with --image: an environment variable (repeatable)")
    add_volume_option(rent, "the rental's container")
    add_interruptible_options(rent, "an interruptible rental")
    add_price_tolerance_option(rent, "the rental")
    rent.add_argument("--queue", action="store_true", help="wait for GPUs (up to 10 minutes) when none are free now")
    rent.add_argument("--restart-on-failure", action="store_true",
                      help="if the host is lost, start the workload again on another host (a new rental)")
    rent.add_argument("--failover-after", type=failover_seconds, metavar="SECONDS",
                      help="how long the host may stay unreachable (its agent link closed) before the rental fails as "
                      "host lost, and with --restart-on-failure is placed again: 10 to 86400 (default: the master's, 20 s)")  # fmt: skip
    rent.add_argument("--no-wait", action="store_true", help="print the rental as created, do not wait until it runs")
    finish(rent, cmd_rent, json="the rental's JSON (no progress lines)")

    rentals = sub.add_parser("rentals", help="your rentals", formatter_class=formatter,
                             description="Your active rentals (pending, starting, running, stopping), newest first.",
                             epilog="examples:\n  gpumarket rentals\n  gpumarket rentals --all --json")  # fmt: skip
    rentals.add_argument("--all", action="store_true", help="ended rentals too")
    finish(rentals, cmd_rentals, json="the rentals' JSON")

    logs = sub.add_parser("logs", help="a rental's output", formatter_class=formatter,
                          description="Print a rental's workload output (as far as its host has sent it) to stdout, as it is.",
                          epilog="examples:\n  gpumarket logs r_abc\n  gpumarket logs r_abc -f\n  gpumarket logs r_abc --since-offset 4096")  # fmt: skip
    logs.add_argument("rental", metavar="RENTAL", help="the rental's id")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new output until the rental ends (Ctrl-C to stop)")
    logs.add_argument("--since-offset", type=non_negative_int, default=0, metavar="N", help="start at byte N of the output (default 0)")
    finish(logs, cmd_logs)

    stop = sub.add_parser("stop", help="stop a rental", formatter_class=formatter,
                          description="Stop a rental: its workload is stopped and billing ends; the GPUs are freed when "
                          "its host confirms.", epilog="examples:\n  gpumarket stop r_abc\n  gpumarket stop r_abc --wait")  # fmt: skip
    stop.add_argument("rental", metavar="RENTAL", help="the rental's id")
    stop.add_argument("--wait", action="store_true", help="wait until the host has confirmed the stop")
    finish(stop, cmd_stop, json="the rental's JSON")

    account = sub.add_parser("account", help="your balance, burn rate, spend cap and quotas", formatter_class=formatter,
                             description="Your account: balance, what your rentals burn per hour, spend cap, quotas; "
                             "a provider's earnings.", epilog="examples:\n  gpumarket account\n  gpumarket account --json")  # fmt: skip
    finish(account, cmd_account, json="the API's JSON")
