"""Use of the fleet over time, for the console's charts: GPU occupancy and hosts online, per UTC day.

Read-only, from what the master records anyway: ``gpu_allocations`` (a rental holds a GPU, or a
share of it, from ``created_at`` until ``released_at``) and ``host_events`` (every state change
of every host, with its time, from its first state on).

* **Occupancy** of a GPU on a day: the share of the day it was held, weighted by how much of
  it (``milli`` / 1000: a quarter share held all day is 0.25), capped at 1. Today counts up to
  ``now``. The rows are narrowed in SQL to the allocations overlapping the window; the overlap
  of each with each day is interval arithmetic, done here.
* **Hosts online** on a day: the mean number of hosts in a serving state (online, rented,
  draining) over the day (host-seconds in those states / the day's seconds) and the most at once, from the state at
  the window's start (each host's last event before it) and the events inside it.

A window of ``days`` days ends with today (UTC): ``[today − (days − 1), tomorrow)``.
This module reads the models only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Gpu, GpuAllocation, Host, HostEvent

MAX_DAYS = 366
SERVING_STATES = frozenset({"online", "rented", "draining"})
DAY = timedelta(days=1)


@dataclass(frozen=True)
class Window:
    """``days`` whole UTC days ending with the day of ``now``; ``now`` bounds today's part."""

    first: date
    days: int
    now: datetime

    @classmethod
    def ending(cls, now: datetime, days: int, *, max_days: int = MAX_DAYS) -> Window:
        if not 1 <= days <= max_days:
            raise ValueError(f"days must be 1..{max_days}")
        now = now.astimezone(UTC)
        return cls(now.date() - timedelta(days=days - 1), days, now)

    @property
    def start(self) -> datetime:
        return datetime.combine(self.first, time(), tzinfo=UTC)

    @property
    def end(self) -> datetime:
        return self.start + timedelta(days=self.days)

    def labels(self) -> list[str]:
        return [(self.first + timedelta(days=i)).isoformat() for i in range(self.days)]

    def day_spans(self) -> list[tuple[datetime, datetime]]:
        """Each day's ``[start, end)``, today's ending at ``now`` (a day wholly in the future is empty)."""
        spans = []
        for i in range(self.days):
            start = self.start + i * DAY
            spans.append((start, max(start, min(start + DAY, self.now))))
        return spans

    def frame(self) -> dict[str, Any]:
        return {"from": self.start.isoformat(), "to": self.end.isoformat()}


def _seconds_per_day(
    window: Window, intervals: Iterable[tuple[datetime, datetime | None, float]]
) -> list[float]:
    """Σ weight × seconds of each interval ``[start, end or now)`` inside each day of the window."""
    spans = window.day_spans()
    totals = [0.0] * len(spans)
    for start, end, weight in intervals:
        stop = end or window.now
        for i, (day_start, day_end) in enumerate(spans):
            overlap = (min(stop, day_end) - max(start, day_start)).total_seconds()
            if overlap > 0:
                totals[i] += weight * overlap
    return totals


def _shares(window: Window, seconds: list[float], per: float = 1.0) -> list[float]:
    """Seconds per day as a share of each day's length (× ``per``), rounded to 4 places; a day not begun is 0."""
    out = []
    for held, (start, end) in zip(seconds, window.day_spans(), strict=True):
        length = (end - start).total_seconds() * per
        out.append(round(min(1.0, held / length), 4) if length > 0 and per > 0 else 0.0)
    return out


async def _allocations(
    session: AsyncSession, window: Window, gpu_ids: list[str]
) -> list[tuple[str, datetime, datetime | None, float]]:
    if not gpu_ids:
        return []
    rows = await session.execute(
        select(
            GpuAllocation.gpu_id, GpuAllocation.created_at, GpuAllocation.released_at, GpuAllocation.milli
        ).where(
            GpuAllocation.gpu_id.in_(gpu_ids),
            GpuAllocation.created_at < window.now,
            or_(GpuAllocation.released_at.is_(None), GpuAllocation.released_at > window.start),
        )
    )
    return [
        (gpu_id, created, released, min(1000, milli) / 1000)
        for gpu_id, created, released, milli in rows.all()
    ]


async def gpu_occupancy(session: AsyncSession, owner_id: str, *, days: int, now: datetime) -> dict[str, Any]:
    """Each present GPU of the provider's hosts: its occupancy per UTC day over the last ``days`` days."""
    window = Window.ending(now, days, max_days=31)
    gpus = (
        await session.execute(
            select(Gpu.id, Gpu.uuid, Gpu.index, Gpu.name, Host.id, Host.name)
            .join(Host, Host.id == Gpu.host_id)
            .where(Host.owner_id == owner_id, Host.state != "revoked", Gpu.present.is_(True))
            .order_by(Host.name, Host.id, Gpu.index)
        )
    ).all()
    held: dict[str, list[tuple[datetime, datetime | None, float]]] = {}
    for gpu_id, start, end, weight in await _allocations(session, window, [row[0] for row in gpus]):
        held.setdefault(gpu_id, []).append((start, end, weight))
    items = []
    for gpu_id, uuid, index, name, host_id, host_name in gpus:
        shares = _shares(window, _seconds_per_day(window, held.get(gpu_id, [])))
        elapsed = sum((end - start).total_seconds() for start, end in window.day_spans())
        weighted = sum(
            s * (end - start).total_seconds()
            for s, (start, end) in zip(shares, window.day_spans(), strict=True)
        )
        items.append({"gpu_id": gpu_id, "uuid": uuid, "index": index, "name": name, "host_id": host_id,
                      "host_name": host_name or host_id, "occupancy": shares,
                      "average": round(weighted / elapsed, 4) if elapsed else 0.0})  # fmt: skip
    return {**window.frame(), "days": window.labels(), "gpus": items}


async def fleet_occupancy(session: AsyncSession, window: Window) -> list[float]:
    """Per day: the share of all present GPUs (of hosts not revoked) held, weighted by shares."""
    gpu_ids = list(
        (
            await session.scalars(
                select(Gpu.id)
                .join(Host, Host.id == Gpu.host_id)
                .where(Host.state != "revoked", Gpu.present.is_(True))
            )
        ).all()
    )
    intervals = [
        (start, end, weight) for _, start, end, weight in await _allocations(session, window, gpu_ids)
    ]
    return _shares(window, _seconds_per_day(window, intervals), per=float(len(gpu_ids)))


async def hosts_online(session: AsyncSession, window: Window) -> list[tuple[float, int]]:
    """Per day: the mean number of hosts in a serving state (online, rented, draining), to 2 places, and the
    most at once."""
    last_before = (
        select(func.max(HostEvent.id))
        .where(HostEvent.at < window.start)
        .group_by(HostEvent.host_id)
        .scalar_subquery()
    )
    events = (
        await session.execute(
            select(HostEvent.host_id, HostEvent.at, HostEvent.to_state)
            .where(
                or_(
                    HostEvent.id.in_(last_before),
                    and_(HostEvent.at >= window.start, HostEvent.at < window.now),
                )
            )
            .order_by(HostEvent.host_id, HostEvent.at, HostEvent.id)
        )
    ).all()
    intervals: list[tuple[datetime, datetime | None, float]] = []
    serving_since: dict[str, datetime] = {}
    for host_id, at, state in events:
        at = max(at, window.start)
        if state in SERVING_STATES:
            serving_since.setdefault(host_id, at)
        elif host_id in serving_since:
            intervals.append((serving_since.pop(host_id), at, 1.0))
    intervals.extend((since, None, 1.0) for since in serving_since.values())
    out = []
    for seconds, (start, end) in zip(_seconds_per_day(window, intervals), window.day_spans(), strict=True):
        mean = round(seconds / (end - start).total_seconds(), 2) if end > start else 0.0
        out.append((mean, _most_at_once(intervals, start, end, window.now)))
    return out


def _most_at_once(
    intervals: list[tuple[datetime, datetime | None, float]], start: datetime, end: datetime, now: datetime
) -> int:
    """The most intervals open at one moment of ``[start, end)`` (one ending as another starts: not both)."""
    changes: list[tuple[datetime, int]] = []
    for since, until, _ in intervals:
        stop = min(until or now, end)
        since = max(since, start)
        if since < stop:
            changes += [(since, 1), (stop, -1)]
    most = current = 0
    for _, change in sorted(changes, key=lambda item: (item[0], item[1])):
        current += change
        most = max(most, current)
    return most
