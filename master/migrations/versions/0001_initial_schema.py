"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-22 02:57:10.297766
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('accounts',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name')
    )
    op.create_table('api_keys',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('account_id', sa.String(length=40), nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('key_prefix', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['account_id'], ['accounts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('key_hash')
    )
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_keys_account_id'), ['account_id'], unique=False)

    op.create_table('enrollment_tokens',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('account_id', sa.String(length=40), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('used_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('host_id', sa.String(length=40), nullable=True),
    sa.ForeignKeyConstraint(['account_id'], ['accounts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('token_hash')
    )
    with op.batch_alter_table('enrollment_tokens', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_enrollment_tokens_account_id'), ['account_id'], unique=False)

    op.create_table('hosts',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('owner_id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('state_changed_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('region', sa.String(length=64), nullable=True),
    sa.Column('relay_id', sa.String(length=64), nullable=True),
    sa.Column('cert_serial', sa.String(length=64), nullable=True),
    sa.Column('cert_not_after', sa.DateTime(timezone=True), nullable=True),
    sa.Column('agent_version', sa.String(length=64), nullable=True),
    sa.Column('gpu_backend', sa.String(length=16), nullable=True),
    sa.Column('facts', sa.JSON(), nullable=False),
    sa.Column('last_seen_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_seq', sa.BigInteger(), nullable=False),
    sa.Column('latest_telemetry', sa.JSON(), nullable=True),
    sa.Column('latest_telemetry_seq', sa.BigInteger(), nullable=False),
    sa.Column('latest_telemetry_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['owner_id'], ['accounts.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('hosts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_hosts_owner_id'), ['owner_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_hosts_state'), ['state'], unique=False)

    op.create_table('host_events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('host_id', sa.String(length=40), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('from_state', sa.String(length=16), nullable=True),
    sa.Column('to_state', sa.String(length=16), nullable=False),
    sa.Column('cause', sa.Text(), nullable=False),
    sa.Column('actor', sa.String(length=64), nullable=False),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('host_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_host_events_host_id'), ['host_id'], unique=False)

    op.create_table('rentals',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('renter_id', sa.String(length=40), nullable=False),
    sa.Column('host_id', sa.String(length=40), nullable=False),
    sa.Column('gpu_model', sa.String(length=255), nullable=True),
    sa.Column('gpu_count', sa.Integer(), nullable=False),
    sa.Column('gpu_uuids', sa.JSON(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('workload', sa.JSON(), nullable=False),
    sa.Column('idempotency_key', sa.String(length=255), nullable=True),
    sa.Column('request_fingerprint', sa.String(length=64), nullable=True),
    sa.Column('failure_reason', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('stopped_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], ),
    sa.ForeignKeyConstraint(['renter_id'], ['accounts.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('renter_id', 'idempotency_key', name='uq_rentals_idempotency')
    )
    with op.batch_alter_table('rentals', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_rentals_host_id'), ['host_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_rentals_renter_id'), ['renter_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_rentals_state'), ['state'], unique=False)

    op.create_table('gpus',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('host_id', sa.String(length=40), nullable=False),
    sa.Column('index', sa.Integer(), nullable=False),
    sa.Column('uuid', sa.String(length=128), nullable=False),
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('memory_total_mib', sa.Integer(), nullable=False),
    sa.Column('info', sa.JSON(), nullable=False),
    sa.Column('present', sa.Boolean(), nullable=False),
    sa.Column('rental_id', sa.String(length=40), nullable=True),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['rental_id'], ['rentals.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('uuid')
    )
    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_gpus_host_id'), ['host_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_gpus_rental_id'), ['rental_id'], unique=False)
        batch_op.create_index('ix_gpus_host_index', ['host_id', 'index'], unique=False)

    op.create_table('telemetry',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('host_id', sa.String(length=40), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('sampled_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('received_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('relay_id', sa.String(length=64), nullable=True),
    sa.Column('gpus', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('host_id', 'seq', name='uq_telemetry_host_seq')
    )
    with op.batch_alter_table('telemetry', schema=None) as batch_op:
        batch_op.create_index('ix_telemetry_host_sampled', ['host_id', 'sampled_at'], unique=False)

    op.create_table('commands',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('host_id', sa.String(length=40), nullable=False),
    sa.Column('rental_id', sa.String(length=40), nullable=True),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('args', sa.JSON(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_sent_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('send_count', sa.Integer(), nullable=False),
    sa.Column('completed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('result', sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['rental_id'], ['rentals.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('commands', schema=None) as batch_op:
        batch_op.create_index('ix_commands_host_state', ['host_id', 'state'], unique=False)
        batch_op.create_index(batch_op.f('ix_commands_rental_id'), ['rental_id'], unique=False)

    op.create_table('rental_events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('rental_id', sa.String(length=40), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('from_state', sa.String(length=16), nullable=True),
    sa.Column('to_state', sa.String(length=16), nullable=False),
    sa.Column('cause', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['rental_id'], ['rentals.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('rental_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_rental_events_rental_id'), ['rental_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('rental_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_rental_events_rental_id'))

    op.drop_table('rental_events')
    with op.batch_alter_table('commands', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_commands_rental_id'))
        batch_op.drop_index('ix_commands_host_state')

    op.drop_table('commands')
    with op.batch_alter_table('telemetry', schema=None) as batch_op:
        batch_op.drop_index('ix_telemetry_host_sampled')

    op.drop_table('telemetry')
    with op.batch_alter_table('rentals', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_rentals_state'))
        batch_op.drop_index(batch_op.f('ix_rentals_renter_id'))
        batch_op.drop_index(batch_op.f('ix_rentals_host_id'))

    op.drop_table('rentals')
    with op.batch_alter_table('host_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_host_events_host_id'))

    op.drop_table('host_events')
    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.drop_index('ix_gpus_host_index')
        batch_op.drop_index(batch_op.f('ix_gpus_rental_id'))
        batch_op.drop_index(batch_op.f('ix_gpus_host_id'))

    op.drop_table('gpus')
    with op.batch_alter_table('hosts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_hosts_state'))
        batch_op.drop_index(batch_op.f('ix_hosts_owner_id'))

    op.drop_table('hosts')
    with op.batch_alter_table('enrollment_tokens', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_enrollment_tokens_account_id'))

    op.drop_table('enrollment_tokens')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_keys_account_id'))

    op.drop_table('api_keys')
    op.drop_table('accounts')
