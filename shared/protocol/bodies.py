"""The message bodies: what an agent reports (hello, heartbeat, telemetry, GPU events, network
reports, workload exits and logs, command results, certificate renewals) and what a relay
answers with (welcome, ack, move). The envelopes that carry them are in ``messages``."""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import Field

from shared.protocol.base import CommandId, HostId, LenientModel, ShortText, StrictModel, Timestamp
from shared.protocol.clusterpaths import ClusterNetworkFacts


class GpuMigInstanceModel(LenientModel):
    uuid: Annotated[str, Field(min_length=1, max_length=128)]
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    memory_total_mib: int | None = None
    name: ShortText | None = None
    profile: ShortText | int | None = None
    multiprocessor_count: int | None = None


class GpuInfoModel(LenientModel):
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


class GpuProcessModel(LenientModel):
    pid: int
    used_memory_mib: int | None = None


class GpuSampleModel(LenientModel):
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
    # The power limit the GPU enforces now (a power policy may have lowered it off-peak: docs/power.md).
    power_limit_w: float | None = None
    # Energy the host's power policy saved on this GPU, cumulative Wh since the agent began counting (docs/power.md);
    # None: the agent keeps no count (no policy ever applied to this GPU, or an older agent).
    energy_saved_wh: float | None = None


class GpuAggregateModel(LenientModel):
    """One GPU over the telemetry window (the agent samples every second, reports every ~10 s)."""

    uuid: Annotated[str, Field(min_length=1, max_length=128)]
    samples: int = Field(ge=0)
    gpu_util_avg: float | None = None
    gpu_util_max: float | None = None
    memory_used_max_mib: int | None = None
    temperature_max_c: float | None = None
    power_avg_w: float | None = None
    power_max_w: float | None = None


class GpuEventModel(LenientModel):
    uuid: Annotated[str, Field(min_length=1, max_length=128)]
    kind: ShortText  # "xid", "double_bit_ecc", "single_bit_ecc", ...
    code: int | None = None
    at: Timestamp


class ImagePolicyModel(LenientModel):
    """A provider's image policy: the registries or names allowed (empty: any) and the largest image."""

    allowed: list[Annotated[str, Field(max_length=256)]] = Field(default_factory=list, max_length=64)
    max_image_mib: int | None = Field(None, ge=1)


WorkloadKindName = Literal["container", "process", "hold"]


def _hold_only() -> list[WorkloadKindName]:
    return ["hold"]


class IsolationFacts(LenientModel):
    """How this host isolates renters' workloads, as the agent found it at start-up.

    ``kinds`` are the workload kinds it accepts (``hold`` always); ``isolated`` is true only where
    what it runs cannot reach the host, other rentals or private networks and the agent proved it at
    start (``network_guard``, ``network_check``), and no workload runs as the agent's own user
    (``allow_unisolated_workloads``): other hosts' offers say "not isolated" and renters can filter them out.
    """

    kinds: list[WorkloadKindName] = Field(default_factory=_hold_only)
    isolated: bool = True
    container_engine: Annotated[str, Field(max_length=256)] | None = None  # "docker 20.10.24"; None: none answers
    process_isolation: Literal["uid", "none"] = "none"  # "uid": each rental runs under a uid of its own
    reason: Annotated[str, Field(max_length=1024)] = ""  # why a kind is missing, in one line
    image_policy: ImagePolicyModel = Field(default_factory=ImagePolicyModel)
    # The most one workload may ask for here (the host's logical CPUs and RAM); None: not said.
    max_cpu_cores: float | None = Field(None, gt=0)
    max_memory_mib: int | None = Field(None, gt=0)
    # The rentals' network: the guard's rules in place (every rental in a namespace of its own behind
    # them), the private ranges the provider lets rentals reach (none by default), and the start-up
    # self-test's line. ``isolated`` is said only where the guard is in place and the test passed.
    network_guard: bool = False
    egress_allow: list[Annotated[str, Field(max_length=64)]] = Field(default_factory=list, max_length=64)
    network_check: Annotated[str, Field(max_length=512)] = ""
    # Every rental's ceilings (shared.ceilings): the host's pid_max, what its provider keeps for the host, and
    # how a rental's disk is bounded ("storage_opt": the engine's quota, "loop": a size-capped filesystem the
    # agent mounts, "none": unbounded) with the largest quota one rental may have. Absent from older agents.
    pid_max: int | None = Field(None, gt=0)
    reserved_cpu_cores: float = Field(0.0, ge=0)
    reserved_memory_mib: int = Field(0, ge=0)
    reserved_pids: int = Field(0, ge=0)
    reserved_disk_gib: int = Field(0, ge=0)
    disk_quota: Literal["storage_opt", "loop", "none"] | None = None
    max_disk_gib: int | None = Field(None, gt=0)
    rental_disk_gib: int | None = Field(None, gt=0)  # a rental's disk when it names none
    # Volumes (docs/volumes.md): whether this agent keeps renters' volumes (size-capped loop disks: root, mkfs.ext4,
    # loop devices), and why not where it does not. Absent (False) from agents older than volumes.
    volumes: bool = False
    volumes_unavailable: Annotated[str, Field(max_length=512)] = ""


class HelloBody(StrictModel):
    agent_version: ShortText
    gpu_backend: Literal["nvml", "sim", "replay"]
    region: ShortText | None = None
    host: dict[str, Any] = Field(default_factory=dict)
    gpus: list[GpuInfoModel] = Field(max_length=64)
    running_rentals: list[CommandId] = Field(default_factory=list, max_length=1024)
    isolation: IsolationFacts | None = None  # absent from agents older than container workloads
    cluster_network: ClusterNetworkFacts | None = None  # absent from agents older than the three paths


class SpoolStats(StrictModel):
    pending: int = Field(ge=0)
    evicted: dict[str, int] = Field(default_factory=dict)


class HeartbeatBody(StrictModel):
    uptime_s: float = Field(ge=0)
    running_rentals: list[CommandId] = Field(default_factory=list, max_length=1024)
    spool: SpoolStats | None = None


class TelemetryBody(StrictModel):
    """The latest sample of every GPU, plus aggregates over the window since the last report."""

    sampled_at: Timestamp
    gpus: list[GpuSampleModel] = Field(max_length=64)
    window_s: float | None = Field(None, ge=0)
    aggregates: list[GpuAggregateModel] = Field(default_factory=list, max_length=64)


class GpuEventsBody(StrictModel):
    """XID errors and ECC events, pushed as soon as the agent sees them."""

    events: list[GpuEventModel] = Field(min_length=1, max_length=256)


class NetworkReportBody(StrictModel):
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


DISK_QUOTA_EXCEEDED: Final = "disk_quota_exceeded"
"""A ``WorkloadExitedBody.reason``'s leading code: the agent stopped a container that wrote more than its disk quota
outside ``/workspace`` (``agent.runtimes.layerquota``); the failure is the renter's (``master.services.market.reliability``)."""


class WorkloadExitedBody(StrictModel):
    rental_id: CommandId
    exit_code: int | None = None
    at: Timestamp
    reason: Annotated[str, Field(max_length=1024)] = ""


class WorkloadProgressBody(StrictModel):
    """A step of a workload's start the renter should see as a rental event (an image pull's progress)."""

    rental_id: CommandId
    at: Timestamp
    stage: Literal["pulling", "pulled", "starting", "copying"]  # copying: a copy_volume's, rental_id the volume's id
    text: Annotated[str, Field(max_length=512)]
    percent: float | None = Field(None, ge=0, le=100)


class TunnelUsageItem(StrictModel):
    rental_id: CommandId
    bytes_in: int = Field(ge=0, le=1 << 62)  # from the renter to the rental
    bytes_out: int = Field(ge=0, le=1 << 62)  # from the rental to the renter
    # SSH keys that logged into the rental since the last report (SHA256 fingerprints, as ssh-keygen -lf prints them)
    keys_used: list[Annotated[str, Field(pattern=r"^SHA256:[A-Za-z0-9+/]{43}$")]] = Field(default_factory=list, max_length=50)


class TunnelUsageBody(StrictModel):
    """Bytes renters moved through the relays to and from each rental since the last report."""

    at: Timestamp
    rentals: list[TunnelUsageItem] = Field(min_length=1, max_length=1024)


class RenewCertificateBody(StrictModel):
    """A CSR for a new key of this host; answered with an ``install_certificate`` command."""

    csr: Annotated[str, Field(min_length=64, max_length=16384)]


MAX_LOG_CHUNK = 64 << 10


class WorkloadLogsBody(StrictModel):
    """Bytes ``[offset, offset + length)`` of a workload's output log, as text (UTF-8, invalid bytes replaced)."""

    rental_id: CommandId
    offset: int = Field(ge=0)
    length: int = Field(ge=0, le=MAX_LOG_CHUNK)
    data: Annotated[str, Field(max_length=MAX_LOG_CHUNK)]


class CommandResultBody(StrictModel):
    command_id: CommandId
    ok: bool
    detail: Annotated[str, Field(max_length=4096)] = ""
    data: dict[str, Any] = Field(default_factory=dict)
    finished_at: Timestamp


class WelcomeBody(StrictModel):
    relay_id: ShortText
    host_id: HostId
    heartbeat_interval: float = Field(gt=0)
    telemetry_interval: float = Field(gt=0)
    max_frame: int = Field(gt=0)
    # The relay's per-connection message budget: agents pace themselves (a replay after a long
    # outage included) to stay under it instead of being closed with 4004.
    max_messages_per_second: float | None = Field(None, gt=0)
    message_burst: int | None = Field(None, ge=1)
    # The largest DATA payload of a stream frame on this link, both ways (``shared.streams.agree_max_data``): said
    # only to an agent that offered one in its upgrade request; absent, protocol v1's 64 KiB.
    max_stream_data: int | None = Field(None, gt=0)


class AckBody(StrictModel):
    seq: int = Field(ge=0)


class MoveBody(StrictModel):
    reason: ShortText
    retry_after: float = Field(0.0, ge=0)
