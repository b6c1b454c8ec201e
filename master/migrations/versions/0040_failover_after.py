"""Fail-over within a minute (issue 43): hosts.link_connection_id, link_opened_at, link_down_since and
rentals.failover_after_s

Revision ID: 0040
Revises: 0039
Create Date: 2026-11-30 16:00:00.000000

The relays report when an agent's link opens and closes (``access.linkevents``); the master keeps the host's current
connection and since when its link is down (``master.telemetry.links``), and fails its rentals over after
``failover_after_s`` (the master's setting, or the rental's own).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0040"
down_revision = "0039"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("link_connection_id", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("link_opened_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("link_down_since", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("rentals", schema=None) as batch_op:
        batch_op.add_column(sa.Column("failover_after_s", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rentals", schema=None) as batch_op:
        batch_op.drop_column("failover_after_s")
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.drop_column("link_down_since")
        batch_op.drop_column("link_opened_at")
        batch_op.drop_column("link_connection_id")
