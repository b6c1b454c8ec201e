"""A volume's files without a rental (docs/volumes.md, "Data in and out"): ``POST /volumes/{id or name}/connect``.

The volume's renter gets what ``POST /rentals/{id}/connect`` gives for a rental's SSH (a connect token for the relay
its host is on now, the CA, the pinned host key), with the volume's id where a rental's would be: the relay and the
agent's tunnels take it as they take a rental's, and the agent serves a file-only session for it (SFTP, scp, rsync;
no shell: ``agent/reach/volumefiles.py``), jailed in the volume's mount, with the renter's SSH keys.

Each connect sends the host an ``open_volume`` with the account's current keys and access version and waits (at
most ``open_timeout``) for the agent's answer, which names the volume's SSH host key (made once on the host and
kept): so the first login never races the keys, and the answer pins the key the agent really serves. Afterwards the
keys follow the account like a rental's (``update_access`` to the volume's host, by the same version rule).

It costs nothing beyond the storage: no rental, no GPU, no meter.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

from sqlalchemy import or_, select

from master.context import Master
from master.models import Command as CommandRow
from master.models import Host, Volume
from master.services import commands
from master.services.accounts import Principal, current_keys
from master.services.volumes.lifecycle import VolumeState
from shared import protocol
from shared.crypto.tokens import new_claims
from shared.errors import Conflict, GpumarketError, NotFound
from shared.streams import CONNECT_PATH

log = logging.getLogger(__name__)

SSH_USER: Final = "gpumarket"
SSH_PORT: Final = 22
DONE: Final = frozenset({"succeeded", "failed"})


def host_alias(volume_id: str) -> str:
    """The name renters' SSH clients know the volume's session by (its pinned host key is filed under it)."""
    return f"{volume_id}.gpumarket"


async def find_volume(master: Master, principal: Principal, ref: str) -> Volume:
    """The caller's live volume by id or name; ``404 volume_not_found`` otherwise (another account's included)."""
    async with master.db.session() as session:
        volume = await session.scalar(
            select(Volume)
            .where(
                Volume.account_id == principal.account_id,
                or_(Volume.id == ref, Volume.name == ref),
                Volume.deleted_at.is_(None),
            )
            .order_by((Volume.id == ref).desc())  # an id wins over a name equal to it
        )
    if volume is None:
        raise NotFound(
            f"no volume {ref!r:.80} in your account; `gpumarket volume list` lists yours",
            code="volume_not_found",
        )
    return volume


async def connect_volume(master: Master, principal: Principal, ref: str, *, open_timeout: float = 15.0,
                         poll_interval: float = 0.05, extra_keys: Sequence[str] = ()) -> dict[str, Any]:  # fmt: skip
    """A connect token to the volume's file-only session (see the module). 404 ``volume_not_found``; 409
    ``volume_not_ready`` (creating, failed, deleting), ``host_offline``, ``volume_opening`` (the agent did not answer
    within ``open_timeout``: try again) or the agent's own refusal (``volume_unsupported``, ``volume_not_found``).

    ``extra_keys`` join the account's for this open (a volume copy's ephemeral key: ``copy.py``); the next change
    of the account's keys, or the copy's end, drops them.

    Cancelling is safe: the ``open_volume`` stays in the outbox and is sent again like any command."""
    volume = await find_volume(master, principal, ref)
    if volume.state != VolumeState.READY:
        raise Conflict(
            f"volume {volume.name} is {volume.state}, not ready: nothing to copy to or from yet",
            code="volume_not_ready",
        )
    now = master.clock.now()
    async with master.db.session() as session:
        host = await session.get(Host, volume.host_id)
        record = await _relay_of(master, host)
        keys, version = await current_keys(session, volume.account_id)
        keys = [*keys, *extra_keys]
        row = commands.new_command(
            session, host_id=volume.host_id,
            command=protocol.OpenVolume(volume_id=volume.id, authorized_keys=keys, version=version), rental_id=None,
        )  # fmt: skip
        # Any access change for this host not yet sent goes first, in the order it was made: a copy's end gives the
        # source the account's keys back (same access version), and arriving after this open it would drop the keys
        # this open adds (a second copy's; fresh run 41).
        earlier = (await session.scalars(
            select(CommandRow.id).where(CommandRow.host_id == volume.host_id, CommandRow.state == "pending",
                                        CommandRow.kind.in_(("update_access", "open_volume")))
        )).all()  # fmt: skip
        await session.commit()
        command_id = row.id
    await commands.publish(master, [*earlier, command_id])
    result = await _answer(master, command_id, timeout=open_timeout, every=poll_interval)
    if result is None:
        raise Conflict(
            f"the host of volume {volume.name} did not answer in {open_timeout:g} s; try again",
            code="volume_opening",
        )
    if not result.get("ok"):
        data = result.get("data") or {}
        raise Conflict(f"the host of volume {volume.name} cannot serve it: {result.get('detail', '')}"[:400],
                       code=str(data.get("code") or "volume_unavailable"))  # fmt: skip
    host_key = (result.get("data") or {}).get("ssh_host_key")
    expires = now + timedelta(seconds=master.settings.connect_token_ttl_s)
    claims = new_claims(account_id=principal.account_id, rental_id=volume.id, host_id=volume.host_id, kind="ssh",
                        port=SSH_PORT, expires_at=expires.timestamp())  # fmt: skip
    agent_url = urlsplit(record.url)
    return {
        "volume_id": volume.id,
        "name": volume.name,
        "kind": "ssh",
        "port": SSH_PORT,
        "relay_id": record.relay_id,
        "relay_url": urlunsplit((agent_url.scheme, agent_url.netloc, CONNECT_PATH, "", "")),
        "token": master.ca.sign_connect_token(claims),
        "expires_at": expires.isoformat().replace("+00:00", "Z"),
        "ca_pem": master.ca.cert_pem.decode(),
        "ssh": {"host_key": host_key, "host_alias": host_alias(volume.id), "user": SSH_USER},
    }


async def _relay_of(master: Master, host: Host | None) -> Any:
    relay_id = host.relay_id if host is not None and host.state not in ("offline", "revoked") else None
    records = {}
    try:
        records = {r.relay_id: r for r in await master.registry.relays() if not r.draining}
    except (GpumarketError, OSError) as exc:
        log.warning("cannot read the relay registry (%s)", exc)
    record = records.get(relay_id) if relay_id is not None else None
    if record is None:
        raise Conflict(
            "the volume's host is not connected to any relay right now; try again in a minute",
            code="host_offline",
        )
    return record


async def _answer(master: Master, command_id: str, *, timeout: float, every: float) -> dict[str, Any] | None:
    """The agent's result for the command once recorded, or None after ``timeout`` seconds."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                async with master.db.session() as session:
                    row = await session.get(CommandRow, command_id)
                    if row is not None and row.state in DONE:
                        return dict(row.result or {"ok": row.state == "succeeded"})
                await asyncio.sleep(every)
    except TimeoutError:
        return None
