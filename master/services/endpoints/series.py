"""A service over time, for its page and ``GET /services/{id}/stats``: per bucket, replicas, requests/s, errors,
latency p50/p99 and requests in flight.

Figures come from ``service_stats`` (summed over the master processes that wrote them; latency
percentiles from the summed histograms, ``gateway.stats.percentile``); replicas are counted from
the replica rentals' own times: *live* from placement to stop, *ready* from ``ready_at`` (the time
it last became ready) to stop.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Rental, Service, ServiceStat
from master.services.gateway import LATENCY_BOUNDS_MS, percentile

MAX_POINTS = 240


def _iso(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


async def series(session: AsyncSession, service: Service, *, now: datetime, minutes: int, bucket_s: float = 5.0) -> dict[str, Any]:
    """Points every ``step_s`` seconds (a multiple of the bucket, at most ``MAX_POINTS`` of them) over the last ``minutes``."""
    span = minutes * 60.0
    step = max(bucket_s, -(-span // MAX_POINTS // bucket_s) * bucket_s)
    start = datetime.fromtimestamp((now.timestamp() - span) // step * step, tz=now.tzinfo)
    count = int((now - start).total_seconds() // step) + 1
    slots = [start + timedelta(seconds=i * step) for i in range(count)]
    totals: dict[int, dict[str, Any]] = defaultdict(lambda: {"requests": 0, "errors": 0, "retries": 0, "inflight": 0.0,
                                                             "hist": [0] * (len(LATENCY_BOUNDS_MS) + 1), "buckets": set()})
    rows = (await session.scalars(select(ServiceStat).where(ServiceStat.service_id == service.id, ServiceStat.bucket_at >= start))).all()
    for row in rows:
        slot = totals[int((row.bucket_at - start).total_seconds() // step)]
        slot["requests"] += row.requests
        slot["errors"] += row.errors
        slot["retries"] += row.retries
        slot["inflight"] += row.inflight_sum / row.inflight_samples if row.inflight_samples else 0.0
        slot["buckets"].add(row.bucket_at)
        for i, n in enumerate(row.latency_hist[: len(slot["hist"])]):
            slot["hist"][i] += n
    replicas = (await session.scalars(select(Rental).where(
        Rental.service_id == service.id, Rental.started_at.is_not(None), or_(Rental.stopped_at.is_(None), Rental.stopped_at >= start),
    ))).all()  # fmt: skip
    points = []
    for i, at in enumerate(slots):
        figures = totals.get(i)
        mid = at + timedelta(seconds=step)
        live = sum(1 for r in replicas if r.started_at is not None and r.started_at <= mid and (r.stopped_at is None or r.stopped_at > mid))
        ready = sum(1 for r in replicas if r.ready_at is not None and r.ready_at <= mid and (r.stopped_at is None or r.stopped_at > mid))
        point: dict[str, Any] = {"at": _iso(at), "replicas": live, "ready": ready, "requests_per_s": 0.0, "errors": 0,
                                 "retries": 0, "inflight": 0.0, "p50_ms": None, "p99_ms": None}  # fmt: skip
        if figures is not None:
            point.update(requests_per_s=round(figures["requests"] / step, 3), errors=figures["errors"], retries=figures["retries"],
                         inflight=round(figures["inflight"] / max(1, len(figures["buckets"])), 3),
                         p50_ms=percentile(figures["hist"], 0.50), p99_ms=percentile(figures["hist"], 0.99))  # fmt: skip
        points.append(point)
    requests = sum(s["requests"] for s in totals.values())
    errors = sum(s["errors"] for s in totals.values())
    retries = sum(s["retries"] for s in totals.values())
    return {"service_id": service.id, "from": _iso(start), "to": _iso(now), "step_s": step, "points": points,
            "totals": {"requests": requests, "errors": errors, "retries": retries}}  # fmt: skip
