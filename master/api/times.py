"""Every time the API reads, in a query parameter or a body: with an offset, within range once in UTC.

``9999-12-31T23:59:59-23:59`` is a valid ISO 8601 time in its own offset, but not in UTC: the
first ``astimezone(UTC)``, comparison or ``timedelta`` sum on it raised ``OverflowError``, a 500.
Each time is converted to UTC as it is read and must then fall between ``EARLIEST`` and
``LATEST``; the services only ever see aware UTC times they can add days to.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from aiohttp import web
from pydantic import AfterValidator, AwareDatetime

from shared.errors import BadRequest

EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
"""Nothing in gpumarket predates the Unix epoch."""
LATEST = datetime(9000, 1, 1, tzinfo=UTC)
"""Far beyond any real date, and a millennium short of ``datetime.max``: adding any span the services add stays representable."""


def in_range_utc(value: datetime) -> datetime:
    """``value`` (aware) in UTC; ``ValueError`` when it lies before ``EARLIEST`` or from ``LATEST`` on, once in UTC."""
    try:
        utc = value.astimezone(UTC)
    except OverflowError:
        utc = None
    if utc is None or not EARLIEST <= utc < LATEST:
        raise ValueError(f"must be from {EARLIEST:%Y-%m-%dT%H:%M:%SZ} to before {LATEST:%Y-%m-%dT%H:%M:%SZ} once in UTC")
    return utc


UtcTime = Annotated[AwareDatetime, AfterValidator(in_range_utc)]
"""A body's time: ISO 8601 with a timezone (422 ``validation_failed`` without one, or out of range), read as UTC."""


def time_query(request: web.Request, name: str) -> datetime | None:
    """The query parameter ``name`` as an aware UTC time (``None`` when absent); 400 ``invalid_query`` otherwise."""
    raw = request.query.get(name)
    if not raw:
        return None
    try:
        value = datetime.fromisoformat(raw)
    except ValueError:
        raise BadRequest(f"query parameter {name!r} must be an ISO 8601 time, got {raw[:64]!r}", code="invalid_query") from None
    if value.tzinfo is None:
        raise BadRequest(f"query parameter {name!r} needs a timezone (e.g. 2026-01-01T00:00:00Z)", code="invalid_query")
    try:
        return in_range_utc(value)
    except ValueError as exc:
        raise BadRequest(f"query parameter {name!r} {exc}; got {raw[:64]!r}", code="invalid_query") from None
