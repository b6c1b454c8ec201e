"""Rentals mount volumes (docs/volumes.md, "Rentals mount them"): what a request asks (``VolumeAsk``), which volumes
that is and the hosts the rental may go to (``resolve``), and the ``volume_attachments`` rows (``attach``).

* A rental's entries each name one of the renter's live volumes (by name or id) and a mount point; a ``ready``
  volume only (404 ``volume_not_found``, 409 ``volume_not_ready``). Its volumes must share a host (409
  ``volumes_on_different_hosts``): the rental goes there.
* A service's replicas (``alternatives``): entries with the same mount point are copies of one another on
  different hosts; a replica goes to a host that has one for every mount point, and mounts those.
* Read-write: one unfinished rental at a time (409 ``volume_in_use`` naming it); read-only: any number, also
  beside the writer. The partial unique index ``uq_volume_attachments_writer`` holds it when two placements race.
* Attachments are written in the rental's own transaction (placed, or queued holding its volumes) and released
  when the rental ends: ``master/services/lifecycle/rentals.py``'s flush hook, the one place every ending passes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Host, Volume, VolumeAttachment, VolumeEvent
from master.services.volumes.lifecycle import VolumeState
from shared import protocol
from shared.errors import Conflict, NotFound, ValidationFailed

RANK: Final = "{rank}"  # a cluster's entry naming it: member r mounts its own volume
HOST_UP: Final = ("online", "rented")  # a host that can take a rental (the hosts' state machine)


@dataclass(frozen=True)
class VolumeAsk:
    """One entry of a request's ``volumes``: a volume by ``name`` or ``id`` (one of them), mounted at ``mount``."""

    mount: str
    name: str | None = None
    id: str | None = None
    read_only: bool = False

    @property
    def ref(self) -> str:
        return self.id if self.id is not None else self.name or ""

    def text(self) -> str:
        return f"volume {self.ref!r}"

    def to_json(self) -> dict[str, Any]:
        key = "id" if self.id is not None else "name"
        return {key: self.ref, "mount": self.mount, "read_only": self.read_only}

    @classmethod
    def of_json(cls, data: Mapping[str, Any]) -> VolumeAsk:
        return cls(
            mount=str(data["mount"]),
            name=data.get("name"),
            id=data.get("id"),
            read_only=bool(data.get("read_only")),
        )

    def for_rank(self, rank: int) -> VolumeAsk:
        if self.name is None:
            return self
        return VolumeAsk(mount=self.mount, name=self.name.replace(RANK, str(rank)), read_only=self.read_only)


def asks_of(spec: Mapping[str, Any] | None) -> tuple[VolumeAsk, ...]:
    """The entries a rental's stored request (``spec["volumes"]``) names."""
    return tuple(VolumeAsk.of_json(item) for item in (spec or {}).get("volumes") or ())


def check_asks(
    asks: Sequence[VolumeAsk],
    workload: Mapping[str, Any],
    *,
    alternatives: bool = False,
    ranked: bool = False,
) -> None:
    """422 (``invalid_volumes``) for entries no placement could honour: a hold or process workload, a bad mount
    point, a volume named twice, two volumes at one mount point (except a service's copies: ``alternatives``), too
    many; ``ranked`` (a cluster's): every entry names ``{rank}`` (members are on distinct hosts, each with its own)."""
    if not asks:
        return

    def refuse(message: str, field: str = "volumes") -> ValidationFailed:
        return ValidationFailed(
            message, code="invalid_volumes", details={"problems": [{"field": field, "problem": message}]}
        )

    kind = workload.get("kind", "hold") if workload else "hold"
    if kind != "container":
        raise refuse(
            f"volumes are mounted into a container workload only, not a {kind} workload: give an image or a template"
        )
    if len(asks) > protocol.MAX_VOLUMES_PER_RENTAL * (4 if alternatives else 1):
        raise refuse(f"at most {protocol.MAX_VOLUMES_PER_RENTAL} volumes per rental")
    refs: set[str] = set()
    mounts: set[str] = set()
    for index, ask in enumerate(asks):
        field = f"volumes[{index}]"
        if (ask.name is None) == (ask.id is None):
            raise refuse("each volume entry names the volume by name or by id (one of them)", field)
        problem = protocol.mount_problem(ask.mount)
        if problem is not None:
            raise refuse(problem, f"{field}.mount")
        if ranked and (ask.name is None or RANK not in ask.name):
            raise refuse(
                f"a cluster's volume names {RANK} (e.g. 'ckpt-{RANK}'): each node mounts its own volume on its own host",
                field,
            )
        if ask.ref in refs:
            raise refuse(f"{ask.text()} is named twice", field)
        if ask.mount in mounts and not alternatives:
            raise refuse(f"two volumes are mounted at {ask.mount}", f"{field}.mount")
        refs.add(ask.ref)
        mounts.add(ask.mount)
    if alternatives and any(not ask.read_only for ask in asks):
        raise refuse("a service's replicas mount volumes read-only: set read_only: true")


@dataclass(frozen=True)
class Resolved:
    """The volumes a request names and where the rental may go: ``options`` maps each host to the mounts the rental
    gets there (one host for a rental; a service's replica may have several)."""

    options: dict[str, tuple[protocol.VolumeMount, ...]]
    volumes: dict[str, Volume]  # by id

    @property
    def hosts(self) -> list[str]:
        return sorted(self.options)

    def describe(self) -> str:
        """``volume 'data' (vol-…) is on host h-…``: what ties the rental to its hosts, for messages."""
        by_host: dict[str, list[str]] = {}
        for volume in self.volumes.values():
            by_host.setdefault(volume.host_id, []).append(f"{volume.name!r} ({volume.id})")
        parts = [f"volume{'s' if len(names) > 1 else ''} {', '.join(sorted(names))} {'are' if len(names) > 1 else 'is'} on host {host}"
                 for host, names in sorted(by_host.items())]  # fmt: skip
        return "; ".join(parts)


async def resolve(
    session: AsyncSession,
    account_id: str,
    asks: Sequence[VolumeAsk],
    *,
    rental_id: str | None = None,
    alternatives: bool = False,
) -> Resolved:
    """The volumes ``asks`` name among the account's, and the hosts the rental may go to. Raises 404
    ``volume_not_found``, 409 ``volume_not_ready``, ``volume_in_use`` (another unfinished rental than ``rental_id``
    mounts it read-write) or ``volumes_on_different_hosts``."""
    volumes: dict[str, Volume] = {}
    per_mount: dict[str, dict[str, protocol.VolumeMount]] = {}  # mount → host → the mount there
    for ask in asks:
        volume = await _find(session, account_id, ask)
        if volume.state != VolumeState.READY:
            why = f"failed ({volume.failure_code or 'no reason'}): delete it and make another" if volume.state == VolumeState.FAILED \
                else "being made: wait until it is ready" if volume.state == VolumeState.CREATING else f"{volume.state}"  # fmt: skip
            raise Conflict(f"{ask.text()} ({volume.id}) is {why}", code="volume_not_ready")
        if not ask.read_only:
            holder = await writer(session, volume.id)
            if holder is not None and holder != rental_id:
                raise in_use(volume, holder)
        volumes[volume.id] = volume
        per_mount.setdefault(ask.mount, {})[volume.host_id] = protocol.VolumeMount(
            volume_id=volume.id, mount=ask.mount, read_only=ask.read_only
        )
    hosts = set.intersection(*(set(by_host) for by_host in per_mount.values()))
    if not hosts:
        found = Resolved({}, volumes)
        what = "every mount point's volumes" if alternatives else "a rental's volumes"
        raise Conflict(
            f"{what} must be on one host, but these are not: {found.describe()}; copy one (gpumarket volume copy) or "
            "mount fewer", code="volumes_on_different_hosts",
        )  # fmt: skip
    options = {host: tuple(per_mount[mount][host] for mount in per_mount) for host in sorted(hosts)}
    return Resolved(options, volumes)


async def _find(session: AsyncSession, account_id: str, ask: VolumeAsk) -> Volume:
    query = select(Volume).where(Volume.account_id == account_id, Volume.deleted_at.is_(None))
    query = query.where(Volume.id == ask.id) if ask.id is not None else query.where(Volume.name == ask.name)
    volume = await session.scalar(query.limit(1))
    if volume is None:
        raise NotFound(
            f"no {ask.text()} in your account; list them with GET /api/v1/volumes", code="volume_not_found"
        )
    return volume


async def writer(session: AsyncSession, volume_id: str) -> str | None:
    """The unfinished rental that mounts the volume read-write, if any."""
    return await session.scalar(
        select(VolumeAttachment.rental_id).where(
            VolumeAttachment.volume_id == volume_id, VolumeAttachment.released_at.is_(None), VolumeAttachment.read_only.is_(False)
        ).limit(1)
    )  # fmt: skip


async def holders(session: AsyncSession, volume_id: str) -> list[str]:
    """The unfinished rentals that mount the volume (read-write or read-only), oldest first."""
    rows = await session.scalars(
        select(VolumeAttachment.rental_id).where(VolumeAttachment.volume_id == volume_id, VolumeAttachment.released_at.is_(None))
        .order_by(VolumeAttachment.id)
    )  # fmt: skip
    return list(rows.all())


def in_use(volume: Volume, holder: str | None) -> Conflict:
    who = f"rental {holder}" if holder else "another rental"
    return Conflict(
        f"volume {volume.name!r} ({volume.id}) is mounted read-write by {who}: stop it first, or mount the volume read_only",
        code="volume_in_use", details={"volume_id": volume.id, "rental_id": holder},
    )  # fmt: skip


async def attach(
    session: AsyncSession, rental_id: str, mounts: Iterable[protocol.VolumeMount], *, at: datetime
) -> None:
    """Write the rental's attachments (the rental flushed, in its transaction); those it holds already are kept.
    A second writer of a volume is 409 ``volume_in_use`` naming the rental that holds it (also when a concurrent
    placement won the race: the unique index refuses the row)."""
    held = set((await session.scalars(
        select(VolumeAttachment.volume_id).where(VolumeAttachment.rental_id == rental_id, VolumeAttachment.released_at.is_(None))
    )).all())  # fmt: skip
    for mount in mounts:
        if mount.volume_id in held:
            continue
        try:
            async with session.begin_nested():
                session.add(VolumeAttachment(volume_id=mount.volume_id, rental_id=rental_id, mount=mount.mount,
                                             read_only=mount.read_only, created_at=at))  # fmt: skip
                await session.flush()
        except IntegrityError:
            volume = await session.get(Volume, mount.volume_id)
            assert volume is not None
            raise in_use(volume, await writer(session, mount.volume_id)) from None
        how = "read-only" if mount.read_only else "read-write"
        volume = await session.get(Volume, mount.volume_id)
        state = volume.state if volume is not None else VolumeState.READY
        session.add(VolumeEvent(volume_id=mount.volume_id, at=at, from_state=state, to_state=state,
                                cause=f"attached to rental {rental_id} at {mount.mount} ({how})"))  # fmt: skip


async def hosts_down(session: AsyncSession, host_ids: Iterable[str]) -> dict[str, str]:
    """Of ``host_ids``, those that cannot take a rental now, with their state."""
    rows = (await session.execute(select(Host.id, Host.state).where(Host.id.in_(list(host_ids))))).all()
    return {host_id: state for host_id, state in rows if state not in HOST_UP}
