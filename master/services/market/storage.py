"""Hosts' storage terms for volumes (docs/volumes.md#the-resource): what a host's listing lends to volumes
(``volume_gib``) at what price (``storage_price_per_gib_hour``), how much of that its live volumes take, and whether its
agent keeps volumes at all (the hello's ``isolation.volumes``; where not, ``volumes_unavailable`` says why).

A volume is live until its deletion is asked (``deleted_at`` is NULL: creating, ready or failed); only live volumes
count against their host's ``volume_gib``. Host views and offers show these figures; the volumes aggregate decides with
them where a volume may go.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import HostListing, Volume
from shared.errors import ValidationFailed

MAX_STORAGE_PRICE: Final = Decimal(
    "10"
)  # USD per GiB-hour: far above any real disk, below a typo's thousands
MAX_LENT_GIB: Final = 1 << 20  # 1 PiB
OLD_AGENT: Final = "its agent is older than volumes"
_QUANTUM: Final = Decimal(
    "0.000001"
)  # Numeric(12, 6), as listings.money shows prices (listings imports this module)


def check_storage_terms(price: Decimal | None, volume_gib: int) -> None:
    """ValidationFailed naming the broken rule: a price above ``MAX_STORAGE_PRICE``, a size outside 0..``MAX_LENT_GIB``,
    or GiB lent without a price (a volume's bill needs one)."""
    if price is not None and price > MAX_STORAGE_PRICE:
        raise ValidationFailed(f"storage_price_per_gib_hour must be at most {MAX_STORAGE_PRICE} USD per GiB-hour; got {price}",
                               code="invalid_storage_price")  # fmt: skip
    if not 0 <= volume_gib <= MAX_LENT_GIB:
        raise ValidationFailed(
            f"volume_gib must be from 0 to {MAX_LENT_GIB}; got {volume_gib}", code="invalid_volume_gib"
        )
    if volume_gib > 0 and price is None:
        raise ValidationFailed("volume_gib needs storage_price_per_gib_hour: the price renters pay per GiB-hour of their "
                               "volumes, e.g. \"0.0002\"", code="storage_price_needed")  # fmt: skip


def volumes_kept(isolation: Mapping[str, Any] | None) -> tuple[bool, str]:
    """Whether the host's agent keeps volumes (its hello said so), and why not where it does not."""
    facts = isolation or {}
    if facts.get("volumes") is True:
        return True, ""
    if "volumes" not in facts:
        return False, OLD_AGENT
    return False, str(facts.get("volumes_unavailable") or "its agent keeps no volumes")


async def volume_gib_used(session: AsyncSession, host_ids: Iterable[str]) -> dict[str, int]:
    """The GiB each host's live volumes take (hosts with none are left out): one statement."""
    wanted = sorted(set(host_ids))
    if not wanted:
        return {}
    rows = await session.execute(
        select(Volume.host_id, func.sum(Volume.size_gib))
        .where(Volume.host_id.in_(wanted), Volume.deleted_at.is_(None))
        .group_by(Volume.host_id)
    )
    return {host_id: int(total or 0) for host_id, total in rows.all()}


def volume_gib_free(listing: HostListing | None, used: int, isolation: Mapping[str, Any] | None) -> int:
    """The GiB a new volume may still take on the host: its lent GiB less its live volumes', or 0 where it lends none
    (no listing, no storage price, or an agent that keeps no volumes)."""
    if listing is None or listing.storage_price_per_gib_hour is None or not volumes_kept(isolation)[0]:
        return 0
    return max(0, listing.volume_gib - used)


def storage_view(
    listing: HostListing | None, used: int, isolation: Mapping[str, Any] | None
) -> dict[str, Any]:
    """A host's storage terms as host views and offers show them."""
    kept, why = volumes_kept(isolation)
    price = None if listing is None else listing.storage_price_per_gib_hour
    return {
        "storage_price_per_gib_hour": None if price is None else str(price.quantize(_QUANTUM)),
        "volume_gib": 0 if listing is None else listing.volume_gib,
        "volume_gib_used": used,
        "volume_gib_free": volume_gib_free(listing, used, isolation),
        "volumes_kept": kept,
        "volumes_unavailable": None if kept else why,
    }
