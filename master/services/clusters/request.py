"""What a renter asks for with ``POST /clusters``: ``ClusterRequest``, its checks, its fingerprint, and each member's request.

A cluster's members are rentals; ``member_request`` is the ``RentalRequest`` one node is placed
with, and ``member_workload`` the workload it runs, with the distributed-training environment.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

from master.models import Cluster, Rental
from master.scheduler.price import tolerance_text
from master.services.rentals import RentalRequest
from master.services.volumes import VolumeAsk, asks_of, check_asks
from shared.errors import ValidationFailed

MAX_NODES = 64
RESTART_POLICIES = ("stop", "replace")
MASTER_PORT = 29500
CLUSTER_INTERFACE = "cluster0"  # the private network's interface in a member container (agent.cluster.net.INTERFACE)


@dataclass(frozen=True)
class ClusterRequest:
    node_count: int
    gpus_per_node: int = 1
    gpu_model: str | None = None
    allow_mixed: bool = False  # True: members may get different GPU models
    workload: dict[str, Any] = field(default_factory=dict)
    template: str | None = None
    query: str = ""  # requirements every node's host meets, in the offer query language
    kind: str = "on_demand"
    bid: Decimal | None = None
    # Bounds between any two nodes ({"max_latency_ms", "max_loss_pct", "min_mbit_s"}, host_links.NetworkBounds): host
    # pairs measured outside them are never placed together, and the cluster's own figures are checked once measured.
    network: dict[str, Any] | None = None
    restart_policy: str = "stop"
    queue: bool = False  # True: wait (as one unit) up to queue_timeout_s when the fleet could take it but not now
    queue_timeout_s: float = 600.0
    volumes: tuple[VolumeAsk, ...] = ()  # each names {rank}: node r mounts its own volume, and goes to its host
    price_tolerance: Decimal | None = None  # the renter's price first (clusters/placement.py); None: the setting's rule

    def check(self, *, max_queue_timeout_s: float) -> ClusterRequest:
        """The request normalised (model words, query), or ValidationFailed saying what is wrong."""
        if not 2 <= self.node_count <= MAX_NODES:
            raise ValidationFailed(f"node_count must be between 2 and {MAX_NODES} (one node is a rental: POST /rentals)",
                                   code="invalid_node_count")  # fmt: skip
        if self.restart_policy not in RESTART_POLICIES:
            raise ValidationFailed(f"restart_policy must be one of {', '.join(RESTART_POLICIES)}", code="invalid_restart_policy")
        if self.volumes and self.template is None:  # a template's workload is checked once copied in (create_cluster)
            check_asks(self.volumes, self.workload, ranked=True)
        # The rental's checks: model, bid, query, and queue_timeout_s within max_queue_timeout_s.
        member = replace(self.member_request(0), volumes=()).check(max_queue_timeout_s=max_queue_timeout_s)
        return replace(self, gpu_model=member.gpu_model, query=member.query)

    def member_request(self, rank: int, *, avoid_hosts: frozenset[str] = frozenset(), model: str | None = None,
                       region: str | None = None) -> RentalRequest:  # fmt: skip
        """The request node ``rank`` is placed with: ``model`` pins the GPU model, ``region`` the hosts' region."""
        query = self.query
        if region is not None:
            query = f"{query} region={json.dumps(region)}".strip()
        return RentalRequest(
            gpu_count=self.gpus_per_node, gpu_model=model or self.gpu_model, workload=self.workload,
            kind=self.kind, bid=self.bid, query=query, avoid_hosts=avoid_hosts, template=self.template, queue=self.queue,
            queue_timeout_s=self.queue_timeout_s, volumes=tuple(ask.for_rank(rank) for ask in self.volumes),
            price_tolerance=self.price_tolerance,
        )  # fmt: skip

    @classmethod
    def of_queued(cls, cluster: Cluster, member: Rental) -> ClusterRequest:
        """A queued cluster's request again, from its row and a queued member's (its requirements, queue timeout)."""
        spec = member.spec or {}
        return cls(
            node_count=cluster.node_count, gpus_per_node=cluster.gpus_per_node, gpu_model=cluster.gpu_model,
            allow_mixed=cluster.allow_mixed, workload=cluster.workload, template=cluster.template, query=spec.get("query") or "",
            kind=cluster.kind, bid=cluster.bid_per_gpu_hour, network=cluster.network, restart_policy=cluster.restart_policy,
            queue=True, queue_timeout_s=float(spec.get("queue_timeout_s") or 600.0),
            volumes=asks_of({"volumes": spec.get("cluster_volumes")}), price_tolerance=cluster.price_tolerance,
        )  # fmt: skip

    @property
    def world_size(self) -> int:
        return self.node_count * self.gpus_per_node

    def member_workload(self, rank: int) -> dict[str, Any]:
        """Node ``rank``'s workload: the cluster's, with the distributed-training environment (none for a hold)."""
        workload = dict(self.workload)
        if workload.get("kind", "hold") == "hold":
            return workload
        container = workload.get("kind") == "container"
        workload["env"] = {**(workload.get("env") or {}), **cluster_env(rank, self.node_count, self.gpus_per_node, container=container)}
        return workload

    def fingerprint(self) -> str:
        what: dict[str, Any] = {"w": self.workload} if self.template is None else {"t": self.template}
        # min_mbit_s only when given: keys of clusters created before it existed still match.
        network = None if self.network is None else {k: v for k, v in self.network.items() if k != "min_mbit_s" or v is not None}
        fields = {
            "n": self.node_count, "g": self.gpus_per_node, "m": self.gpu_model, "mixed": self.allow_mixed, "q": self.query,
            "kind": self.kind, "bid": str(self.bid) if self.bid is not None else None, "net": network,
            "restart": self.restart_policy, **what,
        }  # fmt: skip
        if self.queue:  # absent otherwise: keys of clusters created before queueing existed still match
            fields["queue"] = self.queue_timeout_s
        if self.volumes:
            fields["vol"] = [ask.to_json() for ask in self.volumes]
        if self.price_tolerance is not None:  # absent otherwise: older keys still match
            fields["tol"] = tolerance_text(self.price_tolerance)
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def cluster_env(rank: int, node_count: int, gpus_per_node: int, *, container: bool = True) -> dict[str, str]:
    """The environment of node ``rank``: torch's names (``WORLD_SIZE`` counts GPUs; ``RANK`` is the global rank of the
    node's first GPU, so one process per node with one GPU each needs nothing else), ``NNODES``, and torchrun's own
    (``PET_*``: a bare ``torchrun train.py`` starts one process per GPU on every node). A container member's
    collectives use its private network's interface (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME=cluster0``);
    ``node-N`` resolve there once the network is made (docs/clusters.md)."""
    env = {
        "MASTER_ADDR": "node-0", "MASTER_PORT": str(MASTER_PORT), "WORLD_SIZE": str(node_count * gpus_per_node),
        "RANK": str(rank * gpus_per_node), "NODE_RANK": str(rank), "LOCAL_WORLD_SIZE": str(gpus_per_node), "NNODES": str(node_count),
        "PET_NNODES": str(node_count), "PET_NPROC_PER_NODE": str(gpus_per_node), "PET_NODE_RANK": str(rank),
        "PET_MASTER_ADDR": "node-0", "PET_MASTER_PORT": str(MASTER_PORT),
    }  # fmt: skip
    if container:
        env |= {"GLOO_SOCKET_IFNAME": CLUSTER_INTERFACE, "NCCL_SOCKET_IFNAME": CLUSTER_INTERFACE}
    return env

