"""``InProcessBus``: the ``Bus`` held in memory, for embedded mode and tests (one event loop)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.bus.base import Backlog, BusMessage, check_limits
from shared.errors import BusError


@dataclass(slots=True)
class _Pending:
    consumer: str
    delivered_at: float
    deliveries: int


@dataclass(slots=True)
class _Group:
    last_delivered: int
    """Sequence number of the newest entry delivered to this group (0: none yet)."""
    pending: dict[int, _Pending] = field(default_factory=dict)
    """By sequence number, in ascending order (reads deliver in order, claims update in place)."""
    claim_cursor: int = 0
    """Where the next ``claim_stale`` sweep resumes, like the cursor of ``XAUTOCLAIM``."""


@dataclass(slots=True)
class _Stream:
    entries: dict[int, bytes] = field(default_factory=dict)
    published_at: dict[int, float] = field(default_factory=dict)
    """Wall-clock publish time of each entry still held."""
    order: deque[int] = field(default_factory=deque)
    """Sequence numbers not yet passed by trimming; contiguous up to ``last_seq``."""
    retained: set[int] = field(default_factory=set)
    """Entries trimming passed over because they were pending; dropped once acknowledged."""
    last_seq: int = 0
    groups: dict[str, _Group] = field(default_factory=dict)
    appended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set (and replaced) on every publish, to wake blocked readers."""


def _parse_local_id(message_id: str) -> int:
    head, sep, tail = message_id.partition("-")
    if not (sep and tail == "0" and head.isdigit()):
        raise BusError(f"invalid message id {message_id!r}: in-process ids look like '42-0'")
    return int(head)


class InProcessBus:
    """A ``Bus`` held in memory, for embedded mode and tests. Not shared between event loops.

    ``max_len`` bounds every stream. When a publish would exceed it, the oldest entries that
    every group has already received and nobody has left pending are dropped; if that is not
    enough, ``publish`` raises ``BusError`` instead of growing without bound. Unlike
    ``RedisBus`` (which trims regardless), it never drops a message a group still needs.

    ``clock`` measures how long messages have been pending, for ``claim_stale``; tests
    inject a fake one. Blocking reads wait on the event loop's own clock.
    """

    def __init__(
        self,
        *,
        max_len: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if max_len < 1:
            raise ValueError(f"max_len must be at least 1, got {max_len}")
        self._max_len = max_len
        self._clock = clock
        self._wall_clock = wall_clock
        self._streams: dict[str, _Stream] = {}
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise BusError("the in-process bus is closed")

    def _stream(self, name: str) -> _Stream:
        stream = self._streams.get(name)
        if stream is None:
            stream = self._streams[name] = _Stream()
        return stream

    def _group(self, stream: _Stream, group: str) -> _Group:
        state = stream.groups.get(group)
        if state is None:
            # "0": the oldest entry trimming has not passed (a retained pending entry of another
            # group is not redelivered to a group created after it was passed over).
            start = stream.order[0] - 1 if stream.order else stream.last_seq
            state = stream.groups[group] = _Group(last_delivered=start)
        return state

    async def publish(self, stream: str, payload: bytes) -> str:
        """Append ``payload``; raise ``BusError`` if the stream is full of unconsumed messages.

        Never suspends, so cancelling it is safe (it either did not start or completed).
        """
        self._check_open()
        state = self._stream(stream)
        if len(state.entries) >= self._max_len:
            self._trim(state, len(state.entries) - self._max_len + 1)
            if len(state.entries) >= self._max_len:
                raise BusError(
                    f"stream {stream!r} is full: {len(state.entries)} unacknowledged messages "
                    f"(max_len={self._max_len}); consumers are not keeping up",
                    details={"stream": stream, "max_len": self._max_len},
                )
        state.last_seq += 1
        state.entries[state.last_seq] = bytes(payload)
        state.published_at[state.last_seq] = self._wall_clock()
        state.order.append(state.last_seq)
        appended, state.appended = state.appended, asyncio.Event()
        appended.set()
        return f"{state.last_seq}-0"

    def _trim(self, state: _Stream, wanted: int) -> None:
        """Drop up to ``wanted`` of the oldest entries every group has received and nobody has pending."""
        horizon = min((group.last_delivered for group in state.groups.values()), default=state.last_seq)
        dropped = 0
        while dropped < wanted and state.order and state.order[0] <= horizon:
            seq = state.order.popleft()
            if any(seq in group.pending for group in state.groups.values()):
                state.retained.add(seq)
            else:
                del state.entries[seq]
                state.published_at.pop(seq, None)
                dropped += 1

    async def ensure_group(self, stream: str, group: str) -> None:
        """Create the group (and stream) if missing. Never suspends; cancelling is safe."""
        self._check_open()
        self._group(self._stream(stream), group)

    async def read(
        self, stream: str, group: str, consumer: str, *, count: int = 100, block: float | None = 1.0
    ) -> list[BusMessage]:
        """Deliver up to ``count`` new messages to ``consumer``; wait up to ``block`` seconds for some.

        Creates the group if missing. Cancelling is safe: messages are taken and marked pending
        in one step with no suspension point before returning them, so a cancelled read has
        taken nothing. ``close()`` wakes a blocked read, which then raises ``BusError``.
        """
        check_limits(count=count, block=block)
        self._check_open()
        state = self._stream(stream)
        group_state = self._group(state, group)
        deadline = None if not block else asyncio.get_running_loop().time() + block
        while True:
            if group_state.last_delivered < state.last_seq:
                return self._deliver(stream, state, group_state, consumer, count)
            if deadline is None:
                return []
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return []
            try:
                async with asyncio.timeout(remaining):
                    await state.appended.wait()
            except TimeoutError:
                return []
            self._check_open()

    def _deliver(
        self, stream: str, state: _Stream, group: _Group, consumer: str, count: int
    ) -> list[BusMessage]:
        now = self._clock()
        first = group.last_delivered + 1
        last = min(state.last_seq, group.last_delivered + count)
        messages = []
        for seq in range(first, last + 1):
            group.pending[seq] = _Pending(consumer=consumer, delivered_at=now, deliveries=1)
            messages.append(
                BusMessage(stream=stream, id=f"{seq}-0", payload=state.entries[seq], deliveries=1)
            )
        group.last_delivered = last
        return messages

    async def ack(self, stream: str, group: str, ids: Sequence[str]) -> int:
        """Acknowledge ``ids``; return how many were pending. Never suspends; cancelling is safe."""
        self._check_open()
        seqs = [_parse_local_id(message_id) for message_id in ids]
        state = self._streams.get(stream)
        group_state = state.groups.get(group) if state is not None else None
        if state is None or group_state is None:
            return 0
        acked = 0
        for seq in seqs:
            if group_state.pending.pop(seq, None) is None:
                continue
            acked += 1
            if seq in state.retained and not any(seq in g.pending for g in state.groups.values()):
                state.retained.discard(seq)
                del state.entries[seq]
                state.published_at.pop(seq, None)
        return acked

    async def claim_stale(
        self, stream: str, group: str, consumer: str, *, min_idle: float, count: int = 100
    ) -> list[BusMessage]:
        """Take over up to ``count`` messages pending for ``min_idle`` seconds or more, in id order.

        Like ``XAUTOCLAIM``, a sweep that stops at ``count`` resumes after the last message it
        took on the next call. Creates the group if missing. Never suspends; cancelling is safe.
        """
        check_limits(count=count, min_idle=min_idle)
        self._check_open()
        state = self._stream(stream)
        group_state = self._group(state, group)
        now = self._clock()
        claimed: list[BusMessage] = []
        next_cursor = 0
        for seq, pending in group_state.pending.items():
            if seq < group_state.claim_cursor or now - pending.delivered_at < min_idle:
                continue
            if len(claimed) == count:
                next_cursor = seq
                break
            pending.consumer = consumer
            pending.delivered_at = now
            pending.deliveries += 1
            claimed.append(
                BusMessage(
                    stream=stream, id=f"{seq}-0", payload=state.entries[seq], deliveries=pending.deliveries
                )
            )
        group_state.claim_cursor = next_cursor
        return claimed

    async def pending_count(self, stream: str, group: str) -> int:
        """Never suspends; cancelling is safe."""
        self._check_open()
        state = self._streams.get(stream)
        group_state = state.groups.get(group) if state is not None else None
        return 0 if group_state is None else len(group_state.pending)

    async def stream_length(self, stream: str) -> int:
        """Never suspends; cancelling is safe."""
        self._check_open()
        state = self._streams.get(stream)
        return 0 if state is None else len(state.entries)

    async def backlog(self, stream: str, group: str) -> Backlog:
        """Never suspends; cancelling is safe."""
        self._check_open()
        state = self._streams.get(stream)
        group_state = state.groups.get(group) if state is not None else None
        if state is None or group_state is None:
            return Backlog(undelivered=0, pending=0, oldest_published_at=None)
        undelivered = state.last_seq - group_state.last_delivered
        oldest_seq = min(group_state.pending, default=None)
        if oldest_seq is None and undelivered:
            oldest_seq = group_state.last_delivered + 1
        oldest = state.published_at.get(oldest_seq) if oldest_seq is not None else None
        return Backlog(undelivered=undelivered, pending=len(group_state.pending), oldest_published_at=oldest)

    async def ping(self) -> None:
        """Raise ``BusError`` if the bus is closed."""
        self._check_open()

    async def close(self) -> None:
        """Drop every stream and wake blocked reads (they raise ``BusError``). Idempotent."""
        self._closed = True
        for state in self._streams.values():
            state.appended.set()
        self._streams.clear()


__all__ = ["InProcessBus"]
