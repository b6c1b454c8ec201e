"""services: elastic services, their events and their gateway figures; rentals as replicas

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-26 20:10:00.000000

``services`` holds what the renter asked for (the container workload and the port it serves, GPUs
per replica, replica bounds, the scaling rule, kind and bid) with the autoscaler's current target
and the service token's hash; ``service_events`` its scaling history; ``service_stats`` each
gateway process's figures per time bucket. A replica is a rental (``rentals.service_id``) with
``ready_at`` set once its health check first passed.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0022'
down_revision = '0021'
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table('services',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('renter_id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=63), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('workload', sa.JSON(), nullable=False),
    sa.Column('template', sa.String(length=40), nullable=True),
    sa.Column('port', sa.Integer(), nullable=False),
    sa.Column('health_path', sa.String(length=255), nullable=False),
    sa.Column('gpu_count', sa.Integer(), nullable=False),
    sa.Column('gpu_model', sa.String(length=255), nullable=True),
    sa.Column('query', sa.Text(), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('bid_per_gpu_hour', sa.Numeric(precision=12, scale=6), nullable=True),
    sa.Column('min_replicas', sa.Integer(), nullable=False),
    sa.Column('max_replicas', sa.Integer(), nullable=False),
    sa.Column('desired_replicas', sa.Integer(), nullable=False),
    sa.Column('scaling', sa.JSON(), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('token_prefix', sa.String(length=16), nullable=False),
    sa.Column('idempotency_key', sa.String(length=255), nullable=True),
    sa.Column('request_fingerprint', sa.String(length=64), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_scale_up_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_scale_down_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('wake_requested_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint('min_replicas >= 0 AND max_replicas >= min_replicas', name='ck_services_replica_bounds'),
    sa.ForeignKeyConstraint(['renter_id'], ['accounts.id']),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('renter_id', 'idempotency_key', name='uq_services_idempotency')
    )
    with op.batch_alter_table('services', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_services_renter_id'), ['renter_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_services_state'), ['state'], unique=False)
        batch_op.create_index(batch_op.f('ix_services_token_hash'), ['token_hash'], unique=False)
    op.create_table('service_events',
    sa.Column('id', _ID, autoincrement=True, nullable=False),
    sa.Column('service_id', sa.String(length=40), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('replicas', sa.Integer(), nullable=False),
    sa.Column('cause', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['service_id'], ['services.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('service_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_service_events_service_id'), ['service_id'], unique=False)
    op.create_table('service_stats',
    sa.Column('id', _ID, autoincrement=True, nullable=False),
    sa.Column('service_id', sa.String(length=40), nullable=False),
    sa.Column('bucket_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('node', sa.String(length=64), nullable=False),
    sa.Column('requests', sa.Integer(), nullable=False),
    sa.Column('errors', sa.Integer(), nullable=False),
    sa.Column('retries', sa.Integer(), nullable=False),
    sa.Column('inflight_sum', sa.Double(), nullable=False),
    sa.Column('inflight_samples', sa.Integer(), nullable=False),
    sa.Column('inflight_peak', sa.Integer(), nullable=False),
    sa.Column('latency_hist', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['service_id'], ['services.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('service_id', 'bucket_at', 'node', name='uq_service_stats_bucket')
    )
    with op.batch_alter_table('service_stats', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_service_stats_service_id'), ['service_id'], unique=False)
    with op.batch_alter_table('rentals', schema=None) as batch_op:
        batch_op.add_column(sa.Column('service_id', sa.String(length=40), nullable=True))
        batch_op.add_column(sa.Column('ready_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.create_foreign_key('fk_rentals_service_id', 'services', ['service_id'], ['id'])
        batch_op.create_index(batch_op.f('ix_rentals_service_id'), ['service_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('rentals', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_rentals_service_id'))
        batch_op.drop_constraint('fk_rentals_service_id', type_='foreignkey')
        batch_op.drop_column('ready_at')
        batch_op.drop_column('service_id')
    op.drop_table('service_stats')
    op.drop_table('service_events')
    with op.batch_alter_table('services', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_services_token_hash'))
        batch_op.drop_index(batch_op.f('ix_services_state'))
        batch_op.drop_index(batch_op.f('ix_services_renter_id'))
    op.drop_table('services')
