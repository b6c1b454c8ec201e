"""Billing at scale: rating and invoicing a month of usage for 100,000 rentals on PostgreSQL.

A fresh database gets 1,000 renters, 200 providers (a tenth of the rentals in renters, at least 20, and a
fifth of that in providers, for runs of under 10,000 rentals), 2,000 hosts (16,000 GPUs) and
``--rentals`` rentals spread over November 2026 — durations from a minute to three days,
prices 0.20–2.50 USD per GPU-hour, 10 % interruptible, 5 % fractional shares, 3 % preempted,
2 % lost with their host (downtime credits), every one ended within the month. Then
``billing.rating.rate_open_rentals`` runs pass after pass (as the billing job does) until
nothing is left to rate, and the run reports the time, rentals and postings per second, and
checks the books: the trial balance, and the renters' total charge against an independent
calculation from the rentals (``cumulative_cost`` per rental, minimum periods included).
Then every renter's November invoice and every provider's statement is built (JSON and
HTML) and timed, and the invoices' total is checked against the ledger.

Baseline, same run: the same number of postings (one transaction and three entries each)
written by plain bulk INSERTs with no rating logic — the floor for writing that much ledger.

Usage: ``python bench/bench_billing.py [--rentals N] [--admin-url URL] [--batch N] [--json FILE] [--quick]``

Measured 2026-11-22 on the development VM (AMD EPYC, 2 cores, PostgreSQL 15), 100,000
rentals: see docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

from _common import Progress, describe_machine, fresh_database, record
from sqlalchemy import func, insert, select

from billing import invoice_html, invoices, ledger
from billing.rating import RatingPolicy, cumulative_cost, rate_open_rentals
from master.db import Database
from master.models import Account, Gpu, Host, LedgerAccount, LedgerEntry, LedgerTransaction, Rental
from master.services.accounts.core import Principal

MONTH = datetime(2026, 11, 1, tzinfo=UTC)
MONTH_END = datetime(2026, 12, 1, tzinfo=UTC)
TIERS = ("flagship", "datacenter", "prosumer", "consumer")
POLICY = RatingPolicy(min_period_s=60, fee_rate=Decimal("0.15"))


async def seed(db: Database, rentals: int, rng: random.Random) -> list[dict[str, Any]]:
    """Accounts, hosts, GPUs and ended rentals; returns the rentals' rows (for the reference)."""
    # 1,000 renters and 200 providers for a month's 10,000 rentals or more; fewer for a small run (its invoices).
    n_renters = min(1000, max(20, rentals // 10))
    n_providers = max(4, n_renters // 5)
    renters = [{"id": f"acct-r{i:05d}", "name": f"renter-{i}", "role": "renter", "created_at": MONTH} for i in range(n_renters)]
    providers = [{"id": f"acct-p{i:04d}", "name": f"provider-{i}", "role": "provider", "created_at": MONTH} for i in range(n_providers)]
    hosts = [{"id": f"h-{i:05d}", "owner_id": providers[i % n_providers]["id"], "state": "online", "created_at": MONTH,
              "state_changed_at": MONTH} for i in range(2000)]  # fmt: skip
    gpus = [{"id": f"g-{h:05d}-{g}", "host_id": f"h-{h:05d}", "index": g, "uuid": f"GPU-{h:05d}-{g}", "name": "NVIDIA GeForce RTX 4090",
             "memory_total_mib": 24564, "info": {}, "tier": TIERS[h % 4]} for h in range(2000) for g in range(8)]  # fmt: skip
    rows = []
    for i in range(rentals):
        host = rng.randrange(2000)
        start = MONTH + timedelta(seconds=rng.randrange(int((MONTH_END - MONTH).total_seconds()) - 120))
        duration = timedelta(seconds=int(min(rng.expovariate(1 / 14400) + 60, 3 * 86400)))
        end = min(start + duration, MONTH_END - timedelta(seconds=1))
        roll = rng.random()
        state, kind, lost = "stopped", "on_demand", False
        if roll < 0.03:
            state, kind = "preempted", "interruptible"
        elif roll < 0.05:
            state, lost = "failed", True
        elif roll < 0.13:
            kind = "interruptible"
        milli = rng.choice((250, 500)) if rng.random() < 0.05 else 1000
        count = 1 if milli < 1000 else rng.choice((1, 1, 1, 2, 4, 8))
        if rng.random() < 0.01:  # a few shorter than the minimum period
            end = start + timedelta(seconds=rng.randrange(1, 60))
        rows.append({
            "id": f"r-{i:06d}", "renter_id": renters[i % n_renters]["id"], "host_id": f"h-{host:05d}", "gpu_model": "NVIDIA GeForce RTX 4090",
            "gpu_count": count, "gpu_uuids": [f"GPU-{host:05d}-{g}" for g in range(count)], "state": state, "kind": kind,
            "gpu_milli": milli, "price_per_gpu_hour": Decimal(rng.randrange(20, 251)) / 100, "created_at": start,
            "started_at": start, "stopped_at": end, "host_lost_at": end if lost else None, "workload": {}, "spec": {},
        })  # fmt: skip
    async with db.session() as session:
        await session.execute(insert(Account), renters + providers)
        await session.execute(insert(Host), hosts)
        for chunk in range(0, len(gpus), 5000):
            await session.execute(insert(Gpu), gpus[chunk : chunk + 5000])
    progress = Progress("seeding rentals", rentals)
    for chunk in range(0, rentals, 5000):
        async with db.session() as session:
            await session.execute(insert(Rental), rows[chunk : chunk + 5000])
        progress.update(chunk + 5000)
    progress.done()
    async with db.session() as session:
        await session.execute(func.now().select())  # a round trip, so ANALYZE sees committed rows
    async with db.engine.begin() as conn:
        await conn.exec_driver_sql("ANALYZE")
    return rows


def reference_total(rows: list[dict[str, Any]]) -> Decimal:
    """The renters' total charge worked out from the rentals alone (no discounts are configured)."""
    total = Decimal(0)
    for row in rows:
        rate = row["price_per_gpu_hour"] * row["gpu_count"] * row["gpu_milli"] / 1000 / 3600
        served = int((row["stopped_at"] - row["started_at"]).total_seconds())
        total += ledger.quantize(cumulative_cost(rate, served, ()))
        if served < POLICY.min_period_s and row["state"] == "stopped":
            total += ledger.quantize(cumulative_cost(rate, POLICY.min_period_s, ())) - ledger.quantize(cumulative_cost(rate, served, ()))
    return total


async def rate_month(db: Database, rentals: int, batch: int) -> tuple[float, int]:
    progress = Progress("rating", rentals)
    started = time.perf_counter()
    done = 0
    while True:
        rated = await rate_open_rentals(db, now=MONTH_END - timedelta(seconds=1), policy=POLICY, batch=batch)
        if not rated:
            break
        done += len(rated)
        progress.update(done)
    progress.done()
    return time.perf_counter() - started, done


async def invoice_month(db: Database) -> tuple[float, int, Decimal]:
    """Every renter's November invoice and every provider's statement; returns the time, how many, and the invoices' total."""
    admin = Principal(account_id="bench", name="bench", role="admin")
    async with db.session() as session:
        accounts = (await session.execute(select(Account.id, Account.role).order_by(Account.id))).all()
    started = time.perf_counter()
    total = Decimal(0)
    for account_id, role in accounts:
        async with db.session() as session:
            doc = await invoices.document(session, admin, f"{'inv' if role == 'renter' else 'stm'}-2026-11-{account_id}")
            invoice_html.render_html(doc)
        if role == "renter":
            total += Decimal(doc["total_charged"])
    return time.perf_counter() - started, len(accounts), total


async def baseline(db: Database, postings: int) -> float:
    """Bulk INSERT the same number of ledger transactions (and three entries each), nothing else."""
    async with db.session() as session:
        renter = await session.scalar(select(LedgerAccount.code).where(LedgerAccount.code.like("renter:%")).limit(1))
        provider = await session.scalar(select(LedgerAccount.code).where(LedgerAccount.code.like("provider:%")).limit(1))
    legs = ((renter, Decimal("1.0")), (provider, Decimal("-0.85")), (ledger.FEES, Decimal("-0.15")))
    started = time.perf_counter()
    for chunk in range(0, postings, 5000):
        size = min(5000, postings - chunk)
        async with db.session() as session:
            ids = (await session.scalars(
                insert(LedgerTransaction).returning(LedgerTransaction.id),
                [{"key": f"baseline:{chunk + i}", "kind": "baseline", "memo": "", "created_at": MONTH} for i in range(size)],
            )).all()  # fmt: skip
            entries = [{"transaction_id": t, "account": account, "amount": amount} for t in ids
                       for account, amount in legs]  # fmt: skip
            await session.execute(insert(LedgerEntry), entries)
    return time.perf_counter() - started


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    async with fresh_database(args.admin_url) as url:
        db = Database(url.replace("postgresql://", "postgresql+asyncpg://", 1))
        try:
            await db.migrate()
            t0 = time.perf_counter()
            rows = await seed(db, args.rentals, rng)
            seeded = time.perf_counter() - t0
            seconds, rated = await rate_month(db, args.rentals, args.batch)
            async with db.engine.begin() as conn:  # the ledger just grew from nothing: fresh statistics, as autovacuum keeps them
                await conn.exec_driver_sql("ANALYZE")
            async with db.session() as session:
                postings = int(await session.scalar(select(func.count()).select_from(LedgerTransaction)) or 0)
                trial = await ledger.trial_balance(session)
                charged = -sum((Decimal(a["balance"]) for a in trial["accounts"] if a["account"].startswith("renter:")), Decimal(0))
            invoicing_s, documents, invoiced = await invoice_month(db)
            async with db.session() as session:
                await session.execute(LedgerEntry.__table__.delete())
                await session.execute(LedgerTransaction.__table__.delete())
            floor = await baseline(db, postings)
        finally:
            await db.close()
    expected = reference_total(rows)
    return {
        "rentals": args.rentals, "seed_s": round(seeded, 1), "rating_s": round(seconds, 1), "rated": rated, "postings": postings,
        "rentals_per_s": round(rated / seconds), "postings_per_s": round(postings / seconds),
        "baseline_s": round(floor, 1), "baseline_postings_per_s": round(postings / floor), "vs_baseline": round(seconds / floor, 1),
        "balanced": trial["balanced"], "charged": ledger.money(charged), "reference": ledger.money(expected),
        "matches_reference": charged == expected, "invoicing_s": round(invoicing_s, 1), "documents": documents,
        "invoices_match_ledger": invoiced == charged,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rentals", type=int, default=100_000, help="rentals in the month (default 100,000)")
    parser.add_argument("--batch", type=int, default=500, help="rentals one rating pass takes (default 500, as the billing job)")
    parser.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres", help="PostgreSQL server to create the throwaway database on")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--quick", action="store_true", help="2,000 rentals (for make bench QUICK=1)")
    args = parser.parse_args()
    if args.quick:
        args.rentals = 2_000
    print(describe_machine())
    result = asyncio.run(run(args))
    print(f"{result['rentals']:,} rentals seeded in {result['seed_s']} s")
    print(f"rating: {result['rating_s']} s, {result['rentals_per_s']:,} rentals/s, {result['postings']:,} postings "
          f"= {result['postings_per_s']:,} postings/s")  # fmt: skip
    print(f"baseline (bulk INSERT of as many postings): {result['baseline_s']} s, {result['baseline_postings_per_s']:,} postings/s; "
          f"rating takes {result['vs_baseline']}× that")  # fmt: skip
    print(f"books balanced: {result['balanced']}; renters charged {result['charged']} USD, reference {result['reference']}: "
          f"{'match' if result['matches_reference'] else 'MISMATCH'}")  # fmt: skip
    print(f"invoicing: {result['documents']:,} invoices and statements (JSON + HTML) in {result['invoicing_s']} s; "
          f"invoice totals {'equal' if result['invoices_match_ledger'] else 'DIFFER FROM'} the ledger")  # fmt: skip
    checks = f"books balanced: {result['balanced']}; total = independent calculation: {result['matches_reference']}"
    record("billing", f"rating a month of {result['rentals']:,} rentals on PostgreSQL, batches of {args.batch}",
           result["postings_per_s"], "postings/s", "bulk INSERT of as many postings", result["baseline_postings_per_s"],
           f"{result['rentals_per_s']:,} rentals/s; {checks}")  # fmt: skip
    record("billing", f"invoices and statements (JSON + HTML) for {result['documents']:,} accounts",
           result["invoicing_s"] * 1e3 / max(1, result["documents"]), "ms each",
           note=f"totals equal to the ledger: {result['invoices_match_ledger']}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["balanced"] and result["matches_reference"] and result["invoices_match_ledger"] else 1


if __name__ == "__main__":
    sys.exit(main())
