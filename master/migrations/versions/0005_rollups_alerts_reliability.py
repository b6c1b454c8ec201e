"""telemetry rollups alerts reliability tiers

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22 05:36:09.265800
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('alerts',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('rule', sa.String(length=32), nullable=False),
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('open_key', sa.String(length=255), nullable=True),
    sa.Column('severity', sa.String(length=16), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('host_id', sa.String(length=40), nullable=True),
    sa.Column('relay_id', sa.String(length=64), nullable=True),
    sa.Column('summary', sa.Text(), nullable=False),
    sa.Column('details', sa.JSON(), nullable=False),
    sa.Column('raised_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_seen_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('resolved_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('occurrences', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('open_key')
    )
    with op.batch_alter_table('alerts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_alerts_host_id'), ['host_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_alerts_key'), ['key'], unique=False)
        batch_op.create_index(batch_op.f('ix_alerts_rule'), ['rule'], unique=False)
        batch_op.create_index('ix_alerts_state_raised', ['state', 'raised_at'], unique=False)

    op.create_table('telemetry_rollups',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('host_id', sa.String(length=40), nullable=False),
    sa.Column('resolution', sa.Integer(), nullable=False),
    sa.Column('bucket_start', sa.DateTime(timezone=True), nullable=False),
    sa.Column('gpu_uuid', sa.String(length=128), nullable=False),
    sa.Column('gpu_index', sa.Integer(), nullable=False),
    sa.Column('samples', sa.Integer(), nullable=False),
    sa.Column('util_n', sa.Integer(), nullable=False),
    sa.Column('util_sum', sa.Double(), nullable=False),
    sa.Column('util_max', sa.Double(), nullable=True),
    sa.Column('mem_n', sa.Integer(), nullable=False),
    sa.Column('mem_sum', sa.Double(), nullable=False),
    sa.Column('mem_max', sa.Double(), nullable=True),
    sa.Column('temp_n', sa.Integer(), nullable=False),
    sa.Column('temp_sum', sa.Double(), nullable=False),
    sa.Column('temp_max', sa.Double(), nullable=True),
    sa.Column('power_n', sa.Integer(), nullable=False),
    sa.Column('power_sum', sa.Double(), nullable=False),
    sa.Column('power_max', sa.Double(), nullable=True),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('host_id', 'resolution', 'bucket_start', 'gpu_uuid', name='uq_rollups_bucket')
    )
    with op.batch_alter_table('telemetry_rollups', schema=None) as batch_op:
        batch_op.create_index('ix_rollups_resolution_bucket', ['resolution', 'bucket_start'], unique=False)

    op.create_table('alert_notifications',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('alert_id', sa.String(length=40), nullable=False),
    sa.Column('event', sa.String(length=16), nullable=False),
    sa.Column('payload', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('delivered_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('gave_up_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['alert_id'], ['alerts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('alert_notifications', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_alert_notifications_alert_id'), ['alert_id'], unique=False)
        batch_op.create_index('ix_alert_notifications_due', ['delivered_at', 'next_attempt_at'], unique=False)

    with op.batch_alter_table('gpu_events', schema=None) as batch_op:
        batch_op.create_index('ix_gpu_events_received', ['received_at'], unique=False)

    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.add_column(sa.Column('tier', sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column('score', sa.Double(), nullable=True))
        batch_op.add_column(sa.Column('model_key', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('needs_review', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('classification', sa.JSON(), nullable=True))
        batch_op.create_index(batch_op.f('ix_gpus_tier'), ['tier'], unique=False)

    with op.batch_alter_table('hosts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('reliability', sa.Double(), nullable=True))
        batch_op.add_column(sa.Column('reliability_inputs', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('reliability_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('faults_since', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('rejected_fields', sa.JSON(), nullable=False, server_default='{}'))

    with op.batch_alter_table('rentals', schema=None) as batch_op:
        batch_op.add_column(sa.Column('host_lost_at', sa.DateTime(timezone=True), nullable=True))

    with op.batch_alter_table('telemetry', schema=None) as batch_op:
        batch_op.add_column(sa.Column('rolled', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.create_index(batch_op.f('ix_telemetry_rolled'), ['rolled'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('telemetry', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_telemetry_rolled'))
        batch_op.drop_column('rolled')

    with op.batch_alter_table('rentals', schema=None) as batch_op:
        batch_op.drop_column('host_lost_at')

    with op.batch_alter_table('hosts', schema=None) as batch_op:
        batch_op.drop_column('rejected_fields')
        batch_op.drop_column('faults_since')
        batch_op.drop_column('reliability_at')
        batch_op.drop_column('reliability_inputs')
        batch_op.drop_column('reliability')

    with op.batch_alter_table('gpu_events', schema=None) as batch_op:
        batch_op.drop_index('ix_gpu_events_received')

    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_gpus_tier'))
        batch_op.drop_column('classification')
        batch_op.drop_column('needs_review')
        batch_op.drop_column('model_key')
        batch_op.drop_column('score')
        batch_op.drop_column('tier')

    with op.batch_alter_table('alert_notifications', schema=None) as batch_op:
        batch_op.drop_index('ix_alert_notifications_due')
        batch_op.drop_index(batch_op.f('ix_alert_notifications_alert_id'))

    op.drop_table('alert_notifications')
    with op.batch_alter_table('telemetry_rollups', schema=None) as batch_op:
        batch_op.drop_index('ix_rollups_resolution_bucket')

    op.drop_table('telemetry_rollups')
    with op.batch_alter_table('alerts', schema=None) as batch_op:
        batch_op.drop_index('ix_alerts_state_raised')
        batch_op.drop_index(batch_op.f('ix_alerts_rule'))
        batch_op.drop_index(batch_op.f('ix_alerts_key'))
        batch_op.drop_index(batch_op.f('ix_alerts_host_id'))

    op.drop_table('alerts')
