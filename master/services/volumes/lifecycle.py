"""A volume's states, one transition table (docs/volumes.md):

    creating ─the agent made it─▶ ready
    creating ─the agent could not─▶ failed
    creating, ready, failed ─deletion asked (the renter, an admin, the credit grace's end)─▶ deleting
    deleting ─the agent deleted it (or the host is gone for good)─▶ deleted
    deleted is final

Every change writes a ``volume_events`` row. Billing stops when deletion is asked (``deleted_at``), not when the
agent confirms: the renter asked, and pays nothing for the agent's delay.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Final

from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Command as CommandRow
from master.models import Volume, VolumeEvent
from master.services.commands import new_command
from shared import protocol
from shared.errors import Conflict


class VolumeState(StrEnum):
    CREATING = "creating"
    READY = "ready"
    FAILED = "failed"
    DELETING = "deleting"
    DELETED = "deleted"


LIVE: Final = frozenset(
    {VolumeState.CREATING, VolumeState.READY, VolumeState.FAILED}
)  # counted on its host, billed once ready
_ALLOWED: Final[dict[VolumeState, frozenset[VolumeState]]] = {
    VolumeState.CREATING: frozenset({VolumeState.READY, VolumeState.FAILED, VolumeState.DELETING}),
    VolumeState.READY: frozenset({VolumeState.DELETING}),
    VolumeState.FAILED: frozenset({VolumeState.DELETING}),
    VolumeState.DELETING: frozenset({VolumeState.DELETED}),
    VolumeState.DELETED: frozenset(),
}


def transition(session: AsyncSession, volume: Volume, to: VolumeState, *, cause: str, at: datetime) -> None:
    """Move ``volume`` to ``to`` (raising ``Conflict`` ``volume_state`` if the table forbids it), with its event and
    the timestamps the state carries (``ready_at``; ``deleted_at`` when deletion is asked)."""
    current = VolumeState(volume.state)
    if to not in _ALLOWED[current]:
        raise Conflict(f"volume {volume.id} is {current}: it cannot become {to}", code="volume_state")
    volume.state = to
    if to is VolumeState.READY and volume.ready_at is None:
        volume.ready_at = at
    if to is VolumeState.DELETING and volume.deleted_at is None:
        volume.deleted_at = at
    session.add(VolumeEvent(volume_id=volume.id, at=at, from_state=current, to_state=to, cause=cause))


def request_deletion(session: AsyncSession, volume: Volume, *, cause: str, at: datetime) -> CommandRow | None:
    """Ask for the volume's deletion: ``deleting`` and a ``delete_volume`` for its host (the caller publishes the
    returned command after the commit). A volume already deleting or deleted is left as it is (None): idempotent.
    Whether a rental still mounts it is the caller's to check first."""
    if volume.state in (VolumeState.DELETING, VolumeState.DELETED):
        return None
    transition(session, volume, VolumeState.DELETING, cause=cause, at=at)
    return new_command(
        session, host_id=volume.host_id, command=protocol.DeleteVolume(volume_id=volume.id), rental_id=None
    )
