"""What agents report over time: raw samples, rollups and GPU events."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    ForeignKey,
    Index,
    Integer,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from master.models.base import Base, _now


class TelemetrySample(Base):
    __tablename__ = "telemetry"
    __table_args__ = (
        UniqueConstraint("host_id", "seq", name="uq_telemetry_host_seq"),
        Index("ix_telemetry_host_sampled", "host_id", "sampled_at"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(BigInteger)
    sampled_at: Mapped[datetime]
    received_at: Mapped[datetime] = mapped_column(default=_now)
    relay_id: Mapped[str | None] = mapped_column(String(64), default=None)
    gpus: Mapped[list[Any]] = mapped_column(default=list)
    window_s: Mapped[float | None] = mapped_column(default=None)
    aggregates: Mapped[list[Any]] = mapped_column(default=list)
    # Folded into telemetry_rollups yet? The roll-up pass flips it in the same transaction.
    rolled: Mapped[bool] = mapped_column(default=False, index=True)


class TelemetryRollup(Base):
    """One GPU's telemetry over one bucket (60 s or 3600 s): counts, sums and maxima.

    Sums and counts (not averages) so a late sample folds in exactly: avg = sum / n.
    """

    __tablename__ = "telemetry_rollups"
    __table_args__ = (
        UniqueConstraint("host_id", "resolution", "bucket_start", "gpu_uuid", name="uq_rollups_bucket"),
        Index("ix_rollups_resolution_bucket", "resolution", "bucket_start"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    resolution: Mapped[int]  # bucket length in seconds
    bucket_start: Mapped[datetime]
    gpu_uuid: Mapped[str] = mapped_column(String(128))
    gpu_index: Mapped[int]
    samples: Mapped[int] = mapped_column(default=0)
    util_n: Mapped[int] = mapped_column(default=0)
    util_sum: Mapped[float] = mapped_column(default=0.0)
    util_max: Mapped[float | None] = mapped_column(default=None)
    mem_n: Mapped[int] = mapped_column(default=0)
    mem_sum: Mapped[float] = mapped_column(default=0.0)
    mem_max: Mapped[float | None] = mapped_column(default=None)
    temp_n: Mapped[int] = mapped_column(default=0)
    temp_sum: Mapped[float] = mapped_column(default=0.0)
    temp_max: Mapped[float | None] = mapped_column(default=None)
    power_n: Mapped[int] = mapped_column(default=0)
    power_sum: Mapped[float] = mapped_column(default=0.0)
    power_max: Mapped[float | None] = mapped_column(default=None)


class GpuEvent(Base):
    """XID errors and ECC events as the agent reported them (one row per event)."""

    __tablename__ = "gpu_events"
    __table_args__ = (
        UniqueConstraint("host_id", "seq", "position", name="uq_gpu_events_host_seq_pos"),
        Index("ix_gpu_events_received", "received_at"),  # fault counting and the alert window
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), index=True)
    seq: Mapped[int] = mapped_column(BigInteger)
    position: Mapped[int]
    gpu_uuid: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(64))
    code: Mapped[int | None] = mapped_column(default=None)
    at: Mapped[datetime]
    received_at: Mapped[datetime] = mapped_column(default=_now)
