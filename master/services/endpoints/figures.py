"""What the autoscaler reads for one service: its endpoint's requests in flight and its replicas' GPU utilisation.

Requests in flight come from ``service_stats``: every master process that serves the endpoint
writes one row per bucket (``service_stats_bucket_s``) with the sum and number of its in-flight
samples; a bucket's figure is the sum over processes of their means, and a bucket nobody wrote
had none in flight. GPU utilisation comes from the agents' raw telemetry of the replicas' hosts,
only the replicas' own GPUs counted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Rental, Service, ServiceStat, TelemetrySample
from master.services.endpoints.scaling import Load

RECENT_BUCKETS = 3  # the "recent" in-flight figure: the mean of the last buckets written within this many
COVERED = 0.8  # telemetry must reach back over this share of period_s before GPU utilisation counts


async def inflight_by_bucket(session: AsyncSession, service_id: str, *, since: datetime) -> dict[datetime, float]:
    """Requests in flight per bucket since ``since`` (sum over gateway processes of each one's mean)."""
    rows = await session.execute(
        select(ServiceStat.bucket_at, ServiceStat.inflight_sum, ServiceStat.inflight_samples)
        .where(ServiceStat.service_id == service_id, ServiceStat.bucket_at >= since)
    )  # fmt: skip
    buckets: dict[datetime, float] = defaultdict(float)
    for at, total, samples in rows:
        buckets[at] += total / samples if samples else 0.0
    return dict(buckets)


async def load_of(session: AsyncSession, service: Service, replicas: Sequence[Rental], *, now: datetime, bucket_s: float) -> Load:
    rule = service.scaling
    if rule["metric"] == "inflight":
        window = max(float(rule["scale_down_cooldown_s"]), RECENT_BUCKETS * bucket_s)
        buckets = await inflight_by_bucket(session, service.id, since=now - timedelta(seconds=window + bucket_s))
        recent = [value for at, value in buckets.items() if at >= now - timedelta(seconds=(RECENT_BUCKETS + 1) * bucket_s)]
        peak_since = now - timedelta(seconds=float(rule["scale_down_cooldown_s"]) + bucket_s)
        return Load(
            inflight_recent=sum(recent) / len(recent) if recent else None,
            inflight_peak=max((value for at, value in buckets.items() if at >= peak_since), default=0.0),
        )
    return Load(gpu_util=await gpu_util(session, replicas, now=now, period_s=float(rule["period_s"])))


async def gpu_util(session: AsyncSession, replicas: Sequence[Rental], *, now: datetime, period_s: float) -> float | None:
    """Mean utilisation (%) of the ready replicas' GPUs over the last ``period_s``; None without enough telemetry."""
    gpus: dict[str, set[str]] = defaultdict(set)
    for rental in replicas:
        if rental.ready_at is not None and rental.host_id is not None:
            gpus[rental.host_id].update(rental.gpu_uuids or [])
    if not gpus:
        return None
    since = now - timedelta(seconds=period_s)
    rows = (await session.execute(
        select(TelemetrySample.host_id, TelemetrySample.sampled_at, TelemetrySample.gpus)
        .where(TelemetrySample.host_id.in_(list(gpus)), TelemetrySample.sampled_at >= since)
    )).all()  # fmt: skip
    values: list[float] = []
    oldest: datetime | None = None
    for host_id, sampled_at, reported in rows:
        for gpu in reported or []:
            util = gpu.get("gpu_util_pct") if isinstance(gpu, dict) else None
            if gpu.get("uuid") in gpus[host_id] and isinstance(util, int | float):
                values.append(float(util))
                oldest = sampled_at if oldest is None or sampled_at < oldest else oldest
    if not values or oldest is None or (now - oldest).total_seconds() < COVERED * period_s:
        return None
    return sum(values) / len(values)
