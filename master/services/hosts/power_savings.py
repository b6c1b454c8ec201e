"""The energy providers' power policies saved (docs/power.md): agents' counters folded into days, and the views.

Each agent reports, per GPU, the energy its policy saved as a cumulative counter in Wh (``energy_saved_wh`` in its
telemetry; ``agent/power.py`` says how it is measured). ``fold`` reads each host's latest telemetry and adds what a
counter grew since it was last folded to that GPU's row of the day (UTC) in ``power_savings``; a counter smaller than
the last one folded means the agent started counting again (its state was lost), and counts from zero. Folding the
same reading twice adds nothing, so any master may run it, and a missed pass only moves the growth to a later day.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Host, HostPowerPolicy, PowerSaving
from master.services.accounts import Principal


def _counters(host: Host) -> dict[str, float]:
    """GPU uuid → the energy-saved counter in the host's latest telemetry (finite, non-negative readings only)."""
    counters: dict[str, float] = {}
    for gpu in (host.latest_telemetry or {}).get("gpus") or []:
        if not isinstance(gpu, dict):
            continue
        uuid, value = gpu.get("uuid"), gpu.get("energy_saved_wh")
        if isinstance(uuid, str) and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
            counters[uuid] = float(value)
    return counters


async def fold(session: AsyncSession, hosts: Sequence[Host], *, now: datetime) -> int:
    """Add each GPU's counter growth since the last fold to today's row; returns the rows written."""
    day = now.strftime("%Y-%m-%d")
    written = 0
    for host in hosts:
        counters = _counters(host)
        if not counters:
            continue
        latest: dict[str, PowerSaving] = {}
        rows = await session.scalars(
            select(PowerSaving).where(PowerSaving.host_id == host.id, PowerSaving.gpu_uuid.in_(list(counters))).order_by(PowerSaving.day)
        )
        for row in rows:
            latest[row.gpu_uuid] = row  # the newest day last
        for uuid, counter in counters.items():
            last = latest.get(uuid)
            grown = counter if last is None or counter < last.counter_wh else counter - last.counter_wh
            if last is not None and last.day == day:
                last.saved_wh += grown
                last.counter_wh, last.updated_at = counter, now
            elif grown > 0 or last is not None:
                session.add(PowerSaving(host_id=host.id, gpu_uuid=uuid, day=day, saved_wh=grown, counter_wh=counter, updated_at=now))
            else:
                continue
            written += 1
    return written


async def saved_per_gpu(session: AsyncSession, host_ids: Sequence[str]) -> dict[str, float]:
    """GPU uuid → Wh saved in all, over the given hosts."""
    if not host_ids:
        return {}
    rows = await session.execute(
        select(PowerSaving.gpu_uuid, func.sum(PowerSaving.saved_wh)).where(PowerSaving.host_id.in_(list(host_ids))).group_by(PowerSaving.gpu_uuid)
    )
    return {uuid: float(total or 0.0) for uuid, total in rows.all()}


async def account_view(session: AsyncSession, principal: Principal, *, now: datetime, days: int) -> dict[str, Any]:
    """The provider's hosts (an admin's: every host with a policy) with their policy and energy saved, the total, and
    the last ``days`` days' savings per UTC day (oldest first, one entry per day)."""
    query = select(Host).order_by(Host.created_at, Host.id)
    if principal.role == "admin":
        query = query.where(Host.id.in_(select(HostPowerPolicy.host_id)))
    else:
        query = query.where(Host.owner_id == principal.account_id)
    hosts = list((await session.scalars(query)).all())
    host_ids = [host.id for host in hosts]
    policies = {p.host_id: p for p in (await session.scalars(select(HostPowerPolicy).where(HostPowerPolicy.host_id.in_(host_ids)))).all()}
    totals = dict(
        (await session.execute(
            select(PowerSaving.host_id, func.sum(PowerSaving.saved_wh)).where(PowerSaving.host_id.in_(host_ids)).group_by(PowerSaving.host_id)
        )).all()
    )  # fmt: skip
    first = (now - timedelta(days=days - 1)).strftime("%Y-%m-%d")
    per_day = dict(
        (await session.execute(
            select(PowerSaving.day, func.sum(PowerSaving.saved_wh))
            .where(PowerSaving.host_id.in_(host_ids), PowerSaving.day >= first).group_by(PowerSaving.day)
        )).all()
    )  # fmt: skip
    series = []
    for back in range(days - 1, -1, -1):
        day = (now - timedelta(days=back)).strftime("%Y-%m-%d")
        series.append({"day": day, "energy_saved_wh": round(float(per_day.get(day) or 0.0), 3)})
    items = []
    for host in hosts:
        policy = policies.get(host.id)
        items.append({
            "host_id": host.id, "name": host.name, "enabled": bool(policy and policy.enabled),
            "cap_watts": policy.cap_watts if policy else None, "cap_fraction": policy.cap_fraction if policy else None,
            "off_peak_until": ((policy.sent or {}).get("off_peak_until") if policy else None),
            "energy_saved_wh": round(float(totals.get(host.id) or 0.0), 3),
        })  # fmt: skip
    return {
        "unit": "Wh",
        "energy_saved_wh": round(sum(float(v or 0.0) for v in totals.values()), 3),
        "hosts": items,
        "days": series,
        "method": "per GPU: (its own idle draw measured uncapped - its draw while capped and idle) x time, summed by its agent",
    }
