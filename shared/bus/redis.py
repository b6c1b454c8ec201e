"""``RedisBus``: the ``Bus`` on Redis Streams, for relays and masters in separate processes.

Also ``delete_prefix`` (drop every key under a prefix) and ``redact_url`` (a Redis URL
without its password, for messages).
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from shared.bus.base import Backlog, BusMessage, check_limits
from shared.errors import BusError, BusTimeout, ConfigError

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_REDIS_HINT = "is Redis running? check GPUMARKET_REDIS_URL"
_PAYLOAD_FIELD = b"p"  # each stream entry is the single field {"p": payload}
# Redis times blocked clients out on its server timer (every 1/hz s: 100 ms at the default
# hz=10), so XREADGROUP BLOCK may answer this much later than asked, round trip included.
_BLOCK_MARGIN = 0.25


# XAUTOCLAIM does not report delivery counts, so the claim and the XPENDING lookups run as
# one script: nobody can claim a message between the two. Sweeps at most `budget` XAUTOCLAIM
# pages (each scans up to 10 x COUNT pending entries) so a huge pending list cannot stall Redis;
# the returned cursor resumes the sweep on the next call. Requires Redis >= 6.2.
_CLAIM_SCRIPT = """
local group, consumer, min_idle = ARGV[1], ARGV[2], ARGV[3]
local want, cursor, budget = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local claimed, deleted = {}, 0
while budget > 0 and #claimed < want do
  budget = budget - 1
  local reply = redis.call('XAUTOCLAIM', KEYS[1], group, consumer, min_idle, cursor, 'COUNT', want - #claimed)
  cursor = reply[1]
  for _, entry in ipairs(reply[2]) do
    if type(entry) == 'table' then
      local info = redis.call('XPENDING', KEYS[1], group, entry[1], entry[1], 1)
      claimed[#claimed + 1] = {entry[1], entry[2], info[1][4]}
    else
      deleted = deleted + 1
    end
  end
  if type(reply[3]) == 'table' then deleted = deleted + #reply[3] end
  if cursor == '0-0' then break end
end
return {cursor, claimed, deleted}
"""


def redact_url(url: str) -> str:
    """``url`` without its password, for error messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urllib.parse.urlunsplit(parts._replace(netloc=user + netloc))


def _describe_client(client: aioredis.Redis) -> str:
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
    return f"redis://{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"


def _group_is_missing(exc: BusError) -> bool:
    """Whether Redis refused because the stream or group is gone (e.g. a restart lost the data).

    NOGROUP answers a command on a missing group; Redis >= 7.2 answers UNBLOCKED to a blocked
    XREADGROUP whose stream or group was deleted meanwhile.
    """
    return isinstance(exc.__cause__, redis_errors.ResponseError) and str(exc.__cause__).startswith(
        ("NOGROUP", "UNBLOCKED")
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _group_info(raw: Any) -> dict[str, Any]:
    """One ``XINFO GROUPS`` entry as a dict with text keys (RESP2 gives a flat list)."""
    if isinstance(raw, dict):
        items = list(raw.items())
    else:
        items = list(zip(raw[::2], raw[1::2], strict=True))
    return {_text(k): (_text(v) if isinstance(v, bytes) else v) for k, v in items}


def _payload(fields: Any) -> bytes | None:
    """The payload of a stream entry's fields: a dict (parsed reply) or a flat list (script reply)."""
    if isinstance(fields, dict):
        value = fields.get(_PAYLOAD_FIELD)
    else:
        pairs = list(fields or ())
        value = dict(zip(pairs[::2], pairs[1::2], strict=True)).get(_PAYLOAD_FIELD)
    return value if isinstance(value, bytes) else None


class RedisBus:
    """A ``Bus`` on Redis Streams (Redis >= 6.2). Stream ``s`` is the key ``prefix + s``.

    Streams are trimmed with ``XADD MAXLEN ~ max_len``: Redis drops whole macro-nodes of the
    oldest entries, whether or not they are pending, so ``max_len`` must be far above any
    backlog consumers can build up. Each call is bounded by ``op_timeout`` seconds (plus the
    block time for ``read``) and raises ``BusTimeout`` beyond it, ``BusError`` if Redis is
    unreachable. Reconnecting is the client's job: ``from_url`` configures a short retry with
    backoff, so the next call after Redis restarts works. If a restart lost the data, ``read``
    and ``claim_stale`` re-create their group (and the stream) and go on.

    Because redis-py retries a command whose connection broke, a ``publish`` that raced a
    connection failure may append its message twice; consumers are idempotent anyway.

    A blocking ``read`` is issued as ``XREADGROUP BLOCK`` calls of at most ``max_block_slice``
    seconds (and less than the client's socket timeout), each holding one pooled connection.
    Redis checks block timeouts on its 1/hz timer, so an empty blocking read may return up to
    ~100 ms after ``block``; a published message wakes it at once.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str = "gpumarket:",
        max_len: int = 1_000_000,
        op_timeout: float = 5.0,
        max_block_slice: float = 4.0,
    ) -> None:
        if max_len < 1:
            raise ValueError(f"max_len must be at least 1, got {max_len}")
        if op_timeout <= 0:
            raise ValueError(f"op_timeout must be > 0 seconds, got {op_timeout}")
        kwargs = client.connection_pool.connection_kwargs
        if kwargs.get("decode_responses"):
            raise ConfigError("RedisBus needs a Redis client with decode_responses=False: payloads are bytes")
        self._client = client
        self._prefix = prefix
        self._max_len = max_len
        self._op_timeout = op_timeout
        self._where = _describe_client(client)
        self._owns_client = False
        self._closed = False
        # A blocking XREADGROUP must answer before the client's socket timeout fires, or redis-py
        # drops the connection as dead: long blocks are split into slices of at most half of it,
        # so a busy Redis (or a busy caller) has the other half to deliver the empty answer.
        socket_timeout = kwargs.get("socket_timeout")
        if socket_timeout is not None:
            if socket_timeout <= _BLOCK_MARGIN:
                raise ConfigError(
                    f"RedisBus needs a client socket_timeout of None or above {_BLOCK_MARGIN}s for "
                    f"blocking reads, got {socket_timeout}s"
                )
            max_block_slice = min(max_block_slice, socket_timeout - max(_BLOCK_MARGIN, socket_timeout / 2))
        if max_block_slice <= 0:
            raise ValueError(f"max_block_slice must be > 0 seconds, got {max_block_slice}")
        self._max_block_slice = max_block_slice
        # redis-py leaves execute_command untyped; every reply is parsed defensively below.
        self._execute = cast("Callable[..., Awaitable[Any]]", client.execute_command)
        self._claim_script = client.register_script(_CLAIM_SCRIPT)
        self._claim_cursors: dict[tuple[str, str], str] = {}
        # Calls wait here (within op_timeout) for a free connection rather than fail with
        # "Too many connections"; cheaper than redis-py's BlockingConnectionPool.
        self._connection_slots = asyncio.Semaphore(getattr(client.connection_pool, "max_connections", 2**31))

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "gpumarket:",
        max_len: int = 1_000_000,
        op_timeout: float = 5.0,
        max_block_slice: float = 4.0,
        max_connections: int = 64,
        client_name: str | None = "gpumarket-bus",
    ) -> RedisBus:
        """A bus owning a new client for ``url`` (``redis://``, ``rediss://``, ``unix://``). Does no I/O.

        ``max_connections`` bounds the pool; every blocked ``read`` holds a connection, and a
        call waits up to ``op_timeout`` for a free one. ``client_name`` is what ``CLIENT LIST``
        shows. The client retries a command whose connection broke 3 times with a short
        backoff (50 ms to 0.5 s), so a Redis restart costs callers nothing but latency.
        ``close()`` closes the client.
        """
        pool = aioredis.ConnectionPool.from_url(
            url,
            max_connections=max_connections,
            # No socket timeout: _call bounds every call by op_timeout (+ the block slice) and
            # redis-py drops a connection whose read was cancelled; a second per-read timer
            # would only cost time (about 8% of publish throughput).
            socket_timeout=None,
            socket_connect_timeout=op_timeout,
            socket_keepalive=True,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=3),
            client_name=client_name,
        )
        bus = cls(
            aioredis.Redis.from_pool(pool),
            prefix=prefix,
            max_len=max_len,
            op_timeout=op_timeout,
            max_block_slice=max_block_slice,
        )
        bus._owns_client = True
        bus._where = redact_url(url)
        return bus

    @property
    def client(self) -> aioredis.Redis:
        """The underlying client (for health checks and tests)."""
        return self._client

    def _key(self, stream: str) -> str:
        return self._prefix + stream

    async def _call(
        self, what: str, operation: Callable[[], Awaitable[_T]], *, extra_time: float = 0.0
    ) -> _T:
        """Run one Redis operation under ``op_timeout``, mapping redis-py errors to ``BusError``."""
        if self._closed:
            raise BusError("the Redis bus is closed")
        try:
            async with asyncio.timeout(self._op_timeout + extra_time), self._connection_slots:
                return await operation()
        except (TimeoutError, redis_errors.TimeoutError) as exc:
            raise BusTimeout(
                f"Redis at {self._where} did not answer {what} within {self._op_timeout + extra_time:.1f}s; "
                f"{_REDIS_HINT}",
                details={"redis": self._where},
            ) from exc
        except redis_errors.ConnectionError as exc:
            raise BusError(
                f"cannot reach Redis at {self._where} ({what}): {str(exc).rstrip('.')}; {_REDIS_HINT}",
                code="bus_unavailable",
                details={"redis": self._where},
            ) from exc
        except redis_errors.RedisError as exc:
            raise BusError(
                f"Redis at {self._where} refused {what}: {exc}", details={"redis": self._where}
            ) from exc

    async def publish(self, stream: str, payload: bytes) -> str:
        """``XADD MAXLEN ~``; returns once Redis has the message.

        Cancelling is safe but leaves it unknown whether the message was appended.
        """
        message_id = await self._call(
            f"XADD {stream}",
            lambda: self._execute(
                "XADD", self._key(stream), "MAXLEN", "~", self._max_len, "*", _PAYLOAD_FIELD, payload
            ),
        )
        return _text(message_id)

    async def ensure_group(self, stream: str, group: str) -> None:
        """``XGROUP CREATE ... 0 MKSTREAM``, ignoring an existing group. Cancelling is safe."""
        await self._call(f"XGROUP CREATE {stream} {group}", lambda: self._create_group(stream, group))

    async def _create_group(self, stream: str, group: str) -> None:
        try:
            await self._execute("XGROUP", "CREATE", self._key(stream), group, "0", "MKSTREAM")
        except redis_errors.ResponseError as exc:
            if not str(exc).startswith("BUSYGROUP"):
                raise

    async def _recreate_group(self, stream: str, group: str, what: str) -> None:
        logger.warning(
            "bus group %r of stream %r vanished from Redis at %s (restarted without persistence?); "
            "re-creating it for %s",
            group,
            stream,
            self._where,
            what,
        )
        await self.ensure_group(stream, group)

    async def read(
        self, stream: str, group: str, consumer: str, *, count: int = 100, block: float | None = 1.0
    ) -> list[BusMessage]:
        """``XREADGROUP GROUP group consumer COUNT count BLOCK ms STREAMS key >``.

        Creates the group if missing (also after a Redis restart lost it). Cancelling is safe:
        nothing is lost, but a message Redis handed out at the instant of the cancellation
        stays pending for ``consumer`` and comes back through ``claim_stale``.
        """
        check_limits(count=count, block=block)
        loop = asyncio.get_running_loop()
        deadline = None if not block else loop.time() + block
        recreated = False
        while True:
            slice_s: float | None = None
            if deadline is not None:
                slice_s = min(max(0.001, deadline - loop.time()), self._max_block_slice)
            try:
                messages = await self._read_once(stream, group, consumer, count, slice_s)
            except BusError as exc:
                if recreated or not _group_is_missing(exc):
                    raise
                recreated = True
                await self._recreate_group(stream, group, "read")
                continue
            if messages or deadline is None or loop.time() >= deadline:
                return messages

    async def _read_once(
        self, stream: str, group: str, consumer: str, count: int, block: float | None
    ) -> list[BusMessage]:
        args: list[Any] = ["XREADGROUP", "GROUP", group, consumer, "COUNT", count]
        if block is not None:
            args += ["BLOCK", max(1, round(block * 1000))]
        args += ["STREAMS", self._key(stream), ">"]
        reply = await self._call(
            f"XREADGROUP {stream} {group}",
            lambda: self._execute(*args),
            extra_time=block or 0.0,
        )
        if not reply:
            return []
        # RESP2: [[key, [(id, fields), ...]]]; RESP3: {key: [[id, fields], ...]}
        streams = reply.values() if isinstance(reply, dict) else (entries for _key, entries in reply)
        messages = []
        for entries in streams:
            for message_id, fields in entries:
                payload = _payload(fields)
                if payload is not None:
                    messages.append(
                        BusMessage(stream=stream, id=_text(message_id), payload=payload, deliveries=1)
                    )
        return messages

    async def ack(self, stream: str, group: str, ids: Sequence[str]) -> int:
        """``XACK``; returns how many were pending. Cancelling is safe (acking again is harmless)."""
        if not ids:
            return 0
        acked = await self._call(
            f"XACK {stream} {group}", lambda: self._execute("XACK", self._key(stream), group, *ids)
        )
        return int(acked)

    async def claim_stale(
        self, stream: str, group: str, consumer: str, *, min_idle: float, count: int = 100
    ) -> list[BusMessage]:
        """``XAUTOCLAIM`` plus the new delivery counts, atomically (one Lua script).

        Sweeps the pending list in id order, resuming where the previous sweep stopped, so a
        call may return fewer than ``count`` even though more are stale; call it periodically.
        Messages trimmed from the stream while pending are dropped from the pending list with
        a warning. Cancelling is safe: claimed messages stay pending and are claimed again.
        """
        check_limits(count=count, min_idle=min_idle)
        key = self._key(stream)
        cursor = self._claim_cursors.pop((stream, group), "0-0")
        args: list[str | int] = [group, consumer, round(min_idle * 1000), count, cursor, 16]
        try:
            reply = await self._call(
                f"XAUTOCLAIM {stream} {group}", lambda: self._claim_script(keys=[key], args=args)
            )
        except BusError as exc:
            if not _group_is_missing(exc):
                raise
            await self._recreate_group(stream, group, "claim_stale")
            return []
        next_cursor, claimed, deleted = reply
        if _text(next_cursor) != "0-0":
            self._claim_cursors[(stream, group)] = _text(next_cursor)
        if deleted:
            logger.warning(
                "%d pending messages of stream %r group %r were trimmed before being acknowledged; "
                "raise max_len or make consumers faster",
                deleted,
                stream,
                group,
            )
        messages = []
        for message_id, fields, deliveries in claimed:
            payload = _payload(fields)
            if payload is not None:
                messages.append(
                    BusMessage(
                        stream=stream, id=_text(message_id), payload=payload, deliveries=int(deliveries)
                    )
                )
        return messages

    async def pending_count(self, stream: str, group: str) -> int:
        """``XPENDING`` summary count; 0 if the group does not exist. Cancelling is safe."""
        try:
            summary = await self._call(
                f"XPENDING {stream} {group}",
                lambda: self._execute("XPENDING", self._key(stream), group),
            )
        except BusError as exc:
            if _group_is_missing(exc):
                return 0
            raise
        if isinstance(summary, dict):
            return int(summary["pending"])
        return int(summary[0])

    async def stream_length(self, stream: str) -> int:
        """``XLEN``. Cancelling is safe."""
        length = await self._call(f"XLEN {stream}", lambda: self._execute("XLEN", self._key(stream)))
        return int(length)

    async def backlog(self, stream: str, group: str) -> Backlog:
        """``XINFO GROUPS`` + ``XPENDING`` + one ``XRANGE``; ids carry their publish time in ms."""
        key = self._key(stream)
        try:
            groups = await self._call(f"XINFO GROUPS {stream}", lambda: self._execute("XINFO", "GROUPS", key))
        except BusError as exc:
            if "no such key" in str(exc).lower():
                return Backlog(undelivered=0, pending=0, oldest_published_at=None)
            raise
        info = next((g for g in (_group_info(g) for g in groups) if g.get("name") == group), None)
        if info is None:
            return Backlog(undelivered=0, pending=0, oldest_published_at=None)
        pending = int(info.get("pending") or 0)
        last_delivered = str(info.get("last-delivered-id") or "0-0")
        oldest_id: str | None = None
        if pending:
            summary = await self._call(f"XPENDING {stream} {group}", lambda: self._execute("XPENDING", key, group))
            first = summary.get("min") if isinstance(summary, dict) else summary[1]
            oldest_id = _text(first) if first is not None else None
        next_entries = await self._call(
            f"XRANGE {stream}", lambda: self._execute("XRANGE", key, f"({last_delivered}", "+", "COUNT", 1)
        )
        lag = info.get("lag")
        if next_entries:
            undelivered = int(lag) if lag is not None else 1
            if oldest_id is None:
                oldest_id = _text(next_entries[0][0])
        else:
            undelivered = 0
        oldest = int(oldest_id.split("-", 1)[0]) / 1000 if oldest_id else None
        return Backlog(undelivered=undelivered, pending=pending, oldest_published_at=oldest)

    async def ping(self) -> None:
        """``PING``; raises ``BusError`` / ``BusTimeout`` naming the Redis URL if it fails."""
        await self._call("PING", lambda: self._execute("PING"))

    async def close(self) -> None:
        """Close the client if this bus created it (``from_url``). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._owns_client:
            await self._client.aclose()


async def delete_prefix(redis_url: str, prefix: str) -> int:
    """Delete every key under ``prefix`` (a bus's streams, the registry, rate limits, Celery's queue); how many."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
        return len(keys)
    finally:
        await client.aclose()


__all__ = ["RedisBus", "delete_prefix", "redact_url"]
