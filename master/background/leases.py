"""Leases: one master process at a time does a given job (the heartbeat sweeper, for example).

A lease row names its holder and an expiry. ``acquire`` takes it when it is free, expired, or
already ours (renewing it), with one conditional UPDATE — or an INSERT when the row does not
exist yet, where the primary key decides between racing masters. A holder that dies simply
stops renewing, and another master takes over after the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta

from sqlalchemy import or_, update
from sqlalchemy.exc import IntegrityError

from master.context import Master
from master.models import Lease

log = logging.getLogger(__name__)


async def acquire(master: Master, name: str, *, ttl: float, now: datetime | None = None) -> bool:
    """Take or renew lease ``name`` for ``ttl`` seconds; returns whether this process holds it."""
    now = now or master.clock.now()
    expires = now + timedelta(seconds=ttl)
    async with master.db.session() as session:
        result = await session.execute(
            update(Lease)
            .where(Lease.name == name, or_(Lease.holder == master.instance_id, Lease.expires_at < now))
            .values(holder=master.instance_id, expires_at=expires)
        )
        if result.rowcount == 1:  # type: ignore[attr-defined]
            return True
        if await session.get(Lease, name) is not None:
            return False  # held by another live master
    try:
        async with master.db.session() as session:
            session.add(Lease(name=name, holder=master.instance_id, expires_at=expires))
    except IntegrityError:
        return False  # another master created it first
    return True


async def release(master: Master, name: str) -> None:
    """Give the lease up early (on a clean shutdown) so another master need not wait for the TTL."""
    async with master.db.session() as session:
        await session.execute(
            update(Lease)
            .where(Lease.name == name, Lease.holder == master.instance_id)
            .values(expires_at=master.clock.now() - timedelta(seconds=1))
        )


async def run_leased(master: Master, name: str, *, every: float, work: Callable[[], Awaitable[None]]) -> None:
    """Call ``work`` every ``every`` seconds while this process holds lease ``name``. Cancel to stop.

    Several masters may run the same loop: the lease (TTL three periods) lets exactly one of
    them work at a time, and another takes over within a TTL when that one dies. A failing
    pass is logged and retried next period; the lease is released on the way out. ``master.nudge(name)``
    cuts the wait short (a nudge during a pass runs one more pass after it).
    """
    nudged = master.nudges.setdefault(name, asyncio.Event())
    try:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(nudged.wait(), every)
            nudged.clear()
            try:
                if await acquire(master, name, ttl=max(3 * every, 1.0)):
                    await work()
            except Exception:
                log.exception("%s pass failed; retrying in %gs", name, every)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.shield(release(master, name))
