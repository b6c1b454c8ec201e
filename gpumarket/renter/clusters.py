"""``gpumarket cluster create | list | show | stop | ssh``: clusters (one rental over several hosts) over ``/clusters``.

A cluster's nodes are member rentals (``node-0`` … ``node-N``), so ``cluster ssh`` is ``gpumarket ssh`` to
the member of that rank, and waiting is ``rent``'s ``wait_for`` on the cluster's own states and events.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import uuid
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, Final

from gpumarket.renter.api import ApiError, Client, CliError, UsageError
from gpumarket.renter.commands import (
    TEMPLATES_HINT,
    all_pages,
    command_group,
    finish,
    listed_already,
    set_command,
)
from gpumarket.renter.options import add_network_bounds, common_options, network_bounds, positive_int, usd
from gpumarket.renter.output import err, event_lines, money, money_column, print_json, short_time, table
from gpumarket.renter.renting import (
    add_price_tolerance_option,
    add_volume_option,
    container_workload,
    price_tolerance_fields,
    wait_for,
)
from gpumarket.renter.sshcmds import add_ssh_options, cmd_ssh

ACTIVE_CLUSTER_STATES = ("pending", "starting", "running", "degraded", "stopping")
ENDED_CLUSTER_STATES = ("stopped", "failed")
NODE_RE = re.compile(r"(?:node-)?(\d{1,3})")
NETWORK_STEPS = {"pending": "not made yet", "creating": "being made", "connecting": "connecting the nodes",
                 "measuring": "measuring between nodes", "deleted": "taken down"}  # fmt: skip


def network_summary(network: Mapping[str, Any] | None) -> str:
    """One line on the cluster's private network: its state, and once up the worst round trip and slowest throughput."""
    if not network:
        return "not made yet"
    state, reason = network.get("state"), network.get("reason")
    if state == "up":
        pairs = [p for p in network.get("pairs") or [] if not p.get("error")]
        failed = len(network.get("pairs") or []) - len(pairs)
        worst = max((p["rtt_ms"] for p in pairs if p.get("rtt_ms") is not None), default=None)
        slowest = min((p["mbit_s"] for p in pairs if p.get("mbit_s") is not None), default=None)
        figures = [f"worst round trip {_figure(worst)} ms" if worst is not None else "", f"slowest {_figure(slowest)} Mbit/s" if slowest is not None else "",
                   f"{failed} pair(s) unreachable" if failed else ""]  # fmt: skip
        return f"up on {network.get('subnet')}" + (": " + ", ".join(f for f in figures if f) if any(figures) else "")
    if state in ("failed", "none"):
        return f"{'failed' if state == 'failed' else 'none'}: {reason}" if reason else str(state)
    return NETWORK_STEPS.get(str(state), str(state))


PATH_WORDS: Final = {"fabric": "fabric (unencrypted)", "kernel": "kernel WireGuard", "wireguard-go": "wireguard-go",
                     "relay": "through the relays", "direct": "direct"}  # fmt: skip


def pair_rows(network: Mapping[str, Any] | None) -> list[list[str]]:
    """Each pair of nodes: its path (``links``: fabric, kernel WireGuard, wireguard-go or the relays) and, once measured,
    round trip and throughput, or why not."""
    paths = {(link["a"], link["b"]): link.get("path") for link in (network or {}).get("links") or []}
    measured = {(p["a"], p["b"]): p for p in (network or {}).get("pairs") or []}
    rows = []
    for a, b in sorted(set(measured) | {pair for pair, path in paths.items() if path}):
        p = measured.get((a, b), {})
        rtt, rate = p.get("rtt_ms"), p.get("mbit_s")
        path = paths.get((a, b)) or p.get("path")
        rows.append([f"{node_name(a)} <-> {node_name(b)}", f"{_figure(rtt)} ms" if rtt is not None else "-",
                     f"{_figure(rate)} Mbit/s" if rate is not None else "-", PATH_WORDS.get(str(path), "-") if path else "-",
                     p.get("error") or ""])  # fmt: skip
    return rows


def _figure(value: float) -> str:
    """A measured figure as JavaScript prints a number (the console says the same): 900.0 is "900", 0.708 is "0.708"."""
    number = float(value)
    return str(int(number)) if number.is_integer() else repr(number)


def node_name(rank: int) -> str:
    """A member's name inside the cluster, as its workload's MASTER_ADDR (``node-0``) names it."""
    return f"node-{rank}"


def cluster_body(args: argparse.Namespace) -> dict[str, Any]:
    """The ``POST /clusters`` body of ``gpumarket cluster create``'s options; ``UsageError`` for ones that do not go together."""
    if args.nodes < 2:
        raise UsageError(f"a cluster has 2 to 64 nodes, not {args.nodes}; for one node use `gpumarket rent`")
    body: dict[str, Any] = {"node_count": args.nodes, "gpus_per_node": args.gpus_per_node}
    if args.model:
        body["gpu_model"] = args.model
    if args.allow_mixed:
        body["allow_mixed"] = True
    if args.max_price:
        body["requirements"] = f"price<={args.max_price}"
    if args.queue:
        body["queue"] = True
    if bounds := network_bounds(args):
        body["network"] = bounds
    if args.command and not args.image:
        raise UsageError("--command goes with --image (a template brings its own)")
    if args.template:
        body["template"] = args.template
    elif args.image:
        body["workload"] = container_workload(args.image, command=args.command)
    else:
        body["workload"] = {"kind": "hold"}
    if args.volume:
        if not args.image and not args.template:
            raise UsageError("--volume mounts into a container: add --template or --image")
        if any("{rank}" not in (v.get("name") or v.get("id") or "") for v in args.volume):
            raise UsageError("a cluster's --volume names each member's own volume with {rank}, e.g. ckpt-{rank}:/ckpt")
        body["volumes"] = args.volume
    body.update(price_tolerance_fields(args))
    return body


def price_per_hour(cluster: Mapping[str, Any]) -> Decimal | None:
    """What the whole cluster costs an hour: each member's price per GPU-hour times its GPUs (``None`` if none is priced)."""
    prices = [Decimal(m["price_per_gpu_hour"]) * _member_gpus(cluster, m) for m in cluster.get("members") or []
              if m.get("price_per_gpu_hour") is not None]  # fmt: skip
    return sum(prices, Decimal(0)) if prices else None


def _member_gpus(cluster: Mapping[str, Any], member: Mapping[str, Any]) -> int:
    return len(member.get("gpu_uuids") or []) or int(cluster["gpus_per_node"])


def model_of(cluster: Mapping[str, Any]) -> str:
    """The members' GPU models (several with ``allow_mixed``), else the words asked for."""
    models = sorted({str(m["gpu_model"]) for m in cluster.get("members") or [] if m.get("gpu_model")})
    return ", ".join(models) or cluster.get("gpu_model") or "any model"


def _size(cluster: Mapping[str, Any]) -> str:
    return f"{cluster['node_count']} x {cluster['gpus_per_node']}"


def _runs(cluster: Mapping[str, Any]) -> str:
    if cluster.get("template"):
        return f"template {cluster['template']}"
    workload = cluster.get("workload") or {}
    if workload.get("kind") == "container":
        return str(workload.get("image", "container"))
    return str(workload.get("kind") or "hold")


# ---- create -------------------------------------------------------------------------------------


async def cmd_create(args: argparse.Namespace, client: Client) -> int:
    body = cluster_body(args)
    # One key per invocation: a retried HTTP call of this invocation cannot create twice; another invocation does.
    key = str(uuid.uuid4())
    try:
        cluster: dict[str, Any] = await client.request("POST", "/clusters", json_body=body, headers={"Idempotency-Key": key}, retry=True)
    except ApiError as exc:
        if exc.code == "insufficient_capacity":  # the API's hint names the rental's queue field; say the option
            raise CliError(f"{exc.api_message.rstrip('.')} ({exc.code}); see what is free with "
                           "`gpumarket offers --nodes N --gpus G`, ask for fewer nodes or GPUs, or add --queue to wait") from None  # fmt: skip
        raise
    args.cluster_id = cluster["id"]  # for Ctrl-C while waiting
    if not args.no_wait:
        try:
            cluster = await wait_for(client, cluster["id"], ("running",), quiet=args.json, collection="clusters", ended=ENDED_CLUSTER_STATES)
        except CliError as exc:  # the cluster exists all the same: say which
            raise CliError(f"cluster {cluster['id']} was created, but waiting for it failed: {exc.message}") from None
    if args.json:
        print_json(cluster)
        return 0 if cluster["state"] not in ENDED_CLUSTER_STATES else 1
    cid, state = cluster["id"], cluster["state"]
    if state in ENDED_CLUSTER_STATES:
        print(f"{cid} {state}")
        err(f"gpumarket: cluster {cid} {state}: {cluster.get('failure_reason') or 'no reason given'}; "
             f"see `gpumarket cluster show {cid}`")  # fmt: skip
        return 1
    rate = price_per_hour(cluster)
    print(f"{cid} {state}: {_size(cluster)} x {model_of(cluster)}" + (f", {money(str(rate), 'rate')}/h" if rate is not None else ""))
    if state == "running":
        holds = (cluster.get("workload") or {}).get("kind", "hold") == "hold" and not cluster.get("template")
        shell = "" if holds else f"shell: gpumarket cluster ssh {cid} node-0; "  # a hold's nodes have nothing to log into
        err(f"nodes: gpumarket cluster show {cid}; {shell}stop: gpumarket cluster stop {cid}")
    else:
        err(f"follow it with `gpumarket cluster show {cid}`; stop it with `gpumarket cluster stop {cid}`")
    return 0


# ---- list, show ---------------------------------------------------------------------------------


async def cmd_list(args: argparse.Namespace, client: Client) -> int:
    items = await all_pages(client, "/clusters")
    if not args.all:
        items = [c for c in items if c["state"] in ACTIVE_CLUSTER_STATES]
    if listed_already(args, items, none="no active clusters; `--all` shows ended ones too, `gpumarket cluster create` makes one",
                      none_at_all="no clusters yet; `gpumarket cluster create` makes one"):  # fmt: skip
        return 0
    rates = [price_per_hour(c) for c in items]
    prices = money_column([str(r) if r is not None else None for r in rates], "rate")
    rows = [
        [c["id"], c["state"], str(c["node_count"]), str(c["node_count"] * c["gpus_per_node"]), model_of(c),
         _runs(c), price, short_time(c.get("started_at"))]
        for c, price in zip(items, prices, strict=True)
    ]  # fmt: skip
    print(table(["ID", "STATE", "NODES", "GPUS", "MODEL", "RUNS", "$/H", "STARTED (UTC)"], rows))
    return 0


async def _host(client: Client, host_id: str) -> Mapping[str, Any]:
    try:
        found: Mapping[str, Any] = await client.get(f"/hosts/{host_id}")
        return found
    except CliError:
        return {}  # a host gone from view: the table shows the member all the same


async def member_rows(client: Client, cluster: Mapping[str, Any]) -> list[list[str]]:
    """RANK, NODE, RENTAL, HOST, REGION, STATE, GPUS for each member, the hosts' names and regions from ``/hosts``."""
    members: list[Mapping[str, Any]] = cluster.get("members") or []
    host_ids = sorted({m["host_id"] for m in members if m.get("host_id")})
    hosts = dict(zip(host_ids, await asyncio.gather(*(_host(client, h) for h in host_ids)), strict=True))
    rows = []
    for m in members:
        host = hosts.get(m.get("host_id") or "", {})
        rows.append([
            str(m["node_rank"]), node_name(m["node_rank"]), m["rental_id"], str(host.get("name") or m.get("host_id") or "-"),
            str(host.get("region") or "-"), m["state"], f"{_member_gpus(cluster, m)} x {m.get('gpu_model') or 'GPU'}",
        ])  # fmt: skip
    return rows


async def cmd_show(args: argparse.Namespace, client: Client) -> int:
    cluster: dict[str, Any] = await client.get(f"/clusters/{args.cluster}")
    if args.json:
        print_json(cluster)
        return 0
    rate = price_per_hour(cluster)
    lines = [
        f"{cluster['id']} {cluster['state']}" + (f": {cluster['failure_reason']}" if cluster.get("failure_reason") else ""),
        f"size       {_size(cluster)} GPUs of {model_of(cluster)}" + (" (mixed models allowed)" if cluster.get("allow_mixed") else ""),
        f"runs       {_runs(cluster)}",
        f"price      {money(str(rate) if rate is not None else None, 'rate')}/h for the whole cluster",
        f"started    {short_time(cluster.get('started_at'))} UTC" if cluster.get("started_at") else f"created    {short_time(cluster.get('created_at'))} UTC",
        f"network    {network_summary(cluster.get('private_network'))}",
        "",
        table(["RANK", "NODE", "RENTAL", "HOST", "REGION", "STATE", "GPUS"], await member_rows(client, cluster)),
    ]  # fmt: skip
    pairs = pair_rows(cluster.get("private_network"))
    if pairs:
        lines += ["", "between nodes (through the cluster's private network):", table(["PAIR", "ROUND TRIP", "THROUGHPUT", "PATH", "PROBLEM"], pairs)]
    lines += event_lines(cluster.get("events") or [], lambda e: f"{e.get('from') or '-'} -> {e.get('to')}")
    print("\n".join(lines))
    return 0


# ---- stop, ssh ----------------------------------------------------------------------------------


async def cmd_stop(args: argparse.Namespace, client: Client) -> int:
    cluster: dict[str, Any] = await client.request("DELETE", f"/clusters/{args.cluster}")
    if args.wait and cluster["state"] not in ENDED_CLUSTER_STATES:
        cluster = await wait_for(client, cluster["id"], ENDED_CLUSTER_STATES, quiet=args.json, collection="clusters", ended=ENDED_CLUSTER_STATES)
    if args.json:
        print_json(cluster)
    else:
        ended = cluster["state"] in ENDED_CLUSTER_STATES
        print(f"{cluster['id']} {cluster['state']}" + ("" if ended else "; every node's GPUs are freed once its host confirms"))
    return 0


def node_arg(text: str) -> int:
    match = NODE_RE.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a node: {text!r} (node-0, node-1, …; `gpumarket cluster show CLUSTER` lists them)")
    return int(match[1])


async def cmd_ssh_node(args: argparse.Namespace, client: Client) -> int:
    cluster: dict[str, Any] = await client.get(f"/clusters/{args.cluster}")
    member = next((m for m in cluster.get("members") or [] if m["node_rank"] == args.node), None)
    if member is None:
        raise UsageError(f"cluster {cluster['id']} has nodes node-0 to {node_name(cluster['node_count'] - 1)}, "
                         f"not {node_name(args.node)}; `gpumarket cluster show {cluster['id']}` lists them")  # fmt: skip
    if member["state"] != "running":
        raise CliError(f"{node_name(args.node)} of cluster {cluster['id']} ({member['rental_id']}) is {member['state']}, "
                       f"not running; `gpumarket cluster show {cluster['id']}` shows its state")  # fmt: skip
    args.rental = member["rental_id"]
    return await cmd_ssh(args, client)


# ---- parsers ------------------------------------------------------------------------------------

CREATE_EPILOG = f"""\
Every node runs the same thing: a template, an image, or nothing (a hold, the default), with
MASTER_ADDR=node-0, MASTER_PORT, WORLD_SIZE, RANK, NODE_RANK and LOCAL_WORLD_SIZE in its
environment. Templates: {TEMPLATES_HINT}. The nodes are placed together or not at all, each on
a host of its own, all of one GPU model unless --allow-mixed. With --queue a cluster that does not
fit now waits (as one, queued among rentals) until the hosts are free or its queue timeout passes.
It waits until every node runs, with a progress line on stderr (Ctrl-C stops waiting, not the
cluster), then prints the cluster's id, state and price per hour; exit status 1 if it failed.
Each invocation sends its own Idempotency-Key: a retried call never creates two clusters.

examples:
  gpumarket cluster create --nodes 2 --gpus-per-node 8 --model H100 --template pytorch
  gpumarket cluster create --nodes 4 --gpus-per-node 1 --image pytorch/pytorch:latest --command 'torchrun train.py'
  gpumarket cluster create --nodes 3 --gpus-per-node 1 --allow-mixed --max-price 0.50 --no-wait --json
  gpumarket cluster create --nodes 3 --gpus-per-node 8 --model H100 --queue
  gpumarket cluster create --nodes 2 --gpus-per-node 1 --template demo --volume 'ckpt-{{rank}}:/ckpt'"""

SSH_EPILOG = """\
NODE is node-0, node-1, … (or just its rank). Options before CLUSTER (-i, -o, -q, -v,
--dry-run) and everything after NODE go as with `gpumarket ssh`: the node is a rental of its
own, reached through its relay with its host key pinned. The nodes of a cluster that holds GPUs
and runs nothing have nothing to log into.

examples:
  gpumarket cluster ssh c-0123456789abcdef node-0
  gpumarket cluster ssh c-0123456789abcdef node-1 nvidia-smi
  gpumarket cluster ssh -i ~/.ssh/id_ed25519 c-0123456789abcdef node-0
  gpumarket cluster ssh c-0123456789abcdef 1 -- -L 6006:localhost:6006"""


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cluster`` and its actions to ``gpumarket``'s subparsers."""
    formatter = argparse.RawDescriptionHelpFormatter
    actions = command_group(sub, "cluster", help="rent, list, show, stop and ssh into clusters (several hosts as one)",
                            description="Clusters: NODES nodes of GPUS-PER-NODE GPUs, each on a host of its own, created and "
                            "stopped as one.", examples=["create --nodes 2 --gpus-per-node 4 --model A100", "list",
                                                         "show c-0123456789abcdef", "stop c-0123456789abcdef"])  # fmt: skip

    create = actions.add_parser("create", help="rent a cluster and wait until every node runs", formatter_class=formatter,
                                description="Rent NODES nodes of GPUS-PER-NODE whole GPUs each, on distinct hosts, all "
                                "running the same template, image, or nothing (a hold).", epilog=CREATE_EPILOG)  # fmt: skip
    create.add_argument("--nodes", type=positive_int, required=True, metavar="N", help="nodes, 2 to 64, each on its own host")
    create.add_argument("--gpus-per-node", type=positive_int, default=1, metavar="G", help="whole GPUs on each node (default 1)")
    create.add_argument("--model", metavar="M", help="GPU model words, e.g. 'H100' or 'A100 80GB'")
    create.add_argument("--allow-mixed", action="store_true", help="let nodes have different GPU models")
    create.add_argument("--max-price", type=usd, metavar="USD", help="at most this price per GPU-hour on every node")
    what = create.add_mutually_exclusive_group()
    what.add_argument("--template", metavar="T", help=f"run a template on every node: {TEMPLATES_HINT}")
    what.add_argument("--image", metavar="REF", help="run this container image on every node")
    create.add_argument("--command", metavar="CMD", help="with --image: the command, replacing the image's entrypoint")
    add_volume_option(create, "each member: NAME has {rank}, member r mounts its own (ckpt-{rank}:/ckpt)")
    add_price_tolerance_option(create, "the cluster (the set of hosts whose dearest costs least)")
    add_network_bounds(create)
    create.add_argument("--queue", action="store_true", help="wait (the whole cluster, as one) when the hosts are busy now")
    create.add_argument("--no-wait", action="store_true", help="print the cluster as created, do not wait until it runs")
    finish(create, cmd_create, json="the cluster's JSON (no progress lines)")

    listing = actions.add_parser("list", help="your clusters", formatter_class=formatter,
                                 description="Your active clusters (pending, starting, running, degraded, stopping), newest first, "
                                 "with nodes, GPUs, model and the whole cluster's price per hour.",
                                 epilog="examples:\n  gpumarket cluster list\n  gpumarket cluster list --all --json")  # fmt: skip
    listing.add_argument("--all", action="store_true", help="ended clusters too")
    finish(listing, cmd_list, json="the clusters' JSON")

    show = actions.add_parser("show", help="one cluster: its nodes and events", formatter_class=formatter,
                              description="One cluster: size, state, price, each node (rank, name, rental, host, region, "
                              "state, GPUs) and its state history.",
                              epilog="examples:\n  gpumarket cluster show c-0123456789abcdef\n  gpumarket cluster show c-0123456789abcdef --json")  # fmt: skip
    show.add_argument("cluster", metavar="CLUSTER", help="the cluster's id")
    finish(show, cmd_show, json="the cluster's JSON")

    stop = actions.add_parser("stop", help="stop every node of a cluster", formatter_class=formatter,
                              description="Stop a cluster: every node's workload is stopped and billing ends; it is stopped "
                              "when every host has confirmed.",
                              epilog="examples:\n  gpumarket cluster stop c-0123456789abcdef\n  gpumarket cluster stop c-0123456789abcdef --wait")  # fmt: skip
    stop.add_argument("cluster", metavar="CLUSTER", help="the cluster's id")
    stop.add_argument("--wait", action="store_true", help="wait until every node has stopped")
    finish(stop, cmd_stop, json="the cluster's JSON")

    ssh = actions.add_parser("ssh", help="open a shell (or run a command) on one node", formatter_class=formatter,
                             description="Run the system ssh to one running node of a cluster (`gpumarket ssh` to "
                             "that node's rental).", epilog=SSH_EPILOG)  # fmt: skip
    common_options(ssh)
    add_ssh_options(ssh, "ssh")
    ssh.add_argument("cluster", metavar="CLUSTER", help="the cluster's id")
    ssh.add_argument("node", type=node_arg, metavar="NODE", help="node-0, node-1, … (or the rank)")
    ssh.add_argument("ssh_args", nargs=argparse.REMAINDER, metavar="SSH ARGS", help="ssh's own options, then a command")
    set_command(ssh, cmd_ssh_node)
