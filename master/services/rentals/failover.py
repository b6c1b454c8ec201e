"""Fail-over on a closed agent link: a host whose last link closed (``master.telemetry.links``) and has not come
back loses its rentals after their ``failover_after_s`` (the rental's own, else the master's setting), measured
from the moment the link closed; those that asked for it are then placed again (``lifecycle.replace_lost``).

A host heard from after its link closed is not lost (a reconnect whose open event is still on its way). Billing
stops at ``host_lost_at``: the last time the host was heard from, never later than the close (a relay declares a
link dead only after its keepalive gave up, up to ``ping_interval`` + ``ping_timeout`` after the host fell
silent). Missed heartbeats remain the backstop for a host whose link looks open but says nothing
(``lifecycle.fail_rentals_of_lost_hosts``).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Host, Rental
from master.services.lifecycle.hosts import transition
from master.services.lifecycle.rentals import ACTIVE_STATES
from master.services.market import FailureCode
from master.services.rentals.lifecycle import fail_rental, note_host_unreachable
from master.services.rentals.request import MAX_FAILOVER_AFTER_S, MIN_FAILOVER_AFTER_S

log = logging.getLogger(__name__)

__all__ = ["MAX_FAILOVER_AFTER_S", "MIN_FAILOVER_AFTER_S", "fail_rentals_of_closed_links", "failover_after",
           "mark_unlinked_hosts_offline"]


def failover_after(rental: Rental, default_s: float) -> timedelta:
    """How long the rental's host may stay unreachable before the rental fails as host lost."""
    return timedelta(seconds=rental.failover_after_s if rental.failover_after_s is not None else default_s)


def _lost(down_since: datetime | None, last_seen: datetime | None) -> bool:
    """Whether a host's link is down with nothing heard since it closed."""
    return down_since is not None and (last_seen is None or last_seen <= down_since)


def _counted_from(down_since: datetime, watching_since: datetime | None) -> datetime:
    """When a link's time down starts to count: at its close, or when the judging master started watching, if later
    (a whole platform restarted after a while: its agents get their fail-over time to reconnect)."""
    return max(down_since, watching_since) if watching_since is not None else down_since


async def fail_rentals_of_closed_links(session: AsyncSession, *, now: datetime, default_s: float,
                                       watching_since: datetime | None = None) -> list[str]:
    """Fail the active rentals of hosts whose link has been down for the rentals' ``failover_after``; returns their ids.

    Judged as of ``now`` (the caller's horizon: no later than what ingestion and the link events have applied), and
    counted from ``watching_since`` for links closed before it.
    """
    rows = (
        await session.execute(
            select(Rental, Host.link_down_since, Host.last_seen_at)
            .join(Host, Host.id == Rental.host_id)
            .where(Host.link_down_since.is_not(None), Host.link_down_since <= now - timedelta(seconds=MIN_FAILOVER_AFTER_S),
                   Rental.state.in_(ACTIVE_STATES))
            .with_for_update(of=Rental, skip_locked=True)
        )
    ).all()  # fmt: skip
    failed = []
    for rental, down_since, last_seen in rows:
        wait = failover_after(rental, default_s)
        if down_since is None or not _lost(down_since, last_seen) or now < _counted_from(down_since, watching_since) + wait:
            continue
        lost_at = min(down_since, last_seen) if last_seen is not None else down_since
        await fail_rental(
            session, rental, code=FailureCode.HOST_LOST, at=lost_at, lost_at=lost_at,
            reason=(f"host {rental.host_id} lost: its agent link closed at {down_since:%Y-%m-%dT%H:%M:%SZ} and was not back "
                    f"within {wait.total_seconds():g}s (failover_after_s)"),
        )  # fmt: skip
        log.warning("rental %s failed: host %s's link down since %s", rental.id, rental.host_id, down_since.isoformat())
        failed.append(rental.id)
    return failed


async def mark_unlinked_hosts_offline(session: AsyncSession, *, now: datetime, default_s: float,
                                      changed_at: datetime | None = None, watching_since: datetime | None = None) -> list[str]:
    """Hosts whose link has been down for the master's ``failover_after_s`` go offline (nothing is placed on them;
    rentals that asked for a longer fail-over wait on, their meter paused); returns their ids."""
    hosts = (
        await session.scalars(
            select(Host).where(Host.state.in_(("online", "rented", "draining")), Host.link_down_since.is_not(None),
                               Host.link_down_since <= now - timedelta(seconds=default_s))
            .with_for_update(skip_locked=True)
        )
    ).all()  # fmt: skip
    gone = []
    for host in hosts:
        assert host.link_down_since is not None
        if not _lost(host.link_down_since, host.last_seen_at) or now < _counted_from(host.link_down_since, watching_since) + timedelta(seconds=default_s):
            continue
        transition(session, host, "offline", actor="monitor", at=changed_at,
                   cause=f"agent link closed at {host.link_down_since:%Y-%m-%dT%H:%M:%SZ}, not back within {default_s:g}s")
        await note_host_unreachable(session, host.id, since=host.link_down_since)
        gone.append(host.id)
    return gone
