"""Rate limits: token buckets keyed by a string, in this process's memory or shared through Redis.

Two layers, as for the protocol:

* Sans-I/O, pure functions of a monotonic time: ``TokenBucket`` (one bucket) and
  ``SourceRateLimiter`` (buckets keyed by source — an address, an API key — in bounded
  memory). The relay limits agents' messages and new connections per source with them, the
  geo DNS its queries per source.
* ``RateStore``, the seam the master's API limits use: ``take`` and ``charge`` tokens of the
  bucket a key and a ``Limit`` name. ``MemoryRateStore`` keeps them in this process
  (embedded mode, tests); ``RedisRateStore`` keeps them in Redis, so every master takes from
  one budget per key: one atomic Lua script (GCRA: a bucket is one number, the time at which
  it is full again), keys under the bus prefix that expire when their bucket is full again.

``RedisRateStore`` fails open: when Redis does not answer within ``timeout``, the request is
let through, ``failed_open`` counts it, a warning is logged, and Redis is not asked again for
``retry_interval`` seconds. A rate limiter must not take the API down with Redis.

``source_key`` is the key a peer address is counted by (IPv6 per /64). Must not import from
agent/, access/, master/, console/ or billing/.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from shared.errors import ConfigError

__all__ = [
    "Limit",
    "MemoryRateStore",
    "RateStore",
    "RedisRateStore",
    "SourceRateLimiter",
    "TokenBucket",
    "retry_after",
    "source_key",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Limit:
    """``rate`` tokens per second, at most ``burst`` at once; a bucket starts full."""

    rate: float
    burst: float

    def __post_init__(self) -> None:
        if not self.rate > 0 or not self.burst >= 1:
            raise ConfigError(f"a rate limit needs rate > 0 and burst >= 1, got rate={self.rate} burst={self.burst}")

    @classmethod
    def per_minute(cls, per_minute: float, burst: float) -> Limit:
        return cls(per_minute / 60.0, burst)


def retry_after(wait: float) -> int:
    """``wait`` seconds as a ``Retry-After`` value: whole seconds, at least 1, never short of ``wait``.

    Rounded to the microsecond first, so float noise (6.000000000000001) does not add a second.
    """
    return max(1, math.ceil(round(wait, 6)))


# ---- Sans-I/O: pure functions of a monotonic time -----------------------------------------


@dataclass(slots=True)
class TokenBucket:
    """``rate`` tokens per second up to ``burst``; starts full at ``updated``."""

    rate: float
    burst: float
    updated: float
    tokens: float = -1.0  # -1: start full

    def __post_init__(self) -> None:
        if self.tokens < 0:
            self.tokens = self.burst

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
            self.updated = now

    def take(self, now: float, cost: float = 1.0) -> bool:
        """Spend ``cost`` tokens if there are that many."""
        self._refill(now)
        if self.tokens >= cost - 1e-9:  # refills are float sums: 0.9999999 is a whole token
            self.tokens = max(0.0, self.tokens - cost)
            return True
        return False

    def charge(self, now: float, cost: float) -> None:
        """Spend ``cost`` tokens whatever is left: below zero the bucket is in debt, refilling from there."""
        self._refill(now)
        self.tokens -= cost

    def wait(self, now: float, cost: float = 1.0) -> float:
        """Seconds until ``cost`` tokens are available (0 if they are now)."""
        self._refill(now)
        return max(0.0, (cost - self.tokens) / self.rate)

    def is_full(self, now: float) -> bool:
        """Whether the bucket has refilled completely, i.e. is the same as a fresh one."""
        return self.tokens + max(0.0, now - self.updated) * self.rate >= self.burst


def source_key(address: str) -> str:
    """The rate-limit key of a peer address: the address itself, or its /64 for IPv6."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class SourceRateLimiter:
    """Token buckets keyed by source (any string), in bounded memory.

    A bucket that has refilled is dropped (it is the same as no bucket), and beyond
    ``max_sources`` the least recently seen source is forgotten (it starts again full).
    """

    def __init__(self, *, rate: float, burst: float, max_sources: int) -> None:
        if rate <= 0 or burst < 1 or max_sources < 1:
            raise ConfigError("source rate limits must be positive")
        self.rate = rate
        self.burst = burst
        self.max_sources = max_sources
        self._buckets: collections.OrderedDict[str, TokenBucket] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def admit(self, source: str, now: float, cost: float = 1.0) -> float:
        """Take ``cost`` tokens for ``source``: 0.0 if admitted, else the seconds until it would be."""
        bucket = self._bucket(source, now)
        return 0.0 if bucket.take(now, cost) else max(bucket.wait(now, cost), 1e-3)

    def charge(self, source: str, now: float, cost: float) -> None:
        """Take ``cost`` tokens for ``source`` even if fewer are left (a penalty)."""
        self._bucket(source, now).charge(now, cost)

    def _bucket(self, source: str, now: float) -> TokenBucket:
        self._drop_refilled(now)
        bucket = self._buckets.get(source)
        if bucket is None:
            bucket = self._buckets[source] = TokenBucket(self.rate, self.burst, now)
            while len(self._buckets) > self.max_sources:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(source)
        return bucket

    def _drop_refilled(self, now: float) -> None:
        # Least recently used first: amortised O(1) per call.
        while self._buckets:
            oldest = next(iter(self._buckets.values()))
            if not oldest.is_full(now):
                return
            self._buckets.popitem(last=False)


# ---- stores: the buckets of every key and limit ------------------------------------------


class RateStore(Protocol):
    """Buckets named by a key and a ``Limit``; each call takes from one bucket atomically."""

    async def take(self, key: str, limit: Limit, *, cost: float = 1.0) -> float:
        """Take ``cost`` tokens from the bucket: 0.0 when taken, else the seconds until they could be
        (and nothing is taken). Cancelling is safe: at worst the tokens were taken."""
        ...

    async def charge(self, key: str, limit: Limit, *, cost: float) -> None:
        """Take ``cost`` tokens even if fewer are left: the bucket goes into debt (a penalty).
        Cancelling is safe: at worst the penalty is not applied."""
        ...

    async def close(self) -> None: ...


class MemoryRateStore:
    """Buckets in this process: one ``SourceRateLimiter`` (``max_keys`` buckets at most) per limit."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, max_keys: int = 100_000) -> None:
        self._clock = clock
        self.max_keys = max_keys
        self._tables: dict[Limit, SourceRateLimiter] = {}

    def _table(self, limit: Limit) -> SourceRateLimiter:
        table = self._tables.get(limit)
        if table is None:
            table = self._tables[limit] = SourceRateLimiter(rate=limit.rate, burst=limit.burst, max_sources=self.max_keys)
        return table

    async def take(self, key: str, limit: Limit, *, cost: float = 1.0) -> float:
        return self._table(limit).admit(key, self._clock(), cost)

    async def charge(self, key: str, limit: Limit, *, cost: float) -> None:
        self._table(limit).charge(key, self._clock(), cost)

    async def close(self) -> None:
        pass


# GCRA. The bucket is its "theoretical arrival time" (TAT): the time at which it is full again.
# It holds burst - (TAT - now) * rate tokens; taking `cost` moves TAT by cost / rate. Times are
# seconds (the caller's clock, so every master must agree on it: the wall clock, NTP-synced).
# Returns "0" when taken (or charged), else the seconds to wait, as a string (Lua numbers
# returned to Redis become integers). The key expires EXPIRY_GRACE_S after its bucket would be full
# again, by Redis's clock: a key gone early hands out tokens the budget does not have (a master whose
# clock runs behind Redis's, or one stalled between reading its clock and Redis running the script —
# a loaded CI machine stalled a test 3 s and its bucket of 3 came back full), while one kept a little
# longer costs a few bytes and changes nothing (a TAT in the past counts as now).
EXPIRY_GRACE_S: Final = 30.0
_GCRA = """
local now = tonumber(ARGV[1])
local interval = tonumber(ARGV[2])
local capacity = tonumber(ARGV[3]) * interval
local cost = tonumber(ARGV[4]) * interval
local tat = tonumber(redis.call('GET', KEYS[1])) or now
if tat < now then tat = now end
local new_tat = tat + cost
local excess = new_tat - now - capacity
if excess > 1e-6 and ARGV[5] ~= '1' then
  return string.format('%.6f', excess)
end
redis.call('SET', KEYS[1], string.format('%.6f', new_tat), 'PX', math.max(1, math.ceil((new_tat - now + tonumber(ARGV[6])) * 1000)))
return '0'
"""


class RedisRateStore:
    """Buckets in Redis under ``{prefix}ratelimit:{key}``, shared by every master with that prefix.

    ``clock`` (seconds, default the wall clock) must agree across the masters sharing the keys;
    a skew of s seconds shifts a bucket by s * rate tokens. Each call waits at most ``timeout``
    for Redis; on any failure the call lets the request through (fail open), counts it in
    ``failed_open`` and leaves Redis alone for ``retry_interval`` seconds.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str = "gpumarket:",
        clock: Callable[[], float] = time.time,
        timeout: float = 0.25,
        retry_interval: float = 5.0,
        owns_client: bool = False,
    ) -> None:
        if timeout <= 0 or retry_interval < 0:
            raise ConfigError("the rate-limit timeout must be > 0 and its retry interval >= 0")
        self._client = client
        self._prefix = prefix
        self._clock = clock
        self.timeout = timeout
        self.retry_interval = retry_interval
        self._owns = owns_client
        self._script = client.register_script(_GCRA)
        self._skip_until = -math.inf
        self.failed_open = 0
        """Decisions made without Redis (requests let through unlimited)."""

    @classmethod
    def from_url(
        cls, url: str, *, prefix: str = "gpumarket:", clock: Callable[[], float] = time.time, timeout: float = 0.25,
        retry_interval: float = 5.0,
    ) -> RedisRateStore:  # fmt: skip
        # No retries: a check that cannot be answered at once fails open; the next request tries again.
        client = aioredis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
        )
        return cls(client, prefix=prefix, clock=clock, timeout=timeout, retry_interval=retry_interval, owns_client=True)

    def key(self, key: str) -> str:
        """The Redis key of ``key``'s bucket."""
        return f"{self._prefix}ratelimit:{key}"

    async def take(self, key: str, limit: Limit, *, cost: float = 1.0) -> float:
        return await self._run(key, limit, cost, force=False)

    async def charge(self, key: str, limit: Limit, *, cost: float) -> None:
        await self._run(key, limit, cost, force=True)

    async def _run(self, key: str, limit: Limit, cost: float, *, force: bool) -> float:
        now = self._clock()
        if now < self._skip_until:
            self.failed_open += 1
            return 0.0
        args = [repr(now), repr(1.0 / limit.rate), repr(float(limit.burst)), repr(float(cost)), "1" if force else "0",
                repr(EXPIRY_GRACE_S)]
        try:
            async with asyncio.timeout(self.timeout):
                reply = await self._script(keys=[self.key(key)], args=args)
        except (RedisError, OSError, TimeoutError) as exc:
            self.failed_open += 1
            self._skip_until = now + self.retry_interval
            log.warning(
                "rate limits are off for %.0f s: Redis did not answer (%s); requests pass unlimited until it does "
                "(check GPUMARKET_REDIS_URL)", self.retry_interval, str(exc) or type(exc).__name__,
            )  # fmt: skip
            return 0.0
        return float(reply)

    async def close(self) -> None:
        if self._owns:
            await self._client.aclose()
