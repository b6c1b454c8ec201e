"""The declarative ``Base`` every table derives from, and the column types and helpers the tables share."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    TypeDecorator,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always aware UTC in Python, whatever the database keeps."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column; use datetime.now(UTC)")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _now() -> datetime:
    return datetime.now(UTC)


def version_key(text: object) -> int | None:
    """``"8.9"`` → 8009 (``major * 1000 + minor``); None for anything that is not such a version."""
    if not isinstance(text, str):
        return None
    major, _, rest = text.strip().partition(".")
    minor = rest.split(".", 1)[0] if rest else "0"
    if not (major.isdigit() and minor.isdigit()) or len(major) > 6 or len(minor) > 3:
        return None
    return int(major) * 1000 + int(minor)


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON, list[Any]: JSON}
