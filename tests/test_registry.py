"""The edge registry, same contract in memory and on the real Redis: live relays and revocations."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from shared.registry import MemoryRegistry, RedisRegistry, Registry, RelayRecord


class FakeTime:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
async def registry(request: pytest.FixtureRequest, redis_url: str, bus_prefix: str) -> AsyncIterator[tuple[Registry, FakeTime]]:
    clock = FakeTime()
    if request.param == "memory":
        yield MemoryRegistry(clock=clock), clock
        return
    client = aioredis.Redis.from_url(redis_url)
    reg = RedisRegistry(client, prefix=bus_prefix, clock=clock)
    try:
        yield reg, clock
    finally:
        keys = [k async for k in client.scan_iter(match=f"{bus_prefix}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


def record(relay_id: str, *, connections: int = 1) -> RelayRecord:
    return RelayRecord(relay_id=relay_id, region="eu", url=f"wss://{relay_id}:8443/v1/agent", host=relay_id, port=8443,
                       connections=connections, capacity=100, draining=False, updated_at=0.0)


class TestRegistry:
    async def test_relays_are_listed_and_refreshed(self, registry: tuple[Registry, FakeTime]) -> None:
        """A put relay is listed; a refresh replaces its record."""
        reg, _ = registry
        await reg.put_relay(record("b"), ttl=30)
        await reg.put_relay(record("a"), ttl=30)
        await reg.put_relay(record("a", connections=7), ttl=30)
        listed = await reg.relays()
        assert [r.relay_id for r in listed] == ["a", "b"] and listed[0].connections == 7 and listed[0].spare == 93
        await reg.remove_relay("b")
        assert [r.relay_id for r in await reg.relays()] == ["a"]

    async def test_revocations_hold_until_the_certificate_expires(self, registry: tuple[Registry, FakeTime]) -> None:
        """A revoked serial is refused until its expiry, then forgotten (case-insensitively)."""
        reg, clock = registry
        await reg.revoke("ABCDEF", until=clock.now + 60)
        assert await reg.is_revoked("abcdef") and await reg.revoked() == frozenset({"abcdef"})
        assert not await reg.is_revoked("123456")
        clock.now += 61
        assert not await reg.is_revoked("abcdef") and await reg.revoked() == frozenset()

    async def test_a_relay_that_stops_refreshing_disappears(self, registry: tuple[Registry, FakeTime]) -> None:
        """Records expire after their TTL (real time for Redis, so a tiny TTL)."""
        reg, clock = registry
        await reg.put_relay(record("a"), ttl=0.05)
        clock.now += 1
        import asyncio

        await asyncio.sleep(0.1)
        assert await reg.relays() == []
