"""The ``Bus`` interface and the records it hands out (``BusMessage``, ``Backlog``).

The semantics every implementation follows are in the package docstring (``shared.bus``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class BusMessage:
    """One message as delivered to a consumer."""

    stream: str
    id: str
    """Opaque, ordered within a stream: Redis ids ``"<ms>-<seq>"``; in-process ``"<n>-0"``."""
    payload: bytes
    deliveries: int
    """1 on first delivery, incremented each time ``claim_stale`` redelivers it."""


@dataclass(frozen=True, slots=True)
class Backlog:
    """What a consumer group has not finished: the basis of the ingestion-lag figure."""

    undelivered: int
    """Entries not yet delivered to the group."""
    pending: int
    """Entries delivered but not acknowledged."""
    oldest_published_at: float | None
    """Wall-clock time (epoch seconds) the oldest unfinished entry was published; None if none."""

    def lag(self, now: float) -> float:
        """Seconds the oldest unfinished entry has waited (0 when the group is caught up)."""
        return 0.0 if self.oldest_published_at is None else max(0.0, now - self.oldest_published_at)


class Bus(Protocol):
    """Append-only streams with Redis consumer-group semantics (at-least-once delivery)."""

    async def publish(self, stream: str, payload: bytes) -> str:
        """Append ``payload`` and return its id once it is durably on the bus.

        Cancelling is safe but leaves it unknown whether the message was published.
        """
        ...

    async def ensure_group(self, stream: str, group: str) -> None:
        """Create ``group`` (and the stream) if missing; a new group starts at the oldest entry.

        Idempotent, so cancelling is safe: call it again.
        """
        ...

    async def read(
        self, stream: str, group: str, consumer: str, *, count: int = 100, block: float | None = 1.0
    ) -> list[BusMessage]:
        """Return up to ``count`` messages never delivered to ``group``, now pending for ``consumer``.

        Waits up to ``block`` seconds when none is available (``None`` or ``0``: do not wait)
        and returns ``[]`` on timeout. Creates the group if it is missing. Cancelling is safe:
        nothing is lost (see the implementations for where an interrupted message goes).
        """
        ...

    async def ack(self, stream: str, group: str, ids: Sequence[str]) -> int:
        """Remove ``ids`` from the group's pending list; return how many were pending.

        Acking an id twice, or one that is not pending, is harmless (it counts 0), so
        cancelling is safe: ack again, or let ``claim_stale`` redeliver.
        """
        ...

    async def claim_stale(
        self, stream: str, group: str, consumer: str, *, min_idle: float, count: int = 100
    ) -> list[BusMessage]:
        """Take over up to ``count`` messages pending (for any consumer) for ``min_idle`` seconds or more.

        They become pending for ``consumer`` and come back with ``deliveries`` incremented.
        The pending list is swept in id order; a sweep stopped by ``count`` resumes after the
        last message it took on the next call. Creates the group if it is missing. Cancelling
        is safe: whatever was claimed stays pending and is claimed again after ``min_idle``.
        """
        ...

    async def pending_count(self, stream: str, group: str) -> int:
        """How many messages of the group are delivered but not acknowledged (0 if no such group).

        Read-only; cancelling is safe.
        """
        ...

    async def stream_length(self, stream: str) -> int:
        """How many entries the stream holds (0 if no such stream). Read-only; cancelling is safe."""
        ...

    async def backlog(self, stream: str, group: str) -> Backlog:
        """The group's undelivered and pending entries and when the oldest was published.

        Read-only; cancelling is safe. A missing group or stream has an empty backlog.
        """
        ...

    async def ping(self) -> None:
        """Raise ``BusError`` unless the bus is reachable. Cancelling is safe."""
        ...

    async def close(self) -> None:
        """Release the bus's resources; later calls raise ``BusError``."""
        ...


def check_limits(*, count: int, block: float | None = None, min_idle: float = 0.0) -> None:
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    if block is not None and block < 0:
        raise ValueError(f"block must be None or >= 0 seconds, got {block}")
    if min_idle < 0:
        raise ValueError(f"min_idle must be >= 0 seconds, got {min_idle}")


__all__ = ["Backlog", "Bus", "BusMessage", "check_limits"]
