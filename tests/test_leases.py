"""Leases on SQLite and PostgreSQL: one master at a time does the sweeping, another takes over when it dies."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime, timedelta

from master.background import leases
from master.context import Master

T0 = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)


def other(master: Master, name: str) -> Master:
    """A second master process on the same database."""
    return dataclasses.replace(master, instance_id=name)


class TestLeases:
    async def test_one_holder_at_a_time_and_renewal(self, master: Master) -> None:
        """The first taker holds the lease; others are refused while it renews."""
        a, b = other(master, "master-a"), other(master, "master-b")
        assert await leases.acquire(a, "sweeper", ttl=10, now=T0)
        assert not await leases.acquire(b, "sweeper", ttl=10, now=T0 + timedelta(seconds=5))
        assert await leases.acquire(a, "sweeper", ttl=10, now=T0 + timedelta(seconds=8))  # renewed to T0+18
        assert not await leases.acquire(b, "sweeper", ttl=10, now=T0 + timedelta(seconds=15))

    async def test_a_dead_holder_is_replaced_after_the_ttl(self, master: Master) -> None:
        """When the holder stops renewing, another master takes over once the lease expires."""
        a, b = other(master, "master-a"), other(master, "master-b")
        assert await leases.acquire(a, "sweeper", ttl=10, now=T0)
        assert await leases.acquire(b, "sweeper", ttl=10, now=T0 + timedelta(seconds=11))
        assert not await leases.acquire(a, "sweeper", ttl=10, now=T0 + timedelta(seconds=12))

    async def test_release_hands_over_at_once(self, master: Master) -> None:
        """A clean shutdown releases the lease so the next master need not wait."""
        a, b = other(master, "master-a"), other(master, "master-b")
        assert await leases.acquire(a, "sweeper", ttl=3600)
        await leases.release(a, "sweeper")
        assert await leases.acquire(b, "sweeper", ttl=3600)

    async def test_racing_masters_get_exactly_one_lease(self, master: Master) -> None:
        """Several masters asking for a new lease at the same moment: exactly one wins."""
        contenders = [other(master, f"master-{i}") for i in range(5)]
        won = await asyncio.gather(*(leases.acquire(m, "fresh", ttl=60, now=T0) for m in contenders))
        assert sum(won) == 1


class TestNudge:
    async def test_a_nudge_runs_a_leased_loop_now_rather_than_at_the_end_of_its_period(self, master: Master) -> None:
        """``run_leased`` waits its period unless ``Master.nudge`` names its lease: an hour-long period still runs at once
        when nudged (the gateway nudges the autoscaler so that a service at zero replicas starts one without waiting)."""
        passes: list[int] = []
        ran = asyncio.Event()

        async def work() -> None:
            passes.append(len(passes))
            ran.set()

        loop = asyncio.create_task(leases.run_leased(master, "nudged", every=3600, work=work))
        try:
            await asyncio.sleep(0.2)
            assert passes == []  # nothing before the period ends, or a nudge
            master.nudge("nudged")
            await asyncio.wait_for(ran.wait(), 30)
            assert passes == [0]
            ran.clear()
            master.nudge("other loop")  # a nudge for another loop leaves this one waiting
            await asyncio.sleep(0.2)
            assert passes == [0]
            master.nudge("nudged")
            await asyncio.wait_for(ran.wait(), 30)
            assert passes == [0, 1]
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
