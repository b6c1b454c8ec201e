"""Leases: one master process at a time does a given job (the heartbeat sweeper, for example).

A lease row names its holder and an expiry. ``acquire`` takes it when it is free, expired, or
already ours (renewing it), with one conditional UPDATE — or an INSERT when the row does not
exist yet, where the primary key decides between racing masters. A holder that dies simply
stops renewing, and another master takes over after the TTL.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import or_, update
from sqlalchemy.exc import IntegrityError

from master.context import Master
from master.models import Lease


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
