"""The typed commands to an agent: one model per kind (their replies: ``shared.protocol.replies``), their bounds, and the
``CommandBody`` they travel in. What a ``start_workload`` runs (the workload specs, their ceilings, the rental id and
GPU field types) is ``shared.protocol.workloads``; the volume commands are ``shared.protocol.volumes``.

A command travels as ``{"command_id", "kind", "args"}`` (``CommandBody``); ``args`` is the
command model without its ``kind``. The relay forwards the body as it is; the master builds
it from a model (``CommandBody.of``) and the agent decodes it into one (``decode_command``),
so an unknown kind or field is refused by this module on both ends.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Annotated, Any, Final, Literal

from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError, model_validator

from shared.errors import ProtocolError
from shared.protocol.base import CommandId, StrictModel, Timestamp
from shared.protocol.clusterpaths import MAX_RDMA_DEVICES, FabricJoin, IPv4Text, RdmaDevice
from shared.protocol.volumes import (
    MAX_VOLUMES_PER_RENTAL,
    CopyVolume,
    CreateVolume,
    DeleteVolume,
    VolumeId,
    VolumeMount,
)
from shared.protocol.workloads import (
    SHARE_ENV,
    ContainerWorkload,
    GpuShare,
    GpuUuid,
    GpuUuids,
    HoldWorkload,
    ProcessWorkload,
    RentalId,
    WorkloadSpec,
    is_number,
)

MAX_STOP_GRACE_S = 600.0  # the longest SIGTERM-to-SIGKILL grace a stop may ask for
MAX_STOP_REASON_CHARS = 200
MAX_AUTHORIZED_KEYS = 50  # SSH public keys one rental accepts (= the API's most per account)
MAX_AUTHORIZED_KEY_CHARS = 16 * 1024  # one OpenSSH public key line (RSA-16384 fits)
MAX_ACCESS_VERSION = (1 << 63) - 1  # an account's access version is a BIGINT counter

_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def _grace(value: object) -> object:
    if value is not None and not (is_number(value) and 0 <= value <= MAX_STOP_GRACE_S):  # type: ignore[operator]
        raise ValueError(f"the stop's grace must be a number of seconds from 0 to {MAX_STOP_GRACE_S:g}, not {value!r:.40}")
    return value


def _reason(value: object) -> object:
    if value is not None and (not isinstance(value, str) or len(value) > MAX_STOP_REASON_CHARS or _CONTROL_RE.search(value)):
        raise ValueError(f"the stop's reason must be one line of text of at most {MAX_STOP_REASON_CHARS} characters")
    return value

AuthorizedKeys = list[Annotated[str, Field(min_length=1, max_length=MAX_AUTHORIZED_KEY_CHARS)]]
AccessVersion = Annotated[int, Field(ge=0, le=MAX_ACCESS_VERSION)]


def _default_hold(value: object) -> object:
    # An absent, null or kind-less workload has always meant "hold" to the agent.
    if value is None:
        return {"kind": "hold"}
    if isinstance(value, dict) and "kind" not in value:
        return {**value, "kind": "hold"}
    return value


MAX_REGISTRY_SECRET_CHARS = 4096  # a password or token (a cloud registry's can run to a few KiB)
# A sealed ``RegistryAuth`` (``shared.crypto.sealed_to``: ``ecies:v1:<point>:<nonce>:<ciphertext>``): its JSON of
# at most ~5 KiB, in base64, with the point and the nonce.
MAX_SEALED_REGISTRY_AUTH_CHARS = 8192
SEALED_TOKEN_PATTERN: Final = r"^ecies:v1:[A-Za-z0-9_-]+:[A-Za-z0-9_-]+:[A-Za-z0-9_-]+$"  # = shared.crypto.sealed_to's


class RegistryAuth(StrictModel):
    """A login to the registry of a container workload's image, for that pull only (never stored by the agent, never
    logged: ``password`` is left out of every repr). It never crosses the wire as is: the master seals its JSON to the
    host's certificate key (``StartWorkload.sealed_registry_auth``) as it sends the start; the command's row never
    holds it (docs/accounts.md, Private registries)."""

    server: str = Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9.\-]+(:[0-9]{1,5})?$")
    username: str = Field(min_length=1, max_length=255, pattern=r"^[^\x00-\x1f\x7f]+$")
    password: str = Field(min_length=1, max_length=MAX_REGISTRY_SECRET_CHARS, pattern=r"^[^\x00-\x1f\x7f]+$", repr=False)


SealedRegistryAuth = Annotated[str, Field(min_length=1, max_length=MAX_SEALED_REGISTRY_AUTH_CHARS, pattern=SEALED_TOKEN_PATTERN)]


def registry_auth_context(host_id: str, command_id: str) -> str:
    """What a start's sealed registry login is bound to: its host and its command (a token copied into another
    host's or another command's delivery does not open)."""
    return f"registry_auth:{host_id}:{command_id}"


class Preemption(StrictModel):
    """A rental whose workload a ``start_workload`` stops before it starts (``StartWorkload.preempts``)."""

    rental_id: RentalId
    grace_s: Annotated[float, Field(ge=0, le=MAX_STOP_GRACE_S), BeforeValidator(_grace)] | None = None
    reason: Annotated[str, Field(max_length=MAX_STOP_REASON_CHARS), BeforeValidator(_reason)] | None = None


MAX_PREEMPTIONS = 64  # rentals one start may preempt (a host has at most 64 GPUs, each with at most a few shares)


class StartWorkload(StrictModel):
    """Start the rental's workload on ``gpu_uuids`` (whole GPUs, or a ``share`` of exactly one).

    ``preempts``: rentals whose GPUs this one takes. The agent first does everything that can fail
    without touching them (the GPUs' check, the image's pull), then stops each (as a ``stop_workload``
    with its grace and reason would), then starts this one; the reply, or the failed result's
    ``data``, lists in ``preempted`` the ones it stopped. A failure before that stops none of them.
    An agent older than this field refuses the command (``bad_command``) and so touches nothing.
    """

    kind: Literal["start_workload"] = "start_workload"
    rental_id: RentalId
    gpu_uuids: GpuUuids = Field(max_length=64)
    workload: Annotated[WorkloadSpec, BeforeValidator(_default_hold)] = Field(default_factory=HoldWorkload)
    share: GpuShare | None = None
    # The renter's SSH public keys (OpenSSH one-line form) when the command was (last) written: the agent's
    # SSH server for this rental accepts these and nothing else, until an ``update_access`` replaces them.
    authorized_keys: AuthorizedKeys = Field(default_factory=list, max_length=MAX_AUTHORIZED_KEYS)
    # The account's access version those keys are of (``UpdateAccess.version``); the agent keeps a newer list
    # it already holds. None: a master from before live access (the keys are taken as they come).
    access_version: AccessVersion | None = None
    # The registry login for a container workload's image pull: a ``RegistryAuth``'s JSON sealed to the host's
    # certificate key under ``registry_auth_context`` (only the agent opens it, at pull time); none: the pull is
    # anonymous. Only a sealed token is accepted here, never a login in the clear.
    sealed_registry_auth: SealedRegistryAuth | None = Field(None, repr=False)
    preempts: list[Preemption] | None = Field(None, max_length=MAX_PREEMPTIONS)
    # The renter's volumes its container mounts (docs/volumes.md); none: an agent older than volumes refuses nothing.
    volumes: list[VolumeMount] | None = Field(None, max_length=MAX_VOLUMES_PER_RENTAL)
    # A cluster member on its host's trusted fabric, whose provider lets RDMA through (``FabricDeclaration.rdma``): the
    # host's RDMA devices, passed into the container (docs/clusters.md, "Three paths"). None: none.
    rdma_devices: list[RdmaDevice] | None = Field(None, max_length=MAX_RDMA_DEVICES)

    @model_validator(mode="after")
    def _volumes_need_a_container(self) -> StartWorkload:
        if self.volumes and not isinstance(self.workload, ContainerWorkload):
            raise ValueError("volumes are mounted into a container workload only")
        mounts = [v.mount for v in self.volumes or ()]
        if len(set(mounts)) != len(mounts) or len({v.volume_id for v in self.volumes or ()}) != len(mounts):
            raise ValueError("each volume is mounted once, each at a mount point of its own")
        return self

    @model_validator(mode="after")
    def _share_env_is_the_agents(self) -> StartWorkload:
        if self.share is not None and isinstance(self.workload, ProcessWorkload | ContainerWorkload):
            overridden = sorted(SHARE_ENV & set(self.workload.env))
            if overridden:
                raise ValueError(f"'env' may not set {', '.join(overridden)}: the agent sets it from the rental's GPU share")
        return self


RELEASED: Final = "released"  # a stop's reason when an ended rental's kept /workspace is released


class StopWorkload(StrictModel):
    """Stop the rental's workload: SIGTERM, then SIGKILL ``grace_s`` later (default: the agent's own);
    ``reason`` is written to its log first."""

    kind: Literal["stop_workload"] = "stop_workload"
    rental_id: RentalId
    grace_s: Annotated[float, Field(ge=0, le=MAX_STOP_GRACE_S), BeforeValidator(_grace)] | None = None
    reason: Annotated[str, Field(max_length=MAX_STOP_REASON_CHARS), BeforeValidator(_reason)] | None = None


class UpdateAccess(StrictModel):
    """The rental's SSH keys are now ``authorized_keys``, the whole list (empty: nobody, as for a disabled account),
    as of the account's access ``version``. The agent stores them, refuses new logins with any other key at once
    and closes the open connections that logged in with a key no longer listed. A ``version`` older than the one
    the agent holds for the rental changes nothing (commands may arrive out of order), so resending is safe."""

    kind: Literal["update_access"] = "update_access"
    rental_id: RentalId
    authorized_keys: AuthorizedKeys = Field(default_factory=list, max_length=MAX_AUTHORIZED_KEYS)
    version: AccessVersion
    # The account is disabled: every stream of the rental (SSH, TCP and web ports) is closed and new ones are
    # refused until a newer version enables it again.
    disabled: bool = False


class OpenVolume(StrictModel):
    """Serve the volume's files to its renter without a rental (docs/volumes.md, "Data in and out"): an SSH server
    for ``volume_id`` that takes ``authorized_keys`` (as of the account's access ``version``, the same rule as
    ``UpdateAccess``, which keeps the list live afterwards) and serves SFTP and rsync jailed in the volume, no shell.
    Idempotent: the reply names the volume's SSH host key, made once and kept (the renter's client pins it)."""

    kind: Literal["open_volume"] = "open_volume"
    volume_id: VolumeId
    authorized_keys: AuthorizedKeys = Field(default_factory=list, max_length=MAX_AUTHORIZED_KEYS)
    version: AccessVersion


class MeasureNetwork(StrictModel):
    """Measure the network to the relay now; the result's ``data`` is the ``NetworkReportBody``."""

    kind: Literal["measure_network"] = "measure_network"


class InstallCertificate(StrictModel):
    """Install a renewed certificate (for the key of the host's last ``renew_certificate``)."""

    kind: Literal["install_certificate"] = "install_certificate"
    certificate: Annotated[str, Field(min_length=64, max_length=65536)]
    ca_certificate: Annotated[str, Field(min_length=64, max_length=1 << 20)] | None = None


class HealthCheck(StrictModel):
    """Check the GPUs the master expects on this host (and any others)."""

    kind: Literal["health_check"] = "health_check"
    gpu_uuids: GpuUuids = Field(default_factory=list, max_length=1024)


# ---- a cluster's private network (docs/clusters.md, "The private network") ----------------------

MAX_CLUSTER_NODES = 64
CLUSTER_ID_PATTERN = r"^c-[A-Za-z0-9_-]{1,61}$"
WIREGUARD_KEY_PATTERN = (
    r"^[A-Za-z0-9+/]{42}[AEIMQUYcgkosw048]=$"  # 32 bytes, base64: what ``wg pubkey`` prints
)
CLUSTER_SUPERNET = ipaddress.IPv4Network("10.64.0.0/10")  # each cluster's /24 lies in it
_ENDPOINT_RE = re.compile(r"^(?P<host>[0-9.]{7,15}|\[[0-9A-Fa-f:.]{2,45}\]):(?P<port>[0-9]{1,5})$")


def _cluster_subnet(value: object) -> object:
    try:
        network = ipaddress.IPv4Network(value)
    except (ValueError, TypeError):
        raise ValueError(f"'subnet' {value!r:.40} must be an IPv4 /24 like 10.70.12.0/24") from None
    if network.prefixlen != 24 or not network.subnet_of(CLUSTER_SUPERNET):
        raise ValueError(f"'subnet' {value!r:.40} must be a /24 inside {CLUSTER_SUPERNET}")
    return value


def _endpoint(value: object) -> object:
    found = _ENDPOINT_RE.fullmatch(value) if isinstance(value, str) else None
    if found is None or not 1 <= int(found["port"]) <= 65535:
        raise ValueError(
            f"endpoint {value!r:.60} must be ADDRESS:PORT, e.g. 203.0.113.7:51820 or [2001:db8::7]:51820"
        )
    ipaddress.ip_address(found["host"].strip("[]"))  # a ValueError names the bad address
    return value


ClusterId = Annotated[str, Field(pattern=CLUSTER_ID_PATTERN)]
NodeRank = Annotated[int, Field(ge=0, lt=MAX_CLUSTER_NODES)]
WireguardKey = Annotated[
    str, Field(pattern=WIREGUARD_KEY_PATTERN, description="A WireGuard public key (base64 of 32 bytes).")
]
Endpoint = Annotated[str, Field(max_length=64), BeforeValidator(_endpoint)]


class ClusterPeer(StrictModel):
    """Another member of the cluster: its rank (its address is the subnet's ``rank + 1``), its key and
    where its agent's tunnel listens (``None``: no direct path known)."""

    rank: NodeRank
    public_key: WireguardKey
    endpoint: Endpoint | None = None
    # The way through the relays when no direct path works: the peer's relay (its ``wss://…/v1/connect``) and a
    # token for a ``wg`` stream to the peer member (signed by the master, as renters' connect tokens are).
    relay_url: Annotated[str, Field(min_length=8, max_length=512, pattern=r"^wss://[^\s]+$")] | None = None
    relay_token: Annotated[str, Field(min_length=16, max_length=4096, pattern=r"^[A-Za-z0-9._-]+$")] | None = None
    # The pair's path is the trusted fabric (both hosts one provider's, on the same declared fabric): the peer's
    # address on it, through which this member reaches the peer's cluster address (``None``: the tunnel).
    fabric_address: IPv4Text | None = None


class CreateCluster(StrictModel):
    """Join the member ``rental_id`` (a running container) to its cluster's private network as ``node-<rank>``.

    The first command for a member has no ``peers``: the agent makes the member's tunnel (a key pair,
    an interface inside the container with the subnet's address ``rank + 1``, ``node-N`` names in its
    ``/etc/hosts``) and answers its public key and endpoints. Once every member has answered, the
    master sends each one again with every other member as ``peers``: the agent sets them (replacing
    any earlier set) and, with ``measure``, measures round trip and throughput to each peer of a higher
    rank. Idempotent: the same request twice changes nothing more.
    """

    kind: Literal["create_cluster"] = "create_cluster"
    cluster_id: ClusterId
    rental_id: RentalId
    rank: NodeRank
    node_count: Annotated[int, Field(ge=2, le=MAX_CLUSTER_NODES)]
    subnet: Annotated[str, Field(max_length=18), BeforeValidator(_cluster_subnet)]
    peers: list[ClusterPeer] = Field(default_factory=list, max_length=MAX_CLUSTER_NODES - 1)
    measure: bool = False
    fabric: FabricJoin | None = None  # the member's interface on its host's declared fabric (``None``: none)

    @model_validator(mode="after")
    def _ranks(self) -> CreateCluster:
        ranks = [peer.rank for peer in self.peers]
        if self.rank >= self.node_count or any(r >= self.node_count for r in ranks):
            raise ValueError(f"every rank must be below node_count ({self.node_count})")
        if self.rank in ranks or len(set(ranks)) != len(ranks):
            raise ValueError("'peers' must name each other member once, and not this one")
        return self


class DeleteCluster(StrictModel):
    """Take the member ``rental_id`` out of its cluster's private network (its tunnel and names go)."""

    kind: Literal["delete_cluster"] = "delete_cluster"
    cluster_id: ClusterId
    rental_id: RentalId


# ---- off-peak power limits (docs/power.md) -------------------------------------------------------

MAX_POWER_LIMIT_W = 5000.0  # more than any board's maximum; bounds a garbage value


def _watts(value: object) -> object:
    if not (is_number(value) and 0 < value <= MAX_POWER_LIMIT_W):  # type: ignore[operator]
        raise ValueError(f"'watts' must be a number of watts above 0 and at most {MAX_POWER_LIMIT_W:g}, e.g. 250")
    return value


class PowerTarget(StrictModel):
    """The power limit one GPU is lowered to while it idles off-peak (within its board's allowed range)."""

    gpu_uuid: GpuUuid
    watts: Annotated[float, Field(gt=0, le=MAX_POWER_LIMIT_W), BeforeValidator(_watts)]


class SetPowerPolicy(StrictModel):
    """The host's power policy, whole (it replaces the one before): until ``off_peak_until`` the agent lowers
    each idle GPU of ``targets`` to its watts; from then on, or at once with no ``off_peak_until`` or no
    targets, it restores every limit it lowered. A GPU is always restored before a workload starts on it,
    and a busy one is never lowered. Idempotent: the same policy twice changes nothing more."""

    kind: Literal["set_power_policy"] = "set_power_policy"
    targets: list[PowerTarget] = Field(default_factory=list, max_length=64)
    off_peak_until: Timestamp | None = None

    @model_validator(mode="after")
    def _one_target_per_gpu(self) -> SetPowerPolicy:
        uuids = [target.gpu_uuid for target in self.targets]
        if len(set(uuids)) != len(uuids):
            raise ValueError("'targets' names a GPU twice")
        return self


# ---- GPU verification (docs/verification.md) -----------------------------------------------------

CHALLENGE_ID_PATTERN = r"^gv-[A-Za-z0-9_-]{1,37}$"  # a gpu_verifications id
MAX_CHALLENGE_JSON_BYTES = 64 << 10  # a challenge or a reveal: seeds, sizes, row and column indices
CHALLENGE_WORKLOAD_PREFIX = "verify-"  # the challenge's workload runs as the rental id ``verify-<challenge id>``


def _challenge_document(what: str) -> Any:
    def check(value: object) -> object:
        if not isinstance(value, dict):
            raise ValueError(f"'{what}' must be an object")
        try:
            size = len(json.dumps(value, separators=(",", ":")))
        except (TypeError, ValueError):
            raise ValueError(f"'{what}' must be plain JSON") from None
        if size > MAX_CHALLENGE_JSON_BYTES:
            raise ValueError(f"'{what}' is longer than {MAX_CHALLENGE_JSON_BYTES} bytes")
        return value

    return check


ChallengeId = Annotated[str, Field(pattern=CHALLENGE_ID_PATTERN)]


class StartChallenge(StrictModel):
    """Run the GPU challenge ``challenge`` on ``gpu_uuids`` (docs/verification.md): the challenge image as a platform
    workload in the container runtime, with those GPUs by UUID, in a work folder of its own. The result comes when the
    program has committed (``ChallengeCommitted``: its Merkle roots) or failed; the master then sends
    ``reveal_challenge``. A rental that needs one of the GPUs meanwhile cancels it (failed result, code
    ``challenge_cancelled``). Idempotent per ``challenge_id``: a resend waits for the same run."""

    kind: Literal["start_challenge"] = "start_challenge"
    challenge_id: ChallengeId
    gpu_uuids: GpuUuids = Field(min_length=1, max_length=64)
    challenge: Annotated[dict[str, Any], BeforeValidator(_challenge_document("challenge"))]
    # How long the agent waits for the commitment before it gives up (the master's own deadline is kept by its clock).
    timeout_s: Annotated[float, Field(gt=0, le=24 * 3600)] = 3600.0


class RevealChallenge(StrictModel):
    """The master's reveal for a committed challenge: the rows and columns to open. The result's ``data`` is the
    program's openings (``ChallengeOpened``); the challenge's workload then ends and its folder is removed."""

    kind: Literal["reveal_challenge"] = "reveal_challenge"
    challenge_id: ChallengeId
    reveal: Annotated[dict[str, Any], BeforeValidator(_challenge_document("reveal"))]
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 300.0


class CancelChallenge(StrictModel):
    """Stop the challenge's workload and remove its folder (the master gave up on it); a challenge not running is
    already cancelled."""

    kind: Literal["cancel_challenge"] = "cancel_challenge"
    challenge_id: ChallengeId
    reason: Annotated[str, Field(max_length=MAX_STOP_REASON_CHARS), BeforeValidator(_reason)] | None = None


AnyCommand = (
    StartWorkload | StopWorkload | UpdateAccess | MeasureNetwork | InstallCertificate | HealthCheck | CreateCluster | DeleteCluster
    | SetPowerPolicy | StartChallenge | RevealChallenge | CancelChallenge | CreateVolume | DeleteVolume
    | OpenVolume | CopyVolume
)
AgentCommand = Annotated[AnyCommand, Field(discriminator="kind")]
COMMAND_KINDS = (
    "start_workload", "stop_workload", "measure_network", "install_certificate", "health_check", "create_cluster", "delete_cluster",
    "set_power_policy", "update_access", "start_challenge", "reveal_challenge", "cancel_challenge", "create_volume", "delete_volume",
    "open_volume", "copy_volume",
)


class CommandBody(StrictModel):
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
