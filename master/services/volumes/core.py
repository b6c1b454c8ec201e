"""Volumes as a renter sees them (docs/volumes.md#the-resource): making one (idempotently, on a host chosen by id,
region or price), reading and listing them, deleting one, and what the agents' ``create_volume``/``delete_volume``
results mean.

**Where it lives.** ``host_id`` names the host; else, among the online hosts (of ``region``, when given) whose agents
keep volumes and whose listings lend storage, the cheapest per GiB-hour with room (most GiB free first between equals).
A host's room is its listing's ``volume_gib`` less its live volumes' sizes; it is read with the listing's row locked
(``FOR UPDATE`` on PostgreSQL; SQLite's write lock, ``serialised_session``), so two volumes made at once never take the
same GiB twice.

**Whose.** A volume belongs to the account it was made for (a team's, when acting for one); anyone else gets 404
``volume_not_found``, as for one that does not exist. Admins see every volume.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import Master
from master.models import Command as CommandRow
from master.models import Host, HostListing, Rental, Volume, VolumeAttachment, VolumeEvent
from master.services import commands, market
from master.services.accounts import Principal
from master.services.lifecycle.rentals import ACTIVE_STATES
from master.services.volumes.lifecycle import VolumeState, request_deletion, transition
from master.services.volumes.request import VolumeRequest, is_volume_id
from shared import protocol
from shared.errors import Conflict, NotFound

log = logging.getLogger(__name__)

KINDS = frozenset({"create_volume", "delete_volume"})  # the commands whose results ``apply_result`` applies
LENDING_STATES = ("online", "rented")  # a host in another state takes no new volume (409 volume_host_offline)
GONE_HOST_STATES = ("revoked",)  # a volume there is deleted at once: its agent will never answer


def new_volume_id() -> str:
    return f"vol-{secrets.token_hex(8)}"


# ---- making one -----------------------------------------------------------------------------------


async def _earlier(master: Master, account_id: str, key: str | None, fingerprint: str) -> Volume | None:
    """What an earlier request with ``key`` made (master/services/idempotency.py's rule, for a table keyed by account)."""
    if key is None:
        return None
    async with master.db.session() as session:
        existing = await session.scalar(
            select(Volume).where(Volume.account_id == account_id, Volume.idempotency_key == key)
        )
    if existing is not None and existing.request_fingerprint != fingerprint:
        raise Conflict("this Idempotency-Key was already used for a different volume request; use a new key",
                       code="idempotency_key_reused")  # fmt: skip
    return existing


async def create_volume(master: Master, principal: Principal, request: VolumeRequest, *,
                        idempotency_key: str | None) -> tuple[Volume, bool]:  # fmt: skip
    """Make a volume (``creating``, and a ``create_volume`` for its host's agent, sent after the commit); returns it and
    whether this call made it (False: a repeat of ``idempotency_key`` answers what the first made)."""
    request = request.check()
    fingerprint = request.fingerprint()
    if (existing := await _earlier(master, principal.account_id, idempotency_key, fingerprint)) is not None:
        return existing, False
    now = master.clock.now()
    try:
        async with master.db.serialised_session() as session:
            if await _live_named(session, principal.account_id, request.name) is not None:
                raise _name_taken(request.name)
            host, listing = await choose_host(session, request)
            assert listing.storage_price_per_gib_hour is not None  # choose_host takes only hosts with a price
            if master.settings.require_credit:  # an hour of its storage, on top of what the account runs and keeps
                await master.credit_gate.has_credit_for_volume(
                    session, principal.account_id, request.size_gib, listing.storage_price_per_gib_hour,
                    min_period_s=master.settings.billing_min_period_s,
                )  # fmt: skip
            volume = Volume(
                id=new_volume_id(), account_id=principal.account_id, name=request.name, size_gib=request.size_gib,
                host_id=host.id, state=VolumeState.CREATING, price_per_gib_hour=listing.storage_price_per_gib_hour,
                idempotency_key=idempotency_key, request_fingerprint=fingerprint, created_at=now,
            )  # fmt: skip
            session.add(volume)
            session.add(VolumeEvent(volume_id=volume.id, at=now, from_state=None, to_state=VolumeState.CREATING,
                                    cause=f"made by {principal.name}: {request.size_gib} GiB on host {host.id}"))  # fmt: skip
            command = commands.new_command(
                session,
                host_id=host.id,
                command=protocol.CreateVolume(volume_id=volume.id, size_gib=request.size_gib),
                rental_id=None,
            )
            await session.flush()
    except IntegrityError:
        # A concurrent request won the race into a unique index: the same key (its volume), or the same name.
        if (
            existing := await _earlier(master, principal.account_id, idempotency_key, fingerprint)
        ) is not None:
            return existing, False
        raise _name_taken(request.name) from None
    await commands.publish(master, [command.id])
    log.info(
        "volume %s (%s, %d GiB) made for %s on host %s",
        volume.id,
        volume.name,
        volume.size_gib,
        principal.account_id,
        host.id,
    )
    return volume, True


def _name_taken(name: str) -> Conflict:
    return Conflict(f"you already have a volume named {name!r}; choose another name, or delete that one first",
                    code="volume_name_taken")  # fmt: skip


async def _live_named(session: AsyncSession, account_id: str, name: str) -> Volume | None:
    return await session.scalar(
        select(Volume).where(
            Volume.account_id == account_id, Volume.name == name, Volume.deleted_at.is_(None)
        )
    )


async def _room(session: AsyncSession, listing: HostListing) -> int:
    """The GiB a new volume may take on the listing's host, the listing's row locked first."""
    await session.refresh(listing, with_for_update=True)
    used = (await market.volume_gib_used(session, [listing.host_id])).get(listing.host_id, 0)
    return max(0, listing.volume_gib - used)


async def choose_host(session: AsyncSession, request: VolumeRequest) -> tuple[Host, HostListing]:
    """The host the volume goes to and its listing (locked), or the refusal that says why none can take it."""
    size = request.size_gib
    if request.host_id is not None:
        host = await session.get(Host, request.host_id)
        if host is None:
            raise NotFound(f"no host {request.host_id!r}", code="host_not_found")
        listing = await session.get(HostListing, host.id)
        if listing is None or listing.storage_price_per_gib_hour is None or listing.volume_gib <= 0:
            raise Conflict(f"host {host.id} lends no storage for volumes (its provider lists no storage price or size); "
                           "choose another host, or leave host_id out to let the platform choose", code="volume_host_lends_none")  # fmt: skip
        kept, why = market.volumes_kept(host.isolation)
        if not kept:
            raise Conflict(
                f"host {host.id} keeps no volumes: {why}; choose another host", code="volume_host_unsupported"
            )
        if host.state not in LENDING_STATES:
            raise Conflict(f"host {host.id} is {host.state}: a volume is made by its agent, so it must be online; try again "
                           "when it is, or choose another host", code="volume_host_offline")  # fmt: skip
        room = await _room(session, listing)
        if size > room:
            raise Conflict(f"host {host.id} has {room} GiB free for volumes, not {size}; ask for at most {room} GiB or choose "
                           "another host", code="volume_host_full", details={"host_id": host.id, "gib_free": room})  # fmt: skip
        return host, listing
    query = (
        select(Host, HostListing)
        .join(HostListing, HostListing.host_id == Host.id)
        .where(
            HostListing.storage_price_per_gib_hour.is_not(None),
            HostListing.volume_gib > 0,
            Host.state.in_(LENDING_STATES),
        )
    )
    if request.region is not None:
        query = query.where(Host.region == request.region)
    rows = [
        (h, lst) for h, lst in (await session.execute(query)).all() if market.volumes_kept(h.isolation)[0]
    ]
    where = f" in region {request.region}" if request.region is not None else ""
    if not rows:
        raise Conflict(f"no online host{where} lends storage for volumes now; try another region or later",
                       code="volume_host_lends_none")  # fmt: skip
    used = await market.volume_gib_used(session, [h.id for h, _ in rows])
    free = {h.id: lst.volume_gib - used.get(h.id, 0) for h, lst in rows}
    rows.sort(key=lambda pair: (pair[1].storage_price_per_gib_hour, -free[pair[0].id], pair[0].id))
    for host, listing in rows:
        if (
            free[host.id] >= size and await _room(session, listing) >= size
        ):  # again, locked: a concurrent volume may have taken it
            return host, listing
    most = max(free.values())
    raise Conflict(f"no online host{where} has {size} GiB free for volumes; the most free is {max(most, 0)} GiB: ask for "
                   "less, or try another region", code="volume_host_full", details={"gib_free": max(most, 0)})  # fmt: skip


# ---- reading ----------------------------------------------------------------------------------


async def get_volume(
    session: AsyncSession, principal: Principal, ref: str, *, for_update: bool = False
) -> Volume:
    """The volume ``ref`` names (its id, or the name of one of the account's live volumes); 404 for anyone else's."""
    if is_volume_id(ref):
        volume = await session.get(Volume, ref, with_for_update=for_update)
    else:
        query = select(Volume).where(
            Volume.account_id == principal.account_id, Volume.name == ref, Volume.deleted_at.is_(None)
        )
        volume = await session.scalar(query.with_for_update() if for_update else query)
    if volume is None or (principal.role != "admin" and volume.account_id != principal.account_id):
        raise NotFound(f"no volume {ref[:80]!r} in your account", code="volume_not_found")
    return volume


async def mounted_by(session: AsyncSession, volume_ids: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """Each volume's unreleased attachments whose rental has not ended (a stopping rental still mounts it)."""
    found: dict[str, list[dict[str, Any]]] = {v: [] for v in volume_ids}
    if not volume_ids:
        return found
    rows = await session.execute(
        select(VolumeAttachment, Rental.state)
        .join(Rental, Rental.id == VolumeAttachment.rental_id)
        .where(VolumeAttachment.volume_id.in_(list(volume_ids)), VolumeAttachment.released_at.is_(None),
               Rental.state.in_([s.value for s in ACTIVE_STATES]))
        .order_by(VolumeAttachment.id)
    )  # fmt: skip
    for attachment, state in rows.all():
        found[attachment.volume_id].append({"rental_id": attachment.rental_id, "mount": attachment.mount,
                                            "read_only": attachment.read_only, "rental_state": state})  # fmt: skip
    return found


async def list_volumes(session: AsyncSession, principal: Principal, *, limit: int, offset: int,
                       include_deleted: bool = False) -> tuple[list[dict[str, Any]], int]:  # fmt: skip
    """A page of the account's volumes (an admin's: everyone's), newest first; deleted ones only with ``include_deleted``."""
    query = select(Volume)
    if principal.role != "admin":
        query = query.where(Volume.account_id == principal.account_id)
    if not include_deleted:
        query = query.where(Volume.state != VolumeState.DELETED)
    total = await session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = (
        await session.scalars(query.order_by(Volume.created_at.desc(), Volume.id).limit(limit).offset(offset))
    ).all()
    regions = await _regions(session, {v.host_id for v in rows})
    mounts = await mounted_by(session, [v.id for v in rows])
    return [volume_view(v, region=regions.get(v.host_id), mounts=mounts[v.id]) for v in rows], total


async def volume_detail(
    session: AsyncSession, principal: Principal, ref: str, *, events: int = 50
) -> dict[str, Any]:
    """One volume with the rentals that mount it now and its latest events."""
    volume = await get_volume(session, principal, ref)
    regions = await _regions(session, {volume.host_id})
    mounts = await mounted_by(session, [volume.id])
    recent = (await session.scalars(
        select(VolumeEvent).where(VolumeEvent.volume_id == volume.id).order_by(VolumeEvent.id.desc()).limit(events)
    )).all()  # fmt: skip
    view = volume_view(volume, region=regions.get(volume.host_id), mounts=mounts[volume.id])
    view["events"] = [
        {"at": _iso(e.at), "from": e.from_state, "to": e.to_state, "cause": e.cause} for e in reversed(recent)
    ]
    return view


async def _regions(session: AsyncSession, host_ids: set[str]) -> dict[str, str | None]:
    if not host_ids:
        return {}
    return {
        h: r
        for h, r in (
            await session.execute(select(Host.id, Host.region).where(Host.id.in_(sorted(host_ids))))
        ).all()
    }


def volume_view(
    volume: Volume, *, region: str | None, mounts: Sequence[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """The volume as the API shows it; ``cost_per_hour``: its size at its price, what it costs while it lives."""
    return {
        "id": volume.id, "name": volume.name, "size_gib": volume.size_gib, "host_id": volume.host_id, "region": region,
        "state": volume.state, "price_per_gib_hour": market.money(volume.price_per_gib_hour),
        "cost_per_hour": market.money(volume.price_per_gib_hour * volume.size_gib),
        "failure_code": volume.failure_code, "failure_reason": volume.failure_reason,
        "mounted_by": [dict(m) for m in mounts],
        "created_at": _iso(volume.created_at), "ready_at": _iso(volume.ready_at), "deleted_at": _iso(volume.deleted_at),
        "unpaid_since": _iso(volume.unpaid_since), "delete_after": _iso(volume.delete_after),
    }  # fmt: skip


def _iso(at: datetime | None) -> str | None:
    return at.isoformat().replace("+00:00", "Z") if at is not None else None


# ---- deleting ---------------------------------------------------------------------------------


async def delete_volume(master: Master, principal: Principal, ref: str) -> Volume:
    """Ask for the volume's deletion (billing stops now; its files go when its agent confirms); idempotent. 409
    ``volume_in_use`` while a rental that has not ended mounts it. A volume on a revoked host is deleted at once."""
    now = master.clock.now()
    command: CommandRow | None = None
    async with master.db.serialised_session() as session:
        volume = await get_volume(session, principal, ref, for_update=True)
        if volume.state in (VolumeState.DELETING, VolumeState.DELETED):
            return volume
        users = (await mounted_by(session, [volume.id]))[volume.id]
        if users:
            names = ", ".join(u["rental_id"] for u in users)
            raise Conflict(f"volume {volume.name} is mounted by rental {names}: stop it first (gpumarket stop {users[0]['rental_id']})",
                           code="volume_in_use", details={"rentals": [u["rental_id"] for u in users]})  # fmt: skip
        host = await session.get(Host, volume.host_id)
        cause = f"deleted by {principal.name}"
        if host is None or host.state in GONE_HOST_STATES:
            transition(session, volume, VolumeState.DELETING, cause=cause, at=now)
            transition(
                session,
                volume,
                VolumeState.DELETED,
                cause="its host is revoked: its disk left the marketplace with it",
                at=now,
            )
        else:
            command = request_deletion(session, volume, cause=cause, at=now)
    if command is not None:
        await commands.publish(master, [command.id])
    return volume


# ---- the agents' results ----------------------------------------------------------------------


async def apply_result(
    session: AsyncSession, row: CommandRow, *, ok: bool, code: str | None, detail: str, at: datetime
) -> None:
    """What an agent's ``create_volume`` or ``delete_volume`` result means for its volume (once: the caller records the
    first result only). A volume deleted while its creation was under way stays deleting."""
    if row.kind not in KINDS:
        return
    volume_id = row.args.get("volume_id")
    volume = (
        await session.get(Volume, volume_id, with_for_update=True) if isinstance(volume_id, str) else None
    )
    if volume is None:
        log.warning("host %s answered %s for an unknown volume %r", row.host_id, row.kind, volume_id)
        return
    if row.kind == "create_volume" and volume.state == VolumeState.CREATING:
        if ok:
            transition(session, volume, VolumeState.READY, cause="its host's agent made it", at=at)
        else:
            volume.failure_code = code or "volume_create_failed"
            volume.failure_reason = (detail or "the agent gave no reason")[:4096]
            transition(
                session,
                volume,
                VolumeState.FAILED,
                cause=f"its host's agent could not make it: {volume.failure_reason}",
                at=at,
            )
    elif row.kind == "delete_volume" and volume.state == VolumeState.DELETING:
        if ok:
            transition(
                session, volume, VolumeState.DELETED, cause="its host's agent deleted its files", at=at
            )
        else:
            log.warning("host %s could not delete volume %s: %s", row.host_id, volume.id, detail)
