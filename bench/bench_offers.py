"""Offer search at scale: p50/p99 of ``GET /api/v1/offers`` searches over 100,000 GPUs on PostgreSQL.

What is timed: ``master.services.market.offers.search_offers`` inside ``Database.session()``, exactly what the
``GET /api/v1/offers`` handler runs (``master/api/routes_market.py``), minus HTTP and JSON encoding.
Each search parses its ``q`` with ``master.services.market.query.parse`` once, outside the timing.

Set-up: a throwaway database on the PostgreSQL server of ``--admin-url`` (``gm_bench_<random>``,
created with asyncpg and dropped at the end, on failure too), migrated with the project's Alembic
migrations (``Database.migrate``), then a fleet of ``--gpus`` GPUs (default 100,000: 12,500 hosts × 8)
inserted in bulk (multi-row executemany, a progress line on stderr):

* 14 GPU models with the names, memory and info the agent's simulated backend reports as NVML
  does (``agent.gpu.sim``: compute capability 7.5-12.0, PCIe, clocks), each host's driver and its
  ``cuda_driver_version`` (12.2-12.8), the integer version keys the search filters on; tier, score,
  ``needs_review`` from ``master.services.market.tiers.classify`` with the host's network and reliability, as the
  master ranks them. One host in 16 mixes two models 4 + 4; 0.3 % of GPUs are absent.
* six regions; host states 93 % online (``rented`` when it holds a rental), 4 % offline, 3 % in
  maintenance or faulty; reliability 0.80-1.00 (5 % not scored yet); a measured network on 96 %
  (download log-normal around 800 Mbit/s, 5 % under 100).
* a listing on 70 % of the hosts, priced 0.6-1.5 × its best tier's default within the tier's
  bounds, 25 % verified (every GPU passed its challenge an hour ago), 30 % with a minimum bid;
  2 % in a maintenance window now and 3 % past their ``available_until`` (not offered), 10 % with
  a window coming up. Unlisted hosts are offered
  at their tiers' default prices.
* running rentals (rows in ``rentals`` and ``gpu_allocations``, the GPUs' ``rental_id`` set) of
  1-8 whole GPUs on 30 % of the rentable hosts, about 10.5 % of the GPUs; fractional shares
  (``milli_used`` 500) on one GPU of 3 % of the hosts. Neither is offered.

Then ``ANALYZE``, and ten searches (``QUERIES``: no filter, a model, ``num_gpus`` with a price cap,
the issue's ``gpu_name=RTX_4090 num_gpus>=2 reliability>0.98 price<=0.5``, a region sorted by price,
best value first, a tier sorted by reliability, compute capability, CUDA version with VRAM and
network, a page at offset 5,000) run ``--warmup`` times untimed, then ``--repeat`` times each, round
robin (one of each in turn, so load from elsewhere hits every query alike), timed with
``perf_counter``: p50, p99 (nearest rank) and worst per query, and the p99 over all of them.

Baselines, the same run and the same round robin: a hand-written SQL (``BASELINE_SQL``) that lists 50
free GPUs joined to their hosts, no filter, grouping, pricing or count, through the same
``Database.session()``: the floor for reading anything of this fleet through this stack; and, every
``--reference-every``-th round, each query on the search over GPU rows that ``offer_summary`` replaced
(``tests/offers_reference.py``: one grouped query over ``gpus`` joined to hosts and listings), so the
old path's p99 and the ratio come from the same machine under the same load.

The fleet is inserted with the summary's triggers on (migration 0018), as the master's writes are: the
insert time includes keeping ``offer_summary``.

Correctness, before the timing: every search's total and page must equal an independent evaluation
of the seeded fleet in Python (``expected_offers``: the availability rules, conditions, grouping and
sort order of the offers module's docstring), every returned offer must satisfy each condition
of its query on the fields it shows, and every answer must equal the search over GPU rows. A mismatch
is printed and the exit code is 1.

Usage: ``python bench/bench_offers.py [--gpus 100000] [--repeat 200] [--warmup 5] [--seed 42]
[--reference-every 5] [--admin-url URL] [--json FILE]``; run it with the checkout on ``PYTHONPATH`` (an
installed ``master`` elsewhere would be imported first). The default run took 14.6 minutes on the loaded machine
of 2026-11-26, seeding through the summary's triggers included (3 min 39 s on an idle one before them).

Measured 2026-11-26 on the development VM (Intel Xeon, 2 cores shared with other jobs and a CI run,
CPython 3.11.7, SQLAlchemy 2.1.9, asyncpg 0.32.0, PostgreSQL 15.20 with Debian's defaults), default run,
``PYTHONPATH=. python bench/bench_offers.py``, 14 min 36 s in all, load average 17.6 at the start and 9.1 at
the end (the hand-written baseline's p50 was 8.6 ms, against 1.1 ms on the idle machine of 2026-11-22: every
figure below is inflated by about as much). The fleet as before: 100,000 GPUs on 12,500 hosts, 8,708 listed,
10,505 GPUs rented whole and 314 shared, 11,237 offers; inserted in 362.8 s with the summary's triggers
(376 rows/s under that load), ANALYZE 1.7 s. Every answer agreed with the Python evaluation and with the
search over GPU rows.

==============================  =========================================================  ======  ======  ======  ========  =====
query                           q (sort)                                                   p50 ms  p99 ms  max ms  GPU rows  ratio
                                                                                                                   p99 ms
==============================  =========================================================  ======  ======  ======  ========  =====
no filter                       (score)                                                     116.1   256.9  2358.7     847.0   3.3×
model                           gpu_name=RTX_4090 (score)                                    71.9   168.0   172.0     951.6   5.7×
4+ GPUs, price cap              num_gpus>=4 price<=1.5 (score)                              111.3   256.0   301.6    1274.5   5.0×
the issue's example             gpu_name=RTX_4090 num_gpus>=2 reliability>0.98 price<=0.5    65.0   160.3   176.9     746.9   4.7×
region, cheapest first          region=eu-west (price)                                       67.0   210.1   220.4     689.7   3.3×
best value first                (price_per_performance)                                     126.8   270.3  1280.8     891.9   3.3×
tier, most reliable first       tier=datacenter (reliability)                                81.2   221.5   280.9     717.0   3.2×
compute capability              compute_capability>=8.9 (score)                              94.9   240.3  1817.2    1046.3   4.4×
CUDA, VRAM and network          cuda_driver_version>=12.4 vram>=40 download_mbps>=500        80.5   180.2  1728.1     875.5   4.9×
deep page                       offset 5,000 (score)                                        216.2   507.6  1736.9    1057.8   2.1×
baseline: 50 free GPUs, SQL     ``BASELINE_SQL``                                              8.60   37.85   63.50         -      -
==============================  =========================================================  ======  ======  ======  ========  =====

p99 over all 2,000 searches: 345.6 ms, 9.1× the baseline's p99 (the search over GPU rows, 40 runs per query in
the same rounds: 1,048.1 ms, 27.7× the baseline, 3.0× the summary's). On 2026-11-22's idle machine the search over
GPU rows was 90× the baseline (p99 129.7 ms, baseline 1.44 ms); at the same 9.1× the summary's p99 would be about
13 ms there. That is an estimate from ratios, not a measurement: this machine was not idle on 2026-11-26.

Where the time goes (``EXPLAIN ANALYZE``): the statement reads the ~12,500 summary rows (about 300 bytes each, no
GPU info JSON), keeps the ~11,200 offered ones, counts them (``WindowAgg``) and keeps the page with a top-N heap
sort; the models of several kinds are found through the partial index ``ix_offer_summary_several`` (none in this
fleet); the page's 50 hosts are read by primary key and the listings by a hash join. The deep page sorts 5,050 rows
instead of 50, hence its higher figures. Before the summary, every search read the whole ``gpus`` heap (79 MB for
100,000 rows with their info JSON), joined ~80,000 free GPU rows to hosts and listings and grouped them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import operator
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

import asyncpg
from sqlalchemy import insert, text

from agent.gpu.sim import SIM_MODELS, SimulatedBackend
from master.db import Database
from master.models import Account, Gpu, GpuAllocation, Host, HostListing, Rental, version_key
from master.services.lifecycle.hosts import RENTABLE_STATES
from master.services.market.listings import TIER_ORDER, PriceBounds, load_price_bounds, window_time
from master.services.market.offers import DEFAULT_ORDER, OfferSearch, Sort, search_offers
from master.services.market.placement import model_matches
from master.services.market.query import Condition, Op, Version, parse
from master.services.market.tiers import Tier, classify
from shared import protocol

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Progress, describe_machine, fresh_database, quantile, record

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.offers_reference import reference_search

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)  # the searches' "now": windows and end dates are relative to it
GPUS_PER_HOST = 8
PAGE = 50
INSERT_CHUNK = 4_000  # rows per executemany
ADMIN_DEFAULT = os.environ.get("GPUMARKET_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")

# How often each simulated model comes up, per 21 hosts (host n gets MODEL_CYCLE[n % 21]): a fleet of 21 hosts
# already has every model, and the mix leans to what peer-to-peer markets list most (RTX 4090s, then A100/H100).
MODEL_CYCLE = (
    "RTX4090", "A100-80GB", "RTX3090", "H100", "L40S", "RTX4090", "RTX3060", "A10", "RTX5090", "RTX4090",
    "H100", "T4", "RTX3090", "A100-40GB", "L4", "RTX4090", "RTX6000ADA", "A100-80GB", "L40S", "RTXA4000", "H200",
)  # fmt: skip
REGION_CYCLE = ("us-east", "eu-west", "us-west", "eu-central", "us-east", "ap-south", "eu-west", "us-west",
                "eu-central", "us-east", "ap-northeast")  # fmt: skip
DRIVERS = (("535.183.01", "12.2"), ("550.127.05", "12.4"), ("560.35.03", "12.6"), ("570.124.06", "12.8"))


class Query(NamedTuple):
    label: str
    q: str  # the query language, as GET /api/v1/offers?q= takes it
    sort: Sort
    offset: int = 0


QUERIES = (
    Query("no filter (best score first)", "", Sort.SCORE),
    Query("model", "gpu_name=RTX_4090", Sort.SCORE),
    Query("4+ GPUs, price cap", "num_gpus>=4 price<=1.5", Sort.SCORE),
    Query("the issue's example", "gpu_name=RTX_4090 num_gpus>=2 reliability>0.98 price<=0.5", Sort.SCORE),
    Query("region, cheapest first", "region=eu-west", Sort.PRICE),
    Query("best value first", "", Sort.PRICE_PER_PERFORMANCE),
    Query("tier, most reliable first", "tier=datacenter", Sort.RELIABILITY),
    Query("compute capability", "compute_capability>=8.9", Sort.SCORE),
    Query("CUDA, VRAM and network", "cuda_driver_version>=12.4 vram>=40 download_mbps>=500", Sort.PRICE),
    Query("deep page (offset 5,000)", "", Sort.SCORE, 5_000),
)
BASELINE_SQL = (
    "SELECT gpus.id, gpus.name, gpus.memory_total_mib, hosts.id AS host_id, hosts.region "
    "FROM gpus JOIN hosts ON hosts.id = gpus.host_id WHERE gpus.rental_id IS NULL LIMIT 50"
)


# ---- the fleet: rows built in Python, inserted in bulk, and kept to check the searches against -------------------


@dataclass
class Fleet:
    accounts: list[dict[str, Any]] = field(default_factory=list)
    hosts: list[dict[str, Any]] = field(default_factory=list)
    gpus: list[dict[str, Any]] = field(default_factory=list)
    listings: list[dict[str, Any]] = field(default_factory=list)
    rentals: list[dict[str, Any]] = field(default_factory=list)
    allocations: list[dict[str, Any]] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {
            "hosts": len(self.hosts),
            "gpus": len(self.gpus),
            "listed_hosts": len(self.listings),
            "rentals": len(self.rentals),
            "rented_gpus": sum(1 for g in self.gpus if g["rental_id"] is not None),
            "shared_gpus": sum(1 for g in self.gpus if g["rental_id"] is None and g["milli_used"] > 0),
            "absent_gpus": sum(1 for g in self.gpus if not g["present"]),
            "models": len({g["name"] for g in self.gpus}),
            "regions": len({h["region"] for h in self.hosts}),
            "rows": sum(len(rows) for rows in (self.accounts, self.hosts, self.gpus, self.listings, self.rentals, self.allocations)),
        }


def _info_templates() -> dict[str, dict[str, Any]]:
    """Each simulated model's GPU info as the master stores it from a hello (``GpuInfoModel`` dumped to JSON)."""
    return {
        model.key: protocol.GpuInfoModel.model_validate(
            SimulatedBackend(f"sim:1x{model.key}", seed="bench-offers").gpus()[0].to_wire()
        ).model_dump(mode="json")
        for model in SIM_MODELS.values()
    }


def _network(rng: random.Random) -> dict[str, Any] | None:
    if rng.random() < 0.04:
        return None  # never measured
    download = min(10_000.0, rng.lognormvariate(math.log(800), 0.9))
    latency = rng.uniform(2, 120)
    return {
        "relay_url": "wss://relay-1.gpumarket.test/agent", "measured_at": (NOW - timedelta(hours=rng.uniform(0, 24))).isoformat(),
        "download_mbps": round(download, 1), "upload_mbps": round(download * rng.uniform(0.2, 1.0), 1),
        "download_bytes": int(download * 1_250_000), "upload_bytes": int(download * 600_000), "latency_ms": round(latency, 2),
        "min_rtt_ms": round(latency * 0.9, 2), "max_rtt_ms": round(latency * 1.4, 2), "jitter_ms": round(rng.uniform(0.1, 8), 2),
        "jitter_rfc3550_ms": round(rng.uniform(0.1, 5), 2), "loss": 0.0 if rng.random() < 0.9 else 0.01,
        "probes_sent": 20, "probes_answered": 20, "duration_s": 10.0,
    }  # fmt: skip


def _window(start: datetime, hours: float) -> dict[str, str]:
    return {"start": window_time(start), "end": window_time(start + timedelta(hours=hours), round_up=True)}


def _listing(host_id: str, tiers: Iterable[str | None], rng: random.Random, bounds: PriceBounds) -> dict[str, Any]:
    present = set(tiers)
    best = next(t for t in TIER_ORDER if t.value in present)
    limits = bounds[best]
    price = min(limits.max, max(limits.min, limits.default * Decimal(str(round(rng.uniform(0.6, 1.5), 3)))))
    price = price.quantize(Decimal("0.001"), rounding=ROUND_HALF_UP)
    roll = rng.random()
    windows: list[dict[str, str]] = []
    available_until = None
    if roll < 0.02:
        windows = [_window(NOW - timedelta(hours=1), 3)]  # in maintenance now: not offered
    elif roll < 0.05:
        available_until = NOW - timedelta(days=rng.randint(1, 30))  # ended: not offered
    elif roll < 0.15:
        windows = [_window(NOW + timedelta(days=rng.randint(1, 20)), 6)]  # coming up: offered, shown
    elif roll < 0.25:
        available_until = NOW + timedelta(days=rng.randint(7, 90))
    return {
        "host_id": host_id, "price_per_gpu_hour": price,
        "min_bid_per_gpu_hour": (price * Decimal("0.7")).quantize(Decimal("0.001")) if rng.random() < 0.3 else None,
        "smallest_unit": "milli:500" if rng.random() < 0.05 else "gpu", "available_until": available_until,
        "maintenance_windows": windows, "verified": rng.random() < 0.25, "created_at": NOW, "updated_at": NOW,
    }  # fmt: skip


def build_fleet(gpus: int, *, seed: int = 42) -> Fleet:
    """``gpus // 8`` hosts of 8 GPUs with everything ``search_offers`` reads; the same fleet for the same seed."""
    rng = random.Random(seed)
    bounds = load_price_bounds()
    infos = _info_templates()
    hosts = gpus // GPUS_PER_HOST
    fleet = Fleet()
    providers = [f"acct-provider-{n:04d}" for n in range(max(1, hosts // 25))]
    renters = [f"acct-renter-{n:04d}" for n in range(max(1, hosts // 60))]
    for role, ids in (("provider", providers), ("renter", renters)):
        fleet.accounts += [{"id": i, "name": i.removeprefix("acct-"), "role": role, "created_at": NOW} for i in ids]
    for number in range(hosts):
        host_id = f"h-{number:06d}"
        roll = rng.random()
        state = "online" if roll < 0.93 else "offline" if roll < 0.97 else "maintenance" if roll < 0.99 else "faulty"
        reliability = None if rng.random() < 0.05 else round(1 - min(0.2, rng.betavariate(1.2, 40)), 4)
        network = _network(rng)
        driver, cuda = DRIVERS[rng.randrange(len(DRIVERS))]
        first = MODEL_CYCLE[number % len(MODEL_CYCLE)]
        if first == "RTX5090":
            driver, cuda = DRIVERS[-1]  # Blackwell needs the R570 branch
        second = MODEL_CYCLE[(number + 7) % len(MODEL_CYCLE)]
        keys = [first] * 4 + [second] * 4 if number % 16 == 15 and second != first else [first] * GPUS_PER_HOST
        host = {
            "id": host_id, "owner_id": providers[number % len(providers)], "name": f"rig-{number:06d}", "state": state,
            "state_changed_at": NOW - timedelta(hours=rng.uniform(1, 500)), "region": REGION_CYCLE[number % len(REGION_CYCLE)],
            "relay_id": f"relay-{number % 4}", "agent_version": "0.1.0", "gpu_backend": "nvml", "facts": {"hostname": f"rig-{number:06d}"},
            "last_seen_at": NOW - timedelta(seconds=rng.uniform(0, 10)) if state != "offline" else NOW - timedelta(hours=2),
            "latest_network": network, "reliability": reliability, "reliability_at": None if reliability is None else NOW,
            "created_at": NOW - timedelta(days=rng.randint(1, 400)),
        }  # fmt: skip
        down = None if network is None else float(network["download_mbps"])
        gpu_rows: list[dict[str, Any]] = []
        classified: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
        for index, key in enumerate(keys):
            if key not in classified:
                model = SIM_MODELS[key]
                info = dict(infos[key], driver_version=driver, cuda_driver_version=cuda)
                result = classify(model.name, model.memory_total_mib, max_sm_clock_mhz=model.max_sm_clock_mhz,
                                  pcie_gen=model.pcie_gen_max, pcie_width=model.pcie_width_max,
                                  network_down_mbps=down, reliability=reliability)  # fmt: skip
                columns = {
                    "name": model.name, "memory_total_mib": model.memory_total_mib, "tier": str(result.tier),
                    "score": result.score, "model_key": result.model_key, "needs_review": result.needs_review,
                    "classification": {"reasons": list(result.reasons)},
                    "compute_capability_key": version_key(info["compute_capability"]), "cuda_version_key": version_key(cuda),
                }  # fmt: skip
                classified[key] = (info, columns)
            info, columns = classified[key]
            uuid = f"GPU-{number:08x}-{index:04x}-bench"
            gpu_rows.append({
                "id": f"gpu-{number:06d}-{index}", "host_id": host_id, "index": index, "uuid": uuid,
                "info": dict(info, index=index, uuid=uuid, pci_bus_id=f"00000000:{0x01 + 0x10 * index:02X}:00.0"),
                "present": rng.random() >= 0.003, "rental_id": None, "milli_used": 0, "memory_used_mib": 0, **columns,
                "verification_outcome": None, "verified_at": None,
            })  # fmt: skip
        if state in RENTABLE_STATES and rng.random() < 0.30:
            free = [g for g in gpu_rows if g["present"]]
            count = min(len(free), rng.choice((1, 1, 2, 2, 4, 8)))
            if count:
                _rent(fleet, host_id, free[:count], renters[number % len(renters)], milli=1000, rng=rng)
                host["state"] = "rented"
        if state in RENTABLE_STATES and rng.random() < 0.03:
            shared = [g for g in gpu_rows if g["present"] and g["rental_id"] is None]
            if shared:
                _rent(fleet, host_id, shared[-1:], renters[(number + 1) % len(renters)], milli=500, rng=rng)
                host["state"] = "rented"
        if rng.random() < 0.70:
            fleet.listings.append(_listing(host_id, (g["tier"] for g in gpu_rows if g["present"]), rng, bounds))
            if fleet.listings[-1]["verified"]:
                # Verified as the GPU challenge leaves it: every GPU passed, recently (master/services/market/proven.py).
                for gpu in gpu_rows:
                    gpu.update(verification_outcome="passed", verified_at=NOW - timedelta(hours=1))
        fleet.hosts.append(host)
        fleet.gpus.extend(gpu_rows)
    return fleet


def _rent(fleet: Fleet, host_id: str, gpus: Sequence[dict[str, Any]], renter: str, *, milli: int, rng: random.Random) -> None:
    """A running rental of ``gpus``: whole (``rental_id`` set) or a share of each (``milli_used``), as allocation.py claims."""
    rental_id = f"rent-{len(fleet.rentals):07d}"
    started = NOW - timedelta(minutes=rng.randint(5, 5_000))
    fleet.rentals.append({
        "id": rental_id, "renter_id": renter, "host_id": host_id, "gpu_model": gpus[0]["name"], "gpu_count": len(gpus),
        "gpu_uuids": [g["uuid"] for g in gpus], "state": "running", "kind": "on_demand", "gpu_milli": milli,
        "gpu_memory_mib": 0 if milli >= 1000 else gpus[0]["memory_total_mib"] // 2, "spec": {}, "workload": {"image": "pytorch/pytorch"},
        "created_at": started, "started_at": started,
    })  # fmt: skip
    for gpu in gpus:
        whole = milli >= 1000
        memory = gpu["memory_total_mib"] if whole else gpu["memory_total_mib"] // 2
        if whole:
            gpu["rental_id"] = rental_id
        gpu["milli_used"], gpu["memory_used_mib"] = milli, memory
        fleet.allocations.append({"rental_id": rental_id, "gpu_id": gpu["id"], "milli": milli, "memory_mib": memory,
                                  "whole": whole, "created_at": started})  # fmt: skip


async def seed(db: Database, fleet: Fleet) -> None:
    """Insert ``fleet`` in bulk (chunks of ``INSERT_CHUNK`` rows, one transaction each), parents before children."""
    tables = ((Account, fleet.accounts), (Host, fleet.hosts), (Rental, fleet.rentals), (Gpu, fleet.gpus),
              (GpuAllocation, fleet.allocations), (HostListing, fleet.listings))  # fmt: skip
    progress = Progress("seeding rows", sum(len(rows) for _, rows in tables), after=0.5)
    done = 0
    for model, rows in tables:
        for start in range(0, len(rows), INSERT_CHUNK):
            async with db.session() as session:
                await session.execute(insert(model), rows[start : start + INSERT_CHUNK])
            done += len(rows[start : start + INSERT_CHUNK])
            progress.update(done)
    progress.done()


async def analyze(db: Database) -> None:
    async with db.engine.connect() as connection:
        await (await connection.execution_options(isolation_level="AUTOCOMMIT")).exec_driver_sql("ANALYZE")


# ---- what every search should answer, worked out from the fleet in Python ------------------------------------------


class Expected(NamedTuple):
    id: str
    num_gpus: int
    price: Decimal
    score: float | None
    reliability: float | None


_ORDERING = {Op.LT: operator.lt, Op.LE: operator.le, Op.GT: operator.gt, Op.GE: operator.ge}


def _passes(value: Any, op: Op, values: Sequence[Any]) -> bool:
    """One comparison as SQL makes it: an unknown value fails every operator but ``!=``."""
    if op is Op.EQ:
        return value is not None and value in values
    if op is Op.NE:
        return value is None or value not in values
    if value is None:
        return False
    [wanted] = values
    return bool(_ORDERING[op](value, wanted))


def _per_score(price: Decimal, score: float | None) -> float | None:
    return float(price) / score if score is not None and score > 0 else None


def _row_value(name: str, gpu: dict[str, Any], host: dict[str, Any], listing: dict[str, Any] | None, price: Decimal) -> Any:
    network = host["latest_network"] or {}
    return {
        "vram": (gpu["memory_total_mib"] + 512) // 1024, "vram_mib": gpu["memory_total_mib"],
        "compute_capability": gpu["compute_capability_key"], "cuda_driver_version": gpu["cuda_version_key"],
        "price": price, "price_per_score": _per_score(price, gpu["score"]), "region": host["region"], "tier": gpu["tier"],
        "score": gpu["score"], "reliability": host["reliability"], "download_mbps": network.get("download_mbps"),
        "upload_mbps": network.get("upload_mbps"), "verified": bool(listing and listing["verified"]),
    }[name]  # fmt: skip


def _key(condition: Condition) -> list[Any]:
    return [v.key if isinstance(v, Version) else v for v in condition.values]


def _available(listing: dict[str, Any] | None, now: datetime) -> bool:
    if listing is None:
        return True
    if listing["available_until"] is not None and listing["available_until"] <= now:
        return False
    moment = window_time(now)
    return not any(w["start"] <= moment < w["end"] for w in listing["maintenance_windows"])


def _sort_key(sort: Sort, offer: Expected) -> tuple[Any, ...]:
    def best_first(value: float | None) -> tuple[bool, float]:
        return (value is None, -value if value is not None else 0.0)

    def lowest_first(value: Any) -> tuple[bool, Any]:
        return (value is None, value if value is not None else 0)

    per_score = _per_score(offer.price, offer.score)
    primary = {Sort.SCORE: best_first(offer.score), Sort.PRICE: lowest_first(offer.price),
               Sort.PRICE_PER_PERFORMANCE: lowest_first(per_score), Sort.RELIABILITY: best_first(offer.reliability)}[sort]  # fmt: skip
    ties = (() if sort is Sort.SCORE else best_first(offer.score)) + (() if sort is Sort.RELIABILITY else best_first(offer.reliability))
    host_id, gpu_name = offer.id.split(":", 1)
    return (*primary, *ties, host_id, gpu_name)


def expected_offers(fleet: Fleet, search: OfferSearch, *, bounds: PriceBounds | None = None) -> list[Expected]:
    """Every offer ``search`` matches, in its order, by the rules of ``master/services/market/offers.py``'s docstring."""
    if search.order not in (None, DEFAULT_ORDER[search.sort]):
        raise ValueError("the reference knows each sort's default direction only")
    bounds = bounds or load_price_bounds()
    now = search.now or datetime.now(UTC)
    hosts = {h["id"]: h for h in fleet.hosts}
    listings = {row["host_id"]: row for row in fleet.listings}
    rows = [c for c in search.conditions if c.field != "num_gpus"]
    groups: dict[tuple[str, str], list[tuple[dict[str, Any], Decimal]]] = defaultdict(list)
    for gpu in fleet.gpus:
        host = hosts[gpu["host_id"]]
        listing = listings.get(host["id"])
        if host["state"] not in RENTABLE_STATES or not gpu["present"] or gpu["rental_id"] is not None or gpu["milli_used"]:
            continue
        if not _available(listing, now):
            continue
        tier = Tier(gpu["tier"]) if gpu["tier"] else Tier.ENTRY
        price = listing["price_per_gpu_hour"] if listing else bounds[tier].default
        if all(
            (any(model_matches(str(w), gpu["name"]) for w in c.values) is (c.op is Op.EQ)) if c.field == "gpu_name"
            else _passes(_row_value(c.field, gpu, host, listing, price), c.op, _key(c))
            for c in rows
        ):  # fmt: skip
            groups[(host["id"], gpu["name"])].append((gpu, price))
    offers = [
        Expected(f"{host_id}:{name}", len(members), max(p for _, p in members),
                 max((g["score"] for g, _ in members if g["score"] is not None), default=None), hosts[host_id]["reliability"])
        for (host_id, name), members in groups.items()
        if all(_passes(len(members), c.op, c.values) for c in search.conditions if c.field == "num_gpus")
    ]  # fmt: skip
    return sorted(offers, key=lambda offer: _sort_key(search.sort, offer))


def _shown_value(name: str, offer: dict[str, Any]) -> Any:
    """A condition's field as the returned offer shows it (``None`` where the offer shows nothing)."""
    if name in ("compute_capability", "cuda_driver_version"):
        return version_key(offer[name])
    if name == "vram":
        return (offer["vram_mib"] + 512) // 1024
    if name == "price":
        return Decimal(offer["price_per_gpu_hour"])
    shown = {"vram_mib": "vram_mib", "score": "performance_score"}.get(name, name)
    return offer[shown]


def check_page(
    search: OfferSearch, items: Sequence[dict[str, Any]], total: int, expected: Sequence[Expected]
) -> list[str]:
    """What is wrong with one search's answer, against the Python evaluation and its own conditions ([] if nothing)."""
    problems = []
    if total != len(expected):
        problems.append(f"total {total:,}, expected {len(expected):,}")
    want = expected[search.offset : search.offset + search.limit]
    if [item["id"] for item in items] != [offer.id for offer in want]:
        problems.append(f"page {[item['id'] for item in items][:3]}…, expected {[offer.id for offer in want][:3]}…")
    for item, offer in zip(items, want, strict=False):
        if item["id"] == offer.id and (item["num_gpus"], Decimal(item["price_per_gpu_hour"])) != (offer.num_gpus, offer.price):
            problems.append(f"{item['id']}: {item['num_gpus']} GPUs at {item['price_per_gpu_hour']}, expected {offer.num_gpus} at {offer.price}")
    for item in items:
        for condition in search.conditions:
            if condition.field == "gpu_name":
                ok = any(model_matches(str(w), item["gpu_name"]) for w in condition.values) is (condition.op is Op.EQ)
            else:
                ok = _passes(_shown_value(condition.field, item), condition.op, _key(condition))
            if not ok:
                problems.append(f"{item['id']} fails {condition}")
    return problems[:5]


# ---- timing ------------------------------------------------------------------------------------------------------


def figures(times: Sequence[float]) -> dict[str, float]:
    return {"p50_ms": round(quantile(times, 0.5), 2), "p99_ms": round(quantile(times, 0.99), 2),
            "max_ms": round(max(times), 2), "mean_ms": round(sum(times) / len(times), 2)}  # fmt: skip


def searches(queries: Sequence[Query] = QUERIES) -> list[OfferSearch]:
    return [OfferSearch(parse(q.q), sort=q.sort, limit=PAGE, offset=q.offset, now=NOW) for q in queries]


async def check_queries(db: Database, fleet: Fleet, queries: Sequence[Query] = QUERIES) -> list[dict[str, Any]]:
    """Each query once, its answer checked: matches, returned and problems per query."""
    checked = []
    for query, search in zip(queries, searches(queries), strict=True):
        async with db.session() as session:
            items, total = await search_offers(session, search)
        problems = check_page(search, items, total, expected_offers(fleet, search))
        async with db.session() as session:
            if (items, total) != await reference_search(session, search):
                problems.append("differs from the search over GPU rows (tests/offers_reference.py)")
        checked.append({"label": query.label, "q": query.q, "sort": query.sort.value, "offset": query.offset,
                        "matches": total, "returned": len(items), "problems": problems})  # fmt: skip
    return checked


async def time_queries(
    db: Database, *, repeat: int, warmup: int, reference_every: int = 5, queries: Sequence[Query] = QUERIES
) -> tuple[list[list[float]], list[list[float]], list[float]]:
    """Milliseconds of each query's ``repeat`` runs, of its runs on the search over GPU rows (every
    ``reference_every``-th round; 0: never), and of the baseline's, after ``warmup`` untimed rounds."""
    plan = searches(queries)
    times: list[list[float]] = [[] for _ in plan]
    reference: list[list[float]] = [[] for _ in plan]
    baseline: list[float] = []
    sql = text(BASELINE_SQL)
    progress = Progress("timing rounds", warmup + repeat, after=1.0)
    # The fleet this bench keeps for its checks (some 140,000 Python objects) is set aside from the garbage collector
    # while timing: a full collection over it (about 250 ms here) landed in random searches' times (p99 270 ms for
    # one shape whose p50 is 9 ms); a master process holds no such fleet.
    gc.collect()
    gc.freeze()
    try:
        for round_number in range(warmup + repeat):
            for number, search in enumerate(plan):
                started = time.perf_counter()
                async with db.session() as session:
                    await search_offers(session, search)
                if round_number >= warmup:
                    times[number].append((time.perf_counter() - started) * 1000)
                if reference_every and round_number >= warmup and (round_number - warmup) % reference_every == 0:
                    started = time.perf_counter()
                    async with db.session() as session:
                        await reference_search(session, search)
                    reference[number].append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            async with db.session() as session:
                (await session.execute(sql)).all()
            if round_number >= warmup:
                baseline.append((time.perf_counter() - started) * 1000)
            progress.update(round_number + 1)
    finally:
        gc.unfreeze()
    progress.done()
    return times, reference, baseline


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark in a throwaway database; its figures as a JSON-ready dict."""
    started = time.perf_counter()
    fleet = build_fleet(args.gpus, seed=args.seed)
    built = time.perf_counter() - started
    async with fresh_database(args.admin_url) as url:
        db = Database(url)
        try:
            await db.migrate()
            started = time.perf_counter()
            await seed(db, fleet)
            inserted = time.perf_counter() - started
            started = time.perf_counter()
            await analyze(db)
            analyzed = time.perf_counter() - started
            async with db.session() as session:
                postgres = str((await session.execute(text("SHOW server_version"))).scalar_one()).split()[0]
            checked = await check_queries(db, fleet)
            times, reference, baseline = await time_queries(
                db, repeat=args.repeat, warmup=args.warmup, reference_every=args.reference_every
            )
        finally:
            await db.close()
    every = [t for per_query in times for t in per_query]
    floor = figures(baseline)
    overall = round(quantile(every, 0.99), 2)
    queries = {}
    for check, per_query, old in zip(checked, times, reference, strict=True):
        label = check.pop("label")
        queries[label] = {**check, **figures(per_query), "p99_vs_baseline": round(quantile(per_query, 0.99) / floor["p99_ms"], 1)}
        if old:
            queries[label]["gpu_rows"] = figures(old)
            queries[label]["gpu_rows_p99_vs_p99"] = round(quantile(old, 0.99) / quantile(per_query, 0.99), 1)
    every_old = [t for per_query in reference for t in per_query]
    return {
        "machine": describe_machine(), "postgres": postgres, "sqlalchemy": metadata.version("sqlalchemy"),
        "asyncpg": metadata.version("asyncpg"), "gpus_requested": args.gpus, "fleet": fleet.counts(),
        "offers": queries[QUERIES[0].label]["matches"], "build_s": round(built, 2), "seed_s": round(inserted, 2),
        "analyze_s": round(analyzed, 2), "repeat": args.repeat, "warmup": args.warmup, "queries": queries,
        "overall_p99_ms": overall, "baseline": {"sql": BASELINE_SQL, **floor},
        "overall_p99_vs_baseline": round(overall / floor["p99_ms"], 1),
        "gpu_rows_overall_p99_ms": round(quantile(every_old, 0.99), 2) if every_old else None,
        "reference_every": args.reference_every,
        "checks_ok": all(not q["problems"] for q in queries.values()),
    }  # fmt: skip


# ---- report ------------------------------------------------------------------------------------------------------


def record_figures(result: dict[str, Any]) -> None:
    """The headline figures into bench/results.json: p99 over every query and the slowest query's, beside the
    hand-written SQL's p99; the search over GPU rows (before offer_summary) in the note where it was timed."""
    fleet, base = result["fleet"], result["baseline"]
    before = result["gpu_rows_overall_p99_ms"]
    note = f"the search over GPU rows, same rounds: p99 {before:.1f} ms" if before is not None else ""
    if not result["checks_ok"]:
        note = "CHECKS FAILED; " + note
    record("offers", f"GET /offers over {fleet['gpus']:,} GPUs: p99 over every query", result["overall_p99_ms"], "ms",
           "hand-written 50-row SQL, p99", base["p99_ms"], note)  # fmt: skip
    label, slowest = max(result["queries"].items(), key=lambda item: item[1]["p99_ms"])
    record("offers", f"GET /offers over {fleet['gpus']:,} GPUs: p99 of the slowest query ({label})", slowest["p99_ms"],
           "ms", "hand-written 50-row SQL, p99", base["p99_ms"])  # fmt: skip


def print_report(result: dict[str, Any]) -> None:
    fleet = result["fleet"]
    print(f"PostgreSQL {result['postgres']} on this machine; SQLAlchemy {result['sqlalchemy']}, asyncpg {result['asyncpg']}")
    print(
        f"fleet: {fleet['gpus']:,} GPUs ({fleet['models']} models, {fleet['rented_gpus']:,} rented whole, {fleet['shared_gpus']:,} "
        f"shared, {fleet['absent_gpus']:,} absent) on {fleet['hosts']:,} hosts in {fleet['regions']} regions, "
        f"{fleet['listed_hosts']:,} listed; {result['offers']:,} offers"
    )
    print(
        f"seeded in {result['seed_s']:.1f} s ({fleet['rows']:,} rows, {fleet['rows'] / result['seed_s']:,.0f}/s; built in Python in {result['build_s']:.1f} s), "
        f"ANALYZE {result['analyze_s']:.1f} s; {result['repeat']} timed runs per query after {result['warmup']} warm-up rounds"
    )
    print()
    print(f"  {'query':<30} {'q':<58} {'sort':<22} {'matches':>7} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'p99 vs base':>11}"
          f" {'GPU rows p99':>12} {'÷ p99':>6}")  # fmt: skip
    for label, q in result["queries"].items():
        shown = " ".join(part for part in (q["q"], f"(offset {q['offset']:,})" if q["offset"] else "") if part)
        old = f"{q['gpu_rows']['p99_ms']:>12.1f} {q['gpu_rows_p99_vs_p99']:>5.1f}×" if "gpu_rows" in q else f"{'-':>12} {'-':>6}"
        print(
            f"  {label:<30} {shown or '(none)':<58} {q['sort']:<22} {q['matches']:>7,} {q['p50_ms']:>7.1f} {q['p99_ms']:>7.1f} "
            f"{q['max_ms']:>7.1f} {q['p99_vs_baseline']:>10.1f}× {old}"
        )
    base = result["baseline"]
    print(
        f"  {'baseline: 50 free GPUs, SQL':<30} {'(hand-written SELECT … JOIN hosts … LIMIT 50)':<58} {'':<22} {'':>7} "
        f"{base['p50_ms']:>7.2f} {base['p99_ms']:>7.2f} {base['max_ms']:>7.2f} {'(baseline)':>11}"
    )
    print()
    print(
        f"p99 over every query: {result['overall_p99_ms']:.1f} ms; baseline p99 {base['p99_ms']:.2f} ms; "
        f"ratio {result['overall_p99_vs_baseline']:.1f}×"
    )
    if result["gpu_rows_overall_p99_ms"] is not None:
        print(
            f"the search over GPU rows (tests/offers_reference.py, the search before offer_summary), every "
            f"{result['reference_every']}th round: p99 over every query {result['gpu_rows_overall_p99_ms']:.1f} ms, "
            f"{result['gpu_rows_overall_p99_ms'] / result['overall_p99_ms']:.1f}× the summary's"
        )
    record_figures(result)
    print("checks: each query's total and page against a Python evaluation of the fleet, each offer against its conditions, "
          "each answer against the search over GPU rows")  # fmt: skip
    for label, q in result["queries"].items():
        if q["problems"]:
            print(f"  {label}: FAILED: {'; '.join(q['problems'])}")
    print("  all OK" if result["checks_ok"] else "  FAILED")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gpus", type=int, default=100_000, help="GPUs in the fleet, 8 per host (default 100000)")
    parser.add_argument("--repeat", type=int, default=200, help="timed runs of each query (default 200)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed rounds of every query first (default 5)")
    parser.add_argument("--seed", type=int, default=42, help="random seed of the fleet (default 42)")
    parser.add_argument("--reference-every", type=int, default=5, metavar="N",
                        help="also time the search over GPU rows every Nth round (default 5; 0: never)")  # fmt: skip
    parser.add_argument("--admin-url", default=ADMIN_DEFAULT,
                        help="PostgreSQL server: a database gm_bench_<random> is created beside this one and dropped "
                        f"at the end (default {ADMIN_DEFAULT}, or GPUMARKET_TEST_POSTGRES_URL)")  # fmt: skip
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures to FILE as JSON")
    args = parser.parse_args(argv)
    if args.gpus < GPUS_PER_HOST or args.gpus % GPUS_PER_HOST:
        parser.error(f"--gpus must be a positive multiple of {GPUS_PER_HOST}")
    if args.repeat < 1 or args.warmup < 0 or args.reference_every < 0:
        parser.error("--repeat must be at least 1, --warmup and --reference-every at least 0")
    args.admin_url = args.admin_url.replace("postgresql+asyncpg://", "postgresql://", 1)
    print(describe_machine())
    print(f"load average at the start: {' '.join(f'{load:.2f}' for load in os.getloadavg())}")
    try:
        result = asyncio.run(run(args))
    except (OSError, asyncpg.PostgresError) as exc:
        print(f"PostgreSQL at {args.admin_url}: {exc}; start it or pass --admin-url", file=sys.stderr)
        return 2
    print_report(result)
    print(f"load average at the end: {' '.join(f'{load:.2f}' for load in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0 if result["checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
