"""A container's output as the engine streams it: entries parsed in batches, timestamps read (no engine needed)."""

from __future__ import annotations

import itertools
import struct

from agent.runtimes import containerlogs
from agent.runtimes.containeropts import parse_timestamp_ns


class Pieces:
    """A stand-in for aiohttp's ``StreamReader``: ``read`` answers with the next piece, then b"" (the end)."""

    def __init__(self, data: bytes, cuts: list[int]) -> None:
        edges = [0, *cuts, len(data)]
        self.pieces = [data[a:b] for a, b in itertools.pairwise(edges)]

    async def read(self, n: int) -> bytes:
        return self.pieces.pop(0) if self.pieces else b""


def entry(stream: int, payload: bytes) -> bytes:
    return struct.pack(">BxxxL", stream, len(payload)) + payload


async def _collect(data: bytes, cuts: list[int]) -> list[list[bytes]]:
    return [batch async for batch in containerlogs._batches(Pieces(data, cuts))]  # type: ignore[arg-type]


async def test_entries_come_in_batches_of_what_arrived_whatever_the_cuts() -> None:
    payloads = [b"2024-01-02T03:04:05.1Z line %d\n" % i for i in range(20)] + [b""]
    data = b"".join(entry(1 + i % 2, p) for i, p in enumerate(payloads))
    whole = await _collect(data, [])
    assert whole == [payloads[:-1]]  # one batch; the empty entry skipped
    for cuts in ([3], [8, 9, 50], list(range(1, len(data), 7)), [len(data) - 1]):
        batches = await _collect(data, cuts)
        assert [p for batch in batches for p in batch] == payloads[:-1]
        assert all(batches)


async def test_an_entry_cut_off_by_the_end_is_dropped() -> None:
    data = entry(1, b"whole\n") + entry(1, b"cut off\n")[:-3]
    assert await _collect(data, [5]) == [[b"whole\n"]]


def test_timestamps_the_engine_writes_and_others() -> None:
    base = 1704164645  # 2024-01-02T03:04:05Z
    assert parse_timestamp_ns(b"2024-01-02T03:04:05.123456789Z") == base * 10**9 + 123456789
    assert parse_timestamp_ns(b"2024-01-02T03:04:05.1234Z") == base * 10**9 + 123400000  # trailing zeros trimmed
    assert parse_timestamp_ns(b"2024-01-02T03:04:05Z") == base * 10**9
    assert parse_timestamp_ns(b"2024-01-02T03:04:06.5Z") == (base + 1) * 10**9 + 500000000
    for bad in (b"garbage", b"", b"2024-13-02T03:04:05.1Z"):
        assert parse_timestamp_ns(bad) is None
