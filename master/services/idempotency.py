"""``Idempotency-Key`` replays, one way for everything a renter creates with one (rentals, clusters, services).

A repeat of a request with the same key answers what the first one made; the same key with another request (its
fingerprint differs) is a 409 ``idempotency_key_reused``. Keys are per renter: each table has a unique
``(renter_id, idempotency_key)``, so of two concurrent requests with one key one insert fails and that request
answers the other's object (``earlier`` again, after the ``IntegrityError``): ``create_once`` does both.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from master.context import Master
from master.models import Cluster, Rental, Service
from shared.errors import Conflict

Keyed = TypeVar("Keyed", Rental, Cluster, Service)
Extra = TypeVar("Extra")


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


async def create_once(
    master: Master, model: type[Keyed], renter_id: str, key: str | None, fingerprint: str, *, what: str,
    create: Callable[[], Awaitable[tuple[Keyed, Extra]]],
) -> tuple[Keyed, Extra | None]:
    """``create()``'s object and what else it returns, or, where a request with ``key`` made one already (before, or
    racing this one into the unique index), that object and ``None``."""
    if (existing := await earlier(master, model, renter_id, key, fingerprint, what=what)) is not None:
        return existing, None
    try:
        return await create()
    except IntegrityError:  # a concurrent request with the same key won the race: its object
        if (existing := await earlier(master, model, renter_id, key, fingerprint, what=what)) is None:
            raise
        return existing, None
