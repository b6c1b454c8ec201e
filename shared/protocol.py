"""The gpumarket wire protocol, Sans-I/O: pure functions of bytes and state.

One websocket text frame carries one JSON object, an *envelope*::

    {"v": 1, "type": "telemetry", "host_id": "h-…", "seq": 42, "ts": "…Z", "body": {…}}

Agent → relay frames carry the sending host's id and a per-host sequence number
(strictly increasing, never reused, even across restarts). The relay acknowledges a
``seq`` only once the message is durably on the bus; the agent keeps every
unacknowledged message and replays it after reconnecting (``shared.outbound.OutboundWindow``).
Relay → agent frames (``welcome``, ``ack``, ``command``, ``move``) carry no seq.

Agent, relay, master and tests all encode and validate through this module; see
``docs/protocol.md`` for the full description. Nothing here does I/O.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import pydantic_core
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    model_serializer,
    model_validator,
)

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


# ---- commands: one model per kind, and one per reply ---------------------------------
#
# A command travels as ``{"command_id", "kind", "args"}`` (``CommandBody``); ``args`` is the
# command model without its ``kind``. The relay forwards the body as it is; the master builds
# it from a model (``CommandBody.of``) and the agent decodes it into one (``decode_command``),
# so an unknown kind or field is refused by this module on both ends.

RENTAL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # a folder, a cgroup, a unit and a container name
MILLI_PER_GPU = 1000  # a share's compute is counted in thousandths of one GPU
MIN_CPU_CORES = 0.01  # cpu.max refuses a quota under 1 ms per 100 ms period
MAX_CPU_CORES = 1024.0
MIN_MEMORY_MIB = 16  # less cannot even start a shell
MAX_MEMORY_MIB = 1 << 24  # 16 TiB
MAX_ARGV_BYTES = 128 << 10
MAX_ENV_VARS = 256
MAX_STOP_GRACE_S = 600.0  # the longest SIGTERM-to-SIGKILL grace a stop may ask for
MAX_STOP_REASON_CHARS = 200
RESERVED_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"})  # and every GPUMARKET_* name
SHARE_ENV = frozenset({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"})

_RENTAL_ID_RE = re.compile(RENTAL_ID_PATTERN)
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _rental_id(value: object) -> object:
    if not isinstance(value, str) or not _RENTAL_ID_RE.match(value):
        raise ValueError(f"rental id {value!r:.80} must be 1-64 letters, digits, '.', '_' or '-'")
    return value


def _gpu_uuids(value: object) -> object:
    if not isinstance(value, list) or not all(isinstance(u, str) for u in value):
        raise ValueError("gpu_uuids must be a list of GPU UUIDs")
    return value


def _argv(value: object) -> object:
    if not isinstance(value, list) or not value or not all(isinstance(a, str) and "\0" not in a for a in value):
        raise ValueError("a process workload needs 'argv', a non-empty list of strings")
    if sum(len(a.encode(errors="surrogatepass")) + 1 for a in value) > MAX_ARGV_BYTES:
        raise ValueError(f"'argv' is longer than {MAX_ARGV_BYTES} bytes; put the long part in a file")
    return value


def _env(value: object) -> object:
    if not isinstance(value, dict):
        raise ValueError("'env' must be an object of NAME: value")
    if len(value) > MAX_ENV_VARS:
        raise ValueError(f"'env' has more than {MAX_ENV_VARS} variables")
    for name, text in value.items():
        if not isinstance(name, str) or not _ENV_NAME_RE.match(name):
            raise ValueError(f"environment variable name {name!r:.80} is not a valid NAME")
        if name in RESERVED_ENV or name.startswith("GPUMARKET_"):
            raise ValueError(f"'env' may not set {name}: the agent sets it to the rental's GPUs")
        if not isinstance(text, str) or "\0" in text:
            raise ValueError(f"environment variable {name} must be a string")
    return value


def _cpu_cores(value: object) -> object:
    if value is not None and not (_is_number(value) and MIN_CPU_CORES <= value <= MAX_CPU_CORES):  # type: ignore[operator]
        raise ValueError(f"'cpu_cores' must be a number of cores from {MIN_CPU_CORES} to {MAX_CPU_CORES:g}, e.g. 2.0")
    return value


def _memory_mib(value: object) -> object:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not MIN_MEMORY_MIB <= value <= MAX_MEMORY_MIB):
        raise ValueError(f"'memory_mib' must be a whole number of MiB from {MIN_MEMORY_MIB} to {MAX_MEMORY_MIB}, e.g. 4096")
    return value


def _share_milli(value: object) -> object:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < MILLI_PER_GPU:
        raise ValueError(
            f"'share.milli' must be a whole number of thousandths of a GPU from 1 to {MILLI_PER_GPU - 1}, e.g. 250; "
            "for a whole GPU send no 'share'"
        )
    return value


def _share_memory(value: object) -> object:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_MEMORY_MIB:
        raise ValueError(f"'share.memory_mib' must be a whole number of MiB from 0 (no limit) to {MAX_MEMORY_MIB}, e.g. 8192")
    return value


def _grace(value: object) -> object:
    if value is not None and not (_is_number(value) and 0 <= value <= MAX_STOP_GRACE_S):  # type: ignore[operator]
        raise ValueError(f"the stop's grace must be a number of seconds from 0 to {MAX_STOP_GRACE_S:g}, not {value!r:.40}")
    return value


def _reason(value: object) -> object:
    if value is not None and (not isinstance(value, str) or len(value) > MAX_STOP_REASON_CHARS or _CONTROL_RE.search(value)):
        raise ValueError(f"the stop's reason must be one line of text of at most {MAX_STOP_REASON_CHARS} characters")
    return value


# Each check runs before pydantic's own (``BeforeValidator``) so that a refusal says what to
# write instead; the ``Field`` bounds are what the OpenAPI document shows.
RentalId = Annotated[str, Field(pattern=RENTAL_ID_PATTERN), BeforeValidator(_rental_id)]
GpuUuid = Annotated[str, Field(min_length=1, max_length=128)]
GpuUuids = Annotated[list[GpuUuid], BeforeValidator(_gpu_uuids)]
Argv = Annotated[list[str], Field(min_length=1, max_length=256, description="Program and arguments, run with the rented GPUs visible."), BeforeValidator(_argv)]
Env = Annotated[dict[str, str], Field(max_length=MAX_ENV_VARS), BeforeValidator(_env)]
CpuCores = Annotated[float, Field(ge=MIN_CPU_CORES, le=MAX_CPU_CORES), BeforeValidator(_cpu_cores)]
MemoryMib = Annotated[int, Field(ge=MIN_MEMORY_MIB, le=MAX_MEMORY_MIB), BeforeValidator(_memory_mib)]


class ProcessWorkload(_Strict):
    """Run ``argv`` on the host with the rented GPUs visible, optionally limited in CPU and memory."""

    kind: Literal["process"] = "process"
    argv: Argv
    env: Env = Field(default_factory=dict)
    cpu_cores: CpuCores | None = Field(None, description="CPU cores the workload may use (a cgroup quota), e.g. 2.0; none: unlimited.")
    memory_mib: MemoryMib | None = Field(None, description="Memory the workload may use, MiB; none: unlimited.")

    @model_serializer(mode="wrap")
    def _omit_unset_limits(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # No limit is no key: the stored and sent form of an unlimited workload stays {kind, argv, env}.
        data: dict[str, Any] = handler(self)
        for name in ("cpu_cores", "memory_mib"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


class HoldWorkload(_Strict):
    """Reserve the GPUs and run nothing."""

    kind: Literal["hold"] = "hold"


WorkloadSpec = Annotated[ProcessWorkload | HoldWorkload, Field(discriminator="kind")]
"""What a rental runs, tagged by ``kind`` (the "Isolated rentals" issue adds ``container``)."""


class GpuShare(_Strict):
    """A fractional share of one GPU: ``milli`` thousandths of its compute and ``memory_mib`` of
    its memory (``0``: no memory limit of its own)."""

    milli: Annotated[int, Field(ge=1, le=MILLI_PER_GPU - 1), BeforeValidator(_share_milli)]
    memory_mib: Annotated[int, Field(ge=0, le=MAX_MEMORY_MIB), BeforeValidator(_share_memory)]


def _default_hold(value: object) -> object:
    # An absent, null or kind-less workload has always meant "hold" to the agent.
    if value is None:
        return {"kind": "hold"}
    if isinstance(value, dict) and "kind" not in value:
        return {**value, "kind": "hold"}
    return value


class StartWorkload(_Strict):
    """Start the rental's workload on ``gpu_uuids`` (whole GPUs, or a ``share`` of exactly one)."""

    kind: Literal["start_workload"] = "start_workload"
    rental_id: RentalId
    gpu_uuids: GpuUuids = Field(max_length=64)
    workload: Annotated[WorkloadSpec, BeforeValidator(_default_hold)] = Field(default_factory=HoldWorkload)
    share: GpuShare | None = None

    @model_validator(mode="after")
    def _share_env_is_the_agents(self) -> StartWorkload:
        if self.share is not None and isinstance(self.workload, ProcessWorkload):
            overridden = sorted(SHARE_ENV & set(self.workload.env))
            if overridden:
                raise ValueError(f"'env' may not set {', '.join(overridden)}: the agent sets it from the rental's GPU share")
        return self


class StopWorkload(_Strict):
    """Stop the rental's workload: SIGTERM, then SIGKILL ``grace_s`` later (default: the agent's own);
    ``reason`` is written to its log first."""

    kind: Literal["stop_workload"] = "stop_workload"
    rental_id: RentalId
    grace_s: Annotated[float, Field(ge=0, le=MAX_STOP_GRACE_S), BeforeValidator(_grace)] | None = None
    reason: Annotated[str, Field(max_length=MAX_STOP_REASON_CHARS), BeforeValidator(_reason)] | None = None


class MeasureNetwork(_Strict):
    """Measure the network to the relay now; the result's ``data`` is the ``NetworkReportBody``."""

    kind: Literal["measure_network"] = "measure_network"


class InstallCertificate(_Strict):
    """Install a renewed certificate (for the key of the host's last ``renew_certificate``)."""

    kind: Literal["install_certificate"] = "install_certificate"
    certificate: Annotated[str, Field(min_length=64, max_length=65536)]
    ca_certificate: Annotated[str, Field(min_length=64, max_length=1 << 20)] | None = None


class HealthCheck(_Strict):
    """Check the GPUs the master expects on this host (and any others)."""

    kind: Literal["health_check"] = "health_check"
    gpu_uuids: GpuUuids = Field(default_factory=list, max_length=1024)


AnyCommand = StartWorkload | StopWorkload | MeasureNetwork | InstallCertificate | HealthCheck
AgentCommand = Annotated[AnyCommand, Field(discriminator="kind")]
COMMAND_KINDS = ("start_workload", "stop_workload", "measure_network", "install_certificate", "health_check")


# Replies: the ``data`` of a successful ``command_result``. Lenient: a newer agent may say more.


class WorkloadStarted(_Lenient):
    """``start_workload``: what runs (``already_running`` when it ran already), and its limits."""

    kind: Literal["hold", "process", "container"]
    pid: int | None = None
    already_running: bool | None = None
    limits: Literal["applied", "unavailable", "none requested"] | None = None
    limits_reason: str | None = None
    cpu_cores: float | None = None
    memory_mib: int | None = None
    cgroups: list[str] | None = None
    systemd_unit: str | None = None


class WorkloadStopped(_Lenient):
    """``stop_workload``: its exit code (``-N`` after signal N; none for a hold or when unknown)."""

    exit_code: int | None = None
    already_stopped: bool | None = None


class CertificateInstalled(_Lenient):
    """``install_certificate``: the serial (hex) and end of validity of the installed certificate."""

    serial: str
    not_after: str  # ISO 8601


class GpuHealthModel(_Lenient):
    uuid: str
    ok: bool
    problems: list[str] = Field(default_factory=list)


class HealthCheckResult(_Lenient):
    """``health_check``: ``healthy`` is the verdict (``ok`` only says the check could run)."""

    healthy: bool
    summary: str = ""
    problems: list[str] = Field(default_factory=list)
    gpus: list[GpuHealthModel] = Field(default_factory=list)


CommandReply = WorkloadStarted | WorkloadStopped | NetworkReportBody | CertificateInstalled | HealthCheckResult


class CommandBody(_Strict):
    """A command for the agent as it travels: ``kind`` and the command's fields as ``args``.

    Open on the wire so that a relay forwards any command; the master builds it with ``of`` and
    the agent reads it with ``decode_command``, which refuses an unknown kind or field.
    """

    command_id: CommandId
    kind: Annotated[str, Field(min_length=1, max_length=64)]
    args: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def of(cls, command_id: str, command: AnyCommand) -> CommandBody:
        return cls(command_id=command_id, kind=command.kind, args=command_args(command))


def command_args(command: AnyCommand) -> dict[str, Any]:
    """The ``args`` of a command on the wire (and in the master's ``commands`` table): no ``kind``, no unset option."""
    args: dict[str, Any] = command.model_dump(mode="json", exclude={"kind"}, exclude_none=True)
    return args


_command_adapter: TypeAdapter[AnyCommand] = TypeAdapter(AgentCommand)


def decode_command(body: CommandBody) -> AnyCommand:
    """The typed command of a ``command`` frame; raises ``ProtocolError`` (``unknown_command`` or
    ``bad_command``) saying what is wrong, which the agent reports as the command's failed result."""
    if body.kind not in COMMAND_KINDS:
        raise ProtocolError(
            f"unknown command kind {body.kind!r:.70}; expected one of {', '.join(sorted(COMMAND_KINDS))}", code="unknown_command"
        )
    if "kind" in body.args:
        raise ProtocolError(f"invalid {body.kind} command: args: 'kind' belongs to the command, not its args", code="bad_command")
    try:
        return _command_adapter.validate_python({**body.args, "kind": body.kind})
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_context=False, include_input=False)[0]
        where = ".".join(str(p) for p in first["loc"][1:]) or "args"
        raise ProtocolError(
            f"invalid {body.kind} command: {where:.200}: {first['msg']:.400} ({exc.error_count()} problem(s))", code="bad_command"
        ) from None


class MoveBody(_Strict):
    reason: ShortText
    retry_after: float = Field(0.0, ge=0)


# ---- envelopes ----------------------------------------------------------------------


class AgentEnvelope(_Strict):
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


class RenewCertificate(AgentEnvelope):
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
INGEST_GROUP = "master"
"""The consumer group in which every master process reads ``AGENT_EVENTS_STREAM``."""


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
