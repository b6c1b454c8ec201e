"""The heartbeat monitor: rentals of hosts whose agent link closed fail over; hosts silent too long go offline;
rentals of hosts lost past the grace fail.

A sweep (every half ``heartbeat_interval``, at most every ``failover_after_s`` / 10, one master at a time under the
``heartbeat-sweeper`` lease) first fails the rentals of hosts whose agent link has been down for their
``failover_after_s`` (``master.services.rentals.failover``: the relays' link events, ``master.background.links``)
and takes hosts down that long offline; then, the backstop, marks hosts silent for ``missed_heartbeats_offline`` ×
``heartbeat_interval`` offline and fails the rentals of hosts offline past ``rental_grace_period`` as *host lost*.
Rentals that asked for it are placed again at once. Silence is judged as of ``ingested_until``, not the wall clock.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from master.background import leases
from master.context import Master
from master.services import rentals
from master.telemetry import hosts
from shared import protocol

log = logging.getLogger(__name__)

SWEEPER_LEASE = "heartbeat-sweeper"


async def ingested_until(master: Master, stream: str = protocol.AGENT_EVENTS_STREAM) -> datetime:
    """The time up to which every record published on ``stream`` has been applied (now, if caught up).

    Bus ids carry their publish time; everything published before the oldest unfinished
    message is in the database, so silence before that moment is real silence.
    """
    now = master.clock.now()
    backlog = await master.bus.backlog(stream, protocol.INGEST_GROUP)
    if backlog.oldest_published_at is None:
        return now
    return min(now, datetime.fromtimestamp(backlog.oldest_published_at, UTC))


async def sweep(master: Master, *, watching_since: datetime | None = None) -> tuple[list[str], list[str]]:
    """One pass of the heartbeat monitor; returns (hosts marked offline, rentals failed as host lost), link first.

    Judged against ``ingested_until``, not the wall clock: a master whose ingestion lags
    does not mistake its own backlog for silent hosts. ``watching_since``: when this monitor started; a link
    closed before then counts as closed from then (after a restart of the whole platform, agents reconnect).
    """
    settings = master.settings
    deadline = timedelta(seconds=settings.heartbeat_interval * settings.missed_heartbeats_offline)
    horizon = await ingested_until(master)
    lag = (master.clock.now() - horizon).total_seconds()
    if lag > settings.heartbeat_interval:
        log.warning("ingestion lags %.1fs behind; judging host silence as of %s", lag, horizon.isoformat())
    # A link is judged down only as of what both streams have applied: a reconnect's open, or a message heard since.
    link_horizon = min(horizon, await ingested_until(master, protocol.AGENT_LINKS_STREAM))
    async with master.db.session() as session:
        failed_over = await rentals.fail_rentals_of_closed_links(session, now=link_horizon, default_s=settings.failover_after_s,
                                                                 watching_since=watching_since)
    async with master.db.session() as session:
        unlinked = await rentals.mark_unlinked_hosts_offline(session, now=link_horizon, default_s=settings.failover_after_s,
                                                             changed_at=master.clock.now(), watching_since=watching_since)
    if unlinked:
        log.warning("hosts offline after their agent link stayed closed %gs: %s", settings.failover_after_s, ", ".join(unlinked))
    await _place_again(master, failed_over)
    async with master.db.session() as session:
        gone = await hosts.mark_silent_hosts_offline(session, now=horizon, deadline=deadline, changed_at=master.clock.now(),
                                                     grace=timedelta(seconds=settings.rental_grace_period))
    if gone:
        log.warning("hosts offline after %gs of silence: %s", deadline.total_seconds(), ", ".join(gone))
    async with master.db.session() as session:
        lost = await rentals.fail_rentals_of_lost_hosts(
            session, now=horizon, grace=timedelta(seconds=settings.rental_grace_period)
        )
    await _place_again(master, lost)
    return [*unlinked, *gone], [*failed_over, *lost]


async def _place_again(master: Master, lost: list[str]) -> None:
    for rental_id in lost:
        try:
            await rentals.replace_lost(master, rental_id)
        except Exception:
            log.exception("placing lost rental %s again failed", rental_id)


async def heartbeat_monitor(master: Master, *, every: float | None = None) -> None:
    """Fail over the rentals of hosts whose link stayed closed, mark silent hosts offline, and fail the rentals of
    hosts lost past the grace period. Cancel to stop.

    Several masters may run this; the ``heartbeat-sweeper`` lease makes one sweep at a time.
    Cancelling is safe: each sweep's transactions commit or roll back whole, and the lease is
    released on the way out.
    """

    started = master.clock.now()

    async def work() -> None:
        await sweep(master, watching_since=started)

    every = every or min(master.settings.heartbeat_interval / 2, master.settings.failover_after_s / 10)
    await leases.run_leased(master, SWEEPER_LEASE, every=every, work=work)
