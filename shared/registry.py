"""Shared live state of the edge: which relays are up (with load), and which certificates are revoked.

Relays ``put_relay`` their record every few seconds with a TTL; a relay that stops
refreshing disappears when its TTL runs out, so readers (the master's ``/relays``, the
geo DNS) only ever see live relays. Revoked certificate serials are kept until the
certificate would have expired anyway (certificates are short-lived).

Two implementations with the same semantics: ``MemoryRegistry`` (embedded mode, tests)
and ``RedisRegistry`` (production; keys under a prefix, so tests can isolate).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.errors import BusError


@dataclass(frozen=True)
class RelayRecord:
    relay_id: str
    region: str
    url: str  # wss://host:port/v1/agent, what agents connect to
    host: str  # public address (name or IP) for DNS answers
    port: int
    connections: int
    capacity: int
    draining: bool
    updated_at: float  # unix time of this refresh
    # Renters' web ports: "https://{label}.<ports domain>:<port>/" (label: "<rental id>-<port>"); None: none served
    ports_url: str | None = None

    @property
    def spare(self) -> int:
        return max(0, self.capacity - self.connections)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> RelayRecord:
        data = json.loads(text)
        data.setdefault("ports_url", None)  # a record of a relay from before web ports
        return cls(**data)


class Registry(Protocol):
    async def put_relay(self, record: RelayRecord, *, ttl: float) -> None:
        """Publish (or refresh) a relay's record; it expires ``ttl`` seconds after this call."""
        ...

    async def remove_relay(self, relay_id: str) -> None: ...

    async def relays(self) -> list[RelayRecord]:
        """Live relays, sorted by id."""
        ...

    async def revoke(self, serial: str, *, until: float) -> None:
        """Refuse certificate ``serial`` (hex) until unix time ``until`` (its expiry)."""
        ...

    async def revoked(self) -> frozenset[str]: ...

    async def is_revoked(self, serial: str) -> bool: ...

    async def close(self) -> None: ...


class MemoryRegistry:
    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._relays: dict[str, tuple[RelayRecord, float]] = {}
        self._revoked: dict[str, float] = {}

    async def put_relay(self, record: RelayRecord, *, ttl: float) -> None:
        self._relays[record.relay_id] = (record, self._clock() + ttl)

    async def remove_relay(self, relay_id: str) -> None:
        self._relays.pop(relay_id, None)

    async def relays(self) -> list[RelayRecord]:
        now = self._clock()
        return [r for r, expires in sorted(self._relays.values(), key=lambda x: x[0].relay_id) if expires > now]

    async def revoke(self, serial: str, *, until: float) -> None:
        self._revoked[serial.lower()] = max(until, self._revoked.get(serial.lower(), 0.0))

    async def revoked(self) -> frozenset[str]:
        now = self._clock()
        return frozenset(s for s, until in self._revoked.items() if until > now)

    async def is_revoked(self, serial: str) -> bool:
        return self._revoked.get(serial.lower(), 0.0) > self._clock()

    async def close(self) -> None:
        pass


class RedisRegistry:
    """Relays as keys with a TTL (``SET … PX``); revocations in a sorted set scored by expiry."""

    def __init__(self, client: aioredis.Redis, *, prefix: str = "gpumarket:", clock: Callable[[], float] = time.time,
                 owns_client: bool = False) -> None:
        self._client = client
        self._prefix = prefix
        self._clock = clock
        self._owns = owns_client

    @classmethod
    def from_url(cls, url: str, *, prefix: str = "gpumarket:", op_timeout: float = 5.0) -> RedisRegistry:
        client = aioredis.Redis.from_url(url, socket_timeout=op_timeout, socket_connect_timeout=op_timeout)
        return cls(client, prefix=prefix, owns_client=True)

    def _relay_key(self, relay_id: str) -> str:
        return f"{self._prefix}relay:{relay_id}"

    @property
    def _revoked_key(self) -> str:
        return f"{self._prefix}revoked-certificates"

    async def put_relay(self, record: RelayRecord, *, ttl: float) -> None:
        try:
            await self._client.set(self._relay_key(record.relay_id), record.to_json(), px=max(1, int(ttl * 1000)))
        except RedisError as exc:
            raise BusError(f"cannot publish relay {record.relay_id} to Redis: {exc}; check GPUMARKET_REDIS_URL") from exc

    async def remove_relay(self, relay_id: str) -> None:
        try:
            await self._client.delete(self._relay_key(relay_id))
        except RedisError as exc:
            raise BusError(f"cannot remove relay {relay_id} from Redis: {exc}") from exc

    async def relays(self) -> list[RelayRecord]:
        try:
            keys = [k async for k in self._client.scan_iter(match=self._relay_key("*"), count=500)]
            values = await self._client.mget(keys) if keys else []
        except RedisError as exc:
            raise BusError(f"cannot read relays from Redis: {exc}; check GPUMARKET_REDIS_URL") from exc
        records = [RelayRecord.from_json(v) for v in values if v is not None]
        return sorted(records, key=lambda r: r.relay_id)

    async def revoke(self, serial: str, *, until: float) -> None:
        try:
            # GT: a later expiry extends the revocation, an earlier one never shortens it; new members are added.
            await self._client.zadd(self._revoked_key, {serial.lower(): until}, gt=True)
        except RedisError as exc:
            raise BusError(f"cannot record the revocation in Redis: {exc}") from exc

    async def revoked(self) -> frozenset[str]:
        now = self._clock()
        try:
            await self._client.zremrangebyscore(self._revoked_key, "-inf", now)
            members = await self._client.zrangebyscore(self._revoked_key, now, "+inf")
        except RedisError as exc:
            raise BusError(f"cannot read revocations from Redis: {exc}") from exc
        return frozenset(m.decode() if isinstance(m, bytes) else str(m) for m in members)

    async def is_revoked(self, serial: str) -> bool:
        try:
            score = await self._client.zscore(self._revoked_key, serial.lower())
        except RedisError as exc:
            raise BusError(f"cannot read revocations from Redis: {exc}") from exc
        return score is not None and float(score) > self._clock()

    async def close(self) -> None:
        if self._owns:
            await self._client.aclose()


async def open_registry(url: str | None, *, prefix: str = "gpumarket:") -> Registry:
    """``None``/``memory://`` → a private in-memory registry; ``redis://`` → Redis."""
    if url is None or url.startswith("memory://"):
        return MemoryRegistry()
    return RedisRegistry.from_url(url, prefix=prefix)
