"""Money and quantity strings: one strict grammar for every amount the API, the console and the CLI take.

Prices, bids, spend caps, quotas, credit top-ups, listing prices, minimum bids and the
``price`` of the offer query language are all read by ``parse_amount``::

    amount = digits [ "." digits ] | "." digits
    digits = one or more of the ASCII characters 0-9

with at most ``places`` digits after the dot (6 for USD per GPU-hour, 2 for real money in
whole cents, 3 for GPU quotas). Nothing else: no sign (``+1``, ``-1``), no exponent
(``1e3``), no digit-group separator (``1,000``, ``1_000``, ``1 000``), no non-ASCII digit
(``١٢٣``, full-width ``１２３``), no whitespace around it, no ``NaN`` or ``Infinity``. Python's
``Decimal()`` takes every one of those, which is why nothing reads an amount with it directly.

**JSON numbers.** An amount is best sent as a JSON string (``"0.45"``). A JSON *integer*
(``25``) is exact and accepted as its digits. A JSON number with a fraction or an exponent
(``0.45``, ``1e2``) is refused: the JSON reader has already turned it into a binary float,
so the digits the client wrote are gone (``0.45000000000000001`` arrives as ``0.45``).

The console mirrors the grammar in ``console/static/money.js`` (``AMOUNT``, ``amountProblem``)
with the same message; the CLI calls ``parse_amount`` (``gpumarket/renter/commands.py``).

**Writing money.** ``format_usd`` is the one way the CLI writes an amount, and ``formatUsd`` in
``money.js`` the console's, with the same rules (``tests/test_money_format.py`` runs both over one
corpus): a total in cents (``$1,234.50``), a rate with as many decimals as it has, down to a
millionth (``$0.30/h``, ``$0.000125/s``); never an exponent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from functools import cache
from typing import Any, Final

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic_core import PydanticCustomError, core_schema

from shared.errors import ValidationFailed

__all__ = [
    "CENT_PLACES",
    "GPU_PLACES",
    "MAX_AMOUNT_CHARS",
    "MAX_PRICE",
    "PRICE_PLACES",
    "Amount",
    "AmountText",
    "amount_pattern",
    "amount_problem",
    "format_usd",
    "parse_amount",
]

PRICE_PLACES: Final = 6  # USD per GPU-hour, bids, spend per hour: a millionth of a dollar
CENT_PLACES: Final = 2  # real money moving (top-ups, spend caps): whole cents
GPU_PLACES: Final = 3  # GPU quotas: a thousandth of a GPU (a milli share)
MAX_PRICE: Final = Decimal("999999.999999")  # Numeric(12, 6)
MAX_AMOUNT_CHARS: Final = 32  # longer than any amount a column holds; refused before the pattern runs

_EXAMPLES: Final = {0: "2", 1: "2.5", 2: "25.00", 3: "1.5"}
_DECIMAL_TEXT: Final = re.compile(r"(-)?([0-9]+)(?:\.([0-9]*))?", re.ASCII)  # money.js DECIMAL: what the API writes
_SHOWN_PLACES: Final = {"total": CENT_PLACES, "rate": PRICE_PLACES}


@cache
def amount_pattern(places: int) -> str:
    """The grammar as a regular expression (anchored; the same text in JSON Schema and the console)."""
    if places == 0:
        return "^[0-9]+$"
    return rf"^(?:[0-9]+(?:\.[0-9]{{1,{places}}})?|\.[0-9]{{1,{places}}})$"


@cache
def _compiled(places: int) -> re.Pattern[str]:
    # fullmatch, not the pattern's "$": in Python "$" also matches before a final newline.
    return re.compile(amount_pattern(places).removeprefix("^").removesuffix("$"), re.ASCII)


def _rule(places: int) -> str:
    example = _EXAMPLES.get(places, "0.45")
    decimals = "no decimals" if places == 0 else f"at most {places} decimal{'s' if places > 1 else ''}"
    dot = "" if places == 0 else " and at most one dot"
    return f"a plain amount like {example} (ASCII digits{dot}, {decimals}; no sign, exponent, spaces or separators)"


def amount_problem(value: object, *, places: int = PRICE_PLACES, maximum: Decimal | None = None,
                   positive: bool = False) -> tuple[str, Decimal | None]:  # fmt: skip
    """``("", amount)`` if ``value`` is an amount of the grammar within the bounds, else ``(what is wrong, None)``.

    ``value`` is a string of the grammar, a non-negative ``int`` (a JSON integer) or a finite ``Decimal``
    (a caller's own amount); anything else — a float, a bool, None — is refused.
    """
    if isinstance(value, bool) or value is None:
        return f"must be {_rule(places)}, sent as a JSON string", None
    if isinstance(value, float):
        return f"must be sent as a JSON string such as \"{_EXAMPLES.get(places, '0.45')}\": a JSON number with a fraction or an " \
               "exponent is read as a binary float, which may not be what you wrote", None  # fmt: skip
    if isinstance(value, int):
        text = str(value) if 0 <= value < 10**MAX_AMOUNT_CHARS else "-"  # str() of a huge int is slow, then refused
    elif isinstance(value, Decimal):
        text = format(value, "f") if value.is_finite() and value.adjusted() < MAX_AMOUNT_CHARS else "-"
    elif isinstance(value, str):
        text = value
    else:
        return f"must be {_rule(places)}", None
    if len(text) > MAX_AMOUNT_CHARS or not _compiled(places).fullmatch(text):
        got = f", got {text[:40]!r}{'…' if len(text) > 40 else ''}" if isinstance(value, str) else ""
        return f"must be {_rule(places)}{got}", None
    amount = Decimal(text)
    if positive and amount == 0:
        return "must be more than 0", None
    if maximum is not None and amount > maximum:
        return f"must be at most {maximum}", None
    return "", amount


def parse_amount(value: object, *, places: int = PRICE_PLACES, maximum: Decimal | None = None, positive: bool = False,
                 field: str = "amount", code: str = "validation_failed") -> Decimal:  # fmt: skip
    """The amount ``value`` says; ValidationFailed (422, ``code``) names ``field`` and says what to write.

    >>> parse_amount("0.45", field="bid")
    Decimal('0.45')
    >>> parse_amount("1,000", field="bid")
    Traceback (most recent call last):
    ...
    shared.errors.ValidationFailed: 'bid' must be a plain amount like 0.45 (ASCII digits and at most one dot, at most 6 decimals; no sign, exponent, spaces or separators), got '1,000'
    """
    problem, amount = amount_problem(value, places=places, maximum=maximum, positive=positive)
    if amount is None:
        raise ValidationFailed(f"{field!r} {problem}", code=code, details={"problems": [{"field": field, "problem": problem}]})
    return amount


def _json_schema(places: int, maximum: Decimal | None) -> dict[str, Any]:
    text: dict[str, Any] = {"type": "string", "pattern": amount_pattern(places), "maxLength": MAX_AMOUNT_CHARS,
                            "examples": [_EXAMPLES.get(places, "0.45")]}  # fmt: skip
    whole: dict[str, Any] = {"type": "integer", "minimum": 0}
    if maximum is not None:
        whole["maximum"] = int(maximum)
    return {"anyOf": [text, whole]}


@dataclass(frozen=True)
class Amount:
    """A request-model field read by ``parse_amount``: ``bid: Annotated[Decimal, Amount(maximum=MAX_PRICE, positive=True)]``.

    A value outside the grammar is a pydantic error whose message says what to write (422
    ``validation_failed`` through ``parse_body``, the field in ``details.problems[0].field``).
    """

    places: int = PRICE_PLACES
    maximum: Decimal | None = None
    positive: bool = False

    def validate(self, value: object) -> Decimal:
        problem, amount = amount_problem(value, places=self.places, maximum=self.maximum, positive=self.positive)
        if amount is None:
            raise PydanticCustomError("invalid_amount", problem)
        return amount

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(self.validate)

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        return _json_schema(self.places, self.maximum)


@dataclass(frozen=True)
class AmountText(Amount):
    """A field kept as sent (``Annotated[str | int, AmountText(places=2)]``) for a service to read with
    ``parse_amount`` under its own error code (``invalid_price``, ``invalid_amount``); a float, a bool or
    another type is refused here."""

    def keep(self, value: object) -> str | int:
        if isinstance(value, str | int) and not isinstance(value, bool):
            return value
        problem, _ = amount_problem(value, places=self.places)
        raise PydanticCustomError("invalid_amount", problem)

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(self.keep)


def _units(amount: Decimal | str | int) -> tuple[int, int] | None:
    """``amount`` as (integer units, decimal places), exactly: "0.450" → (450, 3); None if it is no finite decimal."""
    if isinstance(amount, Decimal):
        if not amount.is_finite():
            return None
        sign, digits, exponent = amount.as_tuple()
        units = int("".join(map(str, digits)) or "0") * (-1 if sign else 1)
        assert isinstance(exponent, int)  # finite
        return (units * 10**exponent, 0) if exponent >= 0 else (units, -exponent)
    match = _DECIMAL_TEXT.fullmatch(str(amount).strip())
    if match is None:
        return None
    fraction = match[3] or ""
    return int(match[2] + fraction) * (-1 if match[1] else 1), len(fraction)


def format_usd(amount: Decimal | str | int | None, kind: str = "total", *, per: str = "", missing: str = "—") -> str:
    """``amount`` in US dollars as the console and the CLI write it (``formatUsd`` in ``console/static/money.js``).

    A ``"total"`` (a balance, a charge, earnings) in cents, rounded half up: ``$1,234.50``; one under half a
    cent but not zero reads ``<$0.01``, never ``$0.00``. A ``"rate"`` (a price per GPU-hour, per hour or per
    second) keeps its decimals down to a millionth, at least two: ``$0.30``, ``$0.000125``, ``<$0.000001``.
    Thousands are grouped with commas, a negative amount starts with ``-``, ``per="h"`` adds ``/h``; no
    exponent, ever. ``None`` or ``""`` is ``missing``; text that is no decimal comes back as it is.

    >>> format_usd("1234.5"), format_usd("0.300000", "rate", per="h"), format_usd(Decimal("0.45") / 3600, "rate", per="s")
    ('$1,234.50', '$0.30/h', '$0.000125/s')
    """
    if amount is None or amount == "":
        return missing
    if kind not in _SHOWN_PLACES:
        raise ValueError(f"kind must be 'total' or 'rate', not {kind!r}")
    parsed = _units(amount)
    if parsed is None:
        return str(amount)
    units, scale = parsed
    places = _SHOWN_PLACES[kind]
    magnitude = abs(units)
    if scale <= places:
        shown = magnitude * 10 ** (places - scale)
    else:
        factor = 10 ** (scale - places)
        shown = (magnitude + factor // 2) // factor  # half up, on the digits
    sign = "-" if units < 0 else ""
    suffix = f"/{per}" if per else ""
    if shown == 0 and magnitude != 0:
        return f"{sign}<${'0.' + '0' * (places - 1) + '1'}{suffix}"
    whole, fraction = divmod(shown, 10**places)
    decimals = str(fraction).rjust(places, "0")
    decimals = decimals[:2] + decimals[2:].rstrip("0")
    return f"{sign}${whole:,}.{decimals}{suffix}"
