"""Rentals: their GPUs' allocations, events, logs and tunnel usage."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    BigInteger,
    ForeignKey,
    Integer,
    Numeric,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from master.models.base import Base, _now


class Rental(Base):
    __tablename__ = "rentals"
    __table_args__ = (UniqueConstraint("renter_id", "idempotency_key", name="uq_rentals_idempotency"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    renter_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    host_id: Mapped[str | None] = mapped_column(ForeignKey("hosts.id"), index=True)  # NULL while queued
    gpu_model: Mapped[str | None] = mapped_column(String(255), default=None)
    gpu_count: Mapped[int]
    gpu_uuids: Mapped[list[Any]] = mapped_column(default=list)
    state: Mapped[str] = mapped_column(String(16), index=True)
    kind: Mapped[str] = mapped_column(String(16), default="on_demand", server_default="on_demand")  # | interruptible
    # Thousandths of each GPU (1000: whole GPUs; a MIG slice counts its compute share) and GPU memory per share.
    gpu_milli: Mapped[int] = mapped_column(default=1000, server_default="1000")
    gpu_memory_mib: Mapped[int] = mapped_column(default=0, server_default="0")
    mig_profile: Mapped[str | None] = mapped_column(String(32), default=None)
    bid_per_gpu_hour: Mapped[Decimal | None] = mapped_column(Numeric(12, 6), default=None)
    # What one whole GPU-hour costs the renter on the chosen host (the bid, for interruptible rentals).
    price_per_gpu_hour: Mapped[Decimal | None] = mapped_column(Numeric(12, 6), default=None)
    # The request as placement reads it again (offer, requirements, network limits): for the queue and re-placement.
    spec: Mapped[dict[str, Any]] = mapped_column(default=dict)
    queue_until: Mapped[datetime | None] = mapped_column(default=None)
    preempted_by_id: Mapped[str | None] = mapped_column(ForeignKey("rentals.id", name="fk_rentals_preempted_by_id"), default=None)
    # A preemption in flight: the rental taking this one's GPUs, whose agent stops this one's workload once it has
    # its image (master/services/rentals/preemption.py). This one runs (and is billed) until then; cleared if it fails.
    preempting_by_id: Mapped[str | None] = mapped_column(
        ForeignKey("rentals.id", name="fk_rentals_preempting_by_id"), default=None, index=True
    )
    # A preempted ``queue: true`` rental queued again as this one (it keeps the first one's ``created_at``: its place).
    requeued_from_id: Mapped[str | None] = mapped_column(ForeignKey("rentals.id", name="fk_rentals_requeued_from_id"), default=None)
    # Billing (billing/rating.py): usage is posted to the ledger up to here; NULL: nothing rated yet.
    rated_until: Mapped[datetime | None] = mapped_column(default=None)
    billed_seconds: Mapped[int] = mapped_column(default=0, server_default="0")
    workload: Mapped[dict[str, Any]] = mapped_column(default=dict)
    idempotency_key: Mapped[str | None] = mapped_column(String(255), default=None)
    request_fingerprint: Mapped[str | None] = mapped_column(String(64), default=None)
    failure_reason: Mapped[str | None] = mapped_column(Text, default=None)
    # Why it failed, as a stable code (master.services.market.failures.FailureCode: image_not_found, host_lost, ...);
    # NULL unless failed.
    failure_code: Mapped[str | None] = mapped_column(String(64), default=None)
    # Whose failure it is (renter, provider, platform), from failure_code (master.services.market.failures); NULL
    # unless failed. Reliability counts only the provider's; billing follows it too (docs/reliability.md).
    failure_owner: Mapped[str | None] = mapped_column(String(16), default=None)
    # The agent's SSH host key for this rental (OpenSSH one-line form): pinned in what connect returns.
    ssh_host_key: Mapped[str | None] = mapped_column(Text, default=None)
    # Until when the ended rental's /workspace stays reachable over SFTP (its workload exited on its own);
    # NULL: not (still running, stopped by request, or released).
    workspace_until: Mapped[datetime | None] = mapped_column(default=None)
    # Bytes renters moved through the relays: to the rental (in) and from it (out), summed from tunnel_usage.
    tunnel_bytes_in: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    tunnel_bytes_out: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(default=_now)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    stopped_at: Mapped[datetime | None] = mapped_column(default=None)
    # When the host was last heard from before it went silent for longer than the grace period.
    host_lost_at: Mapped[datetime | None] = mapped_column(default=None)
    # Re-place the rental on another host if its host is lost (the new rental names this one).
    restart_on_failure: Mapped[bool] = mapped_column(default=False)
    # Seconds its host's link may stay closed before the rental fails as host lost (None: the master's failover_after_s).
    failover_after_s: Mapped[int | None] = mapped_column(default=None)
    replaces_id: Mapped[str | None] = mapped_column(ForeignKey("rentals.id", name="fk_rentals_replaces_id"), default=None)
    # A member of a cluster (master/services/clusters/core.py): the cluster and the member's rank, 0 to node_count - 1.
    cluster_id: Mapped[str | None] = mapped_column(ForeignKey("clusters.id", name="fk_rentals_cluster_id"), default=None, index=True)
    node_rank: Mapped[int | None] = mapped_column(default=None)
    # A replica of an elastic service (master/services/endpoints/core.py), and when its health check first passed
    # (the gateway balances over replicas with ready_at set; created_at is when the autoscaler decided on it).
    service_id: Mapped[str | None] = mapped_column(ForeignKey("services.id", name="fk_rentals_service_id"), default=None, index=True)
    ready_at: Mapped[datetime | None] = mapped_column(default=None)


class GpuAllocation(Base):
    """What one rental holds of one GPU: all of it, a share (milli + memory) or one MIG instance.

    ``released_at`` is set once, when the rental lets go (the GPU's counters are given back in
    the same transaction). ``active_mig`` equals ``mig_uuid`` while held and is NULL after:
    its unique constraint is what keeps a MIG instance from being handed out twice.
    """

    __tablename__ = "gpu_allocations"
    __table_args__ = (UniqueConstraint("active_mig", name="uq_gpu_allocations_active_mig"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    rental_id: Mapped[str] = mapped_column(ForeignKey("rentals.id", ondelete="CASCADE"), index=True)
    gpu_id: Mapped[str] = mapped_column(ForeignKey("gpus.id", ondelete="CASCADE"), index=True)
    milli: Mapped[int]
    memory_mib: Mapped[int] = mapped_column(default=0)
    whole: Mapped[bool] = mapped_column(default=False)
    mig_uuid: Mapped[str | None] = mapped_column(String(128), default=None)
    active_mig: Mapped[str | None] = mapped_column(String(128), default=None)
    created_at: Mapped[datetime] = mapped_column(default=_now)
    released_at: Mapped[datetime | None] = mapped_column(default=None)


class RentalEvent(Base):
    __tablename__ = "rental_events"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    rental_id: Mapped[str] = mapped_column(ForeignKey("rentals.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(default=_now)
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    cause: Mapped[str] = mapped_column(Text)


class TunnelUsage(Base):
    """One agent report of the bytes renters moved to and from one rental; (host, seq, rental) once."""

    __tablename__ = "tunnel_usage"

    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    rental_id: Mapped[str] = mapped_column(ForeignKey("rentals.id", ondelete="CASCADE"), primary_key=True, index=True)
    bytes_in: Mapped[int] = mapped_column(BigInteger)
    bytes_out: Mapped[int] = mapped_column(BigInteger)
    at: Mapped[datetime] = mapped_column()


class RentalLogChunk(Base):
    """A slice of a workload's output as the agent shipped it; ``offset`` is the byte offset in the log."""

    __tablename__ = "rental_logs"
    __table_args__ = (UniqueConstraint("rental_id", "offset", name="uq_rental_logs_offset"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    rental_id: Mapped[str] = mapped_column(ForeignKey("rentals.id", ondelete="CASCADE"), index=True)
    offset: Mapped[int] = mapped_column(BigInteger)
    length: Mapped[int]
    data: Mapped[str] = mapped_column(Text)
    received_at: Mapped[datetime] = mapped_column(default=_now)
