"""Measuring between cluster members through their tunnel (``agent.clusternet``): each member answers a responder
on its private address (``MEASURE_PORT``), and the others measure against it — ``echo``: the median of a few
one-byte round trips; ``sink``: the throughput of sending a number of bytes until the responder says it has them."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Final

MEASURE_PORT: Final = 29499  # the responder's TCP port on the member's private address
PINGS: Final = 5
# The stages the responder answers: "E" echoes bytes one by one (round trip), "S" + 8-byte length sinks that many and says "K".
MAX_SINK_BYTES: Final = 256 << 20


async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        async with asyncio.timeout(60):
            stage = await reader.readexactly(1)
            if stage == b"E":
                for _ in range(PINGS):
                    writer.write(await reader.readexactly(1))
                    await writer.drain()
            elif stage == b"S":
                left = min(int.from_bytes(await reader.readexactly(8), "big"), MAX_SINK_BYTES)
                while left > 0:
                    chunk = await reader.read(min(left, 1 << 16))
                    if not chunk:
                        return
                    left -= len(chunk)
                writer.write(b"K")
                await writer.drain()
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> float:
    """The median of ``PINGS`` one-byte round trips, ms."""
    rtts: list[float] = []
    writer.write(b"E")
    for _ in range(PINGS):
        started = time.perf_counter()
        writer.write(b"p")
        await writer.drain()
        await reader.readexactly(1)
        rtts.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(rtts), 3)


async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, size: int) -> float:
    """Mbit/s of sending ``size`` bytes until the responder says it has them all."""
    chunk = bytes(1 << 16)
    started = time.perf_counter()
    writer.write(b"S" + size.to_bytes(8, "big"))
    sent = 0
    while sent < size:
        part = chunk[: min(len(chunk), size - sent)]
        writer.write(part)
        await writer.drain()
        sent += len(part)
    await reader.readexactly(1)
    return round(size * 8 / (time.perf_counter() - started) / 1e6, 1)
