"""``gpumarket service create | list | show | scale | delete | token``: elastic services over ``/services``.

A service is replicas of one container (each a rental) behind one endpoint, ``<master>/svc/<id>/``,
scaled between ``--min`` and ``--max`` by its rule. Its token, which clients send as
``Authorization: Bearer``, is in the answer of ``create`` and ``token`` only: the master keeps its hash.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from gpumarket.renter.api import Client, UsageError
from gpumarket.renter.commands import (
    TEMPLATES_HINT,
    all_pages,
    command_group,
    finish,
    listed_already,
)
from gpumarket.renter.options import non_negative_int, port, positive_int, usd
from gpumarket.renter.output import err, event_lines, money, money_column, print_json, short_time, table
from gpumarket.renter.renting import (
    add_interruptible_options,
    add_price_tolerance_option,
    add_volume_option,
    container_workload,
    interruptible_fields,
    price_tolerance_fields,
)

# The rule a service gets when only cooldowns are given (the API's own default when no rule is: 4 in flight per replica).
DEFAULT_TARGET_INFLIGHT = 4.0
MAX_IDEMPOTENCY_KEY = 255


def _bounded(low: float, high: float, what: str) -> Callable[[str], float]:
    """An argparse type: a number from ``low`` to ``high`` (the API's bounds for that figure)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{what} is {low:g} to {high:g}, not {text}")
        return value

    return parse


def _idempotency_key(text: str) -> str:
    if not 1 <= len(text) <= MAX_IDEMPOTENCY_KEY:
        raise argparse.ArgumentTypeError(f"an idempotency key is 1 to {MAX_IDEMPOTENCY_KEY} characters")
    return text


def scaling_rule(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``scaling`` of ``POST /services`` from the options; None (the API's default rule) when none is given."""
    if args.period is not None and args.gpu_util is None:
        raise UsageError("--period goes with --gpu-util PCT (the utilization rule's averaging window)")
    rule: dict[str, Any] = {}
    if args.gpu_util is not None:
        rule = {"metric": "gpu_util", "threshold_pct": args.gpu_util}
        if args.period is not None:
            rule["period_s"] = args.period
    elif args.target_inflight is not None:
        rule = {"metric": "inflight", "target": args.target_inflight}
    cooldowns = {k: v for k, v in (("scale_up_cooldown_s", args.scale_up_cooldown), ("scale_down_cooldown_s", args.scale_down_cooldown))
                 if v is not None}  # fmt: skip
    if cooldowns and not rule:
        rule = {"metric": "inflight", "target": DEFAULT_TARGET_INFLIGHT}
    return {**rule, **cooldowns} or None


async def service_body(args: argparse.Namespace, client: Client) -> dict[str, Any]:
    """The ``POST /services`` body of ``gpumarket service create``'s options; ``UsageError`` for ones that do not go together.

    A template's port, when ``--port`` is left out, is its one port (``GET /templates/{name}``)."""
    image_only = [n for n, v in (("--command", args.command), ("--env", args.env)) if v]
    if image_only and not args.image:
        raise UsageError(f"{', '.join(image_only)} {'goes' if len(image_only) == 1 else 'go'} with --image (a template brings its own)")
    if not (args.image or args.template):
        raise UsageError("what does the service run? give --image IMAGE --port N, or --template T (" + TEMPLATES_HINT + ")")
    body: dict[str, Any] = {"name": args.name, "gpu_count": args.gpus}
    if args.image:
        if args.port is None:
            raise UsageError("--image needs --port N: the port the container serves its API on")
        body["workload"] = container_workload(args.image, command=args.command, ports=[args.port], env=args.env)
        body["port"] = args.port
    else:
        body["template"] = args.template
        body["port"] = args.port if args.port is not None else await template_port(client, args.template)
    low = args.min if args.min is not None else 1
    high = args.max if args.max is not None else max(low, 1)
    body["min_replicas"], body["max_replicas"] = low, high
    rule = scaling_rule(args)
    if rule is not None:
        body["scaling"] = rule
    for key, value in (("gpu_model", args.gpu_model), ("max_price_per_gpu_hour", args.max_price), ("health_path", args.health_path)):
        if value:
            body[key] = value
    if args.volume:
        if any(not v.get("read_only") for v in args.volume):
            raise UsageError("a service's replicas share their volumes read-only: write --volume NAME:/MOUNT:ro")
        body["volumes"] = args.volume
    body.update(interruptible_fields(args, "an interruptible service"))
    body.update(price_tolerance_fields(args))
    return body


async def template_port(client: Client, name: str) -> int:
    """The one port template ``name`` serves; ``UsageError`` when it serves none or several."""
    template: Mapping[str, Any] = await client.get(f"/templates/{name}")
    ports = [int(p) for p in template.get("ports") or []]
    if len(ports) != 1:
        listed = ", ".join(str(p) for p in ports) or "none"
        raise UsageError(f"template {name} serves ports {listed}: say which one the service answers on with --port N")
    return ports[0]


def _runs(service: Mapping[str, Any]) -> str:
    image = service.get("image") or "a container"
    return f"template {service['template']} ({image})" if service.get("template") else str(image)


def _counts(service: Mapping[str, Any]) -> str:
    replicas = service.get("replicas") or {}
    return f"{replicas.get('ready', 0)}/{replicas.get('live', 0)}/{service['desired_replicas']}"


def _rule(scaling: Mapping[str, Any]) -> str:
    up, down = scaling.get("scale_up_cooldown_s"), scaling.get("scale_down_cooldown_s")
    cooldowns = f"; waits {up:g} s between scale-ups, {down:g} s between scale-downs" if up is not None and down is not None else ""
    if scaling.get("metric") == "gpu_util":
        return (f"GPU utilization: more replicas above {scaling['threshold_pct']:g} %, fewer below "
                f"{scaling.get('scale_down_below_pct', 0):g} %, averaged over {scaling.get('period_s', 0):g} s{cooldowns}")  # fmt: skip
    return f"requests in flight: {scaling.get('target', DEFAULT_TARGET_INFLIGHT):g} per replica{cooldowns}"


def _gpus(service: Mapping[str, Any]) -> str:
    gpus = f"{service['gpu_count']} x {service.get('gpu_model') or 'any model'} per replica"
    if service.get("kind") == "interruptible":
        return f"{gpus}, interruptible, bid {money(service.get('bid_per_gpu_hour'), 'rate')} per GPU-hour"
    return f"{gpus}, on demand"


def usage_lines(service: Mapping[str, Any], token: str) -> list[str]:
    """How a client calls the service: curl, and an OpenAI client's ``base_url``."""
    endpoint = str(service["endpoint_url"])
    return [
        "call it with the token as a bearer key, e.g.:",
        f"  curl -H 'Authorization: Bearer {token}' {endpoint}v1/models",
        f"  OpenAI(base_url=\"{endpoint}v1\", api_key=\"{token}\")",
    ]


def token_lines(service_id: str, token: str | None) -> list[str]:
    if token is None:
        return [f"token      not shown: this Idempotency-Key made the service before, and a token is shown once; "
                f"`gpumarket service token {service_id}` makes a new one"]  # fmt: skip
    return [f"token      {token}"]


# ---- create -------------------------------------------------------------------------------------


async def cmd_create(args: argparse.Namespace, client: Client) -> int:
    body = await service_body(args, client)
    # One key per invocation unless given: a retried HTTP call cannot make two services; another invocation does.
    key = args.idempotency_key or str(uuid.uuid4())
    service: dict[str, Any] = await client.request("POST", "/services", json_body=body, headers={"Idempotency-Key": key}, retry=True)
    if args.json:
        print_json(service)
        return 0
    sid, token = service["id"], service.get("token")
    print(f"{sid} {service['name']} {service['state']}: {service['min_replicas']} to {service['max_replicas']} replicas of "
          f"{_runs(service)}, port {service['port']}")  # fmt: skip
    print(f"endpoint   {service['endpoint_url']}")
    print("\n".join(token_lines(sid, token)))
    if token is not None:
        err("the token is shown this once: keep it now (the master keeps only its hash); "
             f"`gpumarket service token {sid}` replaces it")  # fmt: skip
        err("\n".join(usage_lines(service, token)))
    err(f"follow it with `gpumarket service show {sid}`; delete it with `gpumarket service delete {sid}`")
    return 0


# ---- list, show ---------------------------------------------------------------------------------


async def cmd_list(args: argparse.Namespace, client: Client) -> int:
    items = await all_pages(client, "/services", {"deleted": "true"} if args.all else None)
    if listed_already(args, items, none="no services; `--all` shows deleted ones too, `gpumarket service create` makes one",
                      none_at_all="no services yet; `gpumarket service create` makes one"):  # fmt: skip
        return 0
    rows = [[s["id"], s["name"], s["state"], _counts(s), f"{s['min_replicas']}..{s['max_replicas']}", s["endpoint_url"]] for s in items]
    print(table(["ID", "NAME", "STATE", "READY/LIVE/DESIRED", "MIN..MAX", "ENDPOINT"], rows))
    return 0


def replica_rows(service: Mapping[str, Any]) -> list[list[str]]:
    replicas: list[Mapping[str, Any]] = service.get("replica_rentals") or []
    prices = money_column([r.get("price_per_gpu_hour") for r in replicas], "rate")
    return [
        [r["rental_id"], r["state"], "yes" if r.get("ready") else "no", r.get("gpu_model") or "-", price,
         short_time(r.get("created_at")), r.get("failure_reason") or ""]
        for r, price in zip(replicas, prices, strict=True)
    ]  # fmt: skip


def failure_lines(service: Mapping[str, Any]) -> list[str]:
    """Why replicas do not start (the streak of start failures, ``failure``), and what happens next."""
    failure = service.get("failure")
    if not failure:
        return []
    sid = service["id"]
    lines = [f"failure    {failure['code']} ({failure.get('owner')}'s), {failure.get('consecutive')} replica(s) in a row "
             f"since {short_time(failure.get('since'))} UTC: {failure.get('message')}"]  # fmt: skip
    if not failure.get("retried"):
        lines.append(f"next       not retried: fix the cause, then `gpumarket service resume {sid}`")
    elif service.get("next_attempt_at"):
        lines.append(f"next       a replica at {short_time(service['next_attempt_at'])} UTC; `gpumarket service resume {sid}` tries now")
    return lines


async def cmd_show(args: argparse.Namespace, client: Client) -> int:
    service: dict[str, Any] = await client.get(f"/services/{args.service}", {"failed": "true"} if args.all else None)
    if args.json:
        print_json(service)
        return 0
    replicas = service.get("replicas") or {}
    failed = replicas.get("failed", 0)
    folded = f" ({failed} failed: `gpumarket service show {service['id']} --all` lists them)" if failed and not args.all else (
        f", {failed} failed" if failed else "")  # fmt: skip
    lines = [
        f"{service['id']} {service['name']} {service['state']}",
        f"endpoint   {service['endpoint_url']}" + (" (closed)" if service["state"] == "deleted" else ""),
        *failure_lines(service),
        f"runs       {_runs(service)}, port {service['port']}, health check GET {service['health_path']}",
        f"replicas   {replicas.get('ready', 0)} ready, {replicas.get('live', 0)} live ({replicas.get('starting', 0)} starting, "
        f"{replicas.get('queued', 0)} queued), {service['desired_replicas']} wanted, between {service['min_replicas']} and "
        f"{service['max_replicas']}{folded}",
        f"scaling    {_rule(service.get('scaling') or {})}",
        f"GPUs       {_gpus(service)}" + (f", where {service['requirements']}" if service.get("requirements") else ""),
        f"cost       {money(service.get('cost_so_far'))} so far",
        f"token      {service.get('token_prefix') or '-'}… (`gpumarket service token {service['id']}` replaces it)",
        f"created    {short_time(service.get('created_at'))} UTC" + (f", deleted {short_time(service['deleted_at'])} UTC" if service.get("deleted_at") else ""),
        "",
        table(["RENTAL", "STATE", "READY", "MODEL", "$/GPU-H", "CREATED (UTC)", "WHY IT ENDED"], replica_rows(service)),
    ]  # fmt: skip
    lines += event_lines(service.get("events") or [], lambda e: f"{e.get('kind')}  {e.get('replicas')} replicas")
    print("\n".join(lines))
    return 0


# ---- scale, delete, token -----------------------------------------------------------------------


async def _change(args: argparse.Namespace, client: Client, method: str, path: str, body: Any = None) -> dict[str, Any] | None:
    """The API's answer to a change of ``args.service``; with ``--json`` printed as it is, and None."""
    answer: dict[str, Any] = await client.request(method, f"/services/{args.service}{path}", json_body=body)
    if args.json:
        print_json(answer)
        return None
    return answer


async def cmd_scale(args: argparse.Namespace, client: Client) -> int:
    if args.min is None and args.max is None:
        raise UsageError("give --min N, --max N or both")
    bounds = {k: v for k, v in (("min_replicas", args.min), ("max_replicas", args.max)) if v is not None}
    if service := await _change(args, client, "PUT", "/replicas", bounds):
        print(f"{service['id']}: {service['min_replicas']} to {service['max_replicas']} replicas, {service['desired_replicas']} wanted now, "
              f"{(service.get('replicas') or {}).get('ready', 0)} ready")  # fmt: skip
    return 0


async def cmd_resume(args: argparse.Namespace, client: Client) -> int:
    """Ask again after start failures: the same bounds set again (``PUT …/replicas`` ends the back-off)."""
    current: dict[str, Any] = await client.get(f"/services/{args.service}")
    bounds = {"min_replicas": current["min_replicas"], "max_replicas": current["max_replicas"]}
    if service := await _change(args, client, "PUT", "/replicas", bounds):
        print(f"{service['id']} {service['state']}: replicas are rented again on the autoscaler's next pass; "
              f"`gpumarket service show {service['id']}` follows them")  # fmt: skip
    return 0


async def cmd_delete(args: argparse.Namespace, client: Client) -> int:
    if service := await _change(args, client, "DELETE", ""):
        stopping = sum(1 for r in service.get("replica_rentals") or [] if r["state"] in ("pending", "starting", "running", "stopping"))
        print(f"{service['id']} {service['state']}: its endpoint is closed" + (f"; {stopping} replica(s) stopping" if stopping else ""))
    return 0


async def cmd_token(args: argparse.Namespace, client: Client) -> int:
    if answer := await _change(args, client, "POST", "/token"):
        print(f"token      {answer['token']}")
        err(f"the old token of {answer['service_id']} stopped working; this one is shown this once: keep it now")
    return 0


# ---- parsers ------------------------------------------------------------------------------------

CREATE_EPILOG = f"""\
A service runs a container: an image (--image with --port, the port it serves its API on) or a
template (--template; --port where it serves more than one). Templates: {TEMPLATES_HINT}.
Each replica is a rental of --gpus GPUs, queued while no host is free; the autoscaler keeps
between --min and --max of them, adding one when the requests in flight per replica pass
--target-inflight (default 4), or when GPU utilization averaged over --period passes --gpu-util.
--min 0 lets the service sleep: the first request then waits for a replica.

It prints the endpoint and the service token; clients send the token as `Authorization: Bearer`.
The token is shown this once (`gpumarket service token ID` replaces it). An OpenAI client uses
base_url ENDPOINTv1. Each invocation sends its own Idempotency-Key unless --idempotency-key
gives one: a repeat with the same key and the same options answers the first service (without
its token) and makes none.

examples:
  gpumarket service create chat --template vllm --gpus 1 --gpu-model A100 --min 1 --max 4
  gpumarket service create echo --image python:3.12 --port 8000 --command 'python -m http.server 8000' --health-path /
  gpumarket service create embed --image ghcr.io/acme/embed:2 --port 8080 --env MODEL=bge --gpu-util 70 --period 120
  gpumarket service create batch --template vllm --min 0 --max 8 --target-inflight 16 --interruptible --bid 0.30
  gpumarket service create chat --template vllm --idempotency-key deploy-42 --json"""


def _id_action(actions: argparse._SubParsersAction[argparse.ArgumentParser], name: str, *, help: str, description: str,
               examples: list[str]) -> argparse.ArgumentParser:  # fmt: skip
    """An action on one service: SERVICE, --json and the common options."""
    parser = actions.add_parser(name, help=help, description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="examples:\n" + "\n".join(f"  gpumarket service {name} {e}" for e in examples))  # fmt: skip
    parser.add_argument("service", metavar="SERVICE", help="the service's id (svc-…; `gpumarket service list` shows them)")
    return parser


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``service`` and its actions to ``gpumarket``'s subparsers."""
    formatter = argparse.RawDescriptionHelpFormatter
    actions = command_group(sub, "service", help="run a model server as an elastic service: create, list, show, scale, resume, delete, token",
                            description="Services: replicas of one container behind one endpoint (<master>/svc/<id>/), scaled "
                            "between a minimum and a maximum by the load.",
                            examples=["create chat --template vllm --min 1 --max 4", "list", "show svc-0123456789abcdef",
                                      "scale svc-0123456789abcdef --max 8", "delete svc-0123456789abcdef"])  # fmt: skip

    create = actions.add_parser("create", help="make a service and print its endpoint and token", formatter_class=formatter,
                                description="Make a service NAME: replicas of an image or a template behind one endpoint.",
                                epilog=CREATE_EPILOG)  # fmt: skip
    create.add_argument("name", metavar="NAME", help="lowercase letters, digits and inner hyphens, e.g. chat-7b")
    what = create.add_mutually_exclusive_group()
    what.add_argument("--image", metavar="IMAGE", help="run this container image (with --port)")
    what.add_argument("--template", metavar="T", help=f"run a template: {TEMPLATES_HINT}")
    create.add_argument("--port", type=port, metavar="N", help="the port the workload serves its API on (a template's own when it has one)")
    create.add_argument("--command", metavar="CMD", help="with --image: the command, replacing the image's entrypoint")
    create.add_argument("--env", action="append", default=[], metavar="K=V", help="with --image: an environment variable (repeatable)")
    create.add_argument("--health-path", metavar="P", help="GET P answers 2xx when a replica is ready (default /health)")
    create.add_argument("--gpus", type=positive_int, default=1, metavar="N", help="whole GPUs per replica (default 1)")
    create.add_argument("--gpu-model", "--model", dest="gpu_model", metavar="M", help="GPU model words, e.g. 'RTX 4090' or 'A100 80GB'")
    create.add_argument("--max-price", type=usd, metavar="USD", help="on-demand replicas only on GPUs at this price per GPU-hour or less")
    create.add_argument("--min", type=non_negative_int, metavar="N", help="fewest replicas (default 1; 0 lets it sleep)")
    create.add_argument("--max", type=positive_int, metavar="N", help="most replicas (default: --min, at least 1)")
    rule = create.add_mutually_exclusive_group()
    rule.add_argument("--target-inflight", type=_bounded(0.1, 10_000, "--target-inflight"), metavar="X",
                      help="scale on requests in flight: X per replica (default 4)")  # fmt: skip
    rule.add_argument("--gpu-util", type=_bounded(1, 100, "--gpu-util"), metavar="PCT", help="scale on GPU utilization above PCT %%")
    create.add_argument("--period", type=_bounded(10, 86_400, "--period"), metavar="S",
                        help="with --gpu-util: seconds the utilization is averaged over (default 300)")  # fmt: skip
    create.add_argument("--scale-up-cooldown", type=_bounded(0, 3_600, "--scale-up-cooldown"), metavar="S",
                        help="seconds between two scale-ups (default 30)")  # fmt: skip
    create.add_argument("--scale-down-cooldown", type=_bounded(0, 86_400, "--scale-down-cooldown"), metavar="S",
                        help="seconds between two scale-downs (default 300)")  # fmt: skip
    add_volume_option(create, "each replica, read-only (:ro; replicas then run only where one lives)")
    add_interruptible_options(create, "interruptible replicas (a preempted one is replaced)")
    add_price_tolerance_option(create, "every replica (kept on the service)")
    create.add_argument("--idempotency-key", type=_idempotency_key, metavar="K", help="send this Idempotency-Key: the same K "
                        "with the same options makes one service however often it runs")  # fmt: skip
    finish(create, cmd_create, json="the service's JSON")

    listing = actions.add_parser("list", help="your services", formatter_class=formatter,
                                 description="Your services, newest first: state, replicas ready/live/wanted, bounds and endpoint.",
                                 epilog="examples:\n  gpumarket service list\n  gpumarket service list --all --json")  # fmt: skip
    listing.add_argument("--all", action="store_true", help="deleted services too")
    finish(listing, cmd_list, json="the services' JSON")

    show = _id_action(actions, "show", help="one service: replicas, scaling, cost and events",
                      description="One service: endpoint, what runs, replicas, its scaling rule, GPUs, cost so far, each "
                      "replica's rental and the recent events. Failed replicas are counted; --all lists them.",
                      examples=["svc-0123456789abcdef", "svc-0123456789abcdef --all", "svc-0123456789abcdef --json"])  # fmt: skip
    show.add_argument("--all", action="store_true", help="list the failed replicas too, not only their count")
    finish(show, cmd_show, json="the service's JSON")

    scale = _id_action(actions, "scale", help="set a service's fewest and most replicas",
                       description="Set the replica bounds; the autoscaler moves into them on its next pass.",
                       examples=["svc-0123456789abcdef --max 8", "svc-0123456789abcdef --min 0 --max 2"])  # fmt: skip
    scale.add_argument("--min", type=non_negative_int, metavar="N", help="fewest replicas (0 lets it sleep)")
    scale.add_argument("--max", type=positive_int, metavar="N", help="most replicas")
    finish(scale, cmd_scale, json="the service's JSON")

    resume = _id_action(actions, "resume", help="try a failing service's replicas again now",
                        description="A service whose replicas failed to start waits longer after each failure, and one "
                        "failing for a cause of yours (an image that does not exist) is not retried at all. Once the cause "
                        "is fixed, resume ends the wait: replicas are rented again on the autoscaler's next pass.",
                        examples=["svc-0123456789abcdef"])  # fmt: skip
    finish(resume, cmd_resume, json="the service's JSON")

    delete = _id_action(actions, "delete", help="delete a service: its replicas stop, its endpoint closes",
                        description="Delete a service: every replica is stopped (billing ends as each host confirms) and "
                        "its endpoint answers no more.", examples=["svc-0123456789abcdef"])  # fmt: skip
    finish(delete, cmd_delete, json="the service's JSON")

    token = _id_action(actions, "token", help="replace a service's token (the old one stops working)",
                       description="Make a new service token and print it, once; the old one stops working at once.",
                       examples=["svc-0123456789abcdef", "svc-0123456789abcdef --json"])  # fmt: skip
    finish(token, cmd_token, json="the new token's JSON")
