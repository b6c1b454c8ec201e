"""The credit grace of a renter's volumes: never deleted silently, never kept unpaid for ever (docs/volumes.md#billing).

Enforcement (``billing/enforce.py``) decides, per renter, whether its credit has run out (where it stops rentals:
the projected balance, or what the monthly spend cap leaves, would not last ``credit_stop_margin_s``). Then, in the
same transaction, with the renter's live volumes locked:

* **out of credit**: each live volume without a grace gets ``unpaid_since`` = now and ``delete_after`` = now +
  ``volume_grace_days``, and an event saying so — once: a volume already in its grace is left as it is, so later
  passes add nothing. The ``volume_grace`` alert (``master.services.alerts``) fires while it lasts (its webhook
  hears of it) and the renter is mailed once, after the commit (``notify``), when the master sends mail.
* **credit back** (a top-up, or a new month under the cap) before ``delete_after``: both are cleared, with an event.
* **still out at** ``delete_after``: the volume is deleted with ``volumes.request_deletion`` (billing stops; the
  ``delete_volume`` command row is published after the commit, by the job's caller or the command resender) and an
  event saying why — unless a rental that has not ended still mounts it: enforcement is stopping that rental (it is
  out of credit too), and the volume goes at the first pass after the rental has ended.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Account, Rental, Volume, VolumeAttachment, VolumeEvent
from master.services import volumes
from master.services.lifecycle.rentals import FINAL_STATES
from shared import mail
from shared.errors import ConfigError
from shared.settings import MasterSettings

log = logging.getLogger(__name__)

UNPAID = "unpaid"
PAID = "paid"


@dataclass
class GraceChanges:
    """What one renter's pass did to its volumes (ids), and the commands to publish after the commit."""

    started: list[str] = field(default_factory=list)
    cleared: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)  # due, but a rental that has not ended mounts it
    commands: list[str] = field(default_factory=list)
    notice: mail.Mail | None = None  # to send once the transaction has committed


async def live_volumes(session: AsyncSession, account_id: str) -> list[Volume]:
    """The account's live volumes (creating, ready, failed), locked ``SKIP LOCKED`` (a concurrent pass takes none)."""
    return list(
        (
            await session.scalars(
                select(Volume).where(Volume.account_id == account_id, Volume.state.in_(sorted(volumes.LIVE)))
                .order_by(Volume.id).with_for_update(skip_locked=True)
            )
        ).all()
    )  # fmt: skip


def _when(moment: datetime) -> str:
    return f"{moment:%Y-%m-%d %H:%M} UTC"


async def apply(
    session: AsyncSession,
    account_id: str,
    live: Sequence[Volume],
    *,
    out: bool,
    limit: str,
    now: datetime,
    grace: timedelta,
) -> GraceChanges:
    """Bring the renter's live volumes' grace in line with whether its credit is ``out`` (``limit``: "credit" or
    "cap", which ran out); see the module's docstring. The caller holds the rows' locks and commits."""
    changes = GraceChanges()
    if not out:
        for volume in live:
            if volume.unpaid_since is None:
                continue
            _event(
                session,
                volume,
                now,
                f"{PAID}: credit is back; the deletion set for {_when(volume.delete_after or now)} is cancelled",
            )
            volume.unpaid_since = volume.delete_after = None
            changes.cleared.append(volume.id)
        return changes
    why = (
        "the account's monthly spend cap was reached"
        if limit == "cap"
        else "the account's prepaid credit ran out"
    )
    fresh = [volume for volume in live if volume.unpaid_since is None]
    for volume in fresh:
        volume.unpaid_since, volume.delete_after = now, now + grace
        _event(session, volume, now, f"{UNPAID}: {why}; the volume is deleted at {_when(volume.delete_after)} unless "
                                     f"{'the cap is raised' if limit == 'cap' else 'credit is added'} before then")  # fmt: skip
        changes.started.append(volume.id)
    due = [volume for volume in live if volume.delete_after is not None and volume.delete_after <= now]
    mounted = await _mounted(session, [volume.id for volume in due])
    for volume in due:
        if volume.id in mounted:
            changes.held.append(volume.id)
            continue
        assert volume.unpaid_since is not None
        cause = (f"deleted: {why} on {_when(volume.unpaid_since)} and was not restored by the end of its grace "
                 f"({_when(volume.delete_after or now)})")  # fmt: skip
        command = volumes.request_deletion(session, volume, cause=cause, at=now)
        changes.deleted.append(volume.id)
        if command is not None:
            changes.commands.append(command.id)
    if fresh:
        changes.notice = await _notice(session, account_id, fresh, why)
    return changes


def _event(session: AsyncSession, volume: Volume, now: datetime, cause: str) -> None:
    session.add(
        VolumeEvent(volume_id=volume.id, at=now, from_state=volume.state, to_state=volume.state, cause=cause)
    )


async def _mounted(session: AsyncSession, volume_ids: Sequence[str]) -> set[str]:
    """Those of the volumes that a rental which has not ended mounts (its attachment unreleased)."""
    if not volume_ids:
        return set()
    rows = await session.scalars(
        select(VolumeAttachment.volume_id)
        .join(Rental, Rental.id == VolumeAttachment.rental_id)
        .where(VolumeAttachment.volume_id.in_(list(volume_ids)), VolumeAttachment.released_at.is_(None),
               Rental.state.not_in([state.value for state in FINAL_STATES]))
    )  # fmt: skip
    return set(rows.all())


async def _notice(
    session: AsyncSession, account_id: str, fresh: Sequence[Volume], why: str
) -> mail.Mail | None:
    """The mail telling the renter which volumes will be deleted when (None: the account has no address)."""
    address = await session.scalar(select(Account.email).where(Account.id == account_id))
    if not address:
        return None
    lines = "\n".join(
        f"  {v.name} ({v.id}, {v.size_gib} GiB): deleted at {_when(v.delete_after or v.created_at)}"
        for v in fresh
    )
    body = (f"Your volumes will be deleted because {why}:\n\n{lines}\n\n"
            "Add credit before then (gpumarket credit add, or the console's Billing page) and they are kept.\n")  # fmt: skip
    return mail.Mail(
        to=address,
        subject=f"gpumarket: {len(fresh)} volume(s) will be deleted unless you add credit",
        body=body,
    )


async def notify(settings: MasterSettings, notice: mail.Mail) -> bool:
    """Mail the renter (after the commit); False when the master sends no mail or the server refused it (logged:
    the volume's event and the ``volume_grace`` alert still say it)."""
    if settings.smtp_url is None:
        return False
    try:
        await mail.send(settings.smtp_url.get_secret_value(), settings.mail_from, notice)
    except (mail.MailUnavailable, ConfigError) as exc:
        log.warning("the volume grace notice to %s could not be sent: %s", notice.to, exc)
        return False
    return True
