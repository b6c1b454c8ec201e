"""The link-event loop: this master's consumer of the ``agent-links`` stream (``shared.protocol.LinkEvent``).

Every master runs it, no lease: the ``master`` consumer group shares the stream between them, as ingestion does
``agent-events``. Each event is applied in its own transaction (``master.telemetry.links``, idempotent) and
acknowledged once it committed; one that fails stays pending and is claimed again after ``stale_message_idle``
seconds, and given up after ``max_deliveries``. What the events mean for rentals is the heartbeat monitor's
(``master.background.heartbeats``).
"""

from __future__ import annotations

import asyncio
import logging

from master.context import Master
from master.telemetry.links import apply_link_event
from shared import protocol
from shared.bus import BusMessage
from shared.errors import BusError, ProtocolError

log = logging.getLogger(__name__)


async def link_events_loop(master: Master, *, block: float = 1.0, claim_every: float = 5.0, max_deliveries: int = 5) -> None:
    """Apply the relays' link events until cancelled.

    Cancelling is safe: an event not yet acknowledged stays pending, and this master (restarted) or another one
    claims it after ``stale_message_idle`` seconds.
    """
    bus, stream = master.bus, protocol.AGENT_LINKS_STREAM
    consumer = master.instance_id
    await bus.ensure_group(stream, protocol.INGEST_GROUP)
    loop = asyncio.get_running_loop()
    last_claim = -claim_every
    backoff = 0.5
    while True:
        try:
            if loop.time() - last_claim >= claim_every:
                last_claim = loop.time()
                stale = await bus.claim_stale(stream, protocol.INGEST_GROUP, consumer, min_idle=master.settings.stale_message_idle)
                await apply_link_events(master, stale, max_deliveries=max_deliveries)
            await apply_link_events(master, await bus.read(stream, protocol.INGEST_GROUP, consumer, count=100, block=block),
                         max_deliveries=max_deliveries)
            backoff = 0.5
        except BusError as exc:
            log.warning("link events: bus unavailable (%s); retrying in %.1fs", exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)


async def apply_link_events(master: Master, messages: list[BusMessage], *, max_deliveries: int = 5) -> None:
    """Apply and acknowledge ``messages`` (link events), each in its own transaction; one that fails stays pending."""
    done: list[str] = []
    for message in messages:
        try:
            event = protocol.decode_link_event(message.payload)
        except ProtocolError as exc:
            log.error("dropping malformed link event %s: %s", message.id, exc)
            done.append(message.id)
            continue
        try:
            async with master.db.session() as session:
                await apply_link_event(session, event, failover_after_s=master.settings.failover_after_s)
        except Exception:
            if message.deliveries >= max_deliveries:
                log.exception("giving up on link event %s after %d deliveries", message.id, message.deliveries)
                done.append(message.id)
            else:
                log.exception("applying link event %s failed (delivery %d); it stays pending", message.id, message.deliveries)
            continue
        done.append(message.id)
    if done:
        await master.bus.ack(protocol.AGENT_LINKS_STREAM, protocol.INGEST_GROUP, done)
