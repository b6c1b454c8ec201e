"""What a renter asks for with ``POST /volumes``: ``VolumeRequest``, its checks (400s that say why) and its fingerprint
(an ``Idempotency-Key`` repeated with another request is a 409)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Final

from shared.errors import BadRequest
from shared.protocol import MAX_VOLUME_GIB, VOLUME_ID_PATTERN

NAME_PATTERN: Final = r"^[a-z0-9][a-z0-9._-]{0,63}$"
NAME: Final = re.compile(NAME_PATTERN)
NAME_RULE: Final = (
    "1 to 64 of a-z, 0-9, '-', '_' and '.', starting with a letter or digit, e.g. data or ckpt-0"
)
_ID: Final = re.compile(VOLUME_ID_PATTERN)


def is_volume_id(text: str) -> bool:
    """Whether ``text`` is a volume's id (``vol-`` and 16 hex digits) rather than a name."""
    return bool(_ID.fullmatch(text))


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a volume, or None."""
    if not NAME.fullmatch(name):
        return f"a volume's name is {NAME_RULE}; got {name[:80]!r}"
    if is_volume_id(name):
        return f"a volume's name may not look like a volume id ({name!r}): routes take either, so it would be ambiguous"
    return None


@dataclass(frozen=True)
class VolumeRequest:
    """A volume of ``size_gib`` GiB named ``name``: on ``host_id``, else on the cheapest host with room in ``region``,
    else anywhere."""

    name: str
    size_gib: int
    host_id: str | None = None
    region: str | None = None

    def check(self) -> VolumeRequest:
        if (problem := name_problem(self.name)) is not None:
            raise BadRequest(problem, code="invalid_volume_name")
        if isinstance(self.size_gib, bool) or not 1 <= self.size_gib <= MAX_VOLUME_GIB:
            raise BadRequest(f"size_gib must be a whole number of GiB from 1 to {MAX_VOLUME_GIB}; got {self.size_gib}",
                             code="invalid_volume_size")  # fmt: skip
        if self.host_id is not None and self.region is not None:
            raise BadRequest("give host_id or region, not both: host_id already says where the volume lives",
                             code="host_or_region")  # fmt: skip
        return self

    def fingerprint(self) -> str:
        fields = {"name": self.name, "size": self.size_gib, "host": self.host_id, "region": self.region}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
