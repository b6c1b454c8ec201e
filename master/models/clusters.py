"""Clusters of rentals and their events."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    JSON,
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


class Cluster(Base):
    """One rental spanning several hosts: ``node_count`` member rentals (``rentals.cluster_id``), one per host.

    Its state is derived from its members' (``master/services/lifecycle/clusters.py``); placement, commands,
    telemetry and billing work per member.
    """

    __tablename__ = "clusters"
    __table_args__ = (UniqueConstraint("renter_id", "idempotency_key", name="uq_clusters_idempotency"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    renter_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    node_count: Mapped[int]
    gpus_per_node: Mapped[int]
    gpu_model: Mapped[str | None] = mapped_column(String(255), default=None)  # model words as asked (None: any)
    allow_mixed: Mapped[bool] = mapped_column(default=False)  # False: every member gets the same GPU model
    workload: Mapped[dict[str, Any]] = mapped_column(default=dict)  # before the per-member environment
    template: Mapped[str | None] = mapped_column(String(40), default=None)
    # Bounds between nodes ({"max_latency_ms", "max_loss_pct", "min_mbit_s"}): placement keeps host pairs measured
    # outside them apart (host_links); once the private network is up its figures are checked against them.
    network: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # The private network between members (master/services/lifecycle/cluster_network.py): its /24 and what the agents said.
    subnet: Mapped[str | None] = mapped_column(String(18), default=None)
    private_network: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    kind: Mapped[str] = mapped_column(String(16), default="on_demand")  # | interruptible
    bid_per_gpu_hour: Mapped[Decimal | None] = mapped_column(Numeric(12, 6), default=None)
    # Its placement's price tolerance (docs/placement.md, "The renter's price first"); None: the master's setting's rule.
    price_tolerance: Mapped[Decimal | None] = mapped_column(Numeric(8, 4), default=None)
    restart_policy: Mapped[str] = mapped_column(String(16), default="stop")  # | replace
    idempotency_key: Mapped[str | None] = mapped_column(String(255), default=None)
    request_fingerprint: Mapped[str | None] = mapped_column(String(64), default=None)
    failure_reason: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[datetime] = mapped_column(default=_now)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    stopped_at: Mapped[datetime | None] = mapped_column(default=None)


class ClusterEvent(Base):
    __tablename__ = "cluster_events"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(default=_now)
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    cause: Mapped[str] = mapped_column(Text)
