"""A master killed (SIGKILL) in the middle of a placement, on SQLite (`gpumarket up`'s engine) and on PostgreSQL.

Unlike the rest of the suite this needs no cluster: one `gpumarket master` process on the parametrized database
(Redis for its bus), a fleet written straight into the database, and the fault injection setting
``placement_pause_after_claim_s``, which holds every placement after its GPUs are claimed, inside its transaction,
so the kill lands exactly there.

Before placement ran in one serialised transaction on SQLite, the claim had been committed on its own by then (the
savepoint's ``RELEASE`` ended a transaction the savepoint itself had begun): the kill left a rental ``pending``,
holding a GPU, with no event and no start command, and nothing repaired it (issue 21). The scenario also seeds
such a rental, as an older master left it, and checks that the master repairs it when it starts.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from sqlalchemy import select, update

from master.db import Database
from master.models import Command, Gpu, GpuAllocation, Host, Rental, RentalEvent
from master.services.accounts.core import create_account
from master.services.queue import INTERRUPTED
from shared.ids import new_id
from tests.faults.checks import check_allocations
from tests.faults.harness import Report
from tests.helpers import eventually
from tests.test_services_integration import Processes, _free_port, _json, _ok, processes, top_up  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.redis]

HOSTS, GPUS_PER_HOST = 2, 2
RENTALS = 3  # asked for at once: one is held after its claim when the master dies, the others wait behind it
PAUSE_S = 30.0  # longer than the test waits: the master is killed inside it
MASTER = "master"


async def _seed(db: Database) -> dict[str, Any]:
    """Accounts, a fleet of ``HOSTS`` × ``GPUS_PER_HOST`` free GPUs, and one rental as a master killed mid-placement
    before this fix left it on SQLite: ``pending`` on a host, one GPU claimed, no event, no start command."""
    async with db.session() as session:
        renter, renter_key = await create_account(session, "renter", "renter")
        provider, _ = await create_account(session, "provider", "provider")
        _, admin_key = await create_account(session, "admin", "admin")
        hosts = [Host(id=new_id("h"), owner_id=provider.id, name=f"kill-{h}", state="online", region="local") for h in range(HOSTS)]
        session.add_all(hosts)
        await session.flush()
        gpus = [Gpu(id=new_id("gpu"), host_id=host.id, index=i, uuid=f"GPU-kill-{h}-{i}", name="NVIDIA GeForce RTX 4090",
                    memory_total_mib=24564, info={}, present=True)
                for h, host in enumerate(hosts) for i in range(GPUS_PER_HOST)]  # fmt: skip
        session.add_all(gpus)
        await session.flush()
        orphan = Rental(id=new_id("r"), renter_id=renter.id, host_id=hosts[0].id, gpu_model=gpus[0].name, gpu_count=1,
                        gpu_uuids=[gpus[0].uuid], state="pending", workload={}, spec={})  # fmt: skip
        session.add(orphan)
        await session.flush()
        session.add(GpuAllocation(rental_id=orphan.id, gpu_id=gpus[0].id, milli=1000, memory_mib=gpus[0].memory_total_mib, whole=True))
        await session.execute(update(Gpu).where(Gpu.id == gpus[0].id).values(rental_id=orphan.id, milli_used=1000,
                                                                             memory_used_mib=gpus[0].memory_total_mib))  # fmt: skip
    return {"renter_key": renter_key, "admin_key": admin_key, "orphan": orphan.id}


async def _rentals(db: Database) -> dict[str, tuple[Rental, list[RentalEvent], list[Command]]]:
    async with db.session() as session:
        rentals = (await session.scalars(select(Rental))).all()
        events = (await session.scalars(select(RentalEvent).order_by(RentalEvent.id))).all()
        commands = (await session.scalars(select(Command))).all()
    return {r.id: (r, [e for e in events if e.rental_id == r.id], [c for c in commands if c.rental_id == r.id]) for r in rentals}


async def check_placements(db: Database) -> dict[str, Any]:
    """Every rental's newest event names its state; none is ``pending`` on a host or holding GPUs without a start command."""
    problems = []
    rentals = await _rentals(db)
    async with db.session() as session:
        holders = set((await session.scalars(select(GpuAllocation.rental_id).where(GpuAllocation.released_at.is_(None)))).all())
    for rental_id, (rental, events, commands) in rentals.items():
        if not events or events[-1].to_state != rental.state:
            problems.append(f"rental {rental_id} is {rental.state} with no event saying so ({[e.to_state for e in events]})")
        started = any(c.kind == "start_workload" for c in commands)
        if rental.state == "pending" and (rental.host_id is not None or rental_id in holders) and not started:
            problems.append(f"rental {rental_id} is pending on {rental.host_id} holding GPUs, with no start command")
    assert not problems, "; ".join(problems)
    return {"rentals": len(rentals), "problems": 0}


def _log(group: Processes) -> str:
    return (group.log_dir / f"{MASTER}.log").read_text(errors="replace")


class TestKillDuringPlacement:
    @pytest.mark.timeout(90, func_only=True)
    async def test_a_master_killed_mid_placement_leaves_no_half_placed_rental(
        self, processes: Processes, database_url: str, redis_url: str, bus_prefix: str, tmp_path: Path,  # noqa: F811
    ) -> None:
        """SIGKILL of a master whose placement has claimed its GPUs and not yet committed: the placement left nothing
        (claim, rental, events and start command are one transaction); the requests retried with their
        Idempotency-Keys on the restarted master place one rental each on distinct GPUs; no GPU is held twice; every
        rental has an event for its state; and the half-placed rental an older master left is failed with an event,
        its GPU released, as soon as a master starts."""
        engine = "sqlite" if database_url.startswith("sqlite") else "postgres"
        report = Report(f"master_kill_mid_placement_{engine}", f"kill -9 a master holding a placement after its claim ({engine})")
        outcome = "failed"
        db = Database(database_url)
        try:
            await db.migrate()
            seeded = await _seed(db)
            port = _free_port()
            api = f"http://127.0.0.1:{port}/api/v1"
            env = {**os.environ, "GPUMARKET_DATABASE_URL": database_url, "GPUMARKET_REDIS_URL": redis_url,
                   "GPUMARKET_BUS_PREFIX": bus_prefix, "GPUMARKET_DATA_DIR": str(tmp_path / "master"),
                   "GPUMARKET_HTTP_PORT": str(port), "GPUMARKET_LOG_LEVEL": "WARNING", "GPUMARKET_RATE_LIMITS_ENABLED": "false",
                   "GPUMARKET_QUEUE_INTERVAL": "0.2", "GPUMARKET_INSTANCE_ID": f"kill-{engine}"}  # fmt: skip
            processes.start(MASTER, "master", env={**env, "GPUMARKET_PLACEMENT_PAUSE_AFTER_CLAIM_S": str(PAUSE_S)})
            keys = [f"kill-{uuid.uuid4()}" for _ in range(RENTALS)]
            async with aiohttp.ClientSession() as http:
                await eventually(lambda: _ok(http, f"{api}/health"), timeout=30, what="master healthy")
                await top_up(http, api, seeded["admin_key"], seeded["renter_key"])

                async def repaired() -> Rental | None:
                    rental, _, _ = (await _rentals(db))[seeded["orphan"]]
                    return rental if rental.state == "failed" else None

                orphan = await eventually(repaired, timeout=10, what="the half-placed rental repaired")
                report.verify("repaired_on_start", {"rental": orphan.id, "state": orphan.state, "failure_reason": orphan.failure_reason})
                assert orphan.failure_reason == INTERRUPTED

                async def rent(key: str) -> tuple[int, Any]:
                    return await _json(http, "POST", f"{api}/rentals", seeded["renter_key"], json={"gpu_count": 1},
                                       headers={"Idempotency-Key": key}, timeout=aiohttp.ClientTimeout(total=PAUSE_S * 2))  # fmt: skip

                asked = [asyncio.create_task(rent(key)) for key in keys]
                deadline = time.monotonic() + 20
                while "paused" not in _log(processes):
                    assert time.monotonic() < deadline and not any(t.done() for t in asked), processes.logs()
                    await asyncio.sleep(0.02)
                processes.kill(MASTER)
                killed = report.inject(f"SIGKILL {MASTER} while a placement held its claim uncommitted", requests=RENTALS)
                answers = await asyncio.gather(*asked)
                assert [status for status, _ in answers] == [0] * RENTALS, answers

                report.verify("after_the_kill", {"allocations": await check_allocations(db), **await check_placements(db)})
                left = [r for r, _, _ in (await _rentals(db)).values() if r.idempotency_key in keys]
                assert left == [], f"the killed placement left {left}"

                processes.start(MASTER, "master", env=env)
                report.inject(f"restarted {MASTER} without the pause")
                await eventually(lambda: _ok(http, f"{api}/health"), timeout=30, what="master healthy again")
                retried = [await rent(key) for key in keys]
            assert [status for status, _ in retried] == [201] * RENTALS, retried  # nothing had been committed: placed now
            uuids = [u for _, body in retried for u in body["gpu_uuids"]]
            assert len(set(uuids)) == RENTALS, uuids
            report.verify("retried", {"rentals": RENTALS, "created": RENTALS, "distinct_gpus": len(set(uuids)),
                                      "states": sorted(body["state"] for _, body in retried)})  # fmt: skip
            allocations = await check_allocations(db)
            placements = await check_placements(db)
            report.verify("after_restart", {"allocations": allocations, **placements})
            repairs = _log(processes).count("left pending by an interrupted placement")
            assert repairs == 1, _log(processes)  # the seeded one, by the first master; the kill left none
            assert processes.stop(MASTER) == 0, processes.logs()
            report.verify("covered_after", str(killed))
            outcome = "passed"
        finally:
            await db.close()
            report.write(outcome)
