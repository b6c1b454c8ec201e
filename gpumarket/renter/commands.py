"""The renter's commands (``gpumarket login | offers | rent | rentals | logs | stop | account``) and their parsers.

Each command is a coroutine over a ``Client``; ``run`` turns a ``CliError`` into one line on
stderr and its exit status, and execs the program a command left in ``args.exec_argv`` (``ssh``). Tables go to stdout, progress to stderr, ``--json`` prints the API's JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import json
import math
import os
import shlex
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpumarket.renter.api import (
    Client,
    CliError,
    Login,
    UsageError,
    default_config_path,
    load_login,
    normalize_url,
    save_login,
)
from shared.money import MAX_PRICE, PRICE_PLACES, amount_problem, format_usd

# How often `rent`, `stop --wait` and `logs -f` ask the API again.
POLL_INTERVAL_S = 1.0
# Rentals fetched per page, and pages at most, for `rentals`.
PAGE_SIZE, MAX_PAGES = 500, 20
ACTIVE_STATES = ("pending", "starting", "running", "stopping")
ENDED_STATES = ("stopped", "failed", "preempted")
TEMPLATES_HINT = "base, pytorch, jupyter, vllm (GET /api/v1/templates lists them all)"

Command = Callable[[argparse.Namespace, Client], Coroutine[Any, Any, int]]


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


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
                async with Client(login, timeout=args.timeout) as client:
                    return await command(args, client)

            code = asyncio.run(main())
        exec_argv: list[str] | None = getattr(args, "exec_argv", None)
        if exec_argv and not code:
            _exec(exec_argv)
    except CliError as exc:
        _err(f"gpumarket: {exc.message}")
        raise SystemExit(exc.status) from None
    except BrokenPipeError:  # `gpumarket logs R | head`: the reader has gone, which is fine
        with contextlib.suppress(OSError, ValueError):  # no "Exception ignored" when Python flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0) from None
    except KeyboardInterrupt:
        rental_id, cluster_id = args.rental_id, getattr(args, "cluster_id", None)
        if cluster_id:
            _err(f"\nstopped waiting; cluster {cluster_id} keeps going: see it with `gpumarket cluster show {cluster_id}`, "
                 f"stop it with `gpumarket cluster stop {cluster_id}`")  # fmt: skip
        elif rental_id:
            _err(f"\nstopped waiting; rental {rental_id} keeps going: see it with `gpumarket rentals`, "
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


# ---- formatting ---------------------------------------------------------------------------------


def money_column(values: Sequence[str | None], kind: str = "total") -> list[str]:
    """Amounts as the console writes them (``shared.money.format_usd``), aligned on the decimal point; ``-`` for none."""
    shown = [format_usd(value, kind, missing="-") for value in values]
    dots = [text.find(".") if "." in text else len(text) for text in shown]
    return [" " * (max(dots) - dot) + text for text, dot in zip(shown, dots, strict=True)]


def money(value: str | None, kind: str = "total") -> str:
    return format_usd(value, kind, missing="-")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in [headers, *rows]]
    return "\n".join(lines)


def _short_time(iso: str | None) -> str:
    return iso[:19].replace("T", " ") if iso else "-"


def _gib(mib: Any) -> str:
    return f"{round(mib / 1024)} GiB" if isinstance(mib, int | float) else "-"


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


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2))


def event_lines(events: Sequence[Mapping[str, Any]], what: Callable[[Mapping[str, Any]], str]) -> list[str]:
    """A blank line, ``events:`` and a line per event (its time, ``what`` happened, its cause); none without events."""
    if not events:
        return []
    return ["", "events:"] + [f"  {_short_time(e.get('at'))}  {what(e)}" + (f": {e['cause']}" if e.get("cause") else "") for e in events]


# ---- login --------------------------------------------------------------------------------------


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


async def cmd_login(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    path: Path = args.config or default_config_path(environ)
    url = args.api or environ.get("GPUMARKET_API_URL")
    if not url:
        raise UsageError("which API? give --api URL, e.g. `gpumarket login --api https://gpumarket.example`")
    login = Login(normalize_url(url), _read_key(args))
    async with Client(login, timeout=args.timeout) as client:
        account = await client.get("/account")
    save_login(path, login)
    print(f"logged in to {login.api_url} as {account['name']} ({account['role']}, account {account['id']}); saved to {path}")
    return 0


# ---- offers -------------------------------------------------------------------------------------


async def cmd_offers(args: argparse.Namespace, client: Client) -> int:
    if args.nodes is not None:
        return await cmd_cluster_offers(args, client)
    if args.allow_mixed or network_bounds(args):
        given = "--allow-mixed" if args.allow_mixed else "--" + next(iter(network_bounds(args))).replace("_", "-")
        raise UsageError(f"{given} prices a cluster: give --nodes N too")
    params: dict[str, str | int] = {"limit": args.limit, "sort": args.sort or "score", **_offer_filters(args)}
    if args.gpus:
        params["num_gpus"] = args.gpus
    body = await client.get("/offers", params)
    if args.json:
        _print_json(body)
        return 0
    items: list[dict[str, Any]] = body["items"]
    if not items:
        print(f"no offers match{' ' + repr(body.get('query')) if body.get('query') else ''}; loosen the query or try later")
        return 0
    prices = money_column([o.get("price_per_gpu_hour") for o in items], "rate")
    rows = [
        [
            o["gpu_name"], str(o["num_gpus"]), _gib(o.get("vram_mib")), price, o.get("region") or "-", o.get("tier") or "-",
            f"{o['reliability']:.3f}" if isinstance(o.get("reliability"), int | float) else "-",
            _isolation(o.get("isolation")), o["id"],
        ]
        for o, price in zip(items, prices, strict=True)
    ]  # fmt: skip
    print(table(["MODEL", "FREE", "VRAM", "$/GPU-H", "REGION", "TIER", "RELIAB", "ISOLATION", "OFFER"], rows))
    shown = len(items) + int(body.get("offset", 0))
    if body.get("total", 0) > shown:
        _err(f"{len(items)} of {body['total']} offers; more with --limit (up to 500) or a narrower query")
    return 0


def _offer_filters(args: argparse.Namespace) -> dict[str, str | int]:
    """The query words (``q``) and ``--isolated`` of ``gpumarket offers``, as both offer routes take them."""
    params: dict[str, str | int] = {}
    query = " ".join(args.query).strip()
    if query:
        params["q"] = query
    if args.isolated:
        params["isolated"] = "true"
    return params


async def cmd_cluster_offers(args: argparse.Namespace, client: Client) -> int:
    """``offers --nodes N``: ``GET /offers/clusters``, one row per group of hosts that could hold the cluster now."""
    if not 2 <= args.nodes <= 64:
        raise UsageError(f"a cluster has 2 to 64 nodes, not {args.nodes}; for one node leave out --nodes")
    if args.sort:
        raise UsageError("cluster offers are sorted by price: leave out --sort with --nodes")
    gpus = args.gpus or 1
    params: dict[str, str | int] = {"nodes": args.nodes, "gpus_per_node": gpus, "limit": args.limit, **_offer_filters(args)}
    if args.allow_mixed:
        params["allow_mixed"] = "true"
    params.update({name: f"{value:g}" for name, value in network_bounds(args).items()})
    body = await client.get("/offers/clusters", params)
    if args.json:
        _print_json(body)
        return 0
    items: list[dict[str, Any]] = body["items"]
    if not items:
        most = body.get("max_nodes", 0)
        models = "" if args.allow_mixed else " of one model"
        print(f"no {args.nodes} hosts with {gpus} free GPU{'' if gpus == 1 else 's'}{models} now "
              f"(at most {most} node{'' if most == 1 else 's'}{' matching ' + repr(body['query']) if 'q' in params else ''}); "
              f"ask for fewer nodes{'' if args.allow_mixed else ', add --allow-mixed'}, loosen the query or try later")  # fmt: skip
        return 0
    lows = money_column([i["price_per_hour"] for i in items], "rate")
    highs = money_column([i["price_per_hour_max"] for i in items], "rate")
    rows = [
        [
            i["gpu_name"] or "mixed", i["region"] or f"across regions ({', '.join(i['regions']) or 'unknown'})", str(i["hosts_available"]),
            low if i["price_per_hour"] == i["price_per_hour_max"] else f"{low} - {high.strip()}",
        ]
        for i, low, high in zip(items, lows, highs, strict=True)
    ]  # fmt: skip
    print(table(["MODEL", "REGION", "HOSTS", "$/H (CHEAPEST - DEAREST)"], rows))
    _err(f"the whole cluster ({args.nodes} x {gpus} GPU{'' if gpus == 1 else 's'}) per hour on the cheapest and the dearest "
         "hosts of each group: placement picks the hosts (one region first), not the price")  # fmt: skip
    if body.get("truncated"):
        _err(f"priced from the cheapest {body['offers_considered']} of {body['offers_matching']} offers; a narrower query prices them all")
    shown = len(items) + int(body.get("offset", 0))
    if body.get("total", 0) > shown:
        _err(f"{len(items)} of {body['total']} groups; more with --limit (up to 500) or a narrower query")
    return 0


def _isolation(view: Any) -> str:
    if not isinstance(view, dict):
        return "unknown"
    kinds = ",".join(k for k in view.get("kinds", []) if k != "hold") or "hold"
    return f"{kinds}" if view.get("isolated") else f"{kinds} (not isolated)"


# ---- rent ---------------------------------------------------------------------------------------


def _env_pairs(pairs: Sequence[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise UsageError(f"--env takes NAME=VALUE, not {pair!r}")
        env[name] = value
    return env


def container_workload(image: str, *, command: str | None = None, ports: Sequence[int] = (), env: Sequence[str] = ()) -> dict[str, Any]:
    """The container workload of ``--image`` and its options: ``--command`` split into words as a shell would,
    ``--port`` (repeatable), ``--env NAME=VALUE`` (repeatable)."""
    workload: dict[str, Any] = {"kind": "container", "image": image}
    if command:
        workload["command"] = shlex.split(command)
    if ports:
        workload["ports"] = list(ports)
    if env:
        workload["env"] = _env_pairs(env)
    return workload


def interruptible_fields(args: argparse.Namespace, what: str) -> dict[str, str]:
    """``{"kind": "interruptible", "bid": ...}`` for ``--interruptible --bid USD``, ``{}`` for neither; ``UsageError`` for one alone."""
    if not (args.interruptible or args.bid):
        return {}
    if not (args.interruptible and args.bid):
        raise UsageError(f"{what} needs both --interruptible and --bid USD (per GPU-hour)")
    return {"kind": "interruptible", "bid": args.bid}


def add_interruptible_options(parser: argparse.ArgumentParser, what: str) -> None:
    """``--interruptible`` and ``--bid USD``, read by ``interruptible_fields``."""
    parser.add_argument("--interruptible", action="store_true", help="cheaper, but preempted by on-demand rentals and higher bids (needs --bid)")
    parser.add_argument("--bid", type=_usd, metavar="USD", help=f"the most you pay per GPU-hour for {what}: "
                        "at least the host's minimum bid; you are charged the lower of the bid and the GPU's on-demand price")  # fmt: skip


def rental_body(args: argparse.Namespace) -> dict[str, Any]:
    """The ``POST /rentals`` body of ``gpumarket rent``'s options; ``UsageError`` for options that do not go together."""
    body: dict[str, Any] = {"gpu_count": args.gpus}
    if args.offer_id:
        if args.model or args.max_price or args.where:
            raise UsageError("an OFFER_ID names host and model already: leave out --model, --max-price and --where")
        body["offer_id"] = args.offer_id
    if args.model:
        body["gpu_model"] = args.model
    requirements = [args.where] if args.where else []
    if args.max_price:
        requirements.append(f"price<={args.max_price}")
    if requirements:
        body["requirements"] = " ".join(requirements)
    container_only = [n for n, v in (("--command", args.command), ("--port", args.port), ("--env", args.env)) if v]
    if container_only and not args.image:
        verb = "goes" if len(container_only) == 1 else "go"
        raise UsageError(f"{', '.join(container_only)} {verb} with --image (a template brings its own)")
    if args.template:
        body["template"] = args.template
    elif args.image:
        body["workload"] = container_workload(args.image, command=args.command, ports=args.port, env=args.env)
    else:
        body["workload"] = {"kind": "hold"}
    body.update(interruptible_fields(args, "an interruptible rental"))
    if args.queue:
        body["queue"] = True
    return body


def _queued_note(rental: Mapping[str, Any]) -> str:
    standing = rental.get("queue") or {}
    return f" (queued {standing['position']}/{standing['length']})" if standing else " (queued)"


def _progress_line(rental: Mapping[str, Any], state: str, cause: str | None, started: float) -> str:
    line = f"[{time.monotonic() - started:4.0f}s] {rental['id']}: {state}"
    if rental.get("queued"):
        standing = rental.get("queue") or {}
        line += f" ({standing.get('message') or 'queued: waiting for GPUs'})"
    return f"{line}: {cause}" if cause else line


async def wait_for(
    client: Client, rental_id: str, until: tuple[str, ...], *, quiet: bool = False,
    collection: str = "rentals", ended: tuple[str, ...] = ENDED_STATES,
) -> dict[str, Any]:
    """Poll the rental (or a cluster: ``collection="clusters"`` with its ``ended`` states) until its state is one of
    ``until`` or ``ended``; on stderr, a progress line for each new event (its state and cause: ``starting: workload
    pulling: ... (45%)``), or for a new state without one.

    Cancelling it is safe: the rental is not touched.
    """
    started = time.monotonic()
    seen: int | None = None  # events already shown; None: the first poll shows the newest only
    last_state = None
    while True:
        rental: dict[str, Any] = await client.get(f"/{collection}/{rental_id}")
        events: list[dict[str, Any]] = rental.get("events") or []
        fresh = events[-1:] if seen is None else events[seen:]
        seen = len(events)
        if not quiet:
            for event in fresh:
                _err(_progress_line(rental, event.get("to") or rental["state"], event.get("cause"), started))
            if not fresh and rental["state"] != last_state:
                _err(_progress_line(rental, rental["state"], None, started))
        # The state shown last: a poll can see an event before the rental's own state has moved to it (the answer's
        # two reads straddled the change); the next poll's state is then no news.
        last_state = (fresh[-1].get("to") or rental["state"]) if fresh else rental["state"]
        if rental["state"] in until or rental["state"] in ended:
            return rental
        await asyncio.sleep(POLL_INTERVAL_S)


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
        _print_json(rental)
    else:
        _print_rental_outcome(rental)
    return 1 if _failed(rental) else 0


def _failed(rental: Mapping[str, Any]) -> bool:
    """Ended without having run to its end: failed, preempted, or stopped before it started (or with a reason)."""
    if rental["state"] == "stopped":
        return bool(rental.get("failure_reason")) or not rental.get("started_at")
    return rental["state"] in ENDED_STATES


def _print_rental_outcome(rental: Mapping[str, Any]) -> None:
    rid, rstate = rental["id"], rental["state"]
    if _failed(rental):
        reason = rental.get("failure_reason") or ("it was stopped before it ran" if rstate == "stopped" else "no reason given")
        print(f"{rid} {rstate}")
        _err(f"gpumarket: rental {rid} {rstate}: {reason}; see `gpumarket logs {rid}`, or rent elsewhere")
        return
    if rstate in ENDED_STATES:  # it ran, and its workload has already ended
        print(f"{rid} {rstate}")
        _err(f"the workload ran and ended; its output: gpumarket logs {rid}")
        return
    gpus = f"{rental.get('gpu_count')} x {rental.get('gpu_model') or 'GPU'}"
    price = f", {money(rental['price_per_hour'], 'rate')}/h" if rental.get("price_per_hour") else ""
    print(f"{rid} {rstate}: {gpus}{price}")
    if rstate == "running":
        inside = f"shell: gpumarket ssh {rid}; files: gpumarket cp FILE {rid}:; " if rental.get("ssh_host_key") else ""
        _err(f"{inside}logs: gpumarket logs {rid} -f; stop: gpumarket stop {rid}")
    else:
        _err(f"follow it with `gpumarket rentals`; stop it with `gpumarket stop {rid}`")


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
        _print_json({"items": items, "total": len(items)})
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
            regions.get(r.get("host_id") or "", "-"), _what(r), price, paid, _short_time(r.get("started_at")),
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
            _err(f"(output before byte {body['offset']} was pruned)")
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
        await asyncio.sleep(POLL_INTERVAL_S)


async def cmd_stop(args: argparse.Namespace, client: Client) -> int:
    rental: dict[str, Any] = await client.request("DELETE", f"/rentals/{args.rental}")
    if args.wait and rental["state"] not in ENDED_STATES:
        rental = await wait_for(client, rental["id"], ENDED_STATES)
    if args.json:
        _print_json(rental)
    else:
        print(f"{rental['id']} {rental['state']}" + ("" if rental["state"] in ENDED_STATES else "; the GPUs are freed once the host confirms"))
    return 0


# ---- account ------------------------------------------------------------------------------------


async def cmd_account(args: argparse.Namespace, client: Client) -> int:
    account: dict[str, Any] = await client.get("/account")
    if args.json:
        _print_json(account)
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


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _bound(text: str) -> float:
    """A network bound: a finite number, not negative (the API checks each bound's own range and says which)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, not {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of at least 0, not {text!r}")
    return value


NETWORK_BOUNDS = (("max_latency_ms", "MS", "no two nodes on hosts measured further apart (round trip, ms)"),
                  ("max_loss_pct", "PCT", "no two nodes on hosts measured losing more packets (%%)"),
                  ("min_mbit_s", "MBIT", "no two nodes on hosts measured slower (Mbit/s)"))  # fmt: skip


def add_network_bounds(parser: argparse.ArgumentParser, *, prefix: str = "") -> None:
    """``--max-latency-ms``, ``--max-loss-pct``, ``--min-mbit-s``: a cluster's network bounds (docs/clusters.md)."""
    for name, metavar, text in NETWORK_BOUNDS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=_bound, metavar=metavar, help=prefix + text)


def network_bounds(args: argparse.Namespace) -> dict[str, float]:
    """The bounds given, by their API names."""
    return {name: value for name, _, _ in NETWORK_BOUNDS if (value := getattr(args, name, None)) is not None}


def _limit(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 500:
        raise argparse.ArgumentTypeError(f"must be 1 to 500, not {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _usd(text: str) -> str:
    """A price in USD per GPU-hour as the API takes it (shared/money.py: 0.45; no sign, exponent, separator, "$" or spaces)."""
    problem, amount = amount_problem(text, places=PRICE_PLACES, maximum=MAX_PRICE, positive=True)
    if amount is None:
        raise argparse.ArgumentTypeError(problem)
    return text


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 1 to 65535, not {value}")
    return value


def common_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="the login file (default $XDG_CONFIG_HOME/gpumarket/config.json, or $GPUMARKET_CONFIG)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=30.0, metavar="S", help="seconds one API call may take (default 30)")


LOGIN_EPILOG = """\
The key is read from stdin when it is not a terminal, else prompted for without echo; --key
works too but shows in the process list. GPUMARKET_API_URL and GPUMARKET_API_KEY, when set,
override the saved login for every command.

examples:
  gpumarket login --api https://gpumarket.example
  echo "$KEY" | gpumarket login --api http://127.0.0.1:8080"""

OFFERS_EPILOG = """\
The query language: space-separated 'field op value' terms, all ANDed; fields gpu_name,
num_gpus, vram (GiB), compute_capability, cuda_driver_version, price (USD per GPU-hour),
price_per_score, region, tier, score, reliability, download_mbps, upload_mbps, verified,
isolated; ops = != < <= > >= (docs/marketplace.md).

With --nodes N, the same filters price a cluster (`gpumarket cluster create`): each group of
hosts placement could take N nodes of --gpus GPUs from (one GPU model and region; across
regions where no region has room; any model with --allow-mixed), with the whole cluster's
price per hour on its cheapest and its dearest hosts (docs/clusters.md).

examples:
  gpumarket offers
  gpumarket offers 'vram>=24 price<=0.5' --sort price
  gpumarket offers gpu_name=RTX_4090 num_gpus>=2 --isolated --json
  gpumarket offers --nodes 4 --gpus 2 'gpu_name=A100 reliability>=0.95'
  gpumarket offers --nodes 8 --allow-mixed --json"""

RENT_EPILOG = f"""\
Without --template or --image the rental holds the GPUs and runs nothing (--hold says so).
Templates: {TEMPLATES_HINT}.
It waits until the rental runs, with a progress line on stderr (Ctrl-C stops waiting, not
the rental), then prints the rental's id and state; exit status 1 if it failed. Each invocation rents anew: it sends its own Idempotency-Key, so a retried
call of the same invocation never rents twice.

examples:
  gpumarket rent --gpus 2 --model 'RTX 4090' --template pytorch
  gpumarket rent 'h_abc:NVIDIA GeForce RTX 4090' --image ubuntu:24.04 --command 'sleep infinity'
  gpumarket rent --image python:3.12 --command 'python -m http.server 8000' --port 8000 --env DEBUG=1
  gpumarket rent --interruptible --bid 0.20 --max-price 0.30 --no-wait"""


def set_command(parser: argparse.ArgumentParser, command: Command | None) -> None:
    parser.set_defaults(func=run, renter_func=command)


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
    common_options(login)
    set_command(login, None)  # cmd_login: no saved login needed

    offers = sub.add_parser("offers", help="GPUs you can rent now", formatter_class=formatter, epilog=OFFERS_EPILOG,
                            description="List offers (per host and GPU model) with price per GPU-hour, region, tier, "
                            "reliability and how the host isolates workloads.")  # fmt: skip
    offers.add_argument("query", nargs="*", metavar="QUERY", help="query language terms, e.g. 'vram>=24 price<=0.5'")
    offers.add_argument("--sort", choices=("score", "price", "price_per_performance", "reliability"),
                        help="score (default, best first), price (cheapest first), price_per_performance or reliability")  # fmt: skip
    offers.add_argument("--gpus", type=_positive_int, metavar="N", help="at least N free GPUs on one host (with --nodes: per node)")
    offers.add_argument("--nodes", type=_positive_int, metavar="N",
                        help="price a cluster of N nodes (2 to 64), each on a host of its own: the groups of hosts that "
                        "could hold it now, with the whole cluster's price per hour")  # fmt: skip
    offers.add_argument("--allow-mixed", action="store_true", help="with --nodes: nodes may have different GPU models")
    add_network_bounds(offers, prefix="with --nodes: ")
    offers.add_argument("--isolated", action="store_true", help="only hosts that isolate renters' workloads")
    offers.add_argument("--limit", type=_limit, default=50, metavar="N", help="at most N offers (default 50, at most 500)")
    offers.add_argument("--json", action="store_true", help="print the API's JSON")
    common_options(offers)
    set_command(offers, cmd_offers)

    rent = sub.add_parser("rent", help="rent GPUs and wait until the rental runs", formatter_class=formatter, epilog=RENT_EPILOG,
                          description="Rent GPUs from an offer, or from any host matching --model / --max-price / --where, "
                          "running a template, an image, or nothing (a hold).")  # fmt: skip
    rent.add_argument("offer_id", nargs="?", metavar="OFFER_ID", help="an offer from `gpumarket offers` (host_id:gpu_name)")
    rent.add_argument("--gpus", type=_positive_int, default=1, metavar="N", help="whole GPUs on one host (default 1)")
    rent.add_argument("--model", metavar="M", help="GPU model words, e.g. 'RTX 4090' or 'A100 80GB'")
    rent.add_argument("--max-price", type=_usd, metavar="USD", help="at most this price per GPU-hour")
    rent.add_argument("--where", metavar="QUERY", help="other offer filters in the query language, e.g. 'vram>=24 reliability>0.98'")
    what = rent.add_mutually_exclusive_group()
    what.add_argument("--template", metavar="NAME", help=f"run a template: {TEMPLATES_HINT}")
    what.add_argument("--image", metavar="REF", help="run this container image, e.g. ubuntu:24.04")
    what.add_argument("--hold", action="store_true", help="run nothing: hold the GPUs (the default)")
    rent.add_argument("--command", metavar="CMD", help="with --image: the command, replacing the image's entrypoint ('python train.py')")
    rent.add_argument("--port", type=_port, action="append", default=[], metavar="P", help="with --image: a TCP port the workload serves (repeatable)")
    rent.add_argument("--env", action="append", default=[], metavar="K=V", help="with --image: an environment variable (repeatable)")
    add_interruptible_options(rent, "an interruptible rental")
    rent.add_argument("--queue", action="store_true", help="wait for GPUs (up to 10 minutes) when none are free now")
    rent.add_argument("--no-wait", action="store_true", help="print the rental as created, do not wait until it runs")
    rent.add_argument("--json", action="store_true", help="print the rental's JSON (no progress lines)")
    common_options(rent)
    set_command(rent, cmd_rent)

    rentals = sub.add_parser("rentals", help="your rentals", formatter_class=formatter,
                             description="Your active rentals (pending, starting, running, stopping), newest first.",
                             epilog="examples:\n  gpumarket rentals\n  gpumarket rentals --all --json")  # fmt: skip
    rentals.add_argument("--all", action="store_true", help="ended rentals too")
    rentals.add_argument("--json", action="store_true", help="print the rentals' JSON")
    common_options(rentals)
    set_command(rentals, cmd_rentals)

    logs = sub.add_parser("logs", help="a rental's output", formatter_class=formatter,
                          description="Print a rental's workload output (as far as its host has sent it) to stdout, as it is.",
                          epilog="examples:\n  gpumarket logs r_abc\n  gpumarket logs r_abc -f\n  gpumarket logs r_abc --since-offset 4096")  # fmt: skip
    logs.add_argument("rental", metavar="RENTAL", help="the rental's id")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new output until the rental ends (Ctrl-C to stop)")
    logs.add_argument("--since-offset", type=_non_negative_int, default=0, metavar="N", help="start at byte N of the output (default 0)")
    common_options(logs)
    set_command(logs, cmd_logs)

    stop = sub.add_parser("stop", help="stop a rental", formatter_class=formatter,
                          description="Stop a rental: its workload is stopped and billing ends; the GPUs are freed when "
                          "its host confirms.", epilog="examples:\n  gpumarket stop r_abc\n  gpumarket stop r_abc --wait")  # fmt: skip
    stop.add_argument("rental", metavar="RENTAL", help="the rental's id")
    stop.add_argument("--wait", action="store_true", help="wait until the host has confirmed the stop")
    stop.add_argument("--json", action="store_true", help="print the rental's JSON")
    common_options(stop)
    set_command(stop, cmd_stop)

    account = sub.add_parser("account", help="your balance, burn rate, spend cap and quotas", formatter_class=formatter,
                             description="Your account: balance, what your rentals burn per hour, spend cap, quotas; "
                             "a provider's earnings.", epilog="examples:\n  gpumarket account\n  gpumarket account --json")  # fmt: skip
    account.add_argument("--json", action="store_true", help="print the API's JSON")
    common_options(account)
    set_command(account, cmd_account)
