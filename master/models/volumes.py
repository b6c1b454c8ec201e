"""Volumes (docs/volumes.md): a renter's disk on one host that outlives its rentals, and which rentals mount it."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from sqlalchemy import BigInteger, ForeignKey, Index, Integer, Numeric, String, Text, UniqueConstraint, text
from sqlalchemy.orm import Mapped, mapped_column

from master.models.base import Base, _now


class Volume(Base):
    """One volume: ``size_gib`` on ``host_id``'s disk, billed per GiB-hour of that size from ``ready_at`` until
    ``deleted_at`` at ``price_per_gib_hour`` (the host's storage price when it was made), running or not.

    States: ``creating`` (the agent is making it) → ``ready`` → ``deleting`` (the agent is told) → ``deleted``;
    ``failed`` (it could not be made: ``failure_code``). A name is one live volume of its account's.
    ``unpaid_since``/``delete_after``: the account's credit ran out; unless it is paid by ``delete_after``
    (``volume_grace_days`` later), the volume is deleted.
    """

    __tablename__ = "volumes"
    __table_args__ = (
        UniqueConstraint("account_id", "idempotency_key", name="uq_volumes_idempotency"),
        Index(
            "uq_volumes_live_name",
            "account_id",
            "name",
            unique=True,
            postgresql_where=text("deleted_at IS NULL"),
            sqlite_where=text("deleted_at IS NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    size_gib: Mapped[int]
    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id"), index=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    price_per_gib_hour: Mapped[Decimal] = mapped_column(Numeric(12, 6))
    failure_code: Mapped[str | None] = mapped_column(String(64), default=None)
    failure_reason: Mapped[str | None] = mapped_column(Text, default=None)
    idempotency_key: Mapped[str | None] = mapped_column(String(255), default=None)
    request_fingerprint: Mapped[str | None] = mapped_column(String(64), default=None)
    # Billing (billing/): storage is posted to the ledger up to here; NULL: nothing rated yet.
    rated_until: Mapped[datetime | None] = mapped_column(default=None)
    unpaid_since: Mapped[datetime | None] = mapped_column(default=None)
    delete_after: Mapped[datetime | None] = mapped_column(default=None)
    created_at: Mapped[datetime] = mapped_column(default=_now)
    ready_at: Mapped[datetime | None] = mapped_column(default=None)
    deleted_at: Mapped[datetime | None] = mapped_column(default=None)


class VolumeAttachment(Base):
    """A rental's mount of a volume, from the rental's creation until it ends (``released_at``). At most one
    attachment of a volume is read-write and unreleased at a time: the partial unique index holds it."""

    __tablename__ = "volume_attachments"
    __table_args__ = (
        Index(
            "uq_volume_attachments_writer",
            "volume_id",
            unique=True,
            postgresql_where=text("released_at IS NULL AND NOT read_only"),
            sqlite_where=text("released_at IS NULL AND NOT read_only"),
        ),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    volume_id: Mapped[str] = mapped_column(ForeignKey("volumes.id", ondelete="CASCADE"), index=True)
    rental_id: Mapped[str] = mapped_column(ForeignKey("rentals.id", ondelete="CASCADE"), index=True)
    mount: Mapped[str] = mapped_column(String(200))
    read_only: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(default=_now)
    released_at: Mapped[datetime | None] = mapped_column(default=None)


class VolumeEvent(Base):
    """What happened to a volume, oldest first (made, attached, warned, deleted, and why)."""

    __tablename__ = "volume_events"

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    volume_id: Mapped[str] = mapped_column(ForeignKey("volumes.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(default=_now)
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    cause: Mapped[str] = mapped_column(Text)
