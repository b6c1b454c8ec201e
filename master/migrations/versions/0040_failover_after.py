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
    # Plain ALTER TABLE on both databases (SQLite >= 3.35 drops columns itself): a batch copy of ``hosts`` on SQLite
    # would trip over the offer-summary triggers that name it (0018).
    op.add_column("hosts", sa.Column("link_connection_id", sa.String(length=64), nullable=True))
    op.add_column("hosts", sa.Column("link_opened_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("hosts", sa.Column("link_down_since", sa.DateTime(timezone=True), nullable=True))
    op.add_column("rentals", sa.Column("failover_after_s", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("rentals", "failover_after_s")
    op.drop_column("hosts", "link_down_since")
    op.drop_column("hosts", "link_opened_at")
    op.drop_column("hosts", "link_connection_id")
