"""The relay ⇄ master bus records: the streams (``AGENT_EVENTS_STREAM``, ``AGENT_LINKS_STREAM``,
``commands_stream``), the masters' consumer group, ``BusEnvelope`` (an agent message and its
provenance), ``LinkEvent`` (an agent's websocket opened or closed at a relay) and
``CommandDelivery`` (a command for a relay's agent), with their codecs."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field, TypeAdapter, ValidationError

from shared.errors import ProtocolError
from shared.protocol.base import CertSerial, HostId, ShortText, StrictModel, Timestamp
from shared.protocol.messages import AgentMessage, AnyAgentMessage, Command

AGENT_EVENTS_STREAM = "agent-events"
INGEST_GROUP = "master"
"""The consumer group in which every master process reads ``AGENT_EVENTS_STREAM`` (and ``AGENT_LINKS_STREAM``)."""
AGENT_LINKS_STREAM = "agent-links"
"""Where relays say that an agent's link opened or closed (``LinkEvent``): a stream of its own, so that a master
that does not read it loses nothing of ``AGENT_EVENTS_STREAM``."""

ConnectionId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:-]+$")]


def commands_stream(relay_id: str) -> str:
    """The bus stream a relay reads the master's commands for its agents from."""
    return f"commands:{relay_id}"


class BusEnvelope(StrictModel):
    """What the relay puts on the bus for each agent message: the message plus provenance."""

    relay_id: ShortText
    received_at: Timestamp
    message: AgentMessage
    # The serial of the certificate the message's connection presented (the master retires a
    # renewed host's older certificates once it sees the new one in use); None from older relays.
    cert_serial: CertSerial | None = None


class LinkEvent(StrictModel):
    """An agent's websocket at a relay opened (``open``: the host is in session there) or closed (``closed``).

    ``connection_id`` names the one connection (unique per relay process and connection): a close counts only
    for the connection the master holds as the host's current one, so the late close of an old link (relay A
    notices it after the agent reconnected through relay B) changes nothing. ``at`` is the relay's clock.
    ``draining``: the relay itself is shutting down and told the agent to move (it reconnects within seconds).
    ``code``: the websocket close code, where there was one.
    """

    event: Literal["open", "closed"]
    relay_id: ShortText
    host_id: HostId
    connection_id: ConnectionId
    at: Timestamp
    draining: bool = False
    code: int | None = Field(None, ge=0, le=4999)


class CommandDelivery(StrictModel):
    """What the master puts on a relay's command stream."""

    host_id: HostId
    command: Command


_bus_adapter = TypeAdapter(BusEnvelope)


def encode_bus_envelope(relay_id: str, message: AnyAgentMessage, received_at: datetime, *,
                        cert_serial: str | None = None) -> bytes:
    envelope = BusEnvelope(relay_id=relay_id, received_at=received_at, message=message, cert_serial=cert_serial)
    # Without a serial the record is what relays wrote before the field existed.
    return envelope.model_dump_json(exclude={"cert_serial"} if cert_serial is None else None).encode()


def decode_bus_envelope(payload: bytes) -> BusEnvelope:
    try:
        return _bus_adapter.validate_json(payload)
    except ValidationError as exc:
        raise ProtocolError(f"invalid bus envelope: {exc.errors()[0]['msg']}", code="bad_bus_record") from None


def decode_command_delivery(payload: bytes) -> CommandDelivery:
    try:
        return CommandDelivery.model_validate_json(payload)
    except ValidationError as exc:
        raise ProtocolError(f"invalid command delivery: {exc.errors()[0]['msg']}", code="bad_bus_record") from None


def encode_link_event(event: LinkEvent) -> bytes:
    return event.model_dump_json().encode()


def decode_link_event(payload: bytes) -> LinkEvent:
    try:
        return LinkEvent.model_validate_json(payload)
    except ValidationError as exc:
        raise ProtocolError(f"invalid link event: {exc.errors()[0]['msg']}", code="bad_bus_record") from None
