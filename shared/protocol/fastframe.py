"""The relay's fast decoder for the agent frames that are nearly all of its traffic: heartbeats and telemetry.

``decode_agent_report`` decodes such a frame in one pass with msgspec into a ``HeartbeatFrame`` or a
``TelemetryFrame``: the envelope of ``messages.Heartbeat`` / ``messages.Telemetry`` with ``v`` required (a
frame must state its version) around ``fastbus``'s bodies, the same fields with the same bounds. As
``fastbus`` does for the master, it never accepts what ``messages.decode_agent_frame`` refuses, and what it
accepts carries the same values; it is stricter instead, and answers ``None`` for anything it does not take
whole, so that the caller asks ``decode_agent_frame``, which decides (and words the refusal) as it always
did. Beyond ``fastbus``'s refusals (another message type, a field it does not know, NaN or infinity, a
number in another JSON type, malformed JSON), it leaves to the full decoder:

* any frame holding a backslash: a JSON escape may spell a lone surrogate, a key or a timestamp that
  msgspec and pydantic would read differently; an agent's own frames carry none (pydantic writes UTF-8);
* a time with more than six digits of fractional seconds: msgspec rounds them to the microsecond,
  pydantic truncates.

``encode_report`` writes the message's JSON as pydantic serialises the model (the same keys in the same
order, defaults included); only a float's exponent may be spelt otherwise (``1e16`` for ``1e+16``), the
same number. Imports nothing of ours but ``fastbus``.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, ClassVar, Literal

import msgspec
from msgspec import Meta, Struct

from shared.protocol import fastbus

Seq = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]

# Seven digits after a point: a float's (``37.61234567``) or a time's past the microsecond, which ``_past_microseconds``
# tells apart by what precedes the point. A search from the literal point is several times faster than one for the
# whole ``\d\d:\d\d\.\d{7}`` (3 against 100 µs in an 8-GPU report).
_SEVEN_DIGITS = re.compile(r"\.[0-9]{7}")


class HeartbeatFrame(Struct, forbid_unknown_fields=True, tag_field="type", tag="heartbeat"):
    """``messages.Heartbeat`` as an agent sends it."""

    type: ClassVar[Literal["heartbeat"]] = "heartbeat"
    v: Literal[1]
    host_id: fastbus.HostIdText
    seq: Seq
    ts: datetime
    body: fastbus.HeartbeatBody

    def __post_init__(self) -> None:
        fastbus._check_utc(self.ts)


class TelemetryFrame(Struct, forbid_unknown_fields=True, tag_field="type", tag="telemetry"):
    """``messages.Telemetry`` as an agent sends it."""

    type: ClassVar[Literal["telemetry"]] = "telemetry"
    v: Literal[1]
    host_id: fastbus.HostIdText
    seq: Seq
    ts: datetime
    body: fastbus.TelemetryBody

    def __post_init__(self) -> None:
        fastbus._check_utc(self.ts)


AgentReport = HeartbeatFrame | TelemetryFrame

_decoder = msgspec.json.Decoder(AgentReport)
_encoder = msgspec.json.Encoder()


def decode_agent_report(frame: str | bytes) -> AgentReport | None:
    """The heartbeat or telemetry frame in ``frame``; None: ask ``decode_agent_frame`` (see the module's doc).

    The frame's size is the caller's to bound first."""
    text = frame if isinstance(frame, str) else frame.decode(errors="replace")
    if "\\" in text or _past_microseconds(text):
        return None
    try:
        return _decoder.decode(frame)
    except (ValueError, RecursionError):  # msgspec.DecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        return None


def _past_microseconds(text: str) -> bool:
    """Whether ``text`` may hold a time with a fraction of a second past the microsecond (``MM:SS.1234567``)."""
    for match in _SEVEN_DIGITS.finditer(text):
        at = match.start()
        if at >= 5 and text[at - 3] == ":" and text[at - 5 : at - 3].isdigit() and text[at - 2 : at].isdigit():
            return True
    return False


def encode_report(report: AgentReport) -> bytes:
    """The message's JSON, as ``model_dump_json`` of the same message writes it."""
    encode = _encoder.encode
    return b"".join((
        b'{"v":1,"host_id":', encode(report.host_id), b',"seq":', b"%d" % report.seq, b',"ts":', encode(report.ts),
        b',"type":"', report.type.encode(), b'","body":', encode(report.body), b"}",
    ))  # fmt: skip
