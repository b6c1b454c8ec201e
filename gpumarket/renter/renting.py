"""What ``gpumarket rent`` asks for, and waiting until it runs: the ``POST /rentals`` body of its options, the
container workload of ``--image`` (also a cluster's and a service's), ``--interruptible --bid`` and ``--volume``, and
``wait_for``, the poll with progress lines that ``rent``, ``stop --wait`` and ``cluster`` share.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import time
from collections.abc import Mapping, Sequence
from typing import Any

from gpumarket.renter.api import Client, UsageError
from gpumarket.renter.options import price_tolerance, usd
from gpumarket.renter.outcome import ENDED_STATES
from gpumarket.renter.output import err

# How often `rent`, `stop --wait` and `logs -f` ask the API again.
POLL_INTERVAL_S = 1.0


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
    parser.add_argument("--bid", type=usd, metavar="USD", help=f"the most you pay per GPU-hour for {what}: "
                        "at least the host's minimum bid; you are charged the lower of the bid and the GPU's on-demand price")  # fmt: skip


def add_price_tolerance_option(parser: argparse.ArgumentParser, what: str) -> None:
    """``--price-tolerance T``, read by ``price_tolerance_fields``."""
    parser.add_argument("--price-tolerance", type=price_tolerance, metavar="T", help=f"the renter's price first: {what} "
                        "goes to the cheapest offers that fit, and the placer chooses among those at most T above the "
                        "cheapest (0.05 or 5%%; 0: the cheapest only). Default: the platform's (5 %%) when no --model is "
                        "named; with a --model, the placer's choice among that model's offers")  # fmt: skip


def price_tolerance_fields(args: argparse.Namespace) -> dict[str, str]:
    return {} if args.price_tolerance is None else {"price_tolerance": args.price_tolerance}


def volume_mount(text: str) -> dict[str, Any]:
    """``--volume NAME:/MOUNT[:ro]`` as a request's volume entry (``{"name" | "id", "mount", "read_only"}``)."""
    name, sep, rest = text.partition(":")
    mount, _, flag = rest.partition(":")
    if not name or not sep or not mount.startswith("/") or flag not in ("", "ro", "rw"):
        raise argparse.ArgumentTypeError(f"--volume takes NAME:/MOUNT or NAME:/MOUNT:ro, e.g. data:/data, not {text!r:.80}")
    entry: dict[str, Any] = {"id" if name.startswith("vol-") else "name": name, "mount": mount}
    if flag == "ro":
        entry["read_only"] = True
    return entry


def add_volume_option(parser: argparse.ArgumentParser, what: str) -> None:
    """``--volume NAME:/MOUNT[:ro]`` (repeatable), read as ``args.volume``: the renter's volumes ``what`` mounts."""
    parser.add_argument("--volume", type=volume_mount, action="append", default=[], metavar="NAME:/MOUNT[:ro]",
                        help=f"mount one of your volumes (`gpumarket volume list`) in {what}, read-only with :ro; "
                        "it then runs on the volume's host (repeatable; docs/volumes.md)")  # fmt: skip


def rental_body(args: argparse.Namespace) -> dict[str, Any]:
    """The ``POST /rentals`` body of ``gpumarket rent``'s options; ``UsageError`` for options that do not go together."""
    body: dict[str, Any] = {"gpu_count": args.gpus}
    if args.mig:
        if args.gpus != 1:
            raise UsageError("--mig rents one MIG instance: leave out --gpus")
        body["mig_profile"] = args.mig
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
    if args.volume:
        if not args.image and not args.template:
            raise UsageError("--volume mounts into a container: add --template or --image (a hold runs nothing to mount it in)")
        body["volumes"] = args.volume
    body.update(interruptible_fields(args, "an interruptible rental"))
    body.update(price_tolerance_fields(args))
    if args.queue:
        body["queue"] = True
    if getattr(args, "restart_on_failure", False):
        body["restart_on_failure"] = True
    if getattr(args, "failover_after", None) is not None:
        body["failover_after_s"] = args.failover_after
    return body


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
                err(_progress_line(rental, event.get("to") or rental["state"], event.get("cause"), started))
            if not fresh and rental["state"] != last_state:
                err(_progress_line(rental, rental["state"], None, started))
        # The state shown last: a poll can see an event before the rental's own state has moved to it (the answer's
        # two reads straddled the change); the next poll's state is then no news.
        last_state = (fresh[-1].get("to") or rental["state"]) if fresh else rental["state"]
        if rental["state"] in until or rental["state"] in ended:
            return rental
        await asyncio.sleep(POLL_INTERVAL_S)
