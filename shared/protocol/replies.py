"""The agent's replies to commands (``shared.protocol.commands``): the ``data`` of a successful ``command_result``, one
model per command kind (``CommandReply``). Lenient: a newer agent may say more."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from shared.protocol.base import LenientModel
from shared.protocol.bodies import NetworkReportBody
from shared.protocol.volumes import VolumeCopied, VolumeCreated, VolumeDeleted


class WorkloadStarted(LenientModel):
    """``start_workload``: what runs (``already_running`` when it ran already), and its limits."""

    kind: Literal["hold", "process", "container"]
    pid: int | None = None
    already_running: bool | None = None
    limits: Literal["applied", "unavailable", "none requested"] | None = None
    limits_reason: str | None = None
    cpu_cores: float | None = None
    memory_mib: int | None = None
    pids_limit: int | None = None
    disk_gib: int | None = None
    disk_quota: str | None = None  # how the disk quota holds: "storage_opt", "loop" or "none"
    cgroups: list[str] | None = None
    systemd_unit: str | None = None
    ssh_host_key: str | None = None  # the rental's SSH host public key (OpenSSH form), pinned by renters' clients
    preempted: list[str] | None = None  # the rentals of ``StartWorkload.preempts`` it stopped before starting


class WorkloadStopped(LenientModel):
    """``stop_workload``: its exit code (``-N`` after signal N; none for a hold or when unknown)."""

    exit_code: int | None = None
    already_stopped: bool | None = None


class AccessUpdated(LenientModel):
    """``update_access``: whether the list was taken (false: the agent holds a newer ``version`` already), the
    version it holds now, whether the rental has an SSH server here yet (``known``: a list for a rental still
    starting is kept for its start), and how many open connections were closed because their key went."""

    applied: bool
    version: int
    known: bool = True
    closed: int = 0


class CertificateInstalled(LenientModel):
    """``install_certificate``: the serial (hex) and end of validity of the installed certificate."""

    serial: str
    not_after: str  # ISO 8601


class GpuHealthModel(LenientModel):
    uuid: str
    ok: bool
    problems: list[str] = Field(default_factory=list)


class HealthCheckResult(LenientModel):
    """``health_check``: ``healthy`` is the verdict (``ok`` only says the check could run)."""

    healthy: bool
    summary: str = ""
    problems: list[str] = Field(default_factory=list)
    gpus: list[GpuHealthModel] = Field(default_factory=list)

class PeerMeasurement(LenientModel):
    """What one member measured to a peer through the tunnel: round trip (median, ms), throughput
    (Mbit/s) and, where the agent measures it, packet loss (%; absent from older agents), or why it
    could not (``error``)."""

    rank: int
    rtt_ms: float | None = None
    mbit_s: float | None = None
    loss_pct: float | None = None
    error: str | None = None
    path: Literal["direct", "relay", "fabric"] | None = None  # how this member reaches the peer


class ClusterJoined(LenientModel):
    """``create_cluster``: the member's tunnel key, address and endpoints; with ``peers``, how many it has
    and (with ``measure``) what it measured."""

    public_key: str
    address: str
    listen_port: int
    endpoints: list[str] = Field(default_factory=list)
    relay_url: str | None = None  # where peers reach this member through the relays (its relay's wss://…/v1/connect)
    peers: int = 0
    measurements: list[PeerMeasurement] = Field(default_factory=list)
    tunnel: Literal["kernel", "wireguard-go"] | None = None  # the member's WireGuard (absent from older agents: wireguard-go)
    fabric_address: str | None = None  # the member's address on its host's fabric (None: not on one)


class ClusterLeft(LenientModel):
    """``delete_cluster``: whether there was a tunnel to take down."""

    deleted: bool


class PowerPolicyApplied(LenientModel):
    """``set_power_policy``: whether the window is open now, the GPUs lowered now (uuid → watts), those restored
    by this command, and those it left alone with why (busy, out of range, the driver refused: uuid → reason)."""

    off_peak: bool
    capped: dict[str, float] = Field(default_factory=dict)
    restored: list[str] = Field(default_factory=list)
    skipped: dict[str, str] = Field(default_factory=dict)


class ChallengeCommitted(LenientModel):
    """``start_challenge``: the program's commitment (per GPU uuid its Merkle root, or the reason it could not
    commit, e.g. ``memory_short``), as ``commitment.json`` holds it."""

    challenge_id: str
    commitment: dict[str, Any]


class ChallengeOpened(LenientModel):
    """``reveal_challenge``: the program's openings (per GPU uuid the opened rows with their Merkle proofs)."""

    challenge_id: str
    openings: dict[str, Any]


class ChallengeCancelled(LenientModel):
    """``cancel_challenge``: whether a run was stopped (false: none was running)."""

    challenge_id: str
    stopped: bool


class VolumeOpened(LenientModel):
    """``open_volume``: the volume's SSH host key (OpenSSH one-line form), the same at every open."""

    ssh_host_key: Annotated[str, Field(min_length=1, max_length=1024)]


CommandReply = (
    WorkloadStarted | WorkloadStopped | AccessUpdated | NetworkReportBody | CertificateInstalled | HealthCheckResult | ClusterJoined | ClusterLeft
    | PowerPolicyApplied | ChallengeCommitted | ChallengeOpened | ChallengeCancelled | VolumeCreated | VolumeDeleted
    | VolumeOpened | VolumeCopied
)
