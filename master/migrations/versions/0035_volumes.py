"""Volumes (issue 41): a renter's disk on one host that outlives its rentals; hosts' storage terms

Revision ID: 0035
Revises: 0034
Create Date: 2026-12-03 09:00:00.000000

``volumes`` (one per volume: its host, size, state, the storage price it is billed at, the credit grace),
``volume_attachments`` (which rentals mount it; at most one unreleased read-write attachment per volume, held by a
partial unique index), ``volume_events``; ``host_listings`` gains the provider's storage price per GiB-hour and how
many GiB of its disk the host lends to volumes (0 for every existing host: none until its provider says).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0035"
down_revision = "0034"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "volumes",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("account_id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("size_gib", sa.Integer(), nullable=False),
        sa.Column("host_id", sa.String(length=40), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("price_per_gib_hour", sa.Numeric(precision=12, scale=6), nullable=False),
        sa.Column("failure_code", sa.String(length=64), nullable=True),
        sa.Column("failure_reason", sa.Text(), nullable=True),
        sa.Column("idempotency_key", sa.String(length=255), nullable=True),
        sa.Column("request_fingerprint", sa.String(length=64), nullable=True),
        sa.Column("rated_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("unpaid_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("delete_after", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ready_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["account_id"], ["accounts.id"]),
        sa.ForeignKeyConstraint(["host_id"], ["hosts.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("account_id", "idempotency_key", name="uq_volumes_idempotency"),
    )
    op.create_index(op.f("ix_volumes_account_id"), "volumes", ["account_id"], unique=False)
    op.create_index(op.f("ix_volumes_host_id"), "volumes", ["host_id"], unique=False)
    op.create_index(op.f("ix_volumes_state"), "volumes", ["state"], unique=False)
    op.create_index('uq_volumes_live_name', 'volumes', ['account_id', 'name'], unique=True,
                    postgresql_where=sa.text('deleted_at IS NULL'), sqlite_where=sa.text('deleted_at IS NULL'))  # fmt: skip
    op.create_table(
        "volume_attachments",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("volume_id", sa.String(length=40), nullable=False),
        sa.Column("rental_id", sa.String(length=40), nullable=False),
        sa.Column("mount", sa.String(length=200), nullable=False),
        sa.Column("read_only", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("released_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["rental_id"], ["rentals.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["volume_id"], ["volumes.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        op.f("ix_volume_attachments_rental_id"), "volume_attachments", ["rental_id"], unique=False
    )
    op.create_index(
        op.f("ix_volume_attachments_volume_id"), "volume_attachments", ["volume_id"], unique=False
    )
    op.create_index('uq_volume_attachments_writer', 'volume_attachments', ['volume_id'], unique=True,
                    postgresql_where=sa.text('released_at IS NULL AND NOT read_only'),
                    sqlite_where=sa.text('released_at IS NULL AND NOT read_only'))  # fmt: skip
    op.create_table(
        "volume_events",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("volume_id", sa.String(length=40), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("from_state", sa.String(length=16), nullable=True),
        sa.Column("to_state", sa.String(length=16), nullable=False),
        sa.Column("cause", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["volume_id"], ["volumes.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_volume_events_volume_id"), "volume_events", ["volume_id"], unique=False)
    # In place, never batch mode's copy-and-rename: the offer summary's triggers name host_listings (0018, 0031).
    op.add_column("host_listings", sa.Column("storage_price_per_gib_hour", sa.Numeric(precision=12, scale=6), nullable=True))
    op.add_column("host_listings", sa.Column("volume_gib", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    # In place (SQLite 3.35+ drops a column itself): batch mode's copy of the table would fail on the offer summary's
    # triggers that name host_listings while it is gone.
    op.execute("ALTER TABLE host_listings DROP COLUMN volume_gib")
    op.execute("ALTER TABLE host_listings DROP COLUMN storage_price_per_gib_hour")
    op.drop_index(op.f("ix_volume_events_volume_id"), table_name="volume_events")
    op.drop_table("volume_events")
    op.drop_index("uq_volume_attachments_writer", table_name="volume_attachments")
    op.drop_index(op.f("ix_volume_attachments_volume_id"), table_name="volume_attachments")
    op.drop_index(op.f("ix_volume_attachments_rental_id"), table_name="volume_attachments")
    op.drop_table("volume_attachments")
    op.drop_index("uq_volumes_live_name", table_name="volumes")
    op.drop_index(op.f("ix_volumes_state"), table_name="volumes")
    op.drop_index(op.f("ix_volumes_host_id"), table_name="volumes")
    op.drop_index(op.f("ix_volumes_account_id"), table_name="volumes")
    op.drop_table("volumes")
