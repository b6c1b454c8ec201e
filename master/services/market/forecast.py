"""Demand forecasts: GPUs wanted per GPU model and region, hour by hour, for the next hours (issue 26, part 3).

**History.** Every rental is demand from its creation — time queued counts: it was wanted — to its stop (or now), of
``gpu_count × gpu_milli / 1000`` GPUs, by GPU model (the one it got, else the words it asked for, else ``any``) and
region (its host's; ``any`` for one never placed). ``hourly_demand`` spreads each over the hours it overlaps, in
GPU-hours per hour: the mean number of GPUs wanted in that hour.

**The forecast** (``master/services/market/forecast_models.py``): per series, the seasonal baseline (each hour the mean of
the same hour over the last seven days), or a small learned model (a ridge regression) where that beat the baseline
on the held-out last days of the history. ``tests/test_forecast.py`` measures both on synthetic histories.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Host, Rental
from master.services.market.forecast_models import choose_forecast, mean_absolute_error, seasonal_forecast

HOUR = timedelta(hours=1)
ANY = "any"
Key = tuple[str, str]  # (GPU model, region)


def hour_start(at: datetime) -> datetime:
    return at.replace(minute=0, second=0, microsecond=0)


def hourly_demand(intervals: Iterable[tuple[Key, datetime, datetime, float]], *, since: datetime,
                  hours: int) -> dict[Key, list[float]]:  # fmt: skip
    """GPUs wanted per hour (GPU-hours in each hour) from ``since`` (an hour's start) for ``hours``, per key."""
    until = since + hours * HOUR
    series: dict[Key, list[float]] = defaultdict(lambda: [0.0] * hours)
    for key, start, end, gpus in intervals:
        start, end = max(start, since), min(end, until)
        if end <= start or gpus <= 0:
            continue
        index = int((hour_start(start) - since) / HOUR)
        bucket = since + index * HOUR
        while bucket < end:
            overlap = min(end, bucket + HOUR) - max(start, bucket)
            series[key][index] += gpus * overlap / HOUR
            index, bucket = index + 1, bucket + HOUR
    return dict(series)


async def demand_history(session: AsyncSession, *, now: datetime, days: int) -> tuple[datetime, dict[Key, list[float]]]:
    """The last ``days`` whole days of hourly demand up to the current hour's start, per (model, region)."""
    until = hour_start(now)
    since = until - timedelta(days=days)
    rows = (await session.execute(
        select(Rental.created_at, Rental.stopped_at, Rental.gpu_count, Rental.gpu_milli, Rental.gpu_model, Rental.spec, Host.region)
        .outerjoin(Host, Host.id == Rental.host_id)
        .where(Rental.created_at < until, or_(Rental.stopped_at.is_(None), Rental.stopped_at > since))
    )).all()  # fmt: skip
    intervals = []
    for created, stopped, count, milli, model, spec, region in rows:
        asked = (spec or {}).get("gpu_model")
        key = (model or asked or ANY, region or ANY)
        intervals.append((key, created, stopped or until, count * milli / 1000))
    return since, hourly_demand(intervals, since=since, hours=days * 24)


async def demand_forecast(session: AsyncSession, *, now: datetime, days: int = 14, horizon: int = 24) -> dict[str, Any]:
    """Per (model, region) with any demand in the last ``days``: the last day's demand and the next ``horizon`` hours'
    forecast, hour by hour from the current hour's start, with the method chosen for it and the held-out errors."""
    since, history = await demand_history(session, now=now, days=days)
    start = since + days * 24 * HOUR
    series = []
    for (model, region), values in sorted(history.items()):
        choice = choose_forecast(values, horizon=horizon)
        ahead = choice.forecast
        peak = max(range(horizon), key=ahead.__getitem__)
        series.append({
            "gpu_model": model, "region": region, "last_day": [round(v, 3) for v in values[-24:]],
            "forecast": [round(v, 3) for v in ahead], "peak_at": _iso(start + peak * HOUR), "peak_gpus": round(ahead[peak], 3),
            "method": choice.method, "held_out_error": _errors(choice.baseline_error, choice.learned_error),
        })  # fmt: skip
    return {"from": _iso(start), "hours": horizon, "history_days": days,
            "method": "per series: the seasonal mean of the same hour over the last 7 days, or a ridge regression where it "
                      "beat that on the last 2 (held-out) days",
            "series": series}  # fmt: skip


def _errors(baseline: float | None, learned: float | None) -> dict[str, float] | None:
    """Mean absolute error (GPUs) of each method on the held-out days; None where the history was too short."""
    if baseline is None or learned is None:
        return None
    return {"seasonal": round(baseline, 3), "learned": round(learned, 3)}


def _iso(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


__all__ = ["ANY", "HOUR", "demand_forecast", "demand_history", "hour_start", "hourly_demand", "mean_absolute_error",
           "seasonal_forecast"]  # fmt: skip
