"""``gpumarket offers``: the offers renters search (``GET /offers``), and with ``--nodes`` the groups of hosts a cluster
could go to now, at the whole cluster's price (``GET /offers/clusters``)."""

from __future__ import annotations

import argparse
from typing import Any

from gpumarket.renter.api import Client, UsageError
from gpumarket.renter.options import network_bounds
from gpumarket.renter.output import err, gib, money, money_column, print_json, table

OFFERS_EPILOG = """\
The query language: space-separated 'field op value' terms, all ANDed; fields gpu_name,
num_gpus, vram (GiB), compute_capability, cuda_driver_version, price (USD per GPU-hour),
price_per_score, region, tier, score, reliability, download_mbps, upload_mbps, verified,
isolated; ops = != < <= > >= (docs/marketplace.md).

VERIFIED: yes when the platform's GPU challenge proved every GPU of the host within the last
7 days, with the measured median and the model's expected TFLOP/s (yes 160/198TF); failed when
a GPU failed its last challenge; no otherwise. --verified (or verified=true) shows only those
(docs/verification.md).

STORAGE: what the host lends to volumes (`gpumarket volume create`): the GiB still free and
the price per GiB-hour (64G $0.0002); - where it lends none (docs/volumes.md).

FREE counts whole GPUs; a GPU in MIG mode never rents whole: MIG lists its free instances per
profile (3g.40gb x1), which `gpumarket rent OFFER_ID --mig 3g.40gb` rents one at a time.

With --nodes N, the same filters price a cluster (`gpumarket cluster create`): each group of
hosts placement could take N nodes of --gpus GPUs from (one GPU model and region; across
regions where no region has room; any model with --allow-mixed), with the whole cluster's
price per hour on its cheapest and its dearest hosts (docs/clusters.md).

examples:
  gpumarket offers
  gpumarket offers 'vram>=24 price<=0.5' --sort price
  gpumarket offers gpu_name=RTX_4090 num_gpus>=2 --isolated --json
  gpumarket offers --verified 'vram>=80'
  gpumarket offers --nodes 4 --gpus 2 'gpu_name=A100 reliability>=0.95'
  gpumarket offers --nodes 8 --allow-mixed --json"""


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
        print_json(body)
        return 0
    items: list[dict[str, Any]] = body["items"]
    if not items:
        print(f"no offers match{' ' + repr(body.get('query')) if body.get('query') else ''}; loosen the query or try later")
        return 0
    prices = money_column([o.get("price_per_gpu_hour") for o in items], "rate")
    rows = [
        [
            o["gpu_name"], str(o["num_gpus"]), mig_column(o), gib(o.get("vram_mib")), price, o.get("region") or "-", o.get("tier") or "-",
            f"{o['reliability']:.3f}" if isinstance(o.get("reliability"), int | float) else "-",
            _isolation(o.get("isolation")), storage_column(o), verified_column(o), o["id"],
        ]
        for o, price in zip(items, prices, strict=True)
    ]  # fmt: skip
    print(table(["MODEL", "FREE", "MIG", "VRAM", "$/GPU-H", "REGION", "TIER", "RELIAB", "ISOLATION", "STORAGE", "VERIFIED", "OFFER"],
                rows))  # fmt: skip
    shown = len(items) + int(body.get("offset", 0))
    if body.get("total", 0) > shown:
        err(f"{len(items)} of {body['total']} offers; more with --limit (up to 500) or a narrower query")
    return 0


def _offer_filters(args: argparse.Namespace) -> dict[str, str | int]:
    """The query words (``q``) and ``--isolated`` of ``gpumarket offers``, as both offer routes take them."""
    params: dict[str, str | int] = {}
    query = " ".join(args.query).strip()
    if query:
        params["q"] = query
    if args.isolated:
        params["isolated"] = "true"
    if args.verified:
        params["verified"] = "true"
    return params


def storage_column(offer: dict[str, Any]) -> str:
    """What the host lends to volumes (docs/volumes.md): the GiB free and the price per GiB-hour, e.g. ``64G $0.0002``."""
    free = offer.get("volume_gib_free") or 0
    if not free or not offer.get("storage_price_per_gib_hour"):
        return "-"
    return f"{free}G {money(offer['storage_price_per_gib_hour'], 'rate')}"


def verified_column(offer: dict[str, Any]) -> str:
    """VERIFIED: ``yes`` with the measured median / expected TFLOP/s (``yes 160/198TF``) when the GPU challenge proved
    the host recently; ``failed`` when one of the offer's GPUs failed its last challenge; ``no`` otherwise (never
    challenged, or its pass is stale)."""
    proof = offer.get("verification") or {}
    if offer.get("verified"):
        measured, expected = proof.get("tflops_median"), proof.get("tflops_expected")
        if isinstance(measured, int | float):
            return f"yes {measured:.0f}/{expected:.0f}TF" if isinstance(expected, int | float) else f"yes {measured:.0f}TF"
        return "yes"
    return "failed" if proof.get("gpus_failed") else "no"


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
        print_json(body)
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
    err(f"the whole cluster ({args.nodes} x {gpus} GPU{'' if gpus == 1 else 's'}) per hour on the cheapest and the dearest "
         "hosts of each group: placement picks the hosts (one region first), not the price")  # fmt: skip
    if body.get("truncated"):
        err(f"priced from the cheapest {body['offers_considered']} of {body['offers_matching']} offers; a narrower query prices them all")
    shown = len(items) + int(body.get("offset", 0))
    if body.get("total", 0) > shown:
        err(f"{len(items)} of {body['total']} groups; more with --limit (up to 500) or a narrower query")
    return 0


def mig_column(offer: dict[str, Any]) -> str:
    """An offer's free MIG instances per profile (``3g.40gb x1 1g.10gb x2``), or ``-`` when it has none."""
    return " ".join(f"{m['profile']} x{m['free']}" for m in offer.get("mig") or ()) or "-"


def _isolation(view: Any) -> str:
    if not isinstance(view, dict):
        return "unknown"
    kinds = ",".join(k for k in view.get("kinds", []) if k != "hold") or "hold"
    return f"{kinds}" if view.get("isolated") else f"{kinds} (not isolated)"
