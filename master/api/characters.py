"""Control characters in request input: the one rule for path parameters, query strings and JSON bodies.

PostgreSQL cannot store NUL in text (asyncpg's ``CharacterNotInRepertoireError``, a 500 when a
``?region=eu%00`` reached a query), and no name, id, filter or time the API takes holds a control
character. So a path parameter or a query parameter (its name or its value) with any C0 control
character or DEL is 400 ``invalid_character``, checked by ``master.api.middleware.query_middleware``
before authentication for every route of the table (a service's endpoint, ``/svc/…``, forwards its
renter's paths and queries as they are); a string in a JSON body (a key or a value, at any depth) is
refused the same by ``master.api.jsonbody`` unless the character is a tab, a line feed or a carriage
return, which multi-line fields take (a CSR's PEM, a script); each single-line field's own pattern
(matched in full: ``fullmatch``, or pydantic's patterns, where ``$`` is the end of the text) refuses those.

The errors middleware turns a NUL that still reaches PostgreSQL into the same 400, with a log line.
"""

from __future__ import annotations

import re
from typing import Any

from shared.errors import BadRequest

_IN_A_LINE = re.compile(r"[\x00-\x1f\x7f]")
"""Refused in a path or query parameter: every C0 control character, and DEL."""
_IN_TEXT = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
"""Refused in a body's string: the same, less tab, line feed and carriage return."""
_NAME_CHARS = 60  # of a field's name, in the message


class InvalidCharacter(BadRequest):
    code = "invalid_character"


def check_line(where: str, text: str) -> None:
    """``InvalidCharacter`` naming ``where`` (e.g. ``query parameter 'region'``) when ``text`` holds a control character."""
    found = _IN_A_LINE.search(text)
    if found is not None:
        raise _refused(where, found.group())


def check_json_text(value: Any) -> None:
    """``InvalidCharacter`` naming the first field (``workload.env.A``, ``items[2]``) whose key or string value holds a
    control character other than tab, line feed and carriage return. Iterative: depth costs no recursion."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            found = _IN_TEXT.search(item)
            if found is not None:
                raise _refused(f"body field {where or '(the body)'!r}", found.group())
        elif isinstance(item, dict):
            for key, child in item.items():
                name = f"{where}.{key}" if where else key
                found = _IN_TEXT.search(key)
                if found is not None:
                    raise _refused(f"body key {name!r}", found.group())
                stack.append((name, child))
        elif isinstance(item, list):
            stack.extend((f"{where}[{index}]", child) for index, child in enumerate(item))


def _refused(where: str, character: str) -> InvalidCharacter:
    if len(where) > _NAME_CHARS:
        where = where[:_NAME_CHARS] + "…"
    return InvalidCharacter(f"{where} holds a control character (U+{ord(character):04X}); remove it")
