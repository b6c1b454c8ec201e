"""Elastic services (the product; REST path ``/api/v1/services``): services, their events and the gateway's figures."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    ForeignKey,
    Integer,
    Numeric,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from master.models.base import Base, _now


class Service(Base):
    """An elastic service: replicas of one container workload behind one endpoint, scaled between bounds.

    Each replica is a rental (``rentals.service_id``); ``desired_replicas`` is what the autoscaler last chose
    (``master/services/endpoints/scaling.py``), ``wake_requested_at`` a request that found no ready replica (scale from zero).
    ``failure_*`` is the streak of replicas that failed to start with one code (``master/services/endpoints/backoff.py``):
    no replacement before ``next_attempt_at``; after ``service_failing_after`` of them the state is ``failing``.
    """

    __tablename__ = "services"
    __table_args__ = (
        UniqueConstraint("renter_id", "idempotency_key", name="uq_services_idempotency"),
        CheckConstraint("min_replicas >= 0 AND max_replicas >= min_replicas", name="ck_services_replica_bounds"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    renter_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    name: Mapped[str] = mapped_column(String(63))
    state: Mapped[str] = mapped_column(String(16), index=True)  # active | failing | deleted
    workload: Mapped[dict[str, Any]] = mapped_column(default=dict)  # the container workload every replica runs
    template: Mapped[str | None] = mapped_column(String(40), default=None)
    port: Mapped[int]  # the port the workload serves the API on
    health_path: Mapped[str] = mapped_column(String(255), default="/health")
    gpu_count: Mapped[int] = mapped_column(default=1)  # per replica
    gpu_model: Mapped[str | None] = mapped_column(String(255), default=None)
    query: Mapped[str] = mapped_column(Text, default="")  # requirements every replica's host meets (offer query language)
    kind: Mapped[str] = mapped_column(String(16), default="on_demand")  # | interruptible
    bid_per_gpu_hour: Mapped[Decimal | None] = mapped_column(Numeric(12, 6), default=None)
    # Every replica's price tolerance (docs/placement.md, "The renter's price first"); None: the master's setting's rule.
    price_tolerance: Mapped[Decimal | None] = mapped_column(Numeric(8, 4), default=None)
    min_replicas: Mapped[int]
    max_replicas: Mapped[int]
    desired_replicas: Mapped[int]
    # {"metric": "inflight", "target": 4} or {"metric": "gpu_util", "threshold_pct": 80, "period_s": 300},
    # with "scale_up_cooldown_s" and "scale_down_cooldown_s".
    scaling: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # The volumes every replica mounts read-only, as asked ([{"name" | "id", "mount", "read_only"}]; docs/volumes.md).
    volumes: Mapped[list[Any] | None] = mapped_column(default=None)
    token_hash: Mapped[str] = mapped_column(String(64), index=True)  # SHA-256 of the service token, hex
    token_prefix: Mapped[str] = mapped_column(String(16))  # its first characters, to tell tokens apart
    idempotency_key: Mapped[str | None] = mapped_column(String(255), default=None)
    request_fingerprint: Mapped[str | None] = mapped_column(String(64), default=None)
    created_at: Mapped[datetime] = mapped_column(default=_now)
    deleted_at: Mapped[datetime | None] = mapped_column(default=None)
    last_scale_up_at: Mapped[datetime | None] = mapped_column(default=None)
    last_scale_down_at: Mapped[datetime | None] = mapped_column(default=None)
    wake_requested_at: Mapped[datetime | None] = mapped_column(default=None)
    # The start failures' streak (backoff.py): replicas asked for since ``backoff_from`` that failed before they were
    # ready, newest first, while they share one code. Reset by a ready replica and by the renter (PUT replicas).
    backoff_from: Mapped[datetime | None] = mapped_column(default=None)
    failure_code: Mapped[str | None] = mapped_column(String(64), default=None)
    failure_owner: Mapped[str | None] = mapped_column(String(16), default=None)
    failure_message: Mapped[str | None] = mapped_column(Text, default=None)
    failure_since: Mapped[datetime | None] = mapped_column(default=None)  # the streak's first failure seen
    failure_count: Mapped[int] = mapped_column(default=0)  # replicas in the streak
    failure_rental_id: Mapped[str | None] = mapped_column(String(40), default=None)  # the streak's newest
    next_attempt_at: Mapped[datetime | None] = mapped_column(default=None)  # no replacement replica before it


class ServiceEvent(Base):
    """What happened to a service: created, scaled (with the figures that decided it), a replica replaced, deleted."""

    __tablename__ = "service_events"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    service_id: Mapped[str] = mapped_column(ForeignKey("services.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(default=_now)
    kind: Mapped[str] = mapped_column(String(16))  # created | scale_up | scale_down | replicas | ready | cold_start | start_failed | failing | recovered | resumed | deleted
    replicas: Mapped[int]  # desired replicas after it
    cause: Mapped[str] = mapped_column(Text)


class ServiceStat(Base):
    """One gateway process's figures for one service over one bucket of ``service_stats_bucket_s`` seconds.

    Several master processes serve a service's endpoint: each writes its own rows (``node``), and readers
    sum them. ``latency_hist`` counts requests per bucket of ``master/services/gateway/stats.py``'s bounds.
    """

    __tablename__ = "service_stats"
    __table_args__ = (UniqueConstraint("service_id", "bucket_at", "node", name="uq_service_stats_bucket"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    service_id: Mapped[str] = mapped_column(ForeignKey("services.id", ondelete="CASCADE"), index=True)
    bucket_at: Mapped[datetime]
    node: Mapped[str] = mapped_column(String(64))
    requests: Mapped[int] = mapped_column(default=0)
    errors: Mapped[int] = mapped_column(default=0)  # answered 5xx by the gateway or a replica, or not answered
    retries: Mapped[int] = mapped_column(default=0)  # requests sent again to another replica
    inflight_sum: Mapped[float] = mapped_column(default=0.0)  # requests in flight, summed over samples
    inflight_samples: Mapped[int] = mapped_column(default=0)
    inflight_peak: Mapped[int] = mapped_column(default=0)
    latency_hist: Mapped[list[int]] = mapped_column(JSON, default=list)
