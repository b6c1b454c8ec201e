"""The relay's word on its agents' links: an ``open`` event when an agent's websocket is in session here, a
``closed`` one when it ends (``shared.protocol.LinkEvent`` on ``AGENT_LINKS_STREAM``).

The master fails a host's rentals over ``failover_after_s`` after its last link closed and did not reopen
(``master.telemetry.links``), instead of waiting for missed heartbeats alone. The events are advice: one that
cannot be published (the bus is down, or slower than ``timeout``) is logged and dropped, and the heartbeats
remain the backstop. Each connection gets an id of its own, so a close that reaches the master after the agent
reconnected elsewhere is recognised as the old link's.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from datetime import datetime
from typing import Literal

from shared import protocol
from shared.bus import Bus
from shared.errors import BusError

log = logging.getLogger(__name__)


def new_connection_id() -> str:
    """An id no other connection of any relay has (random: a restarted relay must not reuse its old ids)."""
    return uuid.uuid4().hex


async def announce(bus: Bus, *, event: Literal["open", "closed"], relay_id: str, host_id: str, connection_id: str, at: datetime,
                   draining: bool = False, code: int | None = None, timeout: float = 2.0) -> bool:
    """Publish one link event; returns whether the bus took it (``False``: logged, dropped).

    Bounded by ``timeout`` seconds. Cancelling it is safe: the event is then simply not sent (the master's
    heartbeat monitor still notices a silent host).
    """
    record = protocol.LinkEvent(event=event, relay_id=relay_id, host_id=host_id, connection_id=connection_id,
                                at=at, draining=draining, code=code if code is not None and 0 <= code <= 4999 else None)
    try:
        async with asyncio.timeout(timeout):
            await bus.publish(protocol.AGENT_LINKS_STREAM, protocol.encode_link_event(record))
    except (BusError, TimeoutError) as exc:
        log.warning("could not tell the master that host %s's link %s: %s", host_id,
                    "opened" if event == "open" else "closed", exc or "timed out")
        return False
    return True
