"""The ``volume_grace`` rule's condition: a renter's volume that will be deleted unless its account's credit comes back.

Billing's enforcement (``billing/volume_grace.py``) sets ``unpaid_since``/``delete_after`` on a live volume when its
account's credit runs out and clears them when credit is added; this rule only reads them, so the alert fires once
per grace (its key is the volume's), escalates to critical in the last day, and resolves when the credit is back or
the volume is gone. It names no host: a renter's volumes are not its provider's concern (admins see it, and the
webhook hears of it). ``rules.evaluate`` makes each into a ``Condition``.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Volume
from master.services.alerts.views import Severity
from master.services.volumes import LIVE

RULE = "volume_grace"
LAST_DAY = timedelta(days=1)


class GraceAlert(NamedTuple):
    key: str
    severity: Severity
    summary: str
    details: dict[str, Any]


async def volume_grace(session: AsyncSession, *, now: datetime) -> list[GraceAlert]:
    """One per live volume in its credit grace."""
    rows = (
        await session.scalars(
            select(Volume)
            .where(Volume.delete_after.is_not(None), Volume.state.in_(sorted(LIVE)))
            .order_by(Volume.id)
        )
    ).all()
    found: list[GraceAlert] = []
    for volume in rows:
        assert volume.delete_after is not None
        found.append(GraceAlert(
            f"{RULE}:{volume.id}", "critical" if volume.delete_after - now <= LAST_DAY else "warning",
            f"volume {volume.id} ({volume.name}, {volume.size_gib} GiB) of account {volume.account_id} is deleted at "
            f"{volume.delete_after:%Y-%m-%d %H:%M} UTC unless its credit is restored",
            {"volume_id": volume.id, "account_id": volume.account_id, "name": volume.name, "size_gib": volume.size_gib,
             "volume_host_id": volume.host_id, "unpaid_since": volume.unpaid_since.isoformat() if volume.unpaid_since else None,
             "delete_after": volume.delete_after.isoformat()},
        ))  # fmt: skip
    return found
