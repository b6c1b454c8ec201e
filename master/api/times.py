"""Every time the API reads, in a query parameter, a path or a body: one grammar, with an offset, within range once in UTC.

The grammar is RFC 3339's date-time, strictly (``RFC_3339``): ``2032-01-01T00:00:00Z`` or with
``+02:00``, seconds always, a fraction of up to six digits, upper-case ``T`` and ``Z``. ISO 8601's
other spellings (``20320101T000000Z``, week dates, a space for ``T``) and pydantic's own readings
(``1700000000`` as Unix seconds, ``2032-01-01t00:00:00z``) are refused in a body as in a query.

``9999-12-31T23:59:59-23:59`` is a valid ISO 8601 time in its own offset, but not in UTC: the
first ``astimezone(UTC)``, comparison or ``timedelta`` sum on it raised ``OverflowError``, a 500.
Each time is converted to UTC as it is read and must then fall between ``EARLIEST`` and
``LATEST``; the services only ever see aware UTC times they can add days to.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any

from aiohttp import web
from pydantic import AwareDatetime, BeforeValidator

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


RFC_3339 = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,6})?(?:Z|[+-][0-9]{2}:[0-9]{2})", re.ASCII)
"""The one grammar of a time the API reads (matched in full)."""
GRAMMAR_HINT = "an RFC 3339 time with a timezone, e.g. 2026-01-01T00:00:00Z or 2026-01-01T02:00:00+02:00"


def parse_time(text: str) -> datetime:
    """``text`` in the API's grammar (``RFC_3339``) as an aware UTC time; ``ValueError`` saying what is wrong otherwise."""
    if not RFC_3339.fullmatch(text):
        raise ValueError(f"must be {GRAMMAR_HINT}")
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"must be {GRAMMAR_HINT} (a real date and time of day)") from None
    return in_range_utc(value)


def _body_time(value: Any) -> Any:
    if isinstance(value, str):
        return parse_time(value)
    if isinstance(value, datetime) and value.tzinfo is not None:
        return in_range_utc(value)  # built in Python, not read from JSON: its grammar is not in question
    raise ValueError(f"must be {GRAMMAR_HINT}")


UtcTime = Annotated[AwareDatetime, BeforeValidator(_body_time)]
"""A body's time, in the grammar of ``parse_time`` (422 ``validation_failed`` otherwise, or out of range), read as UTC."""


def time_query(request: web.Request, name: str) -> datetime | None:
    """The query parameter ``name`` as an aware UTC time (``None`` when absent); 400 ``invalid_query`` otherwise."""
    raw = request.query.get(name)
    if not raw:
        return None
    try:
        return parse_time(raw)
    except ValueError as exc:
        raise BadRequest(f"query parameter {name!r} {exc}; got {raw[:64]!r}", code="invalid_query") from None
