"""A volume copied host to host by the destination's agent (docs/volumes.md, "Data in and out"):
``POST /volumes/{dst}/copy {"from": SRC}`` and ``GET /volumes/{dst}/copy``.

The master checks both volumes (the renter's, ready, on different hosts; the destination mounted by no rental),
opens the source's file-only session (``files.connect_volume``) with one more key, an ephemeral ed25519 pair minted
here for this copy, and sends the destination's host a ``copy_volume`` carrying the private key and the session's
connect token **sealed to that host's certificate key** (``shared.crypto.sealed_to``, bound to the host and the copy
by ``protocol.volume_copy_context``): the commands table, the bus and the relays only ever hold the sealed token.
The agent pulls the tree over SFTP through the source's relay, reports progress as ``workload_progress`` of stage
``copying`` under the destination's id, and its result says whether both trees' SHA-256 matched.

Everything a copy says is a ``volume_events`` row of the destination (``cause`` ``copy <copy id> <phase>: <text>``,
phases ``started``, ``progress``, ``succeeded``, ``failed``): no table of its own. When it ends the source's session
gets the account's keys back without the ephemeral one (an ``update_access`` at the same access version).
"""

from __future__ import annotations

import logging
import secrets
from datetime import datetime
from typing import Any, Final

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import Master
from master.models import Command as CommandRow
from master.models import Volume, VolumeEvent
from master.services import commands
from master.services.accounts import Principal, current_keys, host_certificate_keys
from master.services.volumes.attach import holders
from master.services.volumes.files import connect_volume, find_volume
from master.services.volumes.lifecycle import VolumeState
from shared import protocol
from shared.crypto import sealed_to
from shared.errors import Conflict, NotFound, ValidationFailed

log = logging.getLogger(__name__)

KIND: Final = "copy_volume"
PREFIX: Final = "copy "
PHASES: Final = ("started", "progress", "succeeded", "failed")
FINISHED: Final = frozenset({"succeeded", "failed"})
MAX_EVENTS_SHOWN: Final = 20


def _cause(copy_id: str, phase: str, text: str) -> str:
    return f"{PREFIX}{copy_id} {phase}: {' '.join(text.split())}"[:2000]


def _parse(cause: str) -> tuple[str, str, str] | None:
    """``(copy id, phase, text)`` of a copy's event, or None for any other event."""
    if not cause.startswith(PREFIX):
        return None
    head, _, text = cause[len(PREFIX) :].partition(": ")
    copy_id, _, phase = head.partition(" ")
    return (copy_id, phase, text) if phase in PHASES else None


def mint_key(copy_id: str) -> tuple[str, str]:
    """A fresh ed25519 key pair for one copy: (private key in OpenSSH form, public key line)."""
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return private.decode(), f"{public.decode()} gpumarket-volume-copy-{copy_id}"


async def _running_copy(session: AsyncSession, volume: Volume) -> str | None:
    """The id of an unanswered copy into ``volume``, if any."""
    rows = await session.scalars(
        select(CommandRow).where(CommandRow.host_id == volume.host_id, CommandRow.kind == KIND,
                                 CommandRow.state.in_(commands.OPEN_STATES))
    )  # fmt: skip
    for row in rows.all():
        if row.args.get("volume_id") == volume.id:
            return str(row.args.get("copy_id"))
    return None


async def start_copy(master: Master, principal: Principal, dst_ref: str, src_ref: str) -> dict[str, Any]:
    """Start copying ``src_ref``'s files into ``dst_ref`` (both the caller's, by id or name); the copy's view.

    404 ``volume_not_found``; 422 ``volume_copy_same_volume``; 409 ``volume_not_ready``, ``volume_copy_same_host``
    (a copy between two volumes of one host is not this), ``volume_in_use`` (a rental mounts the destination),
    ``volume_copy_running`` (one copy into a volume at a time), ``host_offline`` (either host), ``volume_opening``.
    A destination smaller than the source's files fails the copy with ``volume_no_space`` (the master does not know
    what the source holds). Cancelling before the command is written is safe; after, the copy runs."""
    dst = await find_volume(master, principal, dst_ref)
    src = await find_volume(master, principal, src_ref)
    if dst.id == src.id:
        raise ValidationFailed("SRC and DST are the same volume", code="volume_copy_same_volume")
    for volume in (src, dst):
        if volume.state != VolumeState.READY:
            raise Conflict(f"volume {volume.name} is {volume.state}, not ready", code="volume_not_ready")
    if src.host_id == dst.host_id:
        raise Conflict(
            f"volumes {src.name} and {dst.name} are on the same host: copy inside a rental that mounts both",
            code="volume_copy_same_host",
        )
    async with master.db.session() as session:
        held = await holders(session, dst.id)
        running = await _running_copy(session, dst)
        host_key = (await host_certificate_keys(session, {dst.host_id}, now=master.clock.now())).get(
            dst.host_id
        )
    if held:
        raise Conflict(f"volume {dst.name} is mounted by rental {held[0]}: stop it before copying into the volume",
                       code="volume_in_use", details={"rental_id": held[0]})  # fmt: skip
    if running is not None:
        raise Conflict(f"copy {running} into volume {dst.name} is still running; `gpumarket volume copy` follows it",
                       code="volume_copy_running", details={"copy_id": running})  # fmt: skip
    if host_key is None:
        raise Conflict(f"the host of volume {dst.name} has no valid certificate to send the copy's key to; try later",
                       code="host_offline")  # fmt: skip
    copy_id = f"vcp-{secrets.token_hex(8)}"
    private_key, public_key = mint_key(copy_id)
    ticket = await connect_volume(master, principal, src.id, extra_keys=[public_key])
    login = protocol.CopyLogin(private_key=private_key, token=ticket["token"])
    sealed = sealed_to.seal_to(
        host_key, login.model_dump_json().encode(), protocol.volume_copy_context(dst.host_id, copy_id)
    )
    del private_key, login
    command = protocol.CopyVolume(copy_id=copy_id, volume_id=dst.id, source_volume_id=src.id, relay_url=ticket["relay_url"],
                                  source_host_key=ticket["ssh"]["host_key"], sealed_login=sealed)  # fmt: skip
    now = master.clock.now()
    async with master.db.session() as session:
        row = commands.new_command(session, host_id=dst.host_id, command=command, rental_id=None)
        session.add(VolumeEvent(volume_id=dst.id, at=now, from_state=dst.state, to_state=dst.state,
                                cause=_cause(copy_id, "started", f"from {src.name} ({src.id}) on host {src.host_id}")))  # fmt: skip
        await session.commit()
        command_id = row.id
    await commands.publish(master, [command_id])
    log.info("volume copy %s: %s → %s (command %s)", copy_id, src.id, dst.id, command_id)
    return {
        "copy_id": copy_id,
        "volume_id": dst.id,
        "from": src.id,
        "state": "running",
        "command_id": command_id,
    }


async def copy_status(
    master: Master, principal: Principal, dst_ref: str, copy_id: str | None = None
) -> dict[str, Any]:
    """The latest copy into ``dst_ref`` (or ``copy_id``): its state (``running``, ``succeeded``, ``failed``), its
    newest progress line and its last events. 404 ``volume_copy_not_found`` when there is none."""
    dst = await find_volume(master, principal, dst_ref)
    async with master.db.session() as session:
        events = (
            await session.scalars(
                select(VolumeEvent).where(VolumeEvent.volume_id == dst.id, VolumeEvent.cause.startswith(PREFIX))
                .order_by(VolumeEvent.id.desc()).limit(2000)
            )
        ).all()  # fmt: skip
    parsed = [(event, p) for event in events if (p := _parse(event.cause)) is not None]
    if copy_id is None and parsed:
        copy_id = next((p[0] for _, p in parsed if p[1] == "started"), parsed[0][1][0])
    mine = [(event, p) for event, p in parsed if p[0] == copy_id]
    if not mine:
        raise NotFound(f"no copy into volume {dst.name}", code="volume_copy_not_found")
    state = next((p[1] for _, p in mine if p[1] in FINISHED), "running")
    progress = next((p[2] for _, p in mine if p[1] == "progress"), "")
    ending = next((p[2] for _, p in mine if p[1] in FINISHED), "")
    # The newest events, and always the first (its start: where from), however many progress lines came between.
    shown = mine[:MAX_EVENTS_SHOWN] if len(mine) <= MAX_EVENTS_SHOWN else [*mine[: MAX_EVENTS_SHOWN - 1], mine[-1]]
    return {
        "copy_id": copy_id, "volume_id": dst.id, "state": state, "progress": progress, "detail": ending,
        "events": [{"at": _iso(e.at), "phase": p[1], "text": p[2]} for e, p in reversed(shown)],
    }  # fmt: skip


def _iso(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


async def apply_copy_progress(
    session: AsyncSession, host_id: str, volume_id: str, *, text: str, at: datetime
) -> bool:
    """A running copy's progress line (``workload_progress`` of stage ``copying``) as an event of the destination;
    returns whether one was stored. Only for a volume of that host; ``text`` starts with the copy's id."""
    volume = await session.get(Volume, volume_id)
    copy_id, _, line = text.partition(" ")
    if volume is None or volume.host_id != host_id or not copy_id.startswith("vcp-"):
        log.warning(
            "host %s reported copy progress for volume %s it does not keep; dropped", host_id, volume_id[:80]
        )
        return False
    session.add(VolumeEvent(volume_id=volume.id, at=at, from_state=volume.state, to_state=volume.state,
                            cause=_cause(copy_id, "progress", line)))  # fmt: skip
    return True


async def apply_copy_result(session: AsyncSession, row: CommandRow, *, ok: bool, detail: str, data: dict[str, Any],
                            at: datetime) -> None:  # fmt: skip
    """A ``copy_volume``'s result: an event of the destination (succeeded with the figures, or failed with the code
    and why), and the source's session gets the account's keys without the copy's (an ``update_access``)."""
    volume = await session.get(Volume, str(row.args.get("volume_id")))
    copy_id = str(row.args.get("copy_id"))
    if volume is not None:
        if ok:
            text = (f"{data.get('files', 0)} files, {data.get('bytes', 0)} bytes copied, {data.get('skipped', 0)} already "
                    f"there; sha256 tree {data.get('tree', '')} on both")  # fmt: skip
        else:
            text = f"{data.get('code') or 'volume_copy_failed'}: {detail}"
        session.add(VolumeEvent(volume_id=volume.id, at=at, from_state=volume.state, to_state=volume.state,
                                cause=_cause(copy_id, "succeeded" if ok else "failed", text)))  # fmt: skip
    source = await session.get(Volume, str(row.args.get("source_volume_id")))
    if source is not None and source.deleted_at is None:
        keys, version = await current_keys(session, source.account_id)
        commands.new_command(session, host_id=source.host_id, rental_id=None,
                             command=protocol.UpdateAccess(rental_id=source.id, authorized_keys=keys, version=version))  # fmt: skip
