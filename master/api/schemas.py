"""Request bodies of the REST API (pydantic); they also feed the OpenAPI document.

A rental's workload is ``shared.protocol.WorkloadSpec``, the model the agent receives in ``start_workload``.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic_core import core_schema

from master.services.rentals import MAX_DESCRIPTION_CHARS, NAME_PATTERN
from master.services.volumes import VolumeAsk
from shared.money import CENT_PLACES, GPU_PLACES, MAX_PRICE, Amount, AmountText
from shared.protocol import (
    MAX_VOLUMES_PER_RENTAL,
    VOLUME_ID_PATTERN,
    ContainerWorkload,
    HoldWorkload,
    WorkloadSpec,
)

# Money and quantities (shared/money.py): ASCII digits, at most one dot, bounded decimals; a string or a JSON integer.
Bid = Annotated[Decimal, Amount(maximum=MAX_PRICE, positive=True)]
GpuQuota = Annotated[Decimal, Amount(places=GPU_PLACES, maximum=Decimal("9999999.999"))]  # Numeric(10, 3)
SpendQuota = Annotated[Decimal, Amount(maximum=Decimal("99999999.999999"))]  # Numeric(14, 6)
Cents = Annotated[str | int, AmountText(places=CENT_PLACES, maximum=Decimal("1000000"))]  # read by billing.ledger.cents: 422 invalid_amount


class _Raw:
    """A field kept as sent, for a service to read under its own error code (400 ``invalid_price_tolerance``:
    ``master.scheduler.price.parse_tolerance``), with ``schema`` as its JSON Schema."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(lambda value: value)

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        return dict(self.schema)


PriceTolerance = Annotated[Any, _Raw({
    "anyOf": [{"type": "string", "pattern": r"^(?:[0-9]+(?:\.[0-9]{1,4})?|\.[0-9]{1,4})$", "maxLength": 16},
              {"type": "number", "minimum": 0, "maximum": 10}, {"type": "null"}],
    "examples": ["0.05"],
})]  # fmt: skip
PRICE_TOLERANCE_TEXT = ("The renter's price first: go to the cheapest offers that meet the request, and let the placer "
                        "choose among those priced at most this fraction above the cheapest (0.05 = 5 %, 0 = the cheapest "
                        "only, up to 10). Default: the platform's price_tolerance when no GPU model is named; with a "
                        "model named and no tolerance, the placer chooses among that model's offers as before. A bad "
                        "value is 400 invalid_price_tolerance.")  # fmt: skip


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NetworkLimitsBody(_Body):
    region: str = Field(min_length=1, max_length=64, description="Your region; hosts are measured to their own region's relay.")
    max_latency_ms: float | None = Field(None, gt=0, le=10_000, description="Worst round-trip time to your region you accept.")
    max_jitter_ms: float | None = Field(None, ge=0, le=10_000)
    max_loss_pct: float | None = Field(None, ge=0, le=100)


class VolumeMountBody(_Body):
    """One of the renter's volumes the container mounts (docs/volumes.md): by name or by id, at an absolute mount point."""

    name: str | None = Field(None, min_length=1, max_length=64, description="The volume's name (a cluster's may hold {rank}).")
    id: str | None = Field(None, pattern=VOLUME_ID_PATTERN, description="Or its id, vol-<16 hex>.")
    mount: str = Field(min_length=1, max_length=200, description="Where it appears in the container, e.g. /data (not /workspace "
                       "itself nor a system folder).")  # fmt: skip
    read_only: bool = Field(False, description="Mount it read-only: any number of rentals may; read-write, one at a time.")

    def ask(self) -> VolumeAsk:
        return VolumeAsk(mount=self.mount, name=self.name, id=self.id, read_only=self.read_only)


VolumeMounts = list[VolumeMountBody]


class RentalCreate(_Body):
    """At least one of offer_id, gpu_model, requirements, gpu_count, gpu_milli, mig_profile, template or workload
    (``routes.RENTAL_TARGETS``): an empty body is 422 ``rental_target_missing``, never a GPU of the placer's choosing."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1})

    offer_id: str | None = Field(None, min_length=3, max_length=300, description="An offer from GET /offers (host_id:gpu_name); or give requirements.")
    requirements: str | None = Field(None, max_length=2000, description="Offer filters in the query language of GET /offers?q=, e.g. 'vram>=24 reliability>0.98 price<=0.5'.")
    gpu_count: int = Field(1, ge=1, le=64, description="Whole GPUs, all on one host (gang).")
    gpu_model: str | None = Field(None, max_length=128, description="Model words, e.g. 'RTX 4090' or 'A100 80GB'.")
    gpu_milli: int = Field(1000, ge=1, le=1000, description="Thousandths of one GPU: below 1000 rents a fractional share of one GPU (gpu_count 1).")
    gpu_memory_mib: int = Field(0, ge=0, le=1 << 21, description="GPU memory of a share, MiB (0: in proportion to gpu_milli).")
    mig_profile: str | None = Field(None, max_length=32, description="One MIG instance of this profile, e.g. 1g.10gb.")
    kind: Literal["on_demand", "interruptible"] = Field("on_demand", description="interruptible: cheaper, preempted by on-demand rentals and higher bids.")
    bid: Bid | None = Field(None, description="Most USD per GPU-hour you pay for an interruptible rental: at least the host's minimum "
                            "bid; you are charged the lower of the bid and the GPU's on-demand price.")
    network: NetworkLimitsBody | None = Field(None, description="Only hosts whose measured network to your region keeps these limits.")
    price_tolerance: PriceTolerance = Field(None, description=PRICE_TOLERANCE_TEXT)
    queue: bool = Field(False, description="Wait for GPUs instead of failing when none are free now.")
    queue_timeout_s: float = Field(600.0, ge=1, le=30 * 86400, description="How long to wait in the queue before failing.")
    template: str | None = Field(None, pattern=NAME_PATTERN, max_length=40, description="A template from GET /templates (e.g. base, "
                                 "pytorch, jupyter, vllm): the rental runs its container workload as it is now. Excludes workload.")
    workload: WorkloadSpec = Field(default_factory=HoldWorkload, description="What the rental runs (the same model the agent receives); "
                                   "with neither this nor template, a hold (GPUs reserved, nothing run).")
    restart_on_failure: bool = Field(False, description="If the host is lost, start the workload again on another host "
                                                          "(a new rental, named in this one's events).")
    failover_after_s: int | None = Field(None, ge=10, le=86400, strict=True, description="Whole seconds the host's agent "
                                         "link may stay closed (or, for a host still looking connected, silent) before the "
                                         "rental fails as host lost (and, with restart_on_failure, is placed again); at "
                                         "least 10, at most 86400. Unset: the master's failover_after_s (20 s by default).")
    volumes: VolumeMounts | None = Field(None, max_length=MAX_VOLUMES_PER_RENTAL, description="Your volumes the container "
                                         "mounts; the rental then goes only to their host (docs/volumes.md).")  # fmt: skip


class ClusterNetworkBody(_Body):
    """Bounds between any two nodes, against what the members' agents measure through the cluster's private network."""

    max_latency_ms: float | None = Field(None, gt=0, le=10_000, description="Worst round trip between two nodes, ms: hosts "
                                         "measured further apart are never placed together (hosts never measured are).")
    max_loss_pct: float | None = Field(None, ge=0, le=100, description="Worst packet loss between two nodes, %, where the "
                                       "agents measure it: hosts measured losing more are never placed together.")
    min_mbit_s: float | None = Field(None, gt=0, le=400_000, description="Least throughput between two nodes, Mbit/s: hosts "
                                     "measured slower are never placed together.")


class ClusterCreate(_Body):
    """A cluster: node_count rentals of gpus_per_node whole GPUs each, one per host, placed together or not at all."""

    node_count: int = Field(ge=2, le=64, description="Nodes (hosts), each running the same workload.")
    gpus_per_node: int = Field(1, ge=1, le=64, description="Whole GPUs on each node.")
    gpu_model: str | None = Field(None, max_length=128, description="Model words, e.g. 'H100' or 'A100 80GB'.")
    allow_mixed: bool = Field(False, description="Let nodes have different GPU models (default: all the model node 0 got).")
    requirements: str | None = Field(None, max_length=2000, description="Offer filters every node's host meets (query language).")
    kind: Literal["on_demand", "interruptible"] = Field("on_demand", description="As for rentals; interruptible nodes need a bid.")
    bid: Bid | None = Field(None, description="Most USD per GPU-hour for an interruptible cluster.")
    price_tolerance: PriceTolerance = Field(None, description=PRICE_TOLERANCE_TEXT + " For a cluster: the cheapest set "
                                            "of hosts is the one whose dearest node costs least.")
    network: ClusterNetworkBody | None = Field(None, description="Bounds between any two nodes: host pairs measured outside "
                                               "them (or unreachable) are never placed together, pairs never measured are; once "
                                               "the private network is up, its figures are checked against them "
                                               "(private_network.within_bounds, and an event when not; the cluster keeps running).")
    restart_policy: Literal["stop", "replace"] = Field("stop", description="What a node that fails, is preempted or loses "
                                                       "its host does to the cluster: stop every other node (the cluster "
                                                       "fails), or replace it on another host (the cluster is degraded "
                                                       "until the replacement runs).")
    queue: bool = Field(False, description="Wait, as one unit, up to queue_timeout_s when the fleet could take the cluster but "
                        "not now (still 409 exceeds_fleet when it never could).")
    queue_timeout_s: float = Field(600.0, ge=1, le=30 * 86400, description="How long a queued cluster waits before failing "
                                   "(at most the master's max_queue_timeout_s, as for rentals).")
    template: str | None = Field(None, pattern=NAME_PATTERN, max_length=40, description="A template from GET /templates. Excludes workload.")
    workload: WorkloadSpec = Field(default_factory=HoldWorkload, description="What every node runs, with MASTER_ADDR, MASTER_PORT, "
                                   "WORLD_SIZE, RANK, NODE_RANK, and LOCAL_WORLD_SIZE added to its environment.")
    volumes: VolumeMounts | None = Field(None, max_length=MAX_VOLUMES_PER_RENTAL, description="Volumes each node mounts: a name "
                                         "holding {rank} is node r's own (ckpt-{rank}), and node r goes to its host.")  # fmt: skip


class ScalingBody(_Body):
    """The autoscaler's rule: requests in flight per replica, or GPU utilisation over a period (docs/services.md)."""

    metric: Literal["inflight", "gpu_util"] | None = Field(None, description="inflight (with target) or gpu_util "
                                                          "(with threshold_pct and period_s); without it: 400 scaling_metric_missing.")
    target: float | None = Field(None, description="inflight: requests in flight per replica to aim for, e.g. 4.")
    threshold_pct: float | None = Field(None, description="gpu_util: one more replica when the replicas' GPUs average at least this.")
    period_s: float | None = Field(None, description="gpu_util: over this many seconds (default 300).")
    scale_down_below_pct: float | None = Field(None, description="gpu_util: one fewer below this (default half the threshold).")
    scale_up_cooldown_s: float | None = Field(None, description="Least seconds between two scale-ups (default 30).")
    scale_down_cooldown_s: float | None = Field(None, description="Seconds without scaling, and of low load, before a "
                                                "scale-down (default 300).")


class ServiceCreate(_Body):
    """A service: replicas of one container workload behind one endpoint, between min_replicas and max_replicas."""

    name: str = Field(min_length=1, max_length=63, description="Lowercase ASCII letters, digits and inner hyphens, e.g. chat-7b.")
    template: str | None = Field(None, pattern=NAME_PATTERN, max_length=40, description="A template from GET /templates "
                                 "(e.g. vllm). Excludes workload.")
    workload: ContainerWorkload | None = Field(None, description="The container every replica runs; its ports include port.")
    port: int = Field(ge=1, le=65535, description="The port the workload serves its API on (one of its ports).")
    health_path: str = Field("/health", max_length=255, description="GET on it answers 2xx when a replica is ready.")
    gpu_count: int = Field(1, ge=1, le=64, description="Whole GPUs per replica, on one host.")
    gpu_model: str | None = Field(None, max_length=128, description="Model words, e.g. 'RTX 4090'.")
    requirements: str | None = Field(None, max_length=2000, description="Offer filters every replica's host meets (query language).")
    max_price_per_gpu_hour: Bid | None = Field(None, description="On-demand replicas only go to GPUs at this price or less.")
    kind: Literal["on_demand", "interruptible"] = Field("on_demand", description="interruptible replicas are cheaper and "
                                                       "may be preempted; a preempted replica is replaced.")
    bid: Bid | None = Field(None, description="Most USD per GPU-hour for interruptible replicas.")
    price_tolerance: PriceTolerance = Field(None, description=PRICE_TOLERANCE_TEXT + " Kept on the service: every "
                                            "replica is placed with it.")
    min_replicas: int = Field(1, ge=0, le=1000, description="Fewest replicas; 0 lets the service sleep (the first request waits).")
    max_replicas: int = Field(1, ge=0, le=1000, description="Most replicas.")
    scaling: ScalingBody | None = Field(None, description="The scaling rule; default: inflight with target 4.")
    volumes: VolumeMounts | None = Field(None, max_length=4 * MAX_VOLUMES_PER_RENTAL, description="Read-only volumes every "
                                         "replica mounts (shared weights); entries at one mount point are copies on different "
                                         "hosts, and a replica goes only to a host with one of each (docs/volumes.md).")  # fmt: skip


class ServiceScale(_Body):
    min_replicas: int | None = Field(None, ge=0, le=1000, description="Fewest replicas (unchanged when left out).")
    max_replicas: int | None = Field(None, ge=0, le=1000, description="Most replicas (unchanged when left out).")


class CreditTopUp(_Body):
    account_id: str = Field(min_length=1, max_length=40, description="The renter account to credit.")
    amount: Cents = Field(description="USD in whole cents as a string, e.g. \"25.00\".")
    reference: str = Field(min_length=1, max_length=128, description="The payment's id: the same reference is credited once.")


class SpendCapPut(_Body):
    monthly_spend_cap: Cents | None = Field(description="USD in whole cents as a string, e.g. \"100.00\"; null removes the cap.")


class QuotaPut(_Body):
    max_gpus: GpuQuota | None = Field(None, description="GPUs (fractions count, at most 3 decimals) held at once; null: the platform default.")
    max_spend_per_hour: SpendQuota | None = Field(None, description="USD per hour of active rentals at once; null: the platform default.")


# The largest fair-share weight: 1,000 times an account of weight 1 is already "everyone else waits".
MAX_FAIR_SHARE_WEIGHT = 1000


class FairSharePut(_Body):
    weight: int = Field(ge=1, le=MAX_FAIR_SHARE_WEIGHT, strict=True,
                        description="The account's weight in the queue's fair share, relative to others' (default 1): an account "
                        "of weight 2 is served as if it held half the GPUs it holds.")  # fmt: skip


class EnrollRequest(_Body):
    token: str = Field(min_length=8, max_length=256)
    csr: str = Field(min_length=64, max_length=16384, description="PEM certificate signing request of the agent's own key.")
    hostname: str = Field("", max_length=255)


class EnrollCheckRequest(_Body):
    token: str = Field(min_length=8, max_length=256, description="The enrollment token, as POST /enroll takes it.")


class ErrorBody(BaseModel):
    code: str
    message: str
    details: dict[str, Any] | None = None


class TemplatePut(ContainerWorkload):
    """A template as ``PUT /templates/{name}`` takes it: a container workload (the same fields and checks
    as ``workload`` of ``POST /rentals`` with ``kind: container``) and a description."""

    description: str = Field("", max_length=MAX_DESCRIPTION_CHARS, description="What the template is for, shown to renters.")

    def workload(self) -> ContainerWorkload:
        return ContainerWorkload.model_validate(self.model_dump(mode="json", exclude={"description"}))


class SshKeyCreate(_Body):
    """An SSH public key to register: one line of a ``.pub`` file."""

    public_key: str = Field(max_length=65536, description="One line of your public key file, e.g. the contents of ~/.ssh/id_ed25519.pub: "
                            "'ssh-ed25519 AAAA... comment'. Ed25519, ECDSA (P-256/384/521) or RSA of 2048 bits or more; at most 16 KiB.")
    name: str | None = Field(None, max_length=1000, description="A name to tell your keys apart (at most 100 characters once "
                             "NFC-normalised); by default the key's comment.")


class ConnectBody(_Body):
    port: Literal["ssh"] | int = Field("ssh", description="\"ssh\": the agent's SSH server for the rental (shell, commands, "
                                       "SFTP, -L); a number: a TCP port the rental declared, e.g. 8888.")
