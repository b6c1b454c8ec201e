"""clusters: the private network between members

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-26 17:40:00.000000

``clusters.subnet`` is the cluster's /24 in 10.64.0.0/10 (``node-N`` is its ``N + 1``);
``clusters.private_network`` what the members' agents answered to ``create_cluster`` (each
member's key, endpoint and step) and the pairwise figures they measured
(``master/services/lifecycle/cluster_network.py``). ``host_links`` is what the fleet learns from those
figures: the latest round trip, throughput and loss (or unreachable) measured between two hosts,
which placement reads to honour a cluster's network bounds (``master/services/host_links.py``).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0020'
down_revision = '0019'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('clusters') as batch:
        batch.add_column(sa.Column('subnet', sa.String(length=18), nullable=True))
        batch.add_column(sa.Column('private_network', sa.JSON(), nullable=True))
    op.create_table('host_links',
    sa.Column('host_a', sa.String(length=40), nullable=False),
    sa.Column('host_b', sa.String(length=40), nullable=False),
    sa.Column('reachable', sa.Boolean(), nullable=False),
    sa.Column('rtt_ms', sa.Double(), nullable=True),
    sa.Column('mbit_s', sa.Double(), nullable=True),
    sa.Column('loss_pct', sa.Double(), nullable=True),
    sa.Column('error', sa.String(length=300), nullable=True),
    sa.Column('path', sa.String(length=8), nullable=True),
    sa.Column('measured_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('cluster_id', sa.String(length=40), nullable=True),
    sa.CheckConstraint('host_a < host_b', name='ck_host_links_ordered'),
    sa.ForeignKeyConstraint(['cluster_id'], ['clusters.id'], ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['host_a'], ['hosts.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['host_b'], ['hosts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('host_a', 'host_b')
    )
    with op.batch_alter_table('host_links', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_host_links_host_b'), ['host_b'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('host_links', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_host_links_host_b'))
    op.drop_table('host_links')
    with op.batch_alter_table('clusters') as batch:
        batch.drop_column('private_network')
        batch.drop_column('subnet')
