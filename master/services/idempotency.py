"""``Idempotency-Key`` replays, one way for everything a renter creates with one (rentals, clusters, services).

A repeat of a request with the same key answers what the first one made; the same key with another request (its
fingerprint differs) is a 409 ``idempotency_key_reused``. Keys are per renter: each table has a unique
``(renter_id, idempotency_key)``, so of two concurrent requests with one key one insert fails and that request
answers the other's object (``earlier`` again, after the ``IntegrityError``).
"""

from __future__ import annotations

from typing import TypeVar

from sqlalchemy import select

from master.context import Master
from master.models import Cluster, Rental, Service
from shared.errors import Conflict

Keyed = TypeVar("Keyed", Rental, Cluster, Service)


async def earlier(
    master: Master, model: type[Keyed], renter_id: str, key: str | None, fingerprint: str, *, what: str
) -> Keyed | None:
    """What an earlier request with ``key`` made, ``None`` when there is no key or it is new; ``Conflict`` when that
    request was another (``what``: the word for it in the message, "rental" or "cluster")."""
    if key is None:
        return None
    async with master.db.session() as session:
        existing = await session.scalar(select(model).where(model.renter_id == renter_id, model.idempotency_key == key))
    if existing is not None and existing.request_fingerprint != fingerprint:
        raise Conflict(
            f"this Idempotency-Key was already used for a different {what} request; use a new key",
            code="idempotency_key_reused",
        )
    return existing
