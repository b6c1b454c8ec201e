"""The envelopes and the frame codec: agent → relay messages (``AGENT_TYPES``), relay → agent
messages (``SERVER_TYPES``), ``encode``, ``decode_agent_frame`` and ``decode_server_frame``
(each refusal a ``ProtocolError`` with its close code) and ``check_identity``."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Protocol

import pydantic_core
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from shared.errors import ProtocolError
from shared.protocol.base import (
    CLOSE_BAD_FRAME,
    CLOSE_IDENTITY_MISMATCH,
    CLOSE_TOO_BIG,
    CLOSE_UNKNOWN_TYPE,
    CLOSE_UNSUPPORTED_VERSION,
    DEFAULT_MAX_FRAME,
    PROTOCOL_VERSION,
    HostId,
    StrictModel,
    Timestamp,
)
from shared.protocol.bodies import (
    AckBody,
    CommandResultBody,
    GpuEventsBody,
    HeartbeatBody,
    HelloBody,
    MoveBody,
    NetworkReportBody,
    RenewCertificateBody,
    TelemetryBody,
    TunnelUsageBody,
    WelcomeBody,
    WorkloadExitedBody,
    WorkloadLogsBody,
    WorkloadProgressBody,
)
from shared.protocol.commands import CommandBody


class AgentEnvelope(StrictModel):
    v: Literal[1] = PROTOCOL_VERSION
    host_id: HostId
    seq: int = Field(ge=0, lt=1 << 63)
    ts: Timestamp


class Hello(AgentEnvelope):
    type: Literal["hello"] = "hello"
    body: HelloBody


class Heartbeat(AgentEnvelope):
    type: Literal["heartbeat"] = "heartbeat"
    body: HeartbeatBody


class Telemetry(AgentEnvelope):
    type: Literal["telemetry"] = "telemetry"
    body: TelemetryBody


class CommandResult(AgentEnvelope):
    type: Literal["command_result"] = "command_result"
    body: CommandResultBody


class GpuEvents(AgentEnvelope):
    type: Literal["gpu_events"] = "gpu_events"
    body: GpuEventsBody


class NetworkReport(AgentEnvelope):
    type: Literal["network_report"] = "network_report"
    body: NetworkReportBody


class WorkloadExited(AgentEnvelope):
    type: Literal["workload_exited"] = "workload_exited"
    body: WorkloadExitedBody


class WorkloadLogs(AgentEnvelope):
    type: Literal["workload_logs"] = "workload_logs"
    body: WorkloadLogsBody


class WorkloadProgress(AgentEnvelope):
    type: Literal["workload_progress"] = "workload_progress"
    body: WorkloadProgressBody


class TunnelUsage(AgentEnvelope):
    type: Literal["tunnel_usage"] = "tunnel_usage"
    body: TunnelUsageBody


class RenewCertificate(AgentEnvelope):
    type: Literal["renew_certificate"] = "renew_certificate"
    body: RenewCertificateBody


AnyAgentMessage = (
    Hello | Heartbeat | Telemetry | CommandResult | GpuEvents | NetworkReport | WorkloadExited | WorkloadLogs | RenewCertificate
    | WorkloadProgress | TunnelUsage
)
AgentMessage = Annotated[AnyAgentMessage, Field(discriminator="type")]
AGENT_TYPES = frozenset(
    {"hello", "heartbeat", "telemetry", "command_result", "gpu_events", "network_report", "workload_exited", "workload_logs",
     "renew_certificate", "workload_progress", "tunnel_usage"}
)


class _ServerEnvelope(StrictModel):
    v: Literal[1] = PROTOCOL_VERSION


class Welcome(_ServerEnvelope):
    type: Literal["welcome"] = "welcome"
    body: WelcomeBody


class Ack(_ServerEnvelope):
    type: Literal["ack"] = "ack"
    body: AckBody


class Command(_ServerEnvelope):
    type: Literal["command"] = "command"
    body: CommandBody


class Move(_ServerEnvelope):
    type: Literal["move"] = "move"
    body: MoveBody


ServerMessage = Annotated[Welcome | Ack | Command | Move, Field(discriminator="type")]
SERVER_TYPES = frozenset({"welcome", "ack", "command", "move"})

_agent_adapter: TypeAdapter[AnyAgentMessage] = TypeAdapter(AgentMessage)
_server_adapter: TypeAdapter[Welcome | Ack | Command | Move] = TypeAdapter(ServerMessage)


def encode(message: BaseModel) -> str:
    """Serialise any envelope to the text of one frame."""
    return message.model_dump_json()


def _load_object(data: str | bytes, *, max_frame: int) -> dict[str, Any]:
    if len(data) > max_frame:
        raise ProtocolError(
            f"frame of {len(data)} bytes exceeds the {max_frame}-byte limit",
            code="frame_too_big",
            close_code=CLOSE_TOO_BIG,
        )
    # pydantic's parser (as the bus records use), not json.loads: deep nesting is a clean error at
    # 200 levels instead of a RecursionError, and text it accepts (no lone surrogates) is text
    # the relay can encode again for the bus.
    try:
        obj = pydantic_core.from_json(data.encode() if isinstance(data, str) else data)
    except ValueError as exc:  # UnicodeEncodeError too: a str holding lone surrogates
        raise ProtocolError(f"frame is not valid JSON: {exc}", code="bad_frame", close_code=CLOSE_BAD_FRAME) from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame must be a JSON object", code="bad_frame", close_code=CLOSE_BAD_FRAME)
    version = obj.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r:.40} is not supported; this side speaks v{PROTOCOL_VERSION}",
            code="unsupported_version",
            close_code=CLOSE_UNSUPPORTED_VERSION,
        )
    return obj


def _validate(adapter: TypeAdapter[Any], obj: dict[str, Any], known: frozenset[str]) -> Any:
    kind = obj.get("type")
    if not isinstance(kind, str) or kind not in known:  # a list or object is unhashable: never ``in`` a set
        raise ProtocolError(
            f"unknown message type {kind!r:.40}; expected one of {', '.join(sorted(known))}",
            code="unknown_type",
            close_code=CLOSE_UNKNOWN_TYPE,
        )
    try:
        return adapter.validate_python(obj)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_context=False, include_input=False)[0]
        where = ".".join(str(p) for p in first["loc"][1:]) or "frame"
        raise ProtocolError(  # the path may hold a field name the peer chose: bounded, as the relay logs it
            f"invalid {kind} message: {where:.200}: {first['msg']:.200} ({exc.error_count()} problem(s))",
            code="bad_frame",
            close_code=CLOSE_BAD_FRAME,
        ) from None


def decode_agent_frame(data: str | bytes, *, max_frame: int = DEFAULT_MAX_FRAME) -> AnyAgentMessage:
    """Parse and validate one agent → relay frame; raises ``ProtocolError`` with a close code."""
    message: AnyAgentMessage = _validate(
        _agent_adapter, _load_object(data, max_frame=max_frame), AGENT_TYPES
    )
    return message


def decode_server_frame(data: str | bytes, *, max_frame: int = DEFAULT_MAX_FRAME) -> Welcome | Ack | Command | Move:
    """Parse and validate one relay → agent frame."""
    message: Welcome | Ack | Command | Move = _validate(
        _server_adapter, _load_object(data, max_frame=max_frame), SERVER_TYPES
    )
    return message


class ClaimsHost(Protocol):
    """A decoded agent message: a model here, or the relay's msgspec report (``fastframe``)."""

    @property
    def host_id(self) -> str: ...


def check_identity(message: ClaimsHost, certified_host_id: str) -> None:
    """Refuse a message that claims a host other than the one its certificate names."""
    if message.host_id != certified_host_id:
        raise ProtocolError(
            f"message claims host {message.host_id!r} but the certificate is for {certified_host_id!r}",
            code="identity_mismatch",
            close_code=CLOSE_IDENTITY_MISMATCH,
        )
