"""Roll-ups and retention of the telemetry store.

A roll-up pass folds each raw ``telemetry`` row, exactly once, into per-GPU 1-minute and
1-hour buckets (``telemetry_rollups``: counts, sums and maxima, so a late sample folds in
exactly) and flips the row's ``rolled`` flag in the same transaction. The retention pass then
deletes rolled raw rows past ``raw_retention_hours`` and buckets past their own retention.
One master at a time runs both, under the ``telemetry-maintenance`` lease
(``master.background.telemetry``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import Master
from master.models import TelemetryRollup, TelemetrySample
from master.telemetry.store import HOUR, MINUTE, bucket_start

log = logging.getLogger(__name__)

ROLLUP_CHUNK = 2000  # raw rows folded per transaction
DELETE_CHUNK = 5000  # rows deleted per statement, so retention never holds long locks

# ---- roll-ups ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Acc:
    """Counts, sums and maxima of one GPU's readings in one bucket."""

    gpu_index: int
    samples: int = 0
    util_n: int = 0
    util_sum: float = 0.0
    util_max: float | None = None
    mem_n: int = 0
    mem_sum: float = 0.0
    mem_max: float | None = None
    temp_n: int = 0
    temp_sum: float = 0.0
    temp_max: float | None = None
    power_n: int = 0
    power_sum: float = 0.0
    power_max: float | None = None

    def merge_into(self, row: TelemetryRollup) -> None:
        row.gpu_index = self.gpu_index
        row.samples += self.samples
        for name in ("util", "mem", "temp", "power"):
            setattr(row, f"{name}_n", getattr(row, f"{name}_n") + getattr(self, f"{name}_n"))
            setattr(row, f"{name}_sum", getattr(row, f"{name}_sum") + getattr(self, f"{name}_sum"))
            setattr(row, f"{name}_max", _max(getattr(row, f"{name}_max"), getattr(self, f"{name}_max")))


def _max(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else max(a, b)


def _add(acc: _Acc, name: str, mean: float | None, weight: int, peak: float | None) -> None:
    if mean is not None and weight > 0:
        setattr(acc, f"{name}_n", getattr(acc, f"{name}_n") + weight)
        setattr(acc, f"{name}_sum", getattr(acc, f"{name}_sum") + mean * weight)
    setattr(acc, f"{name}_max", _max(getattr(acc, f"{name}_max"), _max(peak, mean)))


def _fold(acc: _Acc, gpu: Mapping[str, Any], aggregate: Mapping[str, Any] | None) -> None:
    """One report of one GPU: the window's aggregates where the agent sent them, else the sample."""
    acc.samples += 1
    window = int(aggregate.get("samples") or 0) if aggregate else 0
    if aggregate and window > 0 and aggregate.get("gpu_util_avg") is not None:
        _add(acc, "util", aggregate["gpu_util_avg"], window, aggregate.get("gpu_util_max"))
    else:
        _add(acc, "util", gpu.get("gpu_util_pct"), 1, None)
    _add(acc, "mem", gpu.get("memory_used_mib"), 1, aggregate.get("memory_used_max_mib") if aggregate else None)
    _add(acc, "temp", gpu.get("temperature_c"), 1, aggregate.get("temperature_max_c") if aggregate else None)
    if aggregate and window > 0 and aggregate.get("power_avg_w") is not None:
        _add(acc, "power", aggregate["power_avg_w"], window, aggregate.get("power_max_w"))
    else:
        _add(acc, "power", gpu.get("power_draw_w"), 1, None)


_Key = tuple[str, int, datetime, str]  # host, resolution, bucket start, GPU uuid


def _accumulate(rows: Sequence[TelemetrySample]) -> dict[_Key, _Acc]:
    buckets: dict[_Key, _Acc] = {}
    for row in rows:
        aggregates = {a.get("uuid"): a for a in row.aggregates or [] if isinstance(a, dict)}
        for gpu in row.gpus or []:
            uuid = gpu.get("uuid")
            if not isinstance(uuid, str):
                continue
            for resolution in (MINUTE, HOUR):
                key = (row.host_id, resolution, bucket_start(row.sampled_at, resolution), uuid)
                acc = buckets.get(key)
                if acc is None:
                    acc = buckets[key] = _Acc(gpu_index=int(gpu.get("index") or 0))
                _fold(acc, gpu, aggregates.get(uuid))
    return buckets


async def rollup_once(session: AsyncSession, *, limit: int = ROLLUP_CHUNK) -> int:
    """Fold up to ``limit`` raw rows not rolled yet into their buckets; returns how many.

    Exactly once: the rows are flagged ``rolled`` in the same transaction. Run by one master
    at a time (the maintenance lease), so read-modify-write of the buckets is safe.
    """
    rows = (
        await session.scalars(select(TelemetrySample).where(TelemetrySample.rolled.is_(False)).order_by(TelemetrySample.id).limit(limit))
    ).all()
    if not rows:
        return 0
    buckets = _accumulate(rows)
    hosts = {key[0] for key in buckets}
    starts = {key[2] for key in buckets}
    existing = {
        (r.host_id, r.resolution, r.bucket_start, r.gpu_uuid): r
        for r in (
            await session.scalars(
                select(TelemetryRollup).where(TelemetryRollup.host_id.in_(hosts), TelemetryRollup.bucket_start.in_(starts))
            )
        ).all()
    }
    for key, acc in buckets.items():
        row = existing.get(key)
        if row is None:
            host_id, resolution, start, uuid = key
            row = TelemetryRollup(
                host_id=host_id, resolution=resolution, bucket_start=start, gpu_uuid=uuid, gpu_index=acc.gpu_index,
                samples=0, util_n=0, util_sum=0.0, mem_n=0, mem_sum=0.0, temp_n=0, temp_sum=0.0, power_n=0, power_sum=0.0,
            )
            session.add(row)
        acc.merge_into(row)
    await session.execute(update(TelemetrySample).where(TelemetrySample.id.in_([r.id for r in rows])).values(rolled=True))
    return len(rows)


async def rollup(master: Master, *, limit: int = ROLLUP_CHUNK) -> int:
    """Fold every raw row not rolled yet, a chunk per transaction; returns how many."""
    total = 0
    while True:
        async with master.db.session() as session:
            done = await rollup_once(session, limit=limit)
        total += done
        master.stats.rollup_rows += done
        if done < limit:
            master.stats.rollup_passes += 1
            return total


async def _delete_chunks(master: Master, table: Any, condition: Any) -> int:
    deleted = 0
    while True:
        async with master.db.session() as session:
            ids = select(table.id).where(condition).limit(DELETE_CHUNK).scalar_subquery()
            result = await session.execute(delete(table).where(table.id.in_(ids)))
        count = int(result.rowcount or 0)  # type: ignore[attr-defined]
        deleted += count
        if count < DELETE_CHUNK:
            return deleted


async def expire(master: Master, *, now: datetime | None = None) -> dict[str, int]:
    """Delete what the retention policy no longer keeps; returns rows deleted per kind.

    Raw rows go only once rolled up, so a backlog of unrolled samples is never lost.
    """
    now = now or master.clock.now()
    settings = master.settings
    deleted = {
        "raw": await _delete_chunks(
            master, TelemetrySample,
            (TelemetrySample.sampled_at < now - timedelta(hours=settings.raw_retention_hours)) & TelemetrySample.rolled.is_(True),
        ),
        "1m": await _delete_chunks(
            master, TelemetryRollup,
            (TelemetryRollup.resolution == MINUTE)
            & (TelemetryRollup.bucket_start < now - timedelta(days=settings.rollup_1m_retention_days)),
        ),
        "1h": await _delete_chunks(
            master, TelemetryRollup,
            (TelemetryRollup.resolution == HOUR)
            & (TelemetryRollup.bucket_start < now - timedelta(days=settings.rollup_1h_retention_days)),
        ),
    }
    master.stats.retention_deleted.update(deleted)
    if any(deleted.values()):
        log.info("telemetry retention deleted %s", ", ".join(f"{n} {kind}" for kind, n in deleted.items() if n))
    return deleted
