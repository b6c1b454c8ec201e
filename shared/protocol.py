"""The gpumarket wire protocol, Sans-I/O: pure functions of bytes and state.

One websocket text frame carries one JSON object, an *envelope*::

    {"v": 1, "type": "telemetry", "host_id": "h-…", "seq": 42, "ts": "…Z", "body": {…}}

Agent → relay frames carry the sending host's id and a per-host sequence number
(strictly increasing, never reused, even across restarts). The relay acknowledges a
``seq`` only once the message is durably on the bus; the agent keeps every
unacknowledged message and replays it after reconnecting (``OutboundWindow``).
Relay → agent frames (``welcome``, ``ack``, ``command``, ``move``) carry no seq.

Agent, relay, master and tests all encode and validate through this module; see
``docs/protocol.md`` for the full description. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, Protocol

import pydantic_core
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from shared.errors import ProtocolError

PROTOCOL_VERSION: Literal[1] = 1
DEFAULT_MAX_FRAME = 1 << 20

# Websocket close codes the relay uses, one table (4000–4999 are application codes).
CLOSE_GOING_AWAY = 1001  # relay shutting down: reconnect elsewhere
CLOSE_TOO_BIG = 1009  # frame larger than max_frame (sent by the websocket layer)
CLOSE_BAD_FRAME = 4000  # not JSON, or not a valid envelope/body
CLOSE_UNKNOWN_TYPE = 4001
CLOSE_UNSUPPORTED_VERSION = 4002
CLOSE_IDENTITY_MISMATCH = 4003  # message claims a host other than the certificate's
CLOSE_RATE_LIMITED = 4004
CLOSE_REVOKED = 4005
CLOSE_REPLACED = 4006  # a newer connection of the same host took over
CLOSE_SLOW_CONSUMER = 4007
CLOSE_BUS_UNAVAILABLE = 4008  # relay cannot reach the bus: try another relay
CLOSE_TOO_MANY_CONNECTIONS = 4009

CLOSE_CODES: dict[str, int] = {
    "bad_frame": CLOSE_BAD_FRAME,
    "unknown_type": CLOSE_UNKNOWN_TYPE,
    "unsupported_version": CLOSE_UNSUPPORTED_VERSION,
    "identity_mismatch": CLOSE_IDENTITY_MISMATCH,
    "rate_limited": CLOSE_RATE_LIMITED,
    "revoked": CLOSE_REVOKED,
    "replaced": CLOSE_REPLACED,
    "slow_consumer": CLOSE_SLOW_CONSUMER,
    "bus_unavailable": CLOSE_BUS_UNAVAILABLE,
    "frame_too_big": CLOSE_TOO_BIG,
    "too_many_connections": CLOSE_TOO_MANY_CONNECTIONS,
}

def _representable_in_utc(value: datetime) -> datetime:
    """Refuse a time that exists in its own offset but not in UTC (``9999-12-31T23:59:59-23:59``):
    every reader converts to UTC, and the conversion would raise ``OverflowError`` there."""
    if value.tzinfo is not None:
        try:
            value.astimezone(UTC)
        except OverflowError:
            raise ValueError("timestamp out of range once converted to UTC") from None
    return value


Timestamp = Annotated[datetime, AfterValidator(_representable_in_utc)]
HostId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
ShortText = Annotated[str, Field(max_length=256)]
CommandId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:-]+$")]


# NaN and Infinity travel as JSON constants (Python's json reads them) instead of turning into
# null on the relay, so the master can see, refuse and count an impossible reading.
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")


class _Lenient(BaseModel):
    """GPU and host records: newer agents may add fields; older masters keep what they know."""

    model_config = ConfigDict(extra="allow", frozen=True, ser_json_inf_nan="constants")


# ---- bodies -------------------------------------------------------------------------


class GpuMigInstanceModel(_Lenient):
    uuid: Annotated[str, Field(min_length=1, max_length=128)]
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    memory_total_mib: int | None = None
    name: ShortText | None = None
    profile: ShortText | int | None = None
    multiprocessor_count: int | None = None


class GpuInfoModel(_Lenient):
    index: int = Field(ge=0, le=255)
    uuid: Annotated[str, Field(min_length=1, max_length=128)]
    name: ShortText
    pci_bus_id: ShortText | None = None
    serial: ShortText | None = None
    memory_total_mib: int = Field(ge=0, le=1 << 24)
    compute_capability: ShortText | None = None
    driver_version: ShortText | None = None
    cuda_driver_version: ShortText | None = None
    power_limit_w: float | None = None
    max_sm_clock_mhz: int | None = None
    max_mem_clock_mhz: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_max: int | None = None
    mig_mode: bool | None = None
    power_limit_default_w: float | None = None
    power_limit_min_w: float | None = None
    power_limit_max_w: float | None = None
    mig_instances: list[GpuMigInstanceModel] = Field(default_factory=list, max_length=64)


class GpuProcessModel(_Lenient):
    pid: int
    used_memory_mib: int | None = None


class GpuSampleModel(_Lenient):
    index: int = Field(ge=0, le=255)
    uuid: Annotated[str, Field(min_length=1, max_length=128)]
    gpu_util_pct: float | None = None
    mem_util_pct: float | None = None
    memory_used_mib: int | None = None
    memory_free_mib: int | None = None
    temperature_c: float | None = None
    power_draw_w: float | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    fan_pct: float | None = None
    pcie_tx_kbps: int | None = None
    pcie_rx_kbps: int | None = None
    ecc_volatile_uncorrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    pcie_gen_current: int | None = None
    pcie_width_current: int | None = None
    throttle_reasons: list[ShortText] | None = Field(None, max_length=64)  # [] = not throttled; None = cannot tell
    retired_pages_single_bit: int | None = None
    retired_pages_double_bit: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    processes: list[GpuProcessModel] = Field(default_factory=list, max_length=1024)


class GpuAggregateModel(_Lenient):
    """One GPU over the telemetry window (the agent samples every second, reports every ~10 s)."""

    uuid: Annotated[str, Field(min_length=1, max_length=128)]
    samples: int = Field(ge=0)
    gpu_util_avg: float | None = None
    gpu_util_max: float | None = None
    memory_used_max_mib: int | None = None
    temperature_max_c: float | None = None
    power_avg_w: float | None = None
    power_max_w: float | None = None


class GpuEventModel(_Lenient):
    uuid: Annotated[str, Field(min_length=1, max_length=128)]
    kind: ShortText  # "xid", "double_bit_ecc", "single_bit_ecc", ...
    code: int | None = None
    at: Timestamp


class HelloBody(_Strict):
    agent_version: ShortText
    gpu_backend: Literal["nvml", "sim", "replay"]
    region: ShortText | None = None
    host: dict[str, Any] = Field(default_factory=dict)
    gpus: list[GpuInfoModel] = Field(max_length=64)
    running_rentals: list[CommandId] = Field(default_factory=list, max_length=1024)


class SpoolStats(_Strict):
    pending: int = Field(ge=0)
    evicted: dict[str, int] = Field(default_factory=dict)


class HeartbeatBody(_Strict):
    uptime_s: float = Field(ge=0)
    running_rentals: list[CommandId] = Field(default_factory=list, max_length=1024)
    spool: SpoolStats | None = None


class TelemetryBody(_Strict):
    """The latest sample of every GPU, plus aggregates over the window since the last report."""

    sampled_at: Timestamp
    gpus: list[GpuSampleModel] = Field(max_length=64)
    window_s: float | None = Field(None, ge=0)
    aggregates: list[GpuAggregateModel] = Field(default_factory=list, max_length=64)


class GpuEventsBody(_Strict):
    """XID errors and ECC events, pushed as soon as the agent sees them."""

    events: list[GpuEventModel] = Field(min_length=1, max_length=256)


class NetworkReportBody(_Strict):
    relay_url: Annotated[str, Field(max_length=512)]
    measured_at: Timestamp
    download_mbps: float | None = Field(None, ge=0)
    upload_mbps: float | None = Field(None, ge=0)
    download_bytes: int = Field(0, ge=0)
    upload_bytes: int = Field(0, ge=0)
    latency_ms: float | None = Field(None, ge=0)
    min_rtt_ms: float | None = Field(None, ge=0)
    max_rtt_ms: float | None = Field(None, ge=0)
    jitter_ms: float | None = Field(None, ge=0)
    jitter_rfc3550_ms: float | None = Field(None, ge=0)
    loss: float = Field(ge=0, le=1)
    probes_sent: int = Field(ge=0)
    probes_answered: int = Field(ge=0)
    duration_s: float = Field(ge=0)
    error: Annotated[str, Field(max_length=1024)] | None = None


class WorkloadExitedBody(_Strict):
    rental_id: CommandId
    exit_code: int | None = None
    at: Timestamp
    reason: Annotated[str, Field(max_length=1024)] = ""


class RenewCertificateBody(_Strict):
    """A CSR for a new key of this host; answered with an ``install_certificate`` command."""

    csr: Annotated[str, Field(min_length=64, max_length=16384)]


MAX_LOG_CHUNK = 64 << 10


class WorkloadLogsBody(_Strict):
    """Bytes ``[offset, offset + length)`` of a workload's output log, as text (UTF-8, invalid bytes replaced)."""

    rental_id: CommandId
    offset: int = Field(ge=0)
    length: int = Field(ge=0, le=MAX_LOG_CHUNK)
    data: Annotated[str, Field(max_length=MAX_LOG_CHUNK)]


class CommandResultBody(_Strict):
    command_id: CommandId
    ok: bool
    detail: Annotated[str, Field(max_length=4096)] = ""
    data: dict[str, Any] = Field(default_factory=dict)
    finished_at: Timestamp


class WelcomeBody(_Strict):
    relay_id: ShortText
    host_id: HostId
    heartbeat_interval: float = Field(gt=0)
    telemetry_interval: float = Field(gt=0)
    max_frame: int = Field(gt=0)
    # The relay's per-connection message budget: agents pace themselves (a replay after a long
    # outage included) to stay under it instead of being closed with 4004.
    max_messages_per_second: float | None = Field(None, gt=0)
    message_burst: int | None = Field(None, ge=1)


class AckBody(_Strict):
    seq: int = Field(ge=0)


COMMAND_KINDS = ("start_workload", "stop_workload", "measure_network", "install_certificate", "health_check")


class CommandBody(_Strict):
    """A command for the agent. ``kind`` is open on the wire: an agent answers a kind it does
    not know with a failed result naming the kinds it supports (``COMMAND_KINDS``)."""

    command_id: CommandId
    kind: Annotated[str, Field(min_length=1, max_length=64)]
    args: dict[str, Any] = Field(default_factory=dict)


class MoveBody(_Strict):
    reason: ShortText
    retry_after: float = Field(0.0, ge=0)


# ---- envelopes ----------------------------------------------------------------------


class _AgentEnvelope(_Strict):
    v: Literal[1] = PROTOCOL_VERSION
    host_id: HostId
    seq: int = Field(ge=0, lt=1 << 63)
    ts: Timestamp


class Hello(_AgentEnvelope):
    type: Literal["hello"] = "hello"
    body: HelloBody


class Heartbeat(_AgentEnvelope):
    type: Literal["heartbeat"] = "heartbeat"
    body: HeartbeatBody


class Telemetry(_AgentEnvelope):
    type: Literal["telemetry"] = "telemetry"
    body: TelemetryBody


class CommandResult(_AgentEnvelope):
    type: Literal["command_result"] = "command_result"
    body: CommandResultBody


class GpuEvents(_AgentEnvelope):
    type: Literal["gpu_events"] = "gpu_events"
    body: GpuEventsBody


class NetworkReport(_AgentEnvelope):
    type: Literal["network_report"] = "network_report"
    body: NetworkReportBody


class WorkloadExited(_AgentEnvelope):
    type: Literal["workload_exited"] = "workload_exited"
    body: WorkloadExitedBody


class WorkloadLogs(_AgentEnvelope):
    type: Literal["workload_logs"] = "workload_logs"
    body: WorkloadLogsBody


class RenewCertificate(_AgentEnvelope):
    type: Literal["renew_certificate"] = "renew_certificate"
    body: RenewCertificateBody


AnyAgentMessage = (
    Hello | Heartbeat | Telemetry | CommandResult | GpuEvents | NetworkReport | WorkloadExited | WorkloadLogs | RenewCertificate
)
AgentMessage = Annotated[AnyAgentMessage, Field(discriminator="type")]
AGENT_TYPES = frozenset(
    {"hello", "heartbeat", "telemetry", "command_result", "gpu_events", "network_report", "workload_exited", "workload_logs",
     "renew_certificate"}
)


class _ServerEnvelope(_Strict):
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


def check_identity(message: AnyAgentMessage, certified_host_id: str) -> None:
    """Refuse a message that claims a host other than the one its certificate names."""
    if message.host_id != certified_host_id:
        raise ProtocolError(
            f"message claims host {message.host_id!r} but the certificate is for {certified_host_id!r}",
            code="identity_mismatch",
            close_code=CLOSE_IDENTITY_MISMATCH,
        )


# ---- relay ⇄ master bus records -------------------------------------------------------

AGENT_EVENTS_STREAM = "agent-events"


def commands_stream(relay_id: str) -> str:
    """The bus stream a relay reads the master's commands for its agents from."""
    return f"commands:{relay_id}"


class BusEnvelope(_Strict):
    """What the relay puts on the bus for each agent message: the message plus provenance."""

    relay_id: ShortText
    received_at: Timestamp
    message: AgentMessage


class CommandDelivery(_Strict):
    """What the master puts on a relay's command stream."""

    host_id: HostId
    command: Command


_bus_adapter = TypeAdapter(BusEnvelope)


def encode_bus_envelope(relay_id: str, message: AnyAgentMessage, received_at: datetime) -> bytes:
    return BusEnvelope(relay_id=relay_id, received_at=received_at, message=message).model_dump_json().encode()


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


# ---- agent-side state: sequence numbers and the unacknowledged window -----------------


class FrameStore(Protocol):
    """Where the window keeps unacknowledged frames (in memory, or the agent's on-disk spool).

    A store is bounded; when full it evicts the oldest *evictable* frames (heartbeats,
    then telemetry) and counts them. Other kinds are never evicted.
    """

    def add(self, seq: int, kind: str, frame: str) -> None: ...
    def ack(self, seq: int) -> bool: ...
    def discard_kind(self, kind: str) -> int: ...
    def pending(self) -> Iterator[tuple[int, str]]: ...
    def __len__(self) -> int: ...
    @property
    def evicted(self) -> dict[str, int]: ...


# Kinds a full store may evict, in eviction order. Everything else is kept.
EVICTABLE = ("heartbeat", "telemetry")


class MemoryStore:
    """An in-memory ``FrameStore`` (tests, tools); the agent uses ``agent.spool.SqliteSpool``."""

    def __init__(self, *, max_messages: int = 10_000) -> None:
        self.max_messages = max_messages
        self._frames: dict[int, tuple[str, str]] = {}
        self._evicted: dict[str, int] = {}

    def add(self, seq: int, kind: str, frame: str) -> None:
        while len(self._frames) >= self.max_messages and self._evict_one():
            pass
        self._frames[seq] = (kind, frame)

    def _evict_one(self) -> bool:
        for kind in EVICTABLE:
            for seq in sorted(self._frames):
                if self._frames[seq][0] == kind:
                    del self._frames[seq]
                    self._evicted[kind] = self._evicted.get(kind, 0) + 1
                    return True
        return False

    def ack(self, seq: int) -> bool:
        return self._frames.pop(seq, None) is not None

    def discard_kind(self, kind: str) -> int:
        doomed = [s for s, (k, _) in self._frames.items() if k == kind]
        for seq in doomed:
            del self._frames[seq]
        return len(doomed)

    def pending(self) -> Iterator[tuple[int, str]]:
        return iter([(s, self._frames[s][1]) for s in sorted(self._frames)])

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def evicted(self) -> dict[str, int]:
        return dict(self._evicted)


class OutboundWindow:
    """Sequence numbering and the store of sent-but-unacknowledged messages of one host.

    ``next_seq`` starts where the persisted lease says (see ``agent.state``), so a
    restarted agent never reuses a number. Messages stay in ``store`` until
    acknowledged; ``pending()`` yields them in sequence order for replay after a
    reconnect. A new hello supersedes unacknowledged older ones (they would replay
    stale facts after the new one).
    """

    def __init__(self, host_id: str, *, first_seq: int, store: FrameStore | None = None) -> None:
        self.host_id = host_id
        self.next_seq = first_seq
        self.store: FrameStore = store if store is not None else MemoryStore()

    def __len__(self) -> int:
        return len(self.store)

    def _envelope(self, cls: type[_AgentEnvelope], body: BaseModel, ts: datetime | None) -> tuple[int, str]:
        seq = self.next_seq
        self.next_seq += 1
        message = cls(host_id=self.host_id, seq=seq, ts=ts or datetime.now(UTC), body=body)  # type: ignore[call-arg]
        frame = encode(message)
        self.store.add(seq, str(cls.model_fields["type"].default), frame)
        return seq, frame

    def hello(self, body: HelloBody, ts: datetime | None = None) -> tuple[int, str]:
        self.store.discard_kind("hello")
        return self._envelope(Hello, body, ts)

    def heartbeat(self, body: HeartbeatBody, ts: datetime | None = None) -> tuple[int, str]:
        return self._envelope(Heartbeat, body, ts)

    def telemetry(self, body: TelemetryBody, ts: datetime | None = None) -> tuple[int, str]:
        return self._envelope(Telemetry, body, ts)

    def command_result(self, body: CommandResultBody, ts: datetime | None = None) -> tuple[int, str]:
        return self._envelope(CommandResult, body, ts)

    def gpu_events(self, body: GpuEventsBody, ts: datetime | None = None) -> tuple[int, str]:
        return self._envelope(GpuEvents, body, ts)

    def network_report(self, body: NetworkReportBody, ts: datetime | None = None) -> tuple[int, str]:
        return self._envelope(NetworkReport, body, ts)

    def workload_exited(self, body: WorkloadExitedBody, ts: datetime | None = None) -> tuple[int, str]:
        return self._envelope(WorkloadExited, body, ts)

    def workload_logs(self, body: WorkloadLogsBody, ts: datetime | None = None) -> tuple[int, str]:
        return self._envelope(WorkloadLogs, body, ts)

    def renew_certificate(self, body: RenewCertificateBody, ts: datetime | None = None) -> tuple[int, str]:
        return self._envelope(RenewCertificate, body, ts)

    def ack(self, seq: int) -> bool:
        """Forget an acknowledged message; returns whether it was outstanding."""
        return self.store.ack(seq)

    def pending(self) -> Iterator[tuple[int, str]]:
        """Unacknowledged frames in sequence order (a snapshot; safe to ack while iterating)."""
        return iter(list(self.store.pending()))
