"""The relay's per-message work, kept cheap: decode an agent's frame, build its bus record and its ack.

Every function here returns exactly what ``shared.protocol`` would (the same message, errors and
bytes; ``tests/test_relay_forwarding.py`` pins the equality), only with less work per message,
which is most of a relay's CPU:

* ``decode_agent_frame`` decodes a heartbeat or telemetry frame (nearly all of the traffic) with
  msgspec (``shared.protocol.fastframe``: the same values, never accepting what the protocol
  refuses), and leaves any other frame, and any it does not take whole, to
  ``protocol.decode_agent_frame``, so the rest is decided and refused, with the same close codes
  and messages, by the protocol itself. (Before, the rest went through pydantic's JSON validator
  in one pass, which took what the protocol refuses: an integer literal past a float's range in
  a float field, ``1`` followed by 400 zeros, became infinity on the bus.);
* ``encode_bus_envelope`` writes the ``BusEnvelope`` record around the message's own JSON
  instead of serialising the envelope model, whose union field makes pydantic's serializer
  about twice as slow as the message alone (for a msgspec report, its JSON in the model's layout:
  only a float's exponent may be spelt otherwise, ``1e16`` for ``1e+16``);
* ``encode_ack`` formats the ack frame without building two models.
"""

from __future__ import annotations

from datetime import datetime

import pydantic_core

from shared import protocol
from shared.protocol import fastframe

Forwarded = protocol.AnyAgentMessage | fastframe.AgentReport
"""A decoded agent message: a msgspec report (heartbeat, telemetry) or the protocol's model (the rest)."""

_ACK = '{"v":%d,"type":"ack","body":{"seq":%d}}'


def decode_agent_frame(frame: str | bytes, *, max_frame: int) -> Forwarded:
    """``protocol.decode_agent_frame``, with a heartbeat or telemetry report decoded by msgspec: a
    ``fastframe`` Struct holding the values the model would.

    Raises ``ProtocolError`` with the close code ``protocol.decode_agent_frame`` gives."""
    if len(frame) <= max_frame:
        report = fastframe.decode_agent_report(frame)
        if report is not None:
            return report
    return protocol.decode_agent_frame(frame, max_frame=max_frame)


def encode_bus_envelope(relay_id: str, message: Forwarded, received_at: datetime, *,
                        cert_serial: str | None = None) -> bytes:
    """The bytes ``protocol.encode_bus_envelope`` returns for the same arguments (for a report, the same
    record, a float's exponent aside)."""
    tail = b"}" if cert_serial is None else b',"cert_serial":' + pydantic_core.to_json(cert_serial) + b"}"
    return b"".join((
        b'{"relay_id":', pydantic_core.to_json(relay_id),
        b',"received_at":', pydantic_core.to_json(received_at),
        b',"message":', fastframe.encode_report(message) if isinstance(message, fastframe.AgentReport)
        else message.__pydantic_serializer__.to_json(message),
        tail,
    ))


def encode_ack(seq: int) -> str:
    """The text of ``protocol.Ack`` for ``seq``."""
    return _ACK % (protocol.PROTOCOL_VERSION, seq)
