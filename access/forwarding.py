"""The relay's per-message work, kept cheap: decode an agent's frame, build its bus record and its ack.

Every function here returns exactly what ``shared.protocol`` would (the same message, errors and
bytes; ``tests/test_relay_forwarding.py`` pins the equality), only with less work per message,
which is most of a relay's CPU:

* ``decode_agent_frame`` validates the frame in one pass (pydantic's JSON validator) and falls
  back on ``protocol.decode_agent_frame`` only to say what is wrong with a frame that fails, so
  bad input gets the same close codes and messages;
* ``encode_bus_envelope`` writes the ``BusEnvelope`` record around the message's own JSON
  instead of serialising the envelope model, whose union field makes pydantic's serializer
  about twice as slow as the message alone;
* ``encode_ack`` formats the ack frame without building two models.
"""

from __future__ import annotations

from datetime import datetime

import pydantic_core
from pydantic import TypeAdapter, ValidationError

from shared import protocol

_agent_messages: TypeAdapter[protocol.AnyAgentMessage] = TypeAdapter(protocol.AgentMessage)
_ACK = '{"v":%d,"type":"ack","body":{"seq":%d}}'


def decode_agent_frame(frame: str | bytes, *, max_frame: int) -> protocol.AnyAgentMessage:
    """``protocol.decode_agent_frame``, in one pass when the frame is valid.

    Raises ``ProtocolError`` with the close code ``protocol.decode_agent_frame`` gives."""
    if len(frame) <= max_frame:
        try:
            message = _agent_messages.validate_json(frame)
        except ValidationError:
            pass  # the slow path below says why, in the protocol's words
        else:
            if "v" in message.model_fields_set:  # the model defaults ``v``; a frame must state it
                return message
    return protocol.decode_agent_frame(frame, max_frame=max_frame)


def encode_bus_envelope(relay_id: str, message: protocol.AnyAgentMessage, received_at: datetime, *,
                        cert_serial: str | None = None) -> bytes:
    """The bytes ``protocol.encode_bus_envelope`` returns for the same arguments."""
    tail = b"}" if cert_serial is None else b',"cert_serial":' + pydantic_core.to_json(cert_serial) + b"}"
    return b"".join((
        b'{"relay_id":', pydantic_core.to_json(relay_id),
        b',"received_at":', pydantic_core.to_json(received_at),
        b',"message":', message.__pydantic_serializer__.to_json(message),
        tail,
    ))


def encode_ack(seq: int) -> str:
    """The text of ``protocol.Ack`` for ``seq``."""
    return _ACK % (protocol.PROTOCOL_VERSION, seq)
