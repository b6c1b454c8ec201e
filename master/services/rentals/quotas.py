"""The account routes' writes that return a view: an admin setting an account's quotas or its fair-share weight.

(The account's own view carries money, so it is ``billing.views.account_view``.)
Imports ``master.services``, ``master.models`` and ``master.context``; never ``master.api`` or ``billing``.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from master.context import Master
from master.models import Account
from master.services.rentals import placement as rental_placement
from shared.errors import NotFound


async def set_quota(
    master: Master, account_id: str, *, max_gpus: Decimal | None, max_spend_per_hour: Decimal | None
) -> dict[str, Any]:
    """Set the account's quotas (``None``: the platform default); its quota view. 404 ``account_not_found``."""
    async with master.db.session() as session:
        account = await session.get(Account, account_id, with_for_update=True)
        if account is None:
            raise NotFound(f"no account {account_id!r}", code="account_not_found")
        account.max_gpus, account.max_spend_per_hour = max_gpus, max_spend_per_hour
        return await rental_placement.quota_view(master, session, account)


async def set_fair_share(master: Master, account_id: str, *, weight: int) -> int:
    """Set the account's weight in the queue's fair share (``master/scheduler/fairshare.py``; > 0, checked by the
    caller and the table); the weight now. 404 ``account_not_found``."""
    async with master.db.session() as session:
        account = await session.get(Account, account_id, with_for_update=True)
        if account is None:
            raise NotFound(f"no account {account_id!r}", code="account_not_found")
        account.fair_share_weight = weight
        return weight
