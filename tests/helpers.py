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


# Polls space out as a wait goes on: ``every`` at first, then a tenth of the time waited so far, at most this. A check is
# often an API call (a few ms of CPU); at a fixed 20 ms a 10 s wait made ~500 of them, competing with the servers the
# test waits on for the same two cores. Now ~70, and a condition is seen at most 10 % (or 0.25 s) after it holds.
MAX_POLL_S = 0.25


async def eventually(check: Callable[[], Awaitable[T | None]], *, timeout: float = 15.0, every: float = 0.02, what: str = "condition") -> T:
    """Return the first truthy value ``check()`` gives; fail after ``timeout`` seconds. Checks every ``every`` seconds
    at first, further apart as the wait goes on (``MAX_POLL_S``)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + timeout
    last: T | None = None
    while loop.time() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(max(every, min((loop.time() - started) / 10, MAX_POLL_S)))
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

