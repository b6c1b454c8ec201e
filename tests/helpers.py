"""Waiting for conditions without sleeping real seconds blindly: poll briefly, bounded."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import msgspec

from shared import protocol
from shared.protocol import fastbus

T = TypeVar("T")


async def eventually(check: Callable[[], Awaitable[T | None]], *, timeout: float = 15.0, every: float = 0.02, what: str = "condition") -> T:
    """Return the first truthy value ``check()`` gives; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: T | None = None
    while loop.time() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


class ManualClock:
    """A ``shared.clock.Clock`` that moves only when told to (wall and monotonic together)."""

    def __init__(self, start: datetime | None = None) -> None:
        self.current = start or datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
        self.mono = 1_000.0

    def now(self) -> datetime:
        return self.current

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.current += timedelta(seconds=seconds)
        self.mono += seconds


def same_as_full_decoder(payload: bytes) -> fastbus.BusReport | None:
    """The fast decoder accepts nothing ``decode_bus_envelope`` refuses, and what it accepts carries the same values."""
    report = fastbus.decode_bus_report(payload)
    if report is not None:
        envelope = protocol.decode_bus_envelope(payload)  # raises (and fails the test) where it refuses
        assert msgspec.to_builtins(report, builtin_types=(datetime,)) == envelope.model_dump()
    return report

