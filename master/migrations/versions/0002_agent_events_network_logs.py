"""agent telemetry windows, gpu events, network, logs

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 03:23:55.704865
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('gpu_events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('host_id', sa.String(length=40), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.Column('gpu_uuid', sa.String(length=128), nullable=False),
    sa.Column('kind', sa.String(length=64), nullable=False),
    sa.Column('code', sa.Integer(), nullable=True),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('received_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('host_id', 'seq', 'position', name='uq_gpu_events_host_seq_pos')
    )
    with op.batch_alter_table('gpu_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_gpu_events_host_id'), ['host_id'], unique=False)

    op.create_table('network_measurements',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('host_id', sa.String(length=40), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('measured_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('relay_url', sa.String(length=512), nullable=False),
    sa.Column('download_mbps', sa.Double(), nullable=True),
    sa.Column('upload_mbps', sa.Double(), nullable=True),
    sa.Column('latency_ms', sa.Double(), nullable=True),
    sa.Column('jitter_ms', sa.Double(), nullable=True),
    sa.Column('loss', sa.Double(), nullable=False),
    sa.Column('data', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('host_id', 'seq', name='uq_network_host_seq')
    )
    with op.batch_alter_table('network_measurements', schema=None) as batch_op:
        batch_op.create_index('ix_network_host_measured', ['host_id', 'measured_at'], unique=False)

    op.create_table('rental_logs',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('rental_id', sa.String(length=40), nullable=False),
    sa.Column('offset', sa.BigInteger(), nullable=False),
    sa.Column('length', sa.Integer(), nullable=False),
    sa.Column('data', sa.Text(), nullable=False),
    sa.Column('received_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['rental_id'], ['rentals.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('rental_id', 'offset', name='uq_rental_logs_offset')
    )
    with op.batch_alter_table('rental_logs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_rental_logs_rental_id'), ['rental_id'], unique=False)

    with op.batch_alter_table('hosts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('last_hello_seq', sa.BigInteger(), nullable=False, server_default='-1'))
        batch_op.add_column(sa.Column('latest_network', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('spool_stats', sa.JSON(), nullable=True))

    with op.batch_alter_table('telemetry', schema=None) as batch_op:
        batch_op.add_column(sa.Column('window_s', sa.Double(), nullable=True))
        batch_op.add_column(sa.Column('aggregates', sa.JSON(), nullable=False, server_default='[]'))



def downgrade() -> None:
    with op.batch_alter_table('telemetry', schema=None) as batch_op:
        batch_op.drop_column('aggregates')
        batch_op.drop_column('window_s')

    with op.batch_alter_table('hosts', schema=None) as batch_op:
        batch_op.drop_column('spool_stats')
        batch_op.drop_column('latest_network')
        batch_op.drop_column('last_hello_seq')

    with op.batch_alter_table('rental_logs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_rental_logs_rental_id'))

    op.drop_table('rental_logs')
    with op.batch_alter_table('network_measurements', schema=None) as batch_op:
        batch_op.drop_index('ix_network_host_measured')

    op.drop_table('network_measurements')
    with op.batch_alter_table('gpu_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_gpu_events_host_id'))

    op.drop_table('gpu_events')
