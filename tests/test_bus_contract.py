"""The ``Bus`` contract, run against ``InProcessBus`` and ``RedisBus`` on a real Redis server.

Redis comes from ``GPUMARKET_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``); each test uses
a random key prefix and deletes its keys afterwards. An unreachable Redis fails the tests.
Waits are multiples of ``TICK``; pending-idle time passes through ``BusHarness.advance``
(a fake clock in-process, a short real sleep on Redis).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from shared.bus import Bus, BusMessage, InProcessBus, RedisBus, open_bus
from shared.errors import BusError, BusTimeout, ConfigError
from tests.helpers import eventually

REDIS_URL = os.environ.get("GPUMARKET_REDIS_URL", "redis://127.0.0.1:6379/0")
TICK = 0.05  # seconds: the unit of every wait in this file
BLOCK = 4 * TICK  # the block time of a read that is to come back empty
LONG_BLOCK = 30.0  # a read that is to return a message: it returns when the message comes, so only a failure waits

STREAM = "jobs"
GROUP = "masters"


class FakeClock:
    """A monotonic clock that only moves when told to."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class BusHarness:
    kind: str
    bus: Bus
    new_bus: Callable[[int], Bus]
    """Another bus of the same kind (and, on Redis, the same key prefix) with the given max_len."""
    advance: Callable[[float], Awaitable[None]]
    """Let this many seconds of pending-idle time pass."""
    prefix: str = ""
    admin: aioredis.Redis | None = None
    client_name: str = ""


def parse_id(message_id: str) -> tuple[int, int]:
    millis, _, seq = message_id.partition("-")
    return int(millis), int(seq)


async def connect_admin() -> aioredis.Redis:
    admin = aioredis.Redis.from_url(REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    try:
        await admin.ping()
    except (redis_errors.RedisError, OSError) as exc:
        await admin.aclose()
        pytest.fail(
            f"Redis at {REDIS_URL} is unreachable ({exc}); start redis-server or point "
            "GPUMARKET_REDIS_URL at one. These tests never skip.",
            pytrace=False,
        )
    return admin


@contextlib.asynccontextmanager
async def open_memory_harness() -> AsyncIterator[BusHarness]:
    clock = FakeClock()

    async def advance(seconds: float) -> None:
        clock.now += seconds

    def new_bus(max_len: int) -> Bus:
        bus = InProcessBus(max_len=max_len, clock=clock)
        buses.append(bus)
        return bus

    buses: list[Bus] = [InProcessBus(clock=clock)]
    try:
        yield BusHarness(kind="memory", bus=buses[0], new_bus=new_bus, advance=advance)
    finally:
        for bus in buses:
            await bus.close()


@contextlib.asynccontextmanager
async def open_redis_harness() -> AsyncIterator[BusHarness]:
    admin = await connect_admin()
    token = uuid.uuid4().hex
    prefix = f"gpumarket-test:{token}:"
    client_name = f"gpumarket-test-{token}"

    async def advance(seconds: float) -> None:
        await asyncio.sleep(seconds)

    def new_bus(max_len: int) -> Bus:
        bus = RedisBus.from_url(
            REDIS_URL, prefix=prefix, max_len=max_len, op_timeout=2.0, client_name=client_name
        )
        buses.append(bus)
        return bus

    buses: list[Bus] = [RedisBus.from_url(REDIS_URL, prefix=prefix, op_timeout=2.0, client_name=client_name)]
    try:
        yield BusHarness(
            kind="redis",
            bus=buses[0],
            new_bus=new_bus,
            advance=advance,
            prefix=prefix,
            admin=admin,
            client_name=client_name,
        )
    finally:
        for bus in buses:
            await bus.close()
        keys = [key async for key in admin.scan_iter(match=f"{prefix}*")]
        if keys:
            await admin.delete(*keys)
        await admin.aclose()


@pytest.fixture(params=["memory", "redis"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[BusHarness]:
    """Each contract test runs once per implementation."""
    opener = open_memory_harness if request.param == "memory" else open_redis_harness
    async with opener() as opened:
        yield opened


@pytest.fixture
async def redis_harness() -> AsyncIterator[BusHarness]:
    async with open_redis_harness() as opened:
        yield opened


async def publish_all(bus: Bus, payloads: list[bytes], stream: str = STREAM) -> list[str]:
    return [await bus.publish(stream, payload) for payload in payloads]


class TestBusContract:
    async def test_read_returns_published_messages_in_order(self, harness: BusHarness) -> None:
        """Messages come back in publish order with their ids, payloads and deliveries == 1."""
        bus = harness.bus
        await bus.ensure_group(STREAM, GROUP)
        ids = await publish_all(bus, [b"a", b"b", b"c"])
        messages = await bus.read(STREAM, GROUP, "c1", block=None)
        assert messages == [
            BusMessage(stream=STREAM, id=ids[0], payload=b"a", deliveries=1),
            BusMessage(stream=STREAM, id=ids[1], payload=b"b", deliveries=1),
            BusMessage(stream=STREAM, id=ids[2], payload=b"c", deliveries=1),
        ]
        assert await bus.read(STREAM, GROUP, "c1", block=None) == []

    async def test_ids_are_strictly_increasing(self, harness: BusHarness) -> None:
        """Ids have the "<int>-<int>" shape and increase with every publish."""
        ids = await publish_all(harness.bus, [b"x"] * 20)
        parsed = [parse_id(message_id) for message_id in ids]
        assert parsed == sorted(parsed)
        assert len(set(parsed)) == len(parsed)

    async def test_read_respects_count(self, harness: BusHarness) -> None:
        """``count`` caps one read; the rest come with the next."""
        bus = harness.bus
        await publish_all(bus, [bytes([i]) for i in range(5)])
        first = await bus.read(STREAM, GROUP, "c1", count=3, block=None)
        second = await bus.read(STREAM, GROUP, "c1", count=3, block=None)
        assert [m.payload for m in first] == [b"\x00", b"\x01", b"\x02"]
        assert [m.payload for m in second] == [b"\x03", b"\x04"]

    async def test_group_created_after_publishing_receives_earlier_messages(
        self, harness: BusHarness
    ) -> None:
        """A new group starts at the beginning of the stream, like XGROUP CREATE ... 0."""
        bus = harness.bus
        await publish_all(bus, [b"early-1", b"early-2"])
        await bus.ensure_group(STREAM, GROUP)
        await bus.publish(STREAM, b"late")
        messages = await bus.read(STREAM, GROUP, "c1", block=None)
        assert [m.payload for m in messages] == [b"early-1", b"early-2", b"late"]

    async def test_ensure_group_is_idempotent(self, harness: BusHarness) -> None:
        """Calling ensure_group again neither fails nor rewinds the group."""
        bus = harness.bus
        await bus.ensure_group(STREAM, GROUP)
        await bus.publish(STREAM, b"one")
        assert len(await bus.read(STREAM, GROUP, "c1", block=None)) == 1
        await bus.ensure_group(STREAM, GROUP)
        assert await bus.read(STREAM, GROUP, "c1", block=None) == []
        assert await bus.pending_count(STREAM, GROUP) == 1

    async def test_ensure_group_creates_the_stream(self, harness: BusHarness) -> None:
        """ensure_group on a missing stream creates it empty (MKSTREAM)."""
        await harness.bus.ensure_group("fresh", GROUP)
        assert await harness.bus.stream_length("fresh") == 0
        assert await harness.bus.read("fresh", GROUP, "c1", block=None) == []

    async def test_read_creates_a_missing_group(self, harness: BusHarness) -> None:
        """Reading a group that does not exist creates it at the start of the stream."""
        bus = harness.bus
        await bus.publish(STREAM, b"before")
        messages = await bus.read(STREAM, "never-created", "c1", block=None)
        assert [m.payload for m in messages] == [b"before"]

    async def test_consumers_in_one_group_split_messages(self, harness: BusHarness) -> None:
        """Two consumers of one group each get a share; every message is delivered exactly once."""
        bus = harness.bus
        await bus.ensure_group(STREAM, GROUP)
        ids = await publish_all(bus, [str(i).encode() for i in range(10)])
        first = await bus.read(STREAM, GROUP, "c1", count=4, block=None)
        second = await bus.read(STREAM, GROUP, "c2", count=100, block=None)
        assert len(first) == 4
        assert len(second) == 6
        assert [m.id for m in first + second] == ids
        assert await bus.read(STREAM, GROUP, "c1", block=None) == []
        assert await bus.read(STREAM, GROUP, "c2", block=None) == []
        assert await bus.pending_count(STREAM, GROUP) == 10

    async def test_each_group_receives_every_message(self, harness: BusHarness) -> None:
        """Groups are independent: each one gets the whole stream."""
        bus = harness.bus
        await bus.ensure_group(STREAM, "billing")
        await bus.ensure_group(STREAM, "scheduler")
        ids = await publish_all(bus, [b"1", b"2", b"3"])
        billing = await bus.read(STREAM, "billing", "c1", block=None)
        scheduler = await bus.read(STREAM, "scheduler", "c1", block=None)
        assert [m.id for m in billing] == ids
        assert [m.id for m in scheduler] == ids
        await bus.ack(STREAM, "billing", ids)
        assert await bus.pending_count(STREAM, "billing") == 0
        assert await bus.pending_count(STREAM, "scheduler") == 3

    async def test_ack_removes_from_pending_and_double_ack_is_harmless(self, harness: BusHarness) -> None:
        """ack counts only ids that were pending; acking again returns 0."""
        bus = harness.bus
        await bus.ensure_group(STREAM, GROUP)
        ids = await publish_all(bus, [b"a", b"b", b"c"])
        await bus.read(STREAM, GROUP, "c1", block=None)
        assert await bus.pending_count(STREAM, GROUP) == 3
        assert await bus.ack(STREAM, GROUP, ids[:2]) == 2
        assert await bus.pending_count(STREAM, GROUP) == 1
        assert await bus.ack(STREAM, GROUP, ids[:2]) == 0
        assert await bus.ack(STREAM, GROUP, []) == 0
        assert await bus.ack(STREAM, GROUP, ids) == 1
        assert await bus.pending_count(STREAM, GROUP) == 0

    async def test_backlog_counts_undelivered_and_pending_and_dates_the_oldest(self, harness: BusHarness) -> None:
        """The oldest unfinished entry is the oldest pending one, else the next undelivered one."""
        bus = harness.bus
        empty = await bus.backlog(STREAM, GROUP)
        assert (empty.undelivered, empty.pending, empty.oldest_published_at) == (0, 0, None)
        await bus.ensure_group(STREAM, GROUP)
        before = time.time()
        ids = await publish_all(bus, [b"a", b"b", b"c"])
        after = time.time()
        waiting = await bus.backlog(STREAM, GROUP)
        assert (waiting.undelivered, waiting.pending) == (3, 0)
        assert waiting.oldest_published_at is not None
        assert before - 1 <= waiting.oldest_published_at <= after + 1
        assert waiting.lag(waiting.oldest_published_at + 5) == 5
        await bus.read(STREAM, GROUP, "c1", count=2, block=None)
        mixed = await bus.backlog(STREAM, GROUP)
        assert (mixed.undelivered, mixed.pending) == (1, 2)
        assert mixed.oldest_published_at == waiting.oldest_published_at
        await bus.ack(STREAM, GROUP, ids[:2])
        tail = await bus.backlog(STREAM, GROUP)
        assert (tail.undelivered, tail.pending) == (1, 0)
        assert tail.oldest_published_at is not None and tail.oldest_published_at >= waiting.oldest_published_at
        await bus.read(STREAM, GROUP, "c1", block=None)
        await bus.ack(STREAM, GROUP, ids[2:])
        done = await bus.backlog(STREAM, GROUP)
        assert (done.undelivered, done.pending, done.oldest_published_at) == (0, 0, None)
        assert done.lag(time.time()) == 0.0

    async def test_ack_of_unknown_group_or_stream_returns_zero(self, harness: BusHarness) -> None:
        """Acking where nothing is pending is not an error."""
        bus = harness.bus
        message_id = await bus.publish(STREAM, b"a")
        assert await bus.ack(STREAM, "nobody", [message_id]) == 0
        assert await bus.ack("no-such-stream", GROUP, [message_id]) == 0

    async def test_ack_rejects_malformed_ids(self, harness: BusHarness) -> None:
        """An id that cannot be a message id raises BusError."""
        await harness.bus.ensure_group(STREAM, GROUP)
        with pytest.raises(BusError):
            await harness.bus.ack(STREAM, GROUP, ["not-an-id"])

    async def test_claim_stale_recovers_messages_of_a_dead_consumer(self, harness: BusHarness) -> None:
        """Messages left unacknowledged past min_idle move to another consumer with deliveries == 2."""
        bus = harness.bus
        await bus.ensure_group(STREAM, GROUP)
        ids = await publish_all(bus, [b"a", b"b"])
        taken = await bus.read(STREAM, GROUP, "dead-worker", block=None)
        assert [m.id for m in taken] == ids  # ...and then the worker dies without acking
        await harness.advance(2 * TICK)
        recovered = await bus.claim_stale(STREAM, GROUP, "rescuer", min_idle=TICK)
        assert [(m.id, m.payload, m.deliveries) for m in recovered] == [(ids[0], b"a", 2), (ids[1], b"b", 2)]
        assert await bus.pending_count(STREAM, GROUP) == 2
        # Claimed messages are fresh again: an immediate second sweep finds nothing.
        assert await bus.claim_stale(STREAM, GROUP, "other", min_idle=TICK) == []
        assert await bus.ack(STREAM, GROUP, ids) == 2
        assert await bus.pending_count(STREAM, GROUP) == 0

    async def test_claim_stale_counts_every_redelivery(self, harness: BusHarness) -> None:
        """Each claim increments deliveries again."""
        bus = harness.bus
        message_id = await bus.publish(STREAM, b"poison")
        await bus.read(STREAM, GROUP, "w1", block=None)
        for expected in (2, 3):
            await harness.advance(2 * TICK)
            (claimed,) = await bus.claim_stale(STREAM, GROUP, "w2", min_idle=TICK)
            assert (claimed.id, claimed.deliveries) == (message_id, expected)

    async def test_claim_stale_leaves_messages_younger_than_min_idle(self, harness: BusHarness) -> None:
        """A message pending for less than min_idle stays with its consumer."""
        bus = harness.bus
        await bus.ensure_group(STREAM, GROUP)
        await bus.publish(STREAM, b"busy")
        await bus.read(STREAM, GROUP, "alive-worker", block=None)
        await harness.advance(TICK)
        assert await bus.claim_stale(STREAM, GROUP, "rescuer", min_idle=60.0) == []
        assert await bus.pending_count(STREAM, GROUP) == 1

    async def test_claim_stale_never_returns_undelivered_or_acked_messages(self, harness: BusHarness) -> None:
        """Only pending messages are claimed: not new ones, not acknowledged ones."""
        bus = harness.bus
        ids = await publish_all(bus, [b"a", b"b"])
        await bus.read(STREAM, GROUP, "w1", count=1, block=None)
        await bus.ack(STREAM, GROUP, ids[:1])
        await harness.advance(2 * TICK)
        assert await bus.claim_stale(STREAM, GROUP, "w2", min_idle=TICK) == []
        assert [m.id for m in await bus.read(STREAM, GROUP, "w2", block=None)] == ids[1:]

    async def test_claim_stale_respects_count_and_resumes(self, harness: BusHarness) -> None:
        """A sweep stopped by count resumes after the last message it took."""
        bus = harness.bus
        ids = await publish_all(bus, [b"1", b"2", b"3"])
        await bus.read(STREAM, GROUP, "dead", block=None)
        await harness.advance(2 * TICK)
        first = await bus.claim_stale(STREAM, GROUP, "rescuer", min_idle=TICK, count=2)
        second = await bus.claim_stale(STREAM, GROUP, "rescuer", min_idle=TICK, count=2)
        assert [m.id for m in first] == ids[:2]
        assert [m.id for m in second] == ids[2:]

    async def test_claim_stale_on_a_missing_group_returns_nothing(self, harness: BusHarness) -> None:
        """claim_stale of a group that does not exist returns [] (and creates the group)."""
        await harness.bus.publish(STREAM, b"a")
        assert await harness.bus.claim_stale(STREAM, "ghost", "c1", min_idle=0) == []
        assert len(await harness.bus.read(STREAM, "ghost", "c1", block=None)) == 1

    async def test_blocking_read_returns_promptly_when_a_message_is_published(
        self, harness: BusHarness
    ) -> None:
        """A read blocked on an empty stream wakes up as soon as a message arrives."""
        bus = harness.bus
        await bus.ensure_group(STREAM, GROUP)
        loop = asyncio.get_running_loop()
        started = loop.time()
        reader = asyncio.create_task(bus.read(STREAM, GROUP, "c1", block=LONG_BLOCK))
        await asyncio.sleep(TICK / 5)
        assert not reader.done()
        await bus.publish(STREAM, b"wake up")
        messages = await reader
        assert [m.payload for m in messages] == [b"wake up"]
        assert loop.time() - started < LONG_BLOCK / 2  # woken by the message, not by the end of its block

    async def test_blocking_read_returns_empty_on_timeout(self, harness: BusHarness) -> None:
        """With nothing published, a blocking read returns [] after about ``block`` seconds."""
        await harness.bus.ensure_group(STREAM, GROUP)
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await harness.bus.read(STREAM, GROUP, "c1", block=TICK) == []
        assert TICK * 0.9 <= loop.time() - started < LONG_BLOCK  # it waited, and it ended (a loaded machine adds)

    async def test_non_blocking_read_returns_immediately(self, harness: BusHarness) -> None:
        """block=None and block=0 never wait."""
        await harness.bus.ensure_group(STREAM, GROUP)
        # Redis reads block=0 as "for ever": a read that passed it on would never return.
        async with asyncio.timeout(LONG_BLOCK):
            assert await harness.bus.read(STREAM, GROUP, "c1", block=None) == []
            assert await harness.bus.read(STREAM, GROUP, "c1", block=0) == []

    async def test_blocked_readers_of_one_group_share_a_message(self, harness: BusHarness) -> None:
        """Two consumers blocked on one group: the message goes to exactly one of them."""
        bus = harness.bus
        await bus.ensure_group(STREAM, GROUP)
        # Blocked far longer than the test needs: on a loaded machine a block of BLOCK could end before the publish
        # reached the server, and then neither reader gets it.
        readers = [asyncio.create_task(bus.read(STREAM, GROUP, f"c{i}", block=100 * BLOCK)) for i in range(2)]
        await asyncio.sleep(TICK / 5)
        await bus.publish(STREAM, b"only once")
        done, waiting = await asyncio.wait(readers, timeout=100 * BLOCK, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1 and [m.payload for m in done.pop().result()] == [b"only once"]
        await asyncio.sleep(BLOCK)  # the other reader had its chance at the same message
        [other] = waiting
        assert not other.done() or other.result() == []
        other.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await other
        assert await bus.pending_count(STREAM, GROUP) == 1  # delivered once

    async def test_binary_payloads_round_trip_exactly(self, harness: BusHarness) -> None:
        """Every byte value, the empty payload and a large payload come back unchanged."""
        bus = harness.bus
        payloads = [bytes(range(256)), b"", b"\x00\r\n\xff" * 3, os.urandom(256 * 1024)]
        await publish_all(bus, payloads)
        messages = await bus.read(STREAM, GROUP, "c1", block=None)
        assert [m.payload for m in messages] == payloads
        assert all(isinstance(m.payload, bytes) for m in messages)

    async def test_cancelling_a_blocking_read_loses_nothing(self, harness: BusHarness) -> None:
        """A message published after a blocked read was cancelled is delivered to the next read."""
        bus = harness.bus
        await bus.ensure_group(STREAM, GROUP)
        reader = asyncio.create_task(bus.read(STREAM, GROUP, "c1", block=BLOCK))
        await asyncio.sleep(TICK / 5)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await asyncio.sleep(TICK / 5)  # Redis: let the server drop the abandoned blocked client
        message_id = await bus.publish(STREAM, b"after cancel")
        messages = await bus.read(STREAM, GROUP, "c1", block=BLOCK)
        assert [m.id for m in messages] == [message_id]
        assert await bus.pending_count(STREAM, GROUP) == 1

    async def test_stream_is_trimmed_to_about_max_len(self, harness: BusHarness) -> None:
        """Without groups holding them, old entries are trimmed: never below max_len, never far above."""
        bus = harness.new_bus(10)
        await publish_all(bus, [b"x"] * 300)
        length = await bus.stream_length(STREAM)
        if harness.kind == "memory":
            assert length == 10
        else:
            # MAXLEN ~ removes whole macro-nodes only (stream-node-max-entries, 100 by default).
            assert 10 <= length < 300

    async def test_stream_length_and_pending_of_missing_things_are_zero(self, harness: BusHarness) -> None:
        """Asking about a stream or group that does not exist is not an error."""
        assert await harness.bus.stream_length("nothing-here") == 0
        assert await harness.bus.pending_count("nothing-here", GROUP) == 0
        await harness.bus.publish(STREAM, b"a")
        assert await harness.bus.stream_length(STREAM) == 1
        assert await harness.bus.pending_count(STREAM, "no-group") == 0

    async def test_streams_are_independent(self, harness: BusHarness) -> None:
        """Messages stay in the stream they were published to."""
        bus = harness.bus
        await bus.publish("a", b"for a")
        await bus.publish("b", b"for b")
        assert [m.payload for m in await bus.read("a", GROUP, "c1", block=None)] == [b"for a"]
        assert [(m.stream, m.payload) for m in await bus.read("b", GROUP, "c1", block=None)] == [
            ("b", b"for b")
        ]

    async def test_ping_succeeds_and_closed_bus_raises(self, harness: BusHarness) -> None:
        """ping works on an open bus; every call on a closed bus raises BusError."""
        await harness.bus.ping()
        await harness.bus.close()
        await harness.bus.close()  # idempotent
        with pytest.raises(BusError):
            await harness.bus.publish(STREAM, b"late")
        with pytest.raises(BusError):
            await harness.bus.ping()

    async def test_invalid_limits_are_rejected(self, harness: BusHarness) -> None:
        """count < 1, negative block or negative min_idle are programming errors."""
        with pytest.raises(ValueError):
            await harness.bus.read(STREAM, GROUP, "c1", count=0)
        with pytest.raises(ValueError):
            await harness.bus.read(STREAM, GROUP, "c1", block=-1)
        with pytest.raises(ValueError):
            await harness.bus.claim_stale(STREAM, GROUP, "c1", min_idle=-1)


class TestInProcessBus:
    async def test_publish_raises_when_stream_is_full_of_pending_messages(self) -> None:
        """A stream whose entries are all unacknowledged refuses new ones instead of growing."""
        bus = InProcessBus(max_len=3)
        await bus.ensure_group(STREAM, GROUP)
        ids = await publish_all(bus, [b"1", b"2", b"3"])
        await bus.read(STREAM, GROUP, "c1", block=None)
        with pytest.raises(BusError, match="stream 'jobs' is full: 3 unacknowledged messages"):
            await bus.publish(STREAM, b"4")
        assert await bus.stream_length(STREAM) == 3
        await bus.ack(STREAM, GROUP, ids[:1])
        await bus.publish(STREAM, b"4")
        assert await bus.stream_length(STREAM) == 3

    async def test_undelivered_messages_are_never_trimmed(self) -> None:
        """Entries a group has not read yet count as unconsumed, so a lagging group fills the stream."""
        bus = InProcessBus(max_len=2)
        await bus.ensure_group(STREAM, GROUP)
        await publish_all(bus, [b"1", b"2"])
        with pytest.raises(BusError, match="consumers are not keeping up"):
            await bus.publish(STREAM, b"3")
        assert [m.payload for m in await bus.read(STREAM, GROUP, "c1", block=None)] == [b"1", b"2"]

    async def test_trimming_skips_a_stuck_pending_message(self) -> None:
        """Acknowledged entries behind an old pending one are trimmed; the pending one survives until acked."""
        bus = InProcessBus(max_len=3)
        stuck = await bus.publish(STREAM, b"stuck")
        await bus.read(STREAM, GROUP, "c1", count=1, block=None)
        for i in range(10):
            await bus.publish(STREAM, str(i).encode())
            (message,) = await bus.read(STREAM, GROUP, "c1", block=None)
            await bus.ack(STREAM, GROUP, [message.id])
        assert await bus.stream_length(STREAM) == 3
        assert await bus.pending_count(STREAM, GROUP) == 1
        (claimed,) = await bus.claim_stale(STREAM, GROUP, "c2", min_idle=0)
        assert (claimed.id, claimed.payload) == (stuck, b"stuck")
        await bus.ack(STREAM, GROUP, [stuck])
        assert await bus.stream_length(STREAM) == 2

    async def test_close_wakes_a_blocked_read(self) -> None:
        """Closing the bus ends a blocked read with BusError instead of leaving it hanging."""
        bus = InProcessBus()
        reader = asyncio.create_task(bus.read(STREAM, GROUP, "c1", block=BLOCK))
        await asyncio.sleep(0)
        await bus.close()
        with pytest.raises(BusError, match="closed"):
            await reader

    async def test_ids_have_the_redis_shape(self) -> None:
        """In-process ids are "<n>-0", starting at 1 in every stream."""
        bus = InProcessBus()
        assert await publish_all(bus, [b"a", b"b"]) == ["1-0", "2-0"]
        assert await bus.publish("other", b"c") == "1-0"


class TestRedisBus:
    async def kill_bus_connections(self, harness: BusHarness) -> int:
        assert harness.admin is not None
        killed = 0
        for client in await harness.admin.client_list():
            if client.get("name") == harness.client_name:
                await harness.admin.execute_command("CLIENT", "KILL", "ID", client["id"])  # type: ignore[no-untyped-call]
                killed += 1
        return killed

    async def test_next_call_works_after_its_connections_are_killed(self, redis_harness: BusHarness) -> None:
        """After CLIENT KILL of the bus's connections the next call reconnects transparently."""
        bus = redis_harness.bus
        await bus.ensure_group(STREAM, GROUP)
        await bus.publish(STREAM, b"before")
        assert await self.kill_bus_connections(redis_harness) >= 1
        await bus.publish(STREAM, b"after")
        assert [m.payload for m in await bus.read(STREAM, GROUP, "c1", block=None)] == [b"before", b"after"]

    async def test_blocked_read_survives_its_connection_being_killed(self, redis_harness: BusHarness) -> None:
        """A read blocked when its connection dies retries on a new connection instead of failing."""
        bus = redis_harness.bus
        await bus.ensure_group(STREAM, GROUP)
        reader = asyncio.create_task(bus.read(STREAM, GROUP, "c1", block=LONG_BLOCK))
        await asyncio.sleep(TICK / 5)
        assert await self.kill_bus_connections(redis_harness) >= 1
        await asyncio.sleep(TICK / 5)
        await bus.publish(STREAM, b"x")
        assert [m.payload for m in await reader] == [b"x"]

    async def test_read_recreates_the_group_after_redis_lost_the_stream(
        self, redis_harness: BusHarness
    ) -> None:
        """NOGROUP after the stream key vanished (a restart without persistence) is repaired on read."""
        bus = redis_harness.bus
        assert redis_harness.admin is not None
        await bus.ensure_group(STREAM, GROUP)
        await bus.publish(STREAM, b"lost")
        await redis_harness.admin.delete(redis_harness.prefix + STREAM)
        assert await bus.read(STREAM, GROUP, "c1", block=None) == []
        await bus.publish(STREAM, b"new")
        assert [m.payload for m in await bus.read(STREAM, GROUP, "c1", block=None)] == [b"new"]

    async def test_blocking_read_recreates_the_group_after_redis_lost_the_stream(
        self, redis_harness: BusHarness
    ) -> None:
        """A blocking read on a vanished group re-creates it and then waits for new messages."""
        bus = redis_harness.bus
        assert redis_harness.admin is not None
        admin, key = redis_harness.admin, redis_harness.prefix + STREAM
        await bus.ensure_group(STREAM, GROUP)
        await admin.delete(key)
        # The read blocks for as long as the message may take (it returns when it comes), and the message is sent
        # once the group is back: a fixed sleep and a 0.2 s block assumed the reader got there first (CI, loaded).
        reader = asyncio.create_task(bus.read(STREAM, GROUP, "c1", block=LONG_BLOCK))

        async def group_is_back() -> bool:
            with contextlib.suppress(redis_errors.ResponseError):  # no such key yet
                return any(group.get("name") in (GROUP, GROUP.encode()) for group in await admin.xinfo_groups(key))
            return False

        await eventually(group_is_back, timeout=LONG_BLOCK, what="the reader re-creating the group")
        await bus.publish(STREAM, b"new")
        assert [m.payload for m in await reader] == [b"new"]

    async def test_claim_stale_recreates_the_group_after_redis_lost_the_stream(
        self, redis_harness: BusHarness
    ) -> None:
        """claim_stale after the data vanished returns [] and leaves a working group behind."""
        bus = redis_harness.bus
        assert redis_harness.admin is not None
        await bus.publish(STREAM, b"lost")
        await bus.read(STREAM, GROUP, "c1", block=None)
        await redis_harness.admin.delete(redis_harness.prefix + STREAM)
        assert await bus.claim_stale(STREAM, GROUP, "c2", min_idle=0) == []
        assert await bus.pending_count(STREAM, GROUP) == 0
        await bus.publish(STREAM, b"new")
        assert [m.payload for m in await bus.read(STREAM, GROUP, "c1", block=None)] == [b"new"]

    async def test_a_closed_process_messages_are_claimed_by_another(self, redis_harness: BusHarness) -> None:
        """Messages read by a bus whose process went away are recovered through another bus."""
        dead = redis_harness.new_bus(1000)
        survivor = redis_harness.bus
        message_id = await survivor.publish(STREAM, b"orphan")
        assert [m.id for m in await dead.read(STREAM, GROUP, "dead-master", block=None)] == [message_id]
        await dead.close()
        await redis_harness.advance(2 * TICK)
        (claimed,) = await survivor.claim_stale(STREAM, GROUP, "master-2", min_idle=TICK)
        assert (claimed.id, claimed.payload, claimed.deliveries) == (message_id, b"orphan", 2)

    async def test_long_blocking_read_is_split_into_slices(self, redis_harness: BusHarness) -> None:
        """A block longer than max_block_slice is several XREADGROUP BLOCK calls; a publish still wakes it."""
        bus = RedisBus.from_url(REDIS_URL, prefix=redis_harness.prefix, max_block_slice=TICK)
        try:
            await bus.ensure_group(STREAM, GROUP)
            loop = asyncio.get_running_loop()
            started = loop.time()
            assert await bus.read(STREAM, GROUP, "c1", block=BLOCK) == []
            assert BLOCK * 0.9 <= loop.time() - started < LONG_BLOCK  # in slices, for the whole block, and no more
            reader = asyncio.create_task(bus.read(STREAM, GROUP, "c1", block=LONG_BLOCK))
            await asyncio.sleep(TICK * 1.5)
            assert not reader.done()
            await bus.publish(STREAM, b"late")
            assert [m.payload for m in await reader] == [b"late"]
        finally:
            await bus.close()

    async def test_block_slices_stay_below_the_client_socket_timeout(self, redis_harness: BusHarness) -> None:
        """A client socket timeout shorter than the block does not make a blocking read fail.

        The slices are at most half the socket timeout (1 s here), so a loaded machine's Redis has
        a second to deliver each empty answer; an unsliced 2.5 s block would trip the timeout.
        """
        client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=2.0)
        bus = RedisBus(client, prefix=redis_harness.prefix)
        try:
            await bus.ensure_group(STREAM, GROUP)
            assert await bus.read(STREAM, GROUP, "c1", block=2.5) == []
        finally:
            await bus.close()
            await client.aclose()

    async def test_client_socket_timeout_too_short_for_blocking_is_rejected(self) -> None:
        """A socket timeout Redis cannot answer a blocking read within is a configuration error."""
        client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=TICK)
        try:
            with pytest.raises(ConfigError, match="socket_timeout"):
                RedisBus(client)
        finally:
            await client.aclose()

    async def test_calls_beyond_max_connections_wait_for_a_free_one(self, redis_harness: BusHarness) -> None:
        """More concurrent blocking reads than pooled connections queue up instead of failing."""
        bus = RedisBus.from_url(REDIS_URL, prefix=redis_harness.prefix, max_connections=2)
        try:
            await bus.ensure_group(STREAM, GROUP)
            results = await asyncio.gather(*(bus.read(STREAM, GROUP, f"c{i}", block=TICK) for i in range(4)))
            assert results == [[], [], [], []]
        finally:
            await bus.close()

    async def test_trimming_keeps_at_least_max_len_entries(self, redis_harness: BusHarness) -> None:
        """MAXLEN ~ never trims below max_len and stays within one macro-node above it."""
        assert redis_harness.admin is not None
        config = await redis_harness.admin.config_get("stream-node-max-entries")
        node_size = int(str(config["stream-node-max-entries"]))
        bus = redis_harness.new_bus(10)
        await publish_all(bus, [b"x"] * (3 * node_size))
        assert 10 <= await bus.stream_length(STREAM) <= 10 + node_size

    async def test_unreachable_redis_raises_bus_error_naming_the_url(self) -> None:
        """Nothing listening: BusError says where it tried and what to check."""
        bus = RedisBus.from_url("redis://:secret@127.0.0.1:1/0", op_timeout=2.0)
        try:
            with pytest.raises(BusError) as caught:
                await bus.publish(STREAM, b"x")
        finally:
            await bus.close()
        message = str(caught.value)
        assert "127.0.0.1:1" in message
        assert "GPUMARKET_REDIS_URL" in message
        assert "secret" not in message

    async def test_slow_redis_raises_bus_timeout(self, redis_harness: BusHarness) -> None:
        """A command that does not answer within op_timeout raises BusTimeout."""
        assert redis_harness.admin is not None
        bus = RedisBus.from_url(REDIS_URL, prefix=redis_harness.prefix, op_timeout=TICK)
        try:
            await bus.ping()  # connect before writes are paused
            await redis_harness.admin.client_pause(round(4 * TICK * 1000), all=False)
            with pytest.raises(BusTimeout, match="did not answer"):
                await bus.publish(STREAM, b"x")
        finally:
            await bus.close()

    async def test_client_with_decoded_responses_is_rejected(self) -> None:
        """Payloads are bytes, so a client that decodes replies to str is a configuration error."""
        client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        try:
            with pytest.raises(ConfigError, match="decode_responses"):
                RedisBus(client)
        finally:
            await client.aclose()


class TestOpenBus:
    @pytest.mark.parametrize("url", [None, "memory://"])
    async def test_memory_urls_open_an_in_process_bus(self, url: str | None) -> None:
        """No URL, or memory://, means the in-process bus."""
        bus = await open_bus(url, max_len=5)
        try:
            assert isinstance(bus, InProcessBus)
        finally:
            await bus.close()

    async def test_redis_url_opens_a_redis_bus(self) -> None:
        """redis:// opens a RedisBus, already checked with PING."""
        admin = await connect_admin()
        await admin.aclose()
        bus = await open_bus(REDIS_URL, prefix=f"gpumarket-test:{uuid.uuid4().hex}:")
        try:
            assert isinstance(bus, RedisBus)
            await bus.ping()
        finally:
            await bus.close()

    async def test_unreachable_redis_fails_at_open(self) -> None:
        """open_bus pings, so a wrong URL fails at startup with BusError."""
        with pytest.raises(BusError, match=r"127\.0\.0\.1:1\b"):
            await open_bus("redis://127.0.0.1:1/0", op_timeout=2.0)

    async def test_unknown_scheme_is_a_config_error(self) -> None:
        """Anything but memory://, redis://, rediss:// or unix:// is refused."""
        with pytest.raises(ConfigError, match="GPUMARKET_REDIS_URL"):
            await open_bus("amqp://localhost")
