"""Hosts as the API shows them: host and GPU views, listings, state-change events and network; a network
test on demand. (A host's telemetry series and live stream are ``master.telemetry.series``.)

Who sees what: renters and admins see every host (a renter only its own rentals on it),
providers their own; ``owned_host`` is a host the caller may operate.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import Master
from master.models import Gpu, Host, HostEvent, HostListing, NetworkMeasurement, Rental
from master.services import commands, market
from master.services.accounts import Principal
from master.services.isolation import isolation_view
from master.services.lifecycle.rentals import ACTIVE_STATES
from shared import protocol
from shared.errors import NotFound


def _gpu_view(gpu: Gpu, now: datetime) -> dict[str, Any]:
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "name": gpu.name,
        "memory_total_mib": gpu.memory_total_mib,
        "present": gpu.present,
        "rented": gpu.rental_id is not None,
        "milli_used": gpu.milli_used,  # fractional shares and whole rentals alike (1000: all of it)
        "classification": market.classification_view(gpu),
        "info": gpu.info,
        # What the GPU challenge proved (docs/verification.md): outcome, when, measured vs expected TFLOP/s, VRAM proven.
        "verification": market.gpu_verification(gpu, now=now),
    }


def _best_gpu(gpus: Sequence[Gpu]) -> Gpu | None:
    """The host's best present GPU by performance score: what its tier and score in listings are."""
    scored = [g for g in gpus if g.present]
    return max(scored, key=lambda g: g.score if g.score is not None else -1.0, default=None)


async def active_rentals_by_host(
    session: AsyncSession, host_ids: Sequence[str], *, renter_id: str | None = None
) -> dict[str, list[str]]:
    """The ids of each host's rentals that hold GPUs now (pending on the host, starting, running, stopping).

    With ``renter_id``, only that renter's: a renter sees every host, never another renter's rentals.
    """
    if not host_ids:
        return {}
    query = select(Rental.host_id, Rental.id).where(Rental.host_id.in_(list(host_ids)), Rental.state.in_(ACTIVE_STATES))
    if renter_id is not None:
        query = query.where(Rental.renter_id == renter_id)
    rows = await session.execute(query.order_by(Rental.created_at))
    found: dict[str, list[str]] = {}
    for host_id, rental_id in rows.all():
        if host_id is not None:
            found.setdefault(host_id, []).append(rental_id)
    return found


async def storage_by_host(session: AsyncSession, hosts: Sequence[Host]) -> dict[str, dict[str, Any]]:
    """Each host's storage terms for volumes (``market.storage_view``): two statements for a page of hosts."""
    ids = [h.id for h in hosts]
    listings = {row.host_id: row for row in (await session.scalars(select(HostListing).where(HostListing.host_id.in_(ids)))).all()}
    used = await market.volume_gib_used(session, ids)
    return {h.id: market.storage_view(listings.get(h.id), used.get(h.id, 0), h.isolation) for h in hosts}


def host_view(
    host: Host, gpus: Sequence[Gpu], *, now: datetime, detail: bool = False, active_rentals: Sequence[str] = (),
    storage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    best = _best_gpu(gpus)
    view: dict[str, Any] = {
        "id": host.id,
        "name": host.name,
        "state": host.state,
        "state_changed_at": host.state_changed_at.isoformat(),
        "region": host.region,
        "relay_id": host.relay_id,
        "agent_version": host.agent_version,
        "gpu_backend": host.gpu_backend,
        "last_seen_at": host.last_seen_at.isoformat() if host.last_seen_at else None,
        "reliability_score": host.reliability,
        "reliability_seeded": market.is_seeded(host.reliability_inputs),
        "tier": best.tier if best is not None else None,
        "score": best.score if best is not None else None,
        "active_rentals": list(active_rentals),
        "isolation": isolation_view(host.isolation),
        # Its cluster network's paths, from its hello (protocol.ClusterNetworkFacts; None: an older agent).
        "cluster_network": (host.facts or {}).get("cluster_network"),
        "gpu_count": sum(1 for g in gpus if g.present),
        "gpus": [_gpu_view(g, now) for g in sorted(gpus, key=lambda g: g.index) if g.present],
        # Every present GPU passed its challenge within the market's max age (the offers' ``verified``, less the flag).
        "verified": market.host_verified(gpus, now=now),
        **(storage or {}),  # volumes (docs/volumes.md): storage_price_per_gib_hour, volume_gib, volume_gib_free, ...
    }
    if detail:
        view["facts"] = host.facts
        view["latest_telemetry"] = host.latest_telemetry
        view["last_seq"] = host.last_seq
        view["latest_network"] = host.latest_network
        view["spool"] = host.spool_stats
        view["reliability"] = market.reliability_view(host)
        view["faults_since"] = host.faults_since.isoformat() if host.faults_since else None
        view["rejected_fields"] = host.rejected_fields
        view["cert_not_after"] = host.cert_not_after.isoformat() if host.cert_not_after else None
    return view


def _visible(principal: Principal) -> Any:
    if principal.role in ("admin", "renter"):
        return None
    return Host.owner_id == principal.account_id


def _own_rentals_only(principal: Principal) -> str | None:
    """Whose rentals a host view may name: a renter's own only (None: every rental, for its provider and admins)."""
    return principal.account_id if principal.role == "renter" else None


def _event_view(event: HostEvent, principal: Principal) -> dict[str, Any]:
    """A host state change. Renters get no cause or actor: those name other renters' rentals and other accounts."""
    hidden = principal.role == "renter"
    return {
        "at": event.at.isoformat(), "from": event.from_state, "to": event.to_state,
        "cause": None if hidden else event.cause, "actor": None if hidden else event.actor,
    }  # fmt: skip


async def list_hosts(
    session: AsyncSession, principal: Principal, *, limit: int, offset: int, now: datetime | None = None
) -> tuple[list[dict[str, Any]], int]:
    """A page of the hosts the caller sees; ``now`` (the master's clock; None: the wall clock) judges fresh proofs."""
    now = now or datetime.now(UTC)
    query = select(Host)
    condition = _visible(principal)
    if condition is not None:
        query = query.where(condition)
    total = await session.scalar(select(func.count()).select_from(query.subquery())) or 0
    hosts = (await session.scalars(query.order_by(Host.created_at).limit(limit).offset(offset))).all()
    gpus = (await session.scalars(select(Gpu).where(Gpu.host_id.in_([h.id for h in hosts])))).all()
    by_host: dict[str, list[Gpu]] = {}
    for gpu in gpus:
        by_host.setdefault(gpu.host_id, []).append(gpu)
    active = await active_rentals_by_host(session, [h.id for h in hosts], renter_id=_own_rentals_only(principal))
    storage = await storage_by_host(session, hosts)
    return [host_view(h, by_host.get(h.id, []), now=now, active_rentals=active.get(h.id, []), storage=storage[h.id])
            for h in hosts], total  # fmt: skip


async def get_host(session: AsyncSession, principal: Principal, host_id: str, *, now: datetime | None = None) -> dict[str, Any]:
    host = await session.get(Host, host_id)
    condition_ok = principal.role in ("admin", "renter") or (host is not None and host.owner_id == principal.account_id)
    if host is None or not condition_ok:
        raise NotFound(f"no host {host_id!r}", code="host_not_found")
    gpus = (await session.scalars(select(Gpu).where(Gpu.host_id == host.id))).all()
    active = await active_rentals_by_host(session, [host.id], renter_id=_own_rentals_only(principal))
    storage = await storage_by_host(session, [host])
    view = host_view(host, gpus, now=now or datetime.now(UTC), detail=True, active_rentals=active.get(host.id, []),
                     storage=storage[host.id])  # fmt: skip
    events = (await session.scalars(select(HostEvent).where(HostEvent.host_id == host.id).order_by(HostEvent.id.desc()).limit(20))).all()
    view["recent_events"] = [_event_view(e, principal) for e in events]
    return view


async def visible_host(session: AsyncSession, principal: Principal, host_id: str) -> Host:
    """A host the caller may look at (renters and admins: any; providers: their own); 404 otherwise."""
    host = await session.get(Host, host_id)
    if host is None or not (principal.role in ("admin", "renter") or host.owner_id == principal.account_id):
        raise NotFound(f"no host {host_id!r}", code="host_not_found")
    return host


async def host_events(
    session: AsyncSession, principal: Principal, host_id: str, *, limit: int, offset: int
) -> tuple[list[dict[str, Any]], int]:
    """Every state change of the host, newest first, with time, cause and actor (renters: without cause and actor)."""
    host = await visible_host(session, principal, host_id)
    total = await session.scalar(select(func.count()).select_from(HostEvent).where(HostEvent.host_id == host.id)) or 0
    rows = (
        await session.scalars(
            select(HostEvent).where(HostEvent.host_id == host.id).order_by(HostEvent.id.desc()).limit(limit).offset(offset)
        )
    ).all()
    return [_event_view(e, principal) for e in rows], total



async def host_network(session: AsyncSession, principal: Principal, host_id: str, *, limit: int) -> list[dict[str, Any]]:
    host = await visible_host(session, principal, host_id)
    rows = (
        await session.scalars(
            select(NetworkMeasurement).where(NetworkMeasurement.host_id == host.id).order_by(NetworkMeasurement.measured_at.desc()).limit(limit)
        )
    ).all()
    return [{"seq": r.seq, **r.data} for r in rows]


async def owned_host(session: AsyncSession, principal: Principal, host_id: str) -> Host:
    """A host the caller may operate: its provider, or an admin."""
    host = await session.get(Host, host_id)
    if host is None or (principal.role != "admin" and host.owner_id != principal.account_id):
        raise NotFound(f"no host {host_id!r} among your hosts", code="host_not_found")
    return host


# ---- asking a host ----------------------------------------------------


async def request_network_test(master: Master, who: Principal, host_id: str) -> str:
    """Ask the host's agent to measure its network now (its provider or an admin); the command's id."""
    async with master.db.session() as session:
        host = await owned_host(session, who, host_id)
        command = commands.new_command(session, host_id=host.id, command=protocol.MeasureNetwork(), rental_id=None)
        command_id = command.id
    await commands.publish(master, [command_id])
    return command_id
