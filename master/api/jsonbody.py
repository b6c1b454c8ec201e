"""The one JSON reader of REST request bodies: bounded nesting, bounded numbers, text that is text.

Python's ``json`` recurses once per level (``[`` ten thousand deep is a ``RecursionError``),
converts integer literals of any length (past 4,300 digits ``int`` raises ``ValueError``; below
that the conversion is quadratic), reads ``1e999`` as infinity and accepts ``NaN``, which JSON has
not: each was a 500 before sign-in. Here the bytes go through pydantic's parser, as the wire
protocol's frames do (nesting past 200 levels, lone surrogates and ``NaN`` are refused there), and
then through three scans of the valid text with its strings cut out, all at C speed: nesting deeper
than ``max_depth``, a number with more than ``max_number_digits`` digits in a row, a number that
overflows to infinity. Every refusal is ``InvalidJson``: 400 ``invalid_json``, one line.

Then two rules of what the JSON says: an object that names a key twice is 400 ``duplicate_key``
naming it (``{"gpu_count": 1, "gpu_count": 64}`` was read as 64: which one a reader keeps is not
JSON's to say, and a proxy or a log may have read the other); a string holding a control character
other than tab, line feed or carriage return is 400 ``invalid_character`` naming the field
(``master.api.characters``).

Pure: bytes in, a value or ``InvalidJson`` out, in time linear in the size of the body.
``master.api.base.parse_body`` is its caller; the body's size is bounded before it is read (the
app's ``client_max_size``, set from ``max_request_bytes``).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pydantic_core

from master.api.characters import check_json_text
from shared.errors import BadRequest

MAX_DEPTH = 32
"""Arrays and objects inside each other, at most; the deepest request model is far shallower."""
MAX_NUMBER_DIGITS = 100
"""Digits in a row in a number, at most; every number the API takes is far shorter."""
BODY_ITEMS = {
    "digit-runs": b"9" * MAX_NUMBER_DIGITS,
    "fraction-runs": b"9" * 50 + b"." + b"9" * 49,
    "exponents": b"1e1",
    "big-exponents": b"1e100",
    "arrays": b"[]",
    "deepest-arrays": b"[" * (MAX_DEPTH - 1) + b"0" + b"]" * (MAX_DEPTH - 1),
    "escaped-strings": b'"[\\""',
    "zeros": b"0",
}
"""The items each scan likes least, by name: a body of one of them repeated is the worst case of its size."""
_MESSAGE_CHARS = 200  # of the parser's own explanation, in the one-line message
_KEY_CHARS = 60  # of a repeated key, in the message

# Only ever run on text pydantic parsed, where every string ends: one match per string, no backtracking.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_A_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_OPEN_CLOSE = bytes.maketrans(b"{}", b"[]")  # one kind of pair: in valid JSON every bracket closes its own opener
# Each pattern starts only where a number (or a run of digits) starts and never backtracks into it: tried at every
# digit, or giving digits back, they would be quadratic in the length of a run (seconds for a body of 100-digit runs).
# Without a long run of digits, only a positive exponent of three digits or more can overflow a float.
_BIG_EXPONENT = re.compile(rb"(?<![0-9.])-?[0-9]++(?:\.[0-9]++)?[eE]\+?[0-9]{3,}")


class InvalidJson(BadRequest):
    code = "invalid_json"


class DuplicateKey(BadRequest):
    code = "duplicate_key"


def decode_json_body(data: bytes, *, max_depth: int = MAX_DEPTH, max_number_digits: int = MAX_NUMBER_DIGITS) -> Any:
    """The JSON value of a request body, or ``InvalidJson``, ``DuplicateKey`` or ``InvalidCharacter`` saying what is
    wrong with it; raises nothing else."""
    try:
        value = pydantic_core.from_json(data, allow_inf_nan=False)
    except ValueError as exc:
        if str(exc).startswith("recursion limit exceeded"):  # pydantic's own bound on nesting, 200 levels
            raise _too_deep(max_depth) from None
        if str(exc).startswith("number out of range"):  # an integer past Python's 4,300 digits
            raise _too_long(max_number_digits) from None
        raise InvalidJson(f"the request body is not valid JSON: {str(exc)[:_MESSAGE_CHARS]}") from None
    outside_strings = _STRING.sub(b"", data)
    if _deeper_than(outside_strings.translate(_OPEN_CLOSE, _NOT_A_BRACKET), max_depth):
        raise _too_deep(max_depth)
    if re.search(rb"(?<![0-9])[0-9]{%d}" % (max_number_digits + 1), outside_strings):
        raise _too_long(max_number_digits)
    if any(math.isinf(float(literal)) for literal in _BIG_EXPONENT.findall(outside_strings)):
        raise InvalidJson("the request body holds a number too large to represent (it overflows to infinity)")
    if b"{" in outside_strings:
        # pydantic's parser keeps the last of two equal keys without a word; Python's can say. Safe to run now: the
        # scans above bound its recursion (depth) and its integer conversions (digits).
        try:
            json.loads(data, object_pairs_hook=_refuse_duplicate_keys)
        except DuplicateKey:
            raise
        except (ValueError, RecursionError) as exc:  # not expected of text pydantic read; still a 400, never a 500
            raise InvalidJson(f"the request body is not valid JSON: {str(exc)[:_MESSAGE_CHARS]}") from None
    check_json_text(value)
    return value


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            shown = re.sub(r"[\x00-\x1f\x7f]", "?", key[:_KEY_CHARS])
            raise DuplicateKey(f"the request body names the key {shown!r} twice in one object; send it once")
        seen.add(key)
    return dict(pairs)


def largest_body(item: bytes, size: int = 1 << 20) -> bytes:
    """A JSON array of ``item`` repeated, about ``size`` bytes long (the default: the API's largest body)."""
    return b"[" + b",".join([item] * (size // (len(item) + 1))) + b"]"


def _deeper_than(brackets: bytes, max_depth: int) -> bool:
    """Whether balanced ``brackets`` (only ``[`` and ``]``) nest deeper than ``max_depth``. Each pass drops the
    innermost pairs, one level exactly (``replace`` scans the text as it was), in C: at most ``max_depth`` passes."""
    for _ in range(max_depth):
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"")
    return bool(brackets)


def _too_deep(max_depth: int) -> InvalidJson:
    return InvalidJson(f"the request body nests arrays and objects deeper than {max_depth} levels")


def _too_long(max_number_digits: int) -> InvalidJson:
    return InvalidJson(f"the request body holds a number of more than {max_number_digits} digits")
