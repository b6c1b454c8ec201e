"""The master's commands for this relay's agents: the relay reads ``commands:<relay id>`` (a Redis Streams group,
``COMMAND_GROUP``) and hands each record to ``deliver``, which queues it on its host's link; a host not connected here
is skipped, and the master sends the command again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from shared import protocol
from shared.bus import Bus
from shared.cancelling import raise_if_cancelled
from shared.errors import BusError, ProtocolError

if TYPE_CHECKING:
    from access.agentlink import AgentLink

log = logging.getLogger(__name__)

COMMAND_GROUP = "relay"


async def consume_commands(bus: Bus, relay_id: str, deliver: Callable[[bytes], None]) -> None:
    """Deliver commands to connected agents. Cancelling is safe: undelivered ones stay pending."""
    stream = protocol.commands_stream(relay_id)
    backoff = 0.5
    first = True
    while True:
        # redis-py writes with asyncio.wait_for, which can lose a cancel (shared.cancelling): a relay's close then
        # waited on this loop until SIGKILL (tests/test_cluster.py, once under load).
        raise_if_cancelled()
        try:
            if first:
                # Whatever a previous run of this relay left pending: deliver or drop (the master resends).
                batch = await bus.claim_stale(stream, COMMAND_GROUP, relay_id, min_idle=0)
                first = False
            else:
                batch = await bus.read(stream, COMMAND_GROUP, relay_id, count=100, block=1.0)
            for item in batch:
                deliver(item.payload)
            if batch:
                await bus.ack(stream, COMMAND_GROUP, [m.id for m in batch])
            backoff = 0.5
        except BusError as exc:
            log.warning("command stream unavailable (%s); retrying in %.1fs", exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)


def deliver(payload: bytes, links: Mapping[str, AgentLink]) -> bool:
    """Queue one command record on its host's link; ``False`` when the record is malformed or the host is not in
    session here (the master sends it again)."""
    try:
        delivery = protocol.decode_command_delivery(payload)
    except ProtocolError as exc:
        log.error("dropping malformed command record: %s", exc)
        return False
    link = links.get(delivery.host_id)
    if link is None or link.close_request is not None:
        log.info("host %s not connected here; command %s waits for the master to resend", delivery.host_id, delivery.command.body.command_id)
        return False
    link.queue(protocol.encode(delivery.command))
    return True
