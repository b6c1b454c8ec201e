"""Offer search at scale: p50/p99 of ``GET /offers`` queries over 100,000 listed GPUs on PostgreSQL.

A fresh database gets ``--gpus`` GPUs (default 100,000: 12,500 hosts × 8) of six models with
their tiers and performance scores, four regions, reliability and measured network on every
host, compute capability and CUDA version in each GPU's info as the agent reports them,
listings on 70 % of the hosts (prices within the tier bounds, a few in a maintenance window
now), and 10 % of the GPUs rented (not offered). After ``ANALYZE``, each query below runs
``--repeat`` times (after two warm-up runs) through ``master.services.offers.search_offers``
— the code behind ``GET /api/v1/offers`` — and the run prints p50, p99 and the worst time per
query and the p99 over all of them.

Baseline, same run: a hand-written SQL listing 50 free GPUs joined to their hosts, with no
filters, grouping or pricing — the floor for answering anything from that fleet.

Usage: ``python bench/bench_offers.py [--gpus N] [--repeat N] [--admin-url URL] [--json FILE]``

Measured 2026-11-22 on the development VM (AMD EPYC, 2 cores, PostgreSQL 15): see the
README's performance table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from _common import Progress, describe_machine, fresh_database
from sqlalchemy import insert, select

from master.db import Database
from master.models import Account, Gpu, Host, HostListing, Rental, version_key
from master.offerquery import parse
from master.services.offers import OfferSearch, Sort, search_offers

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
# name, memory MiB, tier, score, compute capability, price range (cents per GPU-hour)
MODELS = (
    ("NVIDIA H100 80GB HBM3", 81559, "flagship", 100.0, "9.0", (200, 400)),
    ("NVIDIA A100-SXM4-80GB", 81920, "datacenter", 62.0, "8.0", (90, 200)),
    ("NVIDIA L40S", 46068, "datacenter", 55.0, "8.9", (70, 150)),
    ("NVIDIA GeForce RTX 4090", 24564, "prosumer", 48.0, "8.9", (25, 70)),
    ("NVIDIA GeForce RTX 3090", 24576, "prosumer", 30.0, "8.6", (15, 40)),
    ("NVIDIA GeForce RTX 3080", 10240, "consumer", 22.0, "8.6", (5, 20)),
)
REGIONS = ("eu-west", "eu-central", "us-east", "ap-south")
QUERIES: dict[str, tuple[str, Sort]] = {
    "no filter (best score first)": ("", Sort.SCORE),
    "model": ("gpu_name=RTX_4090", Sort.SCORE),
    "4+ GPUs, price cap": ("num_gpus>=4 price<=1.5", Sort.SCORE),
    "the issue's example": ("gpu_name=RTX_4090 num_gpus>=2 reliability>0.98 price<=0.5", Sort.SCORE),
    "region, cheapest first": ("region=eu-west", Sort.PRICE),
    "best value first": ("", Sort.PRICE_PER_PERFORMANCE),
    "tier": ("tier=datacenter", Sort.RELIABILITY),
    "compute capability": ("compute_capability>=8.9", Sort.SCORE),
    "CUDA version and VRAM": ("cuda_driver_version>=12.4 vram>=40", Sort.PRICE),
    "deep page (offset 5,000)": ("", Sort.SCORE),
}


async def seed(db: Database, gpus: int, rng: random.Random) -> dict[str, int]:
    hosts = gpus // 8
    owners = [{"id": f"acct-p{i:04d}", "name": f"provider-{i}", "role": "provider", "created_at": NOW} for i in range(500)]
    renter = {"id": "acct-renter", "name": "renter", "role": "renter", "created_at": NOW}
    host_rows, gpu_rows, listings, rented = [], [], [], []
    for h in range(hosts):
        name, memory, tier, score, capability, (low, high) = MODELS[h % len(MODELS)]
        host_id = f"h-{h:06d}"
        host_rows.append({
            "id": host_id, "owner_id": owners[h % 500]["id"], "state": "online", "region": REGIONS[h % 4], "created_at": NOW,
            "state_changed_at": NOW, "reliability": round(rng.uniform(0.9, 1.0), 4),
            "latest_network": {"download_mbps": rng.uniform(50, 5000), "upload_mbps": rng.uniform(20, 2000), "latency_ms": rng.uniform(1, 80)},
        })  # fmt: skip
        if rng.random() < 0.7:
            window = [{"start": "2026-11-22T11:00:00Z", "end": "2026-11-22T13:00:00Z"}] if rng.random() < 0.02 else []
            listings.append({"host_id": host_id, "price_per_gpu_hour": Decimal(rng.randint(low, high)) / 100, "smallest_unit": "gpu",
                             "maintenance_windows": window, "verified": rng.random() < 0.3, "created_at": NOW, "updated_at": NOW})  # fmt: skip
        cuda = rng.choice(("12.2", "12.4", "12.6"))
        for g in range(8):
            gpu_id = f"g-{h:06d}-{g}"
            taken = rng.random() < 0.1
            gpu_rows.append({
                "id": gpu_id, "host_id": host_id, "index": g, "uuid": f"GPU-{h:06d}-{g}", "name": name, "memory_total_mib": memory,
                "tier": tier, "score": score, "info": {"compute_capability": capability, "cuda_driver_version": cuda},
                "compute_capability_key": version_key(capability), "cuda_version_key": version_key(cuda),
                "milli_used": 1000 if taken else 0, "memory_used_mib": memory if taken else 0, "rental_id": None,
            })  # fmt: skip
            if taken:
                rental_id = f"r-{len(rented):06d}"
                gpu_rows[-1]["rental_id"] = rental_id
                rented.append({"id": rental_id, "renter_id": renter["id"], "host_id": host_id, "gpu_count": 1, "gpu_uuids": [],
                               "state": "running", "workload": {}, "spec": {}, "created_at": NOW})  # fmt: skip
    async with db.session() as session:
        await session.execute(insert(Account), [*owners, renter])
    progress = Progress("seeding", len(gpu_rows))
    for chunk in range(0, hosts, 2500):
        async with db.session() as session:
            await session.execute(insert(Host), host_rows[chunk : chunk + 2500])
            hosts_here = {h["id"] for h in host_rows[chunk : chunk + 2500]}
            if part := [r for r in rented if r["host_id"] in hosts_here]:
                await session.execute(insert(Rental), part)
            await session.execute(insert(Gpu), gpu_rows[chunk * 8 : (chunk + 2500) * 8])
        progress.update((chunk + 2500) * 8)
    progress.done()
    async with db.session() as session:
        if listings:
            await session.execute(insert(HostListing), listings)
    async with db.engine.begin() as conn:
        await conn.exec_driver_sql("ANALYZE")
    return {"hosts": hosts, "gpus": len(gpu_rows), "listed_hosts": len(listings), "rented_gpus": len(rented)}


def percentile(times: list[float], pct: float) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


async def measure(db: Database, repeat: int) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for label, (query, sort) in QUERIES.items():
        search = OfferSearch(parse(query), sort=sort, limit=50, offset=5000 if "deep page" in label else 0, now=NOW)
        times: list[float] = []
        total = 0
        for run in range(repeat + 2):
            started = time.perf_counter()
            async with db.session() as session:
                items, total = await search_offers(session, search)
            if run >= 2:
                times.append((time.perf_counter() - started) * 1000)
        results[label] = {"query": query, "sort": sort.value, "matches": total, "returned": len(items),
                          "p50_ms": round(statistics.median(times), 1), "p99_ms": round(percentile(times, 99), 1),
                          "max_ms": round(max(times), 1), "times": times}  # fmt: skip
    return results


async def baseline(db: Database, repeat: int) -> float:
    sql = select(Gpu.id, Gpu.name, Host.region).join(Host, Host.id == Gpu.host_id).where(Gpu.rental_id.is_(None)).limit(50)
    times = []
    for run in range(repeat + 2):
        started = time.perf_counter()
        async with db.session() as session:
            (await session.execute(sql)).all()
        if run >= 2:
            times.append((time.perf_counter() - started) * 1000)
    return percentile(times, 99)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with fresh_database(args.admin_url) as url:
        db = Database(url.replace("postgresql://", "postgresql+asyncpg://", 1))
        try:
            await db.migrate()
            started = time.perf_counter()
            fleet = await seed(db, args.gpus, random.Random(args.seed))
            seeded = time.perf_counter() - started
            queries = await measure(db, args.repeat)
            floor = await baseline(db, args.repeat)
        finally:
            await db.close()
    every = [t for q in queries.values() for t in q.pop("times")]
    return {"fleet": fleet, "seed_s": round(seeded, 1), "queries": queries, "overall_p99_ms": round(percentile(every, 99), 1),
            "baseline_p99_ms": round(floor, 2)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gpus", type=int, default=100_000, help="GPUs in the fleet, 8 per host (default 100,000)")
    parser.add_argument("--repeat", type=int, default=100, help="timed runs of each query (default 100)")
    parser.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres", help="PostgreSQL server to create the throwaway database on")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()
    print(describe_machine())
    result = asyncio.run(run(args))
    fleet = result["fleet"]
    print(f"{fleet['gpus']:,} GPUs on {fleet['hosts']:,} hosts ({fleet['listed_hosts']:,} listed, {fleet['rented_gpus']:,} GPUs rented), "
          f"seeded in {result['seed_s']} s")  # fmt: skip
    print(f"{'query':34} {'matches':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for label, q in result["queries"].items():
        print(f"{label:34} {q['matches']:>8,} {q['p50_ms']:>8} {q['p99_ms']:>8} {q['max_ms']:>8}")
    ratio = result["overall_p99_ms"] / result["baseline_p99_ms"] if result["baseline_p99_ms"] else float("inf")
    print(f"p99 over every query: {result['overall_p99_ms']} ms; baseline (50 free GPUs, plain SQL) p99 {result['baseline_p99_ms']} ms "
          f"({ratio:.0f}×)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
