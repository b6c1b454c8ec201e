"""services.price_tolerance, clusters.price_tolerance: the renter's price first (issue 43, point 3)

Revision ID: 0039
Revises: 0038
Create Date: 2026-11-30 16:30:00.000000

A service keeps the price tolerance every replica is placed with, a cluster the one its (queued) members are
placed with; NULL: the master's ``price_tolerance`` setting's rule (docs/placement.md, "The renter's price first").
A rental keeps its own in its ``spec`` (JSON), as its other placement wishes.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0039"
down_revision = "0038"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("services", "clusters"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("price_tolerance", sa.Numeric(precision=8, scale=4), nullable=True))


def downgrade() -> None:
    for table in ("clusters", "services"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("price_tolerance")
