"""host listings: price, minimum bid, smallest unit, availability

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-22 06:36:30.321615
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('host_listings',
    sa.Column('host_id', sa.String(length=40), nullable=False),
    sa.Column('price_per_gpu_hour', sa.Numeric(precision=12, scale=6), nullable=False),
    sa.Column('min_bid_per_gpu_hour', sa.Numeric(precision=12, scale=6), nullable=True),
    sa.Column('smallest_unit', sa.String(length=32), nullable=False),
    sa.Column('available_until', sa.DateTime(timezone=True), nullable=True),
    sa.Column('maintenance_windows', sa.JSON(), nullable=False),
    sa.Column('verified', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('host_id')
    )


def downgrade() -> None:
    op.drop_table('host_listings')
