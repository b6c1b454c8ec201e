"""The telemetry store: impossible readings refused field by field, roll-ups, retention, series.

Raw samples (one ``telemetry`` row per agent report, every GPU in it) are written in batches
by the ingestor (``master/telemetry/ingest.py``). A roll-up pass folds each raw row, exactly once, into
per-GPU 1-minute and 1-hour buckets (``telemetry_rollups``: counts, sums and maxima, so a late
sample folds in exactly) and flips the row's ``rolled`` flag in the same transaction. The
retention pass then deletes rolled raw rows past ``raw_retention_hours`` and buckets past
their own retention. One master at a time runs both, under the ``telemetry-maintenance`` lease.

Readings are checked before anything is stored: a value outside its physical range, NaN or
infinite is replaced by ``None`` (never by 0 — "unknown", not "idle") and counted per field,
in ``master.stats.rejected_fields`` and on the host; the rest of the sample is kept.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from operator import attrgetter
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import TelemetryRollup, TelemetrySample
from shared.errors import BadRequest

log = logging.getLogger(__name__)

MINUTE, HOUR = 60, 3600
RESOLUTIONS = {"1m": MINUTE, "1h": HOUR}
# ``resolution=auto`` serves raw samples for spans up to this, 1-minute buckets up to 3 days.
AUTO_RAW_SPAN = timedelta(hours=6)
AUTO_MINUTE_SPAN = timedelta(days=3)
ROLLUP_CHUNK = 2000  # raw rows folded per transaction
DELETE_CHUNK = 5000  # rows deleted per statement, so retention never holds long locks
MAINTENANCE_LEASE = "telemetry-maintenance"

# ---- refusing impossible readings -------------------------------------------------------

# field → (lowest, highest) accepted, inclusive; None: unbounded on that side.
_SAMPLE_RANGES: dict[str, tuple[float | None, float | None]] = {
    "gpu_util_pct": (0, 100),
    "mem_util_pct": (0, 100),
    "fan_pct": (0, 100),
    "memory_used_mib": (0, 1 << 24),
    "memory_free_mib": (0, 1 << 24),
    "temperature_c": (-40, 150),
    "power_draw_w": (0, 5000),
    "sm_clock_mhz": (0, 10_000),
    "mem_clock_mhz": (0, 50_000),
    "pcie_tx_kbps": (0, None),
    "pcie_rx_kbps": (0, None),
    "ecc_volatile_uncorrected": (0, None),
    "ecc_aggregate_uncorrected": (0, None),
    "pcie_gen_current": (1, 16),
    "pcie_width_current": (1, 64),
    "retired_pages_single_bit": (0, None),
    "retired_pages_double_bit": (0, None),
    "remapped_rows_correctable": (0, None),
    "remapped_rows_uncorrectable": (0, None),
    "power_limit_w": (0, 5000),
    "energy_saved_wh": (0, None),
}
_AGGREGATE_RANGES: dict[str, tuple[float | None, float | None]] = {
    "gpu_util_avg": (0, 100),
    "gpu_util_max": (0, 100),
    "memory_used_max_mib": (0, 1 << 24),
    "temperature_max_c": (-40, 150),
    "power_avg_w": (0, 5000),
    "power_max_w": (0, 5000),
}


def _acceptable(value: Any, bounds: tuple[float | None, float | None]) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    low, high = bounds
    return (low is None or value >= low) and (high is None or value <= high)


def _clean(record: Mapping[str, Any], ranges: Mapping[str, tuple[float | None, float | None]], prefix: str,
           rejected: Counter[str]) -> dict[str, Any]:
    """One pass over the record (this runs for every GPU of every sample: keep it lean)."""
    clean = dict(record)
    for name, value in record.items():
        if value is None:
            continue
        bounds = ranges.get(name)
        if bounds is not None:
            ok = _acceptable(value, bounds)
        else:
            # Any other non-finite number (a field a newer agent added) cannot be stored as JSON either.
            ok = not (isinstance(value, float) and not math.isfinite(value))
        if not ok:
            clean[name] = None
            rejected[f"{prefix}.{name}"] += 1
    return clean


@dataclass(frozen=True, slots=True)
class CleanSample:
    gpus: list[dict[str, Any]]
    aggregates: list[dict[str, Any]]
    rejected: Counter[str]
    """Refused fields, by ``gpus.<field>`` / ``aggregates.<field>``."""


def clean_sample(gpus: Iterable[Mapping[str, Any]], aggregates: Iterable[Mapping[str, Any]]) -> CleanSample:
    """The sample with every impossible reading replaced by ``None``, and what was refused."""
    rejected: Counter[str] = Counter()
    clean_gpus = [_clean(g, _SAMPLE_RANGES, "gpus", rejected) for g in gpus]
    clean_aggregates = [_clean(a, _AGGREGATE_RANGES, "aggregates", rejected) for a in aggregates]
    return CleanSample(gpus=clean_gpus, aggregates=clean_aggregates, rejected=rejected)


def _refuse_column(records: Sequence[Sequence[Any]], name: str, bounds: tuple[float | None, float | None],
                   prefix: str, rejected: dict[int, Counter[str]]) -> None:
    """One field over every record of every sample at once; only a column out of range is walked record by record."""
    low, high = bounds
    get = attrgetter(name)
    values = [value for group in records for value in map(get, group) if value is not None]
    if not values or ((low is None or min(values) >= low) and (high is None or max(values) <= high)):
        return
    for number, group in enumerate(records):
        for record in group:
            value = get(record)
            if value is not None and not _acceptable(value, bounds):
                setattr(record, name, None)
                rejected.setdefault(number, Counter())[f"{prefix}.{name}"] += 1


def refuse_impossible(samples: Sequence[tuple[Sequence[Any], Sequence[Any]]]) -> dict[int, Counter[str]]:
    """``clean_sample`` for many samples of ``shared.protocol.fastbus`` Structs, column by column, in place.

    Each sample is its GPUs and its aggregates. The fast decoder's values are finite numbers of their
    declared types and it admits no field of its own, so a range check per column is all there is:
    ``min`` and ``max`` over every GPU of the read, and only a column out of range is walked. Returns the
    refused fields by the number of the sample that had them (no entry: nothing refused).
    """
    rejected: dict[int, Counter[str]] = {}
    gpus = [sample[0] for sample in samples]
    aggregates = [sample[1] for sample in samples]
    for name, bounds in _SAMPLE_RANGES.items():
        _refuse_column(gpus, name, bounds, "gpus", rejected)
    for name, bounds in _AGGREGATE_RANGES.items():
        _refuse_column(aggregates, name, bounds, "aggregates", rejected)
    return rejected


def sampled_too_far_ahead(sampled_at: datetime, now: datetime, max_future_s: float) -> bool:
    """A sample dated beyond ``now + max_future_s`` cannot be placed in time: refuse all of it."""
    return sampled_at > now + timedelta(seconds=max_future_s)


def bucket_start(at: datetime, resolution: int) -> datetime:
    epoch = int(at.timestamp())
    return datetime.fromtimestamp(epoch - epoch % resolution, UTC)


# ---- series -----------------------------------------------------------------------------


def pick_resolution(requested: str | None, since: datetime | None, until: datetime | None, now: datetime) -> str:
    """``raw``, ``1m`` or ``1h``; ``auto`` (the default) by the span asked for."""
    choice = requested or "auto"
    if choice in ("raw", *RESOLUTIONS):
        return choice
    if choice != "auto":
        raise BadRequest(
            f"resolution must be one of raw, 1m, 1h, auto; got {choice!r}", code="invalid_query"
        )
    if since is None:
        return "raw"
    span = (until or now) - since
    if span <= AUTO_RAW_SPAN:
        return "raw"
    return "1m" if span <= AUTO_MINUTE_SPAN else "1h"


def _mean(total: float, n: int) -> float | None:
    return round(total / n, 3) if n else None


def rollup_view(row: TelemetryRollup) -> dict[str, Any]:
    return {
        "uuid": row.gpu_uuid,
        "index": row.gpu_index,
        "samples": row.samples,
        "gpu_util_avg": _mean(row.util_sum, row.util_n),
        "gpu_util_max": row.util_max,
        "memory_used_avg_mib": _mean(row.mem_sum, row.mem_n),
        "memory_used_max_mib": row.mem_max,
        "temperature_avg_c": _mean(row.temp_sum, row.temp_n),
        "temperature_max_c": row.temp_max,
        "power_avg_w": _mean(row.power_sum, row.power_n),
        "power_max_w": row.power_max,
    }


async def raw_series(
    session: AsyncSession, host_id: str, *, since: datetime | None, until: datetime | None, limit: int
) -> list[dict[str, Any]]:
    """The newest ``limit`` raw samples in the range, oldest first, each with its sequence number."""
    query = select(TelemetrySample).where(TelemetrySample.host_id == host_id)
    if since is not None:
        query = query.where(TelemetrySample.sampled_at >= since)
    if until is not None:
        query = query.where(TelemetrySample.sampled_at < until)
    rows = (await session.scalars(query.order_by(TelemetrySample.sampled_at.desc(), TelemetrySample.seq.desc()).limit(limit))).all()
    return [sample_view(r) for r in reversed(rows)]


def sample_view(row: TelemetrySample) -> dict[str, Any]:
    """One raw sample as the API shows it (``GET /hosts/{id}/metrics``, the live stream)."""
    return {
        "seq": row.seq,
        "sampled_at": row.sampled_at.isoformat(),
        "received_at": row.received_at.isoformat(),
        "window_s": row.window_s,
        "gpus": row.gpus,
        "aggregates": row.aggregates,
    }


async def latest_seq(session: AsyncSession, host_id: str) -> int:
    """The highest sequence number stored for the host's telemetry (-1: none yet)."""
    seq = await session.scalar(select(func.max(TelemetrySample.seq)).where(TelemetrySample.host_id == host_id))
    return -1 if seq is None else int(seq)


async def samples_after(session: AsyncSession, host_id: str, after_seq: int, *, limit: int) -> list[dict[str, Any]]:
    """Raw samples stored with a sequence number above ``after_seq``, lowest first (the live stream's next page)."""
    rows = (
        await session.scalars(
            select(TelemetrySample)
            .where(TelemetrySample.host_id == host_id, TelemetrySample.seq > after_seq)
            .order_by(TelemetrySample.seq)
            .limit(limit)
        )
    ).all()
    return [sample_view(r) for r in rows]


async def rollup_series(
    session: AsyncSession, host_id: str, resolution: str, *, since: datetime | None, until: datetime | None, limit: int
) -> list[dict[str, Any]]:
    """The newest ``limit`` buckets in the range, oldest first, each with every GPU's figures."""
    seconds = RESOLUTIONS[resolution]
    where = [TelemetryRollup.host_id == host_id, TelemetryRollup.resolution == seconds]
    if since is not None:
        where.append(TelemetryRollup.bucket_start >= bucket_start(since, seconds))
    if until is not None:
        where.append(TelemetryRollup.bucket_start < until)
    starts = (
        await session.scalars(
            select(TelemetryRollup.bucket_start).where(*where).group_by(TelemetryRollup.bucket_start)
            .order_by(TelemetryRollup.bucket_start.desc()).limit(limit)
        )
    ).all()
    if not starts:
        return []
    rows = (
        await session.scalars(
            select(TelemetryRollup).where(*where, TelemetryRollup.bucket_start.in_(starts))
            .order_by(TelemetryRollup.bucket_start, TelemetryRollup.gpu_index)
        )
    ).all()
    items: dict[datetime, dict[str, Any]] = {}
    for row in rows:
        item = items.setdefault(
            row.bucket_start, {"bucket_start": row.bucket_start.isoformat(), "resolution_s": seconds, "gpus": []}
        )
        item["gpus"].append(rollup_view(row))
    return list(items.values())


async def count_unrolled(session: AsyncSession) -> int:
    return int(await session.scalar(select(func.count()).select_from(TelemetrySample).where(TelemetrySample.rolled.is_(False))) or 0)
