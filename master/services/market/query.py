"""The offer query language: ``gpu_name=RTX_4090 num_gpus>=2 reliability>0.98 price<=0.5``.

Pure parsing: text in, a list of typed ``Condition`` out, or an ``OfferQueryError`` that
names the position (1-based character) and what was expected there. The search
(``master/services/market/offers.py``) turns conditions into SQL. Imports ``shared``,
``master.services.market.tiers`` and ``master.services.market.placement`` (model words) only. ``docs/marketplace.md`` documents the language for users.

Grammar
=======

::

    query   = { space } [ term { space { space } term } ] { space }
    term    = field { space } op { space } value { "|" value }
    field   = one of FIELDS (case-insensitive)
    op      = "=" | "!=" | "<" | "<=" | ">" | ">="
    value   = word | quoted
    word    = one or more characters other than space, | " ' < > = !
              (an underscore reads as a space: RTX_4090 is "RTX 4090")
    quoted  = '"' { any character but '"' } '"'  |  "'" { any character but "'" } "'"

Terms are ANDed; two terms on one field make a range (``price>=0.2 price<=0.5``).
``a|b`` alternatives are allowed with ``=`` (any of them) and ``!=`` (none of them).
Ordering operators apply to numbers and versions only. An offer whose value is unknown
(a host not scored yet, no network measurement) fails every comparison except ``!=``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum

from master.services.market.placement import model_filter_problem, normalise_name
from master.services.market.tiers import Tier
from shared.errors import BadRequest
from shared.money import PRICE_PLACES, amount_problem

__all__ = [
    "FIELDS",
    "Condition",
    "FieldSpec",
    "Kind",
    "OfferQueryError",
    "Op",
    "Value",
    "Version",
    "format_query",
    "parse",
    "parse_value",
]

# Limits: a query is typed by a person or built by a script, never this long on purpose.
MAX_QUERY_LENGTH = 2000
MAX_TERMS = 32
MAX_ALTERNATIVES = 16
MAX_VALUE_LENGTH = 128


class Op(StrEnum):
    EQ = "="
    NE = "!="
    LT = "<"
    LE = "<="
    GT = ">"
    GE = ">="


ORDERING = frozenset({Op.LT, Op.LE, Op.GT, Op.GE})


class Kind(StrEnum):
    MODEL = "model"  # GPU model words, matched like POST /rentals' gpu_model
    TEXT = "text"  # exact text
    COUNT = "count"  # whole number ≥ 1
    INTEGER = "integer"  # whole number ≥ 0
    NUMBER = "number"  # decimal number ≥ 0 (compared as a float)
    MONEY = "money"  # USD, exact decimal ≥ 0 with at most 6 places
    VERSION = "version"  # major[.minor], compared numerically (12.10 > 12.9)
    TIER = "tier"
    BOOL = "bool"


@dataclass(frozen=True, order=True)
class Version:
    major: int
    minor: int = 0

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"

    @property
    def key(self) -> int:
        """One integer that orders like the version (what the search compares in SQL)."""
        return self.major * 1000 + self.minor


Value = str | int | float | Decimal | Version | bool


@dataclass(frozen=True)
class FieldSpec:
    name: str
    kind: Kind
    description: str

    @property
    def ops(self) -> frozenset[Op]:
        if self.kind in (Kind.COUNT, Kind.INTEGER, Kind.NUMBER, Kind.MONEY, Kind.VERSION):
            return frozenset(Op)
        return frozenset({Op.EQ, Op.NE})


FIELDS: dict[str, FieldSpec] = {
    spec.name: spec
    for spec in (
        FieldSpec("gpu_name", Kind.MODEL, "GPU model words: every word must be a word of the NVML name (RTX_4090, A100_80GB)."),
        FieldSpec("num_gpus", Kind.COUNT, "Free GPUs of the model on one host."),
        FieldSpec("vram", Kind.NUMBER, "GPU memory in GiB, rounded to the nearest GiB (a 24564 MiB card is 24)."),
        FieldSpec("vram_mib", Kind.INTEGER, "GPU memory in MiB as NVML reports it."),
        FieldSpec("compute_capability", Kind.VERSION, "CUDA compute capability (8.9)."),
        FieldSpec("cuda_driver_version", Kind.VERSION, "Highest CUDA version the host's driver supports (12.4)."),
        FieldSpec("price", Kind.MONEY, "USD per GPU-hour."),
        FieldSpec("price_per_score", Kind.NUMBER, "USD per GPU-hour per performance-score point (lower is better value)."),
        FieldSpec("region", Kind.TEXT, "The host's region, exactly (eu-west)."),
        FieldSpec("tier", Kind.TIER, "flagship, datacenter, prosumer, consumer or entry."),
        FieldSpec("score", Kind.NUMBER, "Performance score (an H100 SXM is 100)."),
        FieldSpec("reliability", Kind.NUMBER, "The host's reliability, 0 to 1."),
        FieldSpec("download_mbps", Kind.NUMBER, "Measured download speed, Mbit/s."),
        FieldSpec("upload_mbps", Kind.NUMBER, "Measured upload speed, Mbit/s."),
        FieldSpec("verified", Kind.BOOL, "Proven by the GPU challenge: every GPU of the host passed within the last 7 days "
                  "(true or false; docs/verification.md)."),
        FieldSpec("isolated", Kind.BOOL, "The host isolates renters' workloads (containers or per-rental users): true or "
                  "false; hosts of older agents, which do not say, match neither."),
    )
}


@dataclass(frozen=True)
class Condition:
    """``field op value``; several values are alternatives (any of them for ``=``, none for ``!=``)."""

    field: str
    op: Op
    values: tuple[Value, ...]

    def __str__(self) -> str:
        return f"{self.field}{self.op}{'|'.join(_format_value(v) for v in self.values)}"


class OfferQueryError(BadRequest):
    """A query that does not parse; ``details`` carries the parameter, position and what was expected."""

    code = "invalid_query"

    def __init__(self, message: str, *, position: int | None, expected: str, parameter: str = "q") -> None:
        where = f"position {position}: " if position is not None else ""
        super().__init__(
            f"query parameter {parameter!r}: {where}{message}",
            details={"parameter": parameter, "position": position, "expected": expected},
        )
        self.position = position
        self.expected = expected


# ---- values ------------------------------------------------------------------------------

_INTEGER = re.compile(r"[0-9]{1,9}")
_DECIMAL = re.compile(r"[0-9]{1,12}(\.[0-9]{1,12})?|\.[0-9]{1,12}")
MAX_QUERY_PRICE = Decimal("999999.999999")
_VERSION = re.compile(r"([0-9]{1,6})(?:\.([0-9]{1,3}))?")
_TRUE = frozenset({"true", "yes", "1"})
_FALSE = frozenset({"false", "no", "0"})


class _BadValue(ValueError):
    def __init__(self, expected: str) -> None:
        super().__init__(expected)
        self.expected = expected


def _expected_for(spec: FieldSpec) -> str:
    return {
        Kind.MODEL: "GPU model words",
        Kind.TEXT: "a text value",
        Kind.COUNT: "a whole number of GPUs, at least 1",
        Kind.INTEGER: "a whole number, 0 or more",
        Kind.NUMBER: "a number, 0 or more",
        Kind.MONEY: "a price in USD like 0.45 (ASCII digits and at most one dot, at most 6 decimal places, below 1000000)",
        Kind.VERSION: "a version such as 8.9 or 12",
        Kind.TIER: f"one of {', '.join(t.value for t in Tier)}",
        Kind.BOOL: "true or false",
    }[spec.kind]


def _convert(spec: FieldSpec, text: str) -> Value:
    """The typed value of ``text`` for ``spec``; raises _BadValue naming what was expected."""
    expected = _expected_for(spec)
    if not text or len(text) > MAX_VALUE_LENGTH:
        raise _BadValue(f"{expected} (1 to {MAX_VALUE_LENGTH} characters)")
    match spec.kind:
        case Kind.MODEL:
            # Compared after Unicode normalisation (master/services/market/placement.py); kept NFKC-normalised, so the echoed
            # query shows what is matched (ＲＴＸ_４０９０ reads back as RTX_4090). Nothing meaningful is refused, never "any".
            text = normalise_name(text)
            problem = model_filter_problem(text)
            if problem is not None:
                raise _BadValue(f"GPU model words; this {problem}")
            return text
        case Kind.TEXT:
            return text
        case Kind.COUNT | Kind.INTEGER:
            if not _INTEGER.fullmatch(text):
                raise _BadValue(expected)
            number = int(text)
            if spec.kind is Kind.COUNT and number < 1:
                raise _BadValue(expected)
            return number
        case Kind.MONEY:
            # shared/money.py's grammar: negative amounts, exponents, separators, non-ASCII digits and a
            # seventh decimal place are all refused.
            _, amount = amount_problem(text, places=PRICE_PLACES, maximum=MAX_QUERY_PRICE)
            if amount is None:
                raise _BadValue(expected)
            return amount
        case Kind.NUMBER:
            if not _DECIMAL.fullmatch(text):
                raise _BadValue(expected)
            return float(text)
        case Kind.VERSION:
            found = _VERSION.fullmatch(text)
            if not found:
                raise _BadValue(expected)
            return Version(int(found.group(1)), int(found.group(2) or 0))
        case Kind.TIER:
            try:
                return Tier(text.lower())
            except ValueError:
                raise _BadValue(expected) from None
        case Kind.BOOL:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise _BadValue(expected)
    raise AssertionError(spec.kind)  # pragma: no cover


def parse_value(field: str, op: Op, text: str, *, parameter: str) -> Condition:
    """One condition from a separate query parameter (``max_price=0.5`` → ``price<=0.5``).

    ``text`` is taken literally: no quotes, no underscores for spaces, no alternatives.
    """
    spec = FIELDS[field]
    try:
        value = _convert(spec, text)
    except _BadValue as exc:
        raise OfferQueryError(f"expected {exc.expected}, got {text[:40]!r}", position=None, expected=exc.expected, parameter=parameter) from None
    return Condition(field, op, (value,))


# ---- the parser ------------------------------------------------------------------------

_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OP = re.compile(r"<=|>=|!=|=|<|>")
_WORD_STOP = frozenset(" \t\r\n|\"'<>=!")


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def fail(self, message: str, expected: str, at: int | None = None) -> OfferQueryError:
        return OfferQueryError(message, position=(self.pos if at is None else at) + 1, expected=expected)

    def got(self) -> str:
        if self.pos >= len(self.text):
            return "end of query"
        return repr(self.text[self.pos : self.pos + 20])

    def skip_space(self) -> int:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1
        return self.pos - start

    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def parse(self) -> list[Condition]:
        conditions: list[Condition] = []
        self.skip_space()
        while not self.at_end():
            if len(conditions) == MAX_TERMS:
                raise self.fail(f"too many terms (at most {MAX_TERMS})", "end of query")
            conditions.append(self.term())
            if not self.skip_space() and not self.at_end():
                raise self.fail(f"expected a space before the next term, got {self.got()}", "a space")
        return conditions

    def term(self) -> Condition:
        names = ", ".join(FIELDS)
        found = _FIELD.match(self.text, self.pos)
        if not found:
            raise self.fail(f"expected a field name ({names}), got {self.got()}", "a field name")
        name = found.group().lower()
        spec = FIELDS.get(name)
        if spec is None:
            raise self.fail(f"unknown field {found.group()!r}; expected a field name, one of {names}", "a field name")
        self.pos = found.end()
        self.skip_space()
        op_at = self.pos
        found = _OP.match(self.text, self.pos)
        if not found:
            raise self.fail(f"expected an operator (=, !=, <, <=, >, >=) after {name!r}, got {self.got()}", "an operator")
        op = Op(found.group())
        if op not in spec.ops:
            raise self.fail(f"{name} takes = or != only, not {op.value}", "= or !=", at=op_at)
        self.pos = found.end()
        self.skip_space()
        values = [self.value(spec)]
        while not self.at_end() and self.text[self.pos] == "|":
            if op in ORDERING:
                raise self.fail(
                    f"alternatives (a|b) go with = or != only, not {op.value}; expected a space or end of query",
                    "a space or end of query",
                )
            if len(values) == MAX_ALTERNATIVES:
                raise self.fail(f"too many alternatives (at most {MAX_ALTERNATIVES}); expected a space or end of query", "a space or end of query")
            self.pos += 1
            values.append(self.value(spec))
        return Condition(name, op, tuple(values))

    def value(self, spec: FieldSpec) -> Value:
        start = self.pos
        quote = self.text[self.pos] if not self.at_end() else ""
        if not quote or (quote in _WORD_STOP and quote not in "\"'"):
            raise self.fail(f"expected a value for {spec.name} ({_expected_for(spec)}), got {self.got()}", _expected_for(spec))
        if quote in "\"'":
            end = self.text.find(quote, self.pos + 1)
            if end < 0:
                raise self.fail(f"unterminated quoted value; expected a closing {quote}", f"a closing {quote}")
            raw = self.text[self.pos + 1 : end]
            self.pos = end + 1
        else:
            while not self.at_end() and self.text[self.pos] not in _WORD_STOP:
                self.pos += 1
            raw = self.text[start : self.pos].replace("_", " ")
        try:
            return _convert(spec, raw)
        except _BadValue as exc:
            raise self.fail(
                f"bad value for {spec.name}: expected {exc.expected}, got {self.text[start : self.pos][:40]!r}", exc.expected, at=start
            ) from None


def parse(text: str) -> list[Condition]:
    """The conditions of ``text`` in order; an empty or blank query has none."""
    if len(text) > MAX_QUERY_LENGTH:
        raise OfferQueryError(f"the query is longer than {MAX_QUERY_LENGTH} characters", position=None, expected="a shorter query")
    return _Parser(text).parse()


# ---- formatting (the normalised query echoed back by GET /offers) --------------------------


def _format_value(value: Value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        # Tier is a str too; its value is a bare word.
        if value and not any(c in _WORD_STOP or c == "_" for c in value):
            return value
        if " " in value and "_" not in value and not any(c in _WORD_STOP and c != " " for c in value):
            return value.replace(" ", "_")
        return f"'{value}'" if '"' in value else f'"{value}"'
    if isinstance(value, Decimal):
        return format(value, "f")  # never an exponent: 0E-6 → 0.000000
    if isinstance(value, float):
        text = format(Decimal(repr(value)), "f")  # never an exponent: 1e-07 → 0.0000001
        return text.removesuffix(".0")
    return str(value)


def format_query(conditions: Sequence[Condition]) -> str:
    """A query string that parses back to ``conditions``."""
    return " ".join(str(c) for c in conditions)
