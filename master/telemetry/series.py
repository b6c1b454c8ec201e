"""A host's telemetry as the API serves it: series (raw samples or roll-up buckets) and the live stream.

Each function checks that the caller may see the host (``host_views.visible_host``) and reads the
store (``master.telemetry.store``) in its own short transaction, so a stream that waits between
calls holds none. Imports ``master.services`` and ``master.telemetry.store``; never ``master.api``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from master.context import Master
from master.services.accounts import Principal
from master.services.hosts import visible_host
from master.telemetry import store as telemetry
from master.telemetry.store import raw_series, rollup_series


async def host_metrics(
    session: AsyncSession, principal: Principal, host_id: str, *, since: datetime | None, until: datetime | None, limit: int,
    resolution: str = "raw",
) -> list[dict[str, Any]]:
    """Telemetry of one host, oldest first: raw samples, or ``1m`` / ``1h`` roll-up buckets."""
    host = await visible_host(session, principal, host_id)
    if resolution == "raw":
        return await raw_series(session, host.id, since=since, until=until, limit=limit)
    return await rollup_series(session, host.id, resolution, since=since, until=until, limit=limit)


async def stream_start(
    master: Master, who: Principal, host_id: str, *, resume: int | None, backlog: int, limit: int
) -> tuple[str, list[dict[str, Any]], int]:
    """Where a live stream of a visible host starts: its id, the samples to send first and the last sequence number sent.

    After ``resume`` (a sequence number the client saw last): up to ``limit`` samples after it.
    Otherwise the newest ``backlog`` raw samples, and the stream goes on after the latest stored one.
    """
    async with master.db.session() as session:
        host = await visible_host(session, who, host_id)
        if resume is not None:
            first = await telemetry.samples_after(session, host.id, resume, limit=limit)
        else:
            first = await telemetry.raw_series(session, host.id, since=None, until=None, limit=backlog) if backlog else []
            resume = await telemetry.latest_seq(session, host.id)
    return host.id, first, max([resume, *(item["seq"] for item in first)])


async def samples_after(master: Master, host_id: str, after_seq: int, *, limit: int) -> list[dict[str, Any]]:
    """Up to ``limit`` raw samples of the host after ``after_seq``, oldest first."""
    async with master.db.session() as session:
        return await telemetry.samples_after(session, host_id, after_seq, limit=limit)
