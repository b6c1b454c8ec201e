"""Hypothesis strategies for hostile REST input: parser bombs as raw request bodies, and times whose
offset puts them out of range once in UTC.

Used by ``tests/test_hostile_input.py`` (raw bytes, on SQLite and PostgreSQL) and by the
schemathesis run (``tests/test_api_schemathesis.py``, as JSON values ``requests`` can serialise).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from hypothesis import strategies as st

from master.api.jsonbody import MAX_DEPTH, MAX_NUMBER_DIGITS
from master.api.times import EARLIEST, LATEST

EXTREME_TIMESTAMPS = (
    "9999-12-31T23:59:59-23:59",
    "9999-12-31T23:59:59.999999-00:01",
    "0001-01-01T00:00:00+23:59",
    "0001-01-01T00:00:00+00:00",
    "1969-12-31T23:59:59Z",
    "9000-01-01T00:00:00Z",
    "8999-12-31T23:59:59-23:59",
)
"""Each out of range once in UTC: past ``datetime``'s own limits, or just outside ``EARLIEST`` / ``LATEST``."""
HUGE_NUMBERS = ("1e999", "-1e999", "1E+400", "1" + "0" * 400 + ".5", "1.8e308", "NaN", "Infinity", "-Infinity")


def _nest(depth: int, kind: str, core: str) -> str:
    if kind == "array":
        return "[" * depth + core + "]" * depth
    if kind == "object":
        return '{"a":' * depth + core + "}" * depth
    opener = "".join("[" if level % 2 else '{"k":' for level in range(depth))
    closer = "".join("]" if level % 2 else "}" for level in reversed(range(depth)))
    return opener + core + closer


def deep_nesting(min_depth: int = MAX_DEPTH + 1, max_depth: int = 10_000) -> st.SearchStrategy[str]:
    """JSON text of arrays, objects or both nested ``min_depth`` to ``max_depth`` deep (10,000 once in a while)."""
    depths = st.integers(min_depth, max_depth) | st.sampled_from([min_depth, 201, max_depth])
    return st.builds(_nest, depths, st.sampled_from(["array", "object", "mixed"]), st.sampled_from(["", "1", '"x"', "null"]))


def long_integers(min_digits: int = MAX_NUMBER_DIGITS + 1, max_digits: int = 5000) -> st.SearchStrategy[str]:
    """Integer literals of ``min_digits`` to ``max_digits`` digits (5,000: past Python's int-to-str limit), some negative."""
    digits = st.integers(min_digits, max_digits) | st.sampled_from(sorted({min_digits, min(4301, max_digits), max_digits}))
    return st.builds(lambda n, sign, lead: sign + lead + "7" * (n - 1), digits, st.sampled_from(["", "-"]), st.sampled_from("123456789"))


def huge_numbers() -> st.SearchStrategy[str]:
    """Number literals a float cannot hold (and NaN or Infinity, which JSON has not)."""
    return st.sampled_from(HUGE_NUMBERS) | st.builds(lambda exp: f"1e{exp}", st.integers(309, 100_000))


def bomb_literals() -> st.SearchStrategy[str]:
    return deep_nesting() | long_integers() | huge_numbers()


def bomb_bodies(fields: tuple[str, ...]) -> st.SearchStrategy[bytes]:
    """A request body carrying one parser bomb: the whole body, or the value of one of ``fields`` beside sane ones."""

    def in_field(field: str, literal: str) -> bytes:
        return ('{"' + field + '": ' + literal + "}").encode()

    return bomb_literals().map(str.encode) | st.builds(in_field, st.sampled_from(fields), bomb_literals())


_OFFSETS = st.integers(-(24 * 60 - 1), 24 * 60 - 1).map(lambda minutes: timezone(timedelta(minutes=minutes)))
_EDGES = (datetime(1, 1, 1, tzinfo=UTC), datetime(1970, 1, 1, tzinfo=UTC), datetime(8999, 12, 31, 23, 59, tzinfo=UTC),
          datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC))  # fmt: skip


def timestamps() -> st.SearchStrategy[str]:
    """ISO 8601 times with an offset of up to ±23:59: anywhere from year 1 to 9999 local time, near the edges, or
    this century; some out of range once in UTC (``in_range``), most not."""
    anywhere = st.datetimes(timezones=_OFFSETS)
    edges = st.builds(lambda edge, tz: edge.replace(tzinfo=tz), st.sampled_from(_EDGES), _OFFSETS)
    recent = st.builds(lambda seconds, tz: datetime.fromtimestamp(seconds, tz), st.integers(1_577_836_800, 4_102_444_800), _OFFSETS)
    return st.sampled_from(EXTREME_TIMESTAMPS) | (anywhere | edges | recent).map(datetime.isoformat)


def in_range(text: str) -> bool:
    """Whether the API accepts the time ``text`` as in range (``master.api.times``)."""
    moment = datetime.fromisoformat(text)
    try:
        return EARLIEST <= moment.astimezone(UTC) < LATEST
    except OverflowError:
        return False


def nested_value(depth: int) -> Any:
    """A JSON value ``depth`` arrays deep, for clients that serialise values themselves (schemathesis, requests)."""
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def hostile_json_values() -> st.SearchStrategy[Any]:
    """Parser bombs ``json.dumps`` can still write: nesting past the bound (within its recursion) and long integers."""
    return st.integers(MAX_DEPTH + 1, 400).map(nested_value) | long_integers(max_digits=4000).map(json.loads)
