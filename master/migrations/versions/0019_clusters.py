"""clusters: one rental over several hosts, each node a member rental

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-26 15:30:00.000000

``clusters`` holds what the renter asked for (nodes, GPUs per node, model, workload, network
bounds between nodes, kind and bid, restart policy) and the state derived from its members;
``cluster_events`` its state changes. Each node is a rental (``rentals.cluster_id``,
``rentals.node_rank``), so placement, commands, telemetry and billing work per member.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('clusters',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('renter_id', sa.String(length=40), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('node_count', sa.Integer(), nullable=False),
    sa.Column('gpus_per_node', sa.Integer(), nullable=False),
    sa.Column('gpu_model', sa.String(length=255), nullable=True),
    sa.Column('allow_mixed', sa.Boolean(), nullable=False),
    sa.Column('workload', sa.JSON(), nullable=False),
    sa.Column('template', sa.String(length=40), nullable=True),
    sa.Column('network', sa.JSON(), nullable=True),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('bid_per_gpu_hour', sa.Numeric(precision=12, scale=6), nullable=True),
    sa.Column('restart_policy', sa.String(length=16), nullable=False),
    sa.Column('idempotency_key', sa.String(length=255), nullable=True),
    sa.Column('request_fingerprint', sa.String(length=64), nullable=True),
    sa.Column('failure_reason', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('stopped_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['renter_id'], ['accounts.id']),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('renter_id', 'idempotency_key', name='uq_clusters_idempotency')
    )
    with op.batch_alter_table('clusters', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_clusters_renter_id'), ['renter_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_clusters_state'), ['state'], unique=False)
    op.create_table('cluster_events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('cluster_id', sa.String(length=40), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('from_state', sa.String(length=16), nullable=True),
    sa.Column('to_state', sa.String(length=16), nullable=False),
    sa.Column('cause', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['cluster_id'], ['clusters.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('cluster_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_cluster_events_cluster_id'), ['cluster_id'], unique=False)
    with op.batch_alter_table('rentals', schema=None) as batch_op:
        batch_op.add_column(sa.Column('cluster_id', sa.String(length=40), nullable=True))
        batch_op.add_column(sa.Column('node_rank', sa.Integer(), nullable=True))
        batch_op.create_foreign_key('fk_rentals_cluster_id', 'clusters', ['cluster_id'], ['id'])
        batch_op.create_index(batch_op.f('ix_rentals_cluster_id'), ['cluster_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('rentals', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_rentals_cluster_id'))
        batch_op.drop_constraint('fk_rentals_cluster_id', type_='foreignkey')
        batch_op.drop_column('node_rank')
        batch_op.drop_column('cluster_id')
    with op.batch_alter_table('cluster_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_cluster_events_cluster_id'))
    op.drop_table('cluster_events')
    with op.batch_alter_table('clusters', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_clusters_state'))
        batch_op.drop_index(batch_op.f('ix_clusters_renter_id'))
    op.drop_table('clusters')
