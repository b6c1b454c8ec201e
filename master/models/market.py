"""What is offered: hosts' listings, the offer summary searched by renters, the workload templates."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    ForeignKey,
    Index,
    Integer,
    Numeric,
    String,
    Text,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from master.models.base import Base, _now


class HostListing(Base):
    """A provider's terms for one host on the marketplace (``master/services/market/listings.py``).

    Prices are USD per GPU-hour, exact decimals with six places. ``maintenance_windows`` is a
    list of ``{"start", "end"}`` UTC times written as ``YYYY-MM-DDTHH:MM:SSZ``: that fixed
    form sorts as text, so the offer search can compare it in SQL on both databases.
    """

    __tablename__ = "host_listings"

    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True)
    price_per_gpu_hour: Mapped[Decimal] = mapped_column(Numeric(12, 6))
    min_bid_per_gpu_hour: Mapped[Decimal | None] = mapped_column(Numeric(12, 6), default=None)
    smallest_unit: Mapped[str] = mapped_column(String(32), default="gpu")  # gpu | mig:<profile> | milli:<n>
    available_until: Mapped[datetime | None] = mapped_column(default=None)
    maintenance_windows: Mapped[list[Any]] = mapped_column(default=list)
    verified: Mapped[bool] = mapped_column(default=False)  # set by an admin, never by the provider
    # Volumes (docs/volumes.md): USD per GiB-hour of a volume's size, and how much of its disk the host lends to them
    # (0: none). Both set by the provider.
    storage_price_per_gib_hour: Mapped[Decimal | None] = mapped_column(Numeric(12, 6), default=None)
    volume_gib: Mapped[int] = mapped_column(default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(default=_now)
    updated_at: Mapped[datetime] = mapped_column(default=_now)


class OfferSummary(Base):
    """A host's free GPUs of one kind (every per-GPU value the offer search reads), with its host's and listing's
    searched values: what ``GET /api/v1/offers`` reads. Written only by the database's triggers (migrations 0018, 0030)."""

    __tablename__ = "offer_summary"
    # The rows the search groups (a host's model of several kinds): few, found without a scan.
    __table_args__ = (
        Index("ix_offer_summary_several", "host_id", "gpu_name", postgresql_where=text("kinds > 1"), sqlite_where=text("kinds > 1")),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), index=True)
    gpu_name: Mapped[str] = mapped_column(String(255), index=True)
    free_gpus: Mapped[int]  # GPUs outside MIG mode that rent whole now
    # Free MIG instances of the kind's GPUs in MIG mode (migration 0030): counted apart, never as whole GPUs.
    mig_free: Mapped[int] = mapped_column(default=0, server_default="0")
    memory_total_mib: Mapped[int]
    tier: Mapped[str | None] = mapped_column(String(16), index=True)
    score: Mapped[float | None]
    needs_review: Mapped[bool]
    compute_capability_key: Mapped[int | None] = mapped_column(index=True)
    cuda_version_key: Mapped[int | None]
    compute_capability: Mapped[str | None] = mapped_column(Text)  # the GPUs' info texts
    cuda_driver_version: Mapped[str | None] = mapped_column(Text)
    host_state: Mapped[str] = mapped_column(String(16))
    region: Mapped[str | None] = mapped_column(String(64), index=True)
    reliability: Mapped[float | None]
    download_mbps: Mapped[float | None]
    upload_mbps: Mapped[float | None]
    isolated: Mapped[bool | None]
    listed_price: Mapped[Decimal | None] = mapped_column(Numeric(12, 6))  # NULL: not listed
    verified: Mapped[bool]
    available_until: Mapped[datetime | None]
    maintenance_windows: Mapped[list[Any] | None] = mapped_column(JSON)  # NULL: none
    kinds: Mapped[int]  # rows of this host and model: 1 (the usual case) makes this row the whole offer


class Template(Base):
    """A named container workload renters can start by name (``master/services/rentals/templates.py``).

    ``workload`` is a ``shared.protocol.ContainerWorkload`` as JSON (kind, image, command, args, env,
    ports, shm_mib, limits); a rental copies it when it is created, so editing a template never
    changes a rental that already exists.
    """

    __tablename__ = "templates"

    name: Mapped[str] = mapped_column(String(40), primary_key=True)
    description: Mapped[str] = mapped_column(Text, default="")
    workload: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=_now)
    updated_at: Mapped[datetime] = mapped_column(default=_now)
