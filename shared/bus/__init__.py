"""The message bus: append-only streams read through consumer groups.

Owns the ``Bus`` seam and its two implementations:

* ``memory.InProcessBus`` -- asyncio, one event loop, for embedded mode and tests;
* ``redis.RedisBus`` -- Redis Streams (``XADD`` / ``XREADGROUP`` / ``XACK`` / ``XAUTOCLAIM``),
  for relays and masters in separate processes;

``base`` holds the interface and its records (``Bus``, ``BusMessage``, ``Backlog``); this
module opens a bus from a ``GPUMARKET_REDIS_URL``-style URL (``open_bus``) and is the
package's public API: import from ``shared.bus``.

Both follow Redis consumer-group semantics: delivery is at-least-once, a message stays
*pending* for the consumer it was delivered to until it is acknowledged, and a message
left pending by a consumer that died is taken over with ``claim_stale``. Consumers must
therefore be idempotent. Payloads are opaque bytes; encoding them is ``shared.protocol``'s
job. Must not import from agent/, access/, master/, console/ or billing/.
"""

from __future__ import annotations

import urllib.parse

from shared.bus.base import Backlog, Bus, BusMessage
from shared.bus.memory import InProcessBus
from shared.bus.redis import RedisBus, delete_prefix, redact_url
from shared.errors import ConfigError

__all__ = ["Backlog", "Bus", "BusMessage", "InProcessBus", "RedisBus", "delete_prefix", "open_bus"]


async def open_bus(
    url: str | None,
    *,
    max_len: int | None = None,
    prefix: str = "gpumarket:",
    op_timeout: float = 5.0,
    max_connections: int = 64,
) -> Bus:
    """Open the bus named by ``url``: ``None`` or ``memory://`` in-process, ``redis[s]://`` Redis.

    ``max_len`` defaults to each implementation's own default. A Redis bus is pinged first, so
    a wrong URL fails here with ``BusError`` rather than at the first publish. Every
    ``memory://`` bus is a separate, private one.
    """
    scheme = urllib.parse.urlsplit(url).scheme if url else "memory"
    if scheme == "memory":
        return InProcessBus() if max_len is None else InProcessBus(max_len=max_len)
    if scheme in ("redis", "rediss", "unix"):
        bus = RedisBus.from_url(
            url or "",
            prefix=prefix,
            max_len=1_000_000 if max_len is None else max_len,
            op_timeout=op_timeout,
            max_connections=max_connections,
        )
        try:
            await bus.ping()
        except BaseException:
            await bus.close()
            raise
        return bus
    raise ConfigError(
        f"unsupported bus URL {redact_url(url or '')!r}: use redis://, rediss:// or memory:// "
        "(check GPUMARKET_REDIS_URL)"
    )
