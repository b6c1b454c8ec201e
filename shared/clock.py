"""Time: wall-clock UTC for records, monotonic for durations. Injected, never global."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime:
        """Aware UTC wall-clock time, for timestamps that are stored or shown."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back, for measuring durations."""
        ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()


def utcnow() -> datetime:
    return datetime.now(UTC)
