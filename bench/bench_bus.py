"""Throughput of the bus implementations against raw redis-py on the same Redis, in one run.

Measures, in messages per second:

* publish: ``await bus.publish()`` one message at a time (each returns once the message is
  on the bus), against a raw ``XADD ... MAXLEN ~`` loop;
* round trip: one producer task publishing while one consumer drains with
  ``read(count=100)`` + ``ack`` per batch, against raw ``XADD`` / ``XREADGROUP`` / ``XACK``.

Each is measured ``--rounds`` times, interleaved, and reported as the median. The
in-process rows are compared with the same Redis baseline, to show what Redis costs.

Usage: ``python bench/bench_bus.py [--messages N] [--rounds R] [--payload-bytes B] [--redis-url URL] [--quick]``
(Redis defaults to ``GPUMARKET_REDIS_URL`` or ``redis://127.0.0.1:6379/0``; keys use a
random prefix and are deleted afterwards).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from shared.bus import Bus, InProcessBus, RedisBus

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import record

STREAM = "bench"
GROUP = "bench-group"
BATCH = 100
WARMUP = 200


@dataclass
class Result:
    name: str
    messages: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.messages / self.seconds


async def timed(name: str, messages: int, run: Awaitable[None]) -> Result:
    """Await ``run`` (a coroutine not started yet) and time it."""
    started = time.perf_counter()
    await run
    return Result(name, messages, time.perf_counter() - started)


# ---- our buses ------------------------------------------------------------------------------


async def bus_publish(bus: Bus, stream: str, messages: int, payload: bytes) -> None:
    for _ in range(messages):
        await bus.publish(stream, payload)


async def bus_round_trip(bus: Bus, stream: str, messages: int, payload: bytes) -> None:
    await bus.ensure_group(stream, GROUP)

    async def produce() -> None:
        for sent in range(1, messages + 1):
            await bus.publish(stream, payload)
            if sent % BATCH == 0:
                await asyncio.sleep(0)  # the in-process publish never suspends: let the consumer run

    async def consume() -> None:
        received = 0
        while received < messages:
            batch = await bus.read(stream, GROUP, "bench-consumer", count=BATCH, block=1.0)
            if batch:
                await bus.ack(stream, GROUP, [message.id for message in batch])
                received += len(batch)

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(produce())
        tasks.create_task(consume())


# ---- raw redis-py baseline ------------------------------------------------------------------


async def raw_publish(client: aioredis.Redis, key: str, messages: int, payload: bytes, max_len: int) -> None:
    for _ in range(messages):
        await client.xadd(key, {b"p": payload}, maxlen=max_len, approximate=True)


async def raw_round_trip(
    client: aioredis.Redis, key: str, messages: int, payload: bytes, max_len: int
) -> None:
    await client.xgroup_create(key, GROUP, "0", mkstream=True)

    async def produce() -> None:
        for _ in range(messages):
            await client.xadd(key, {b"p": payload}, maxlen=max_len, approximate=True)

    async def consume() -> None:
        received = 0
        while received < messages:
            reply = cast(
                "list[Any]",
                await client.xreadgroup(GROUP, "bench-consumer", {key: ">"}, count=BATCH, block=1000),
            )
            for _key, entries in reply:
                ids = [message_id for message_id, _fields in entries]
                if ids:
                    await client.xack(key, GROUP, *ids)
                    received += len(ids)

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(produce())
        tasks.create_task(consume())


# ---- report ---------------------------------------------------------------------------------


def median_rate(results: list[Result]) -> float:
    return statistics.median(result.rate for result in results)


def print_table(title: str, baseline: str, results: dict[str, list[Result]]) -> None:
    baseline_rate = median_rate(results[baseline])
    print(f"\n{title}")
    print(f"  {'implementation':<34} {'msg/s (median)':>15} {'min':>10} {'max':>10} {'ours/baseline':>14}")
    for name, rounds in results.items():
        rates = [result.rate for result in rounds]
        ratio = "(baseline)" if name == baseline else f"{median_rate(rounds) / baseline_rate:.2f}x"
        print(
            f"  {name:<34} {median_rate(rounds):>15,.0f} {min(rates):>10,.0f} {max(rates):>10,.0f} {ratio:>14}"
        )
        if name != baseline:
            record("bus", f"{name}, {title.split(' (')[0]}", median_rate(rounds), "msgs/s", baseline, baseline_rate)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=5_000, help="messages per measurement (default 5000)")
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each contender (default 3)")
    parser.add_argument("--payload-bytes", type=int, default=256, help="payload size (default 256)")
    parser.add_argument(
        "--redis-url", default=os.environ.get("GPUMARKET_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--quick", action="store_true", help="1,000 messages × 2 rounds (for make bench QUICK=1)")
    args = parser.parse_args()
    messages: int = 1_000 if args.quick else args.messages
    rounds: int = 2 if args.quick else args.rounds
    if messages < 1 or rounds < 1:
        parser.error("--messages and --rounds must be at least 1")
    payload = os.urandom(args.payload_bytes)
    max_len = max(1_000_000, 2 * messages)
    prefix = f"gpumarket-bench:{uuid.uuid4().hex}:"

    raw = aioredis.Redis.from_url(args.redis_url)
    try:
        await raw.ping()
    except (redis_errors.RedisError, OSError) as exc:
        print(
            f"Redis at {args.redis_url} is unreachable ({exc}); start it or set GPUMARKET_REDIS_URL",
            file=sys.stderr,
        )
        await raw.aclose()
        return 2
    redis_bus = RedisBus.from_url(args.redis_url, prefix=prefix, max_len=max_len)
    memory_bus = InProcessBus(max_len=max_len)
    print(f"{rounds} rounds of {messages} messages of {len(payload)} bytes; Redis at {args.redis_url}")

    publish: dict[str, list[Result]] = {}
    round_trip: dict[str, list[Result]] = {}
    try:
        # Warm up connections, the claim script cache and the interpreter's caches.
        await bus_round_trip(redis_bus, "warmup", WARMUP, payload)
        await raw_round_trip(raw, prefix + "raw-warmup", WARMUP, payload, max_len)
        # Rounds interleave the contenders so that drift (Redis growing its streams, other load
        # on the machine) hits all of them alike; the tables show each one's median.
        for number in range(rounds):
            stream, raw_key = f"p{number}", f"{prefix}raw-p{number}"
            for result in [
                await timed(
                    "InProcessBus.publish", messages, bus_publish(memory_bus, stream, messages, payload)
                ),
                await timed("RedisBus.publish", messages, bus_publish(redis_bus, stream, messages, payload)),
                await timed("redis-py XADD", messages, raw_publish(raw, raw_key, messages, payload, max_len)),
            ]:
                publish.setdefault(result.name, []).append(result)
            stream, raw_key = f"rt{number}", f"{prefix}raw-rt{number}"
            for result in [
                await timed(
                    "InProcessBus publish/read/ack",
                    messages,
                    bus_round_trip(memory_bus, stream, messages, payload),
                ),
                await timed(
                    "RedisBus publish/read/ack",
                    messages,
                    bus_round_trip(redis_bus, stream, messages, payload),
                ),
                await timed(
                    "redis-py XADD/XREADGROUP/XACK",
                    messages,
                    raw_round_trip(raw, raw_key, messages, payload, max_len),
                ),
            ]:
                round_trip.setdefault(result.name, []).append(result)
    finally:
        keys = [key async for key in raw.scan_iter(match=f"{prefix}*")]
        if keys:
            await raw.delete(*keys)
        await redis_bus.close()
        await memory_bus.close()
        await raw.aclose()

    print_table("publish (one at a time)", "redis-py XADD", publish)
    print_table(
        f"round trip (producer + consumer, batches of up to {BATCH})",
        "redis-py XADD/XREADGROUP/XACK",
        round_trip,
    )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
