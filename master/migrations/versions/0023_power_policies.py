"""power policies: providers' off-peak power limits per host, and the energy they saved per GPU and day

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-27 00:00:00.000000

``host_power_policies`` holds a host's opt-in (a cap in watts or as a fraction of each GPU's default limit, the
off-peak threshold) and what its agent was last sent; ``power_savings`` the energy saved per GPU and UTC day, folded
from the agents' cumulative counters (docs/power.md).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0023'
down_revision = '0022'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('host_power_policies',
    sa.Column('host_id', sa.String(length=40), nullable=False),
    sa.Column('enabled', sa.Boolean(), nullable=False),
    sa.Column('cap_watts', sa.Double(), nullable=True),
    sa.Column('cap_fraction', sa.Double(), nullable=True),
    sa.Column('off_peak_threshold', sa.Double(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('sent', sa.JSON(), nullable=True),
    sa.Column('sent_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('command_id', sa.String(length=40), nullable=True),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('host_id')
    )
    op.create_table('power_savings',
    sa.Column('host_id', sa.String(length=40), nullable=False),
    sa.Column('gpu_uuid', sa.String(length=128), nullable=False),
    sa.Column('day', sa.String(length=10), nullable=False),
    sa.Column('saved_wh', sa.Double(), nullable=False),
    sa.Column('counter_wh', sa.Double(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('host_id', 'gpu_uuid', 'day')
    )


def downgrade() -> None:
    op.drop_table('power_savings')
    op.drop_table('host_power_policies')
