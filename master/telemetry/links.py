"""What the master makes of the relays' link events (``shared.protocol.LinkEvent``): each host's current agent
connection, and since when its link is down.

A host's link is *down since T* when the relay holding its current connection said that connection closed at T and
no newer connection has opened since. Only the current connection's close counts: an agent may reconnect through
relay B before relay A notices that its old link closed, and A's late close (another ``connection_id``) changes
nothing. An open older than the one held (a relay that was slow to publish) changes nothing either (the relays'
clocks are taken to be NTP-synchronised; a skewed one is caught by the host's messages heard after the close). Every
handler is idempotent: the bus delivers at least once. A host heard from after T is not lost, whatever the events say
(``master.services.rentals.failover`` checks ``last_seen_at``): the events are advice, and the heartbeats the
backstop.

The renters hear it at once: each active rental of the host gets an event when its link goes down (with the
moment it fails over if the link stays down) and when it comes back.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Host, Rental, RentalEvent
from master.services.lifecycle.rentals import ACTIVE_STATES
from shared import protocol

log = logging.getLogger(__name__)


async def apply_link_event(session: AsyncSession, event: protocol.LinkEvent, *, failover_after_s: float) -> str | None:
    """Apply one relay's link event; returns ``"down"`` or ``"up"`` when it changed the host's link, else None.

    ``failover_after_s``: the master's default, for what the renters are told.
    """
    host = await session.get(Host, event.host_id, with_for_update=True)
    if host is None or host.state == "revoked":
        log.info("link event for unknown host %s via %s dropped", event.host_id, event.relay_id)
        return None
    if event.event == "open":
        if event.connection_id == host.link_connection_id:
            return None  # a redelivery (or the open of a link whose close was already applied)
        if host.link_opened_at is not None and event.at < host.link_opened_at:
            log.info("host %s: open of link %s via %s at %s is older than the current link's; ignored",
                     host.id, event.connection_id, event.relay_id, event.at.isoformat())
            return None
        down_since = host.link_down_since
        host.link_connection_id, host.link_opened_at, host.link_down_since = event.connection_id, event.at, None
        if down_since is None:
            return None
        away = max(0.0, (event.at - down_since).total_seconds())
        await _tell_renters(session, host.id, f"host's agent link back via relay {event.relay_id} after {away:.1f}s: "
                                              "the rental carries on")
        return "up"
    current = host.link_connection_id
    if current is None:
        # No open seen (links opened before this master version): the link through the relay it was last heard via.
        if host.relay_id != event.relay_id:
            return None
        host.link_connection_id = event.connection_id
    elif current != event.connection_id:
        log.info("host %s: close of old link %s via %s ignored (current: %s)", host.id, event.connection_id, event.relay_id, current)
        return None
    if host.link_down_since is not None:
        return None  # a redelivery
    host.link_down_since = event.at
    why = "its relay shutting down" if event.draining else f"close code {event.code}" if event.code is not None else "no close code"
    deadline = event.at + timedelta(seconds=failover_after_s)
    await _tell_renters(session, host.id,
                        f"host's agent link closed at {event.at:%Y-%m-%dT%H:%M:%SZ} via relay {event.relay_id} ({why}): if it is "
                        f"not back by {deadline:%Y-%m-%dT%H:%M:%SZ} (or the rental's own failover_after_s), the rental fails "
                        "as host lost, and is placed again if it asked for that")  # fmt: skip
    log.info("host %s: agent link via %s down since %s", host.id, event.relay_id, event.at.isoformat())
    return "down"


async def _tell_renters(session: AsyncSession, host_id: str, cause: str) -> None:
    rentals = (await session.scalars(select(Rental).where(Rental.host_id == host_id, Rental.state.in_(ACTIVE_STATES)))).all()
    for rental in rentals:
        session.add(RentalEvent(rental_id=rental.id, from_state=rental.state, to_state=rental.state, cause=cause))
