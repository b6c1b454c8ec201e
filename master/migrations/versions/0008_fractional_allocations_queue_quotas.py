"""fractional allocations, interruptible rentals, queue, quotas

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-22 09:06:01.190133
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('gpu_allocations',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('rental_id', sa.String(length=40), nullable=False),
    sa.Column('gpu_id', sa.String(length=40), nullable=False),
    sa.Column('milli', sa.Integer(), nullable=False),
    sa.Column('memory_mib', sa.Integer(), nullable=False),
    sa.Column('whole', sa.Boolean(), nullable=False),
    sa.Column('mig_uuid', sa.String(length=128), nullable=True),
    sa.Column('active_mig', sa.String(length=128), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('released_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['gpu_id'], ['gpus.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['rental_id'], ['rentals.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('active_mig', name='uq_gpu_allocations_active_mig')
    )
    with op.batch_alter_table('gpu_allocations', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_gpu_allocations_gpu_id'), ['gpu_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_gpu_allocations_rental_id'), ['rental_id'], unique=False)

    with op.batch_alter_table('accounts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('max_gpus', sa.Numeric(precision=10, scale=3), nullable=True))
        batch_op.add_column(sa.Column('max_spend_per_hour', sa.Numeric(precision=14, scale=6), nullable=True))

    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.add_column(sa.Column('milli_used', sa.Integer(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('memory_used_mib', sa.Integer(), server_default='0', nullable=False))

    with op.batch_alter_table('rentals', schema=None) as batch_op:
        batch_op.add_column(sa.Column('kind', sa.String(length=16), server_default='on_demand', nullable=False))
        batch_op.add_column(sa.Column('gpu_milli', sa.Integer(), server_default='1000', nullable=False))
        batch_op.add_column(sa.Column('gpu_memory_mib', sa.Integer(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('mig_profile', sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column('bid_per_gpu_hour', sa.Numeric(precision=12, scale=6), nullable=True))
        batch_op.add_column(sa.Column('price_per_gpu_hour', sa.Numeric(precision=12, scale=6), nullable=True))
        batch_op.add_column(sa.Column('spec', sa.JSON(), nullable=False, server_default='{}'))
        batch_op.add_column(sa.Column('queue_until', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('preempted_by_id', sa.String(length=40), nullable=True))
        batch_op.alter_column('host_id',
               existing_type=sa.VARCHAR(length=40),
               nullable=True)
        batch_op.create_foreign_key('fk_rentals_preempted_by_id', 'rentals', ['preempted_by_id'], ['id'])

    # Rentals placed before this revision hold whole GPUs through gpus.rental_id only: give each an allocation row.
    op.execute(
        "INSERT INTO gpu_allocations (rental_id, gpu_id, milli, memory_mib, whole, created_at) "
        "SELECT rental_id, id, 1000, memory_total_mib, true, CURRENT_TIMESTAMP FROM gpus WHERE rental_id IS NOT NULL"
    )
    op.execute("UPDATE gpus SET milli_used = 1000, memory_used_mib = memory_total_mib WHERE rental_id IS NOT NULL")


def downgrade() -> None:
    with op.batch_alter_table('rentals', schema=None) as batch_op:
        batch_op.drop_constraint('fk_rentals_preempted_by_id', type_='foreignkey')
        batch_op.alter_column('host_id',
               existing_type=sa.VARCHAR(length=40),
               nullable=False)
        batch_op.drop_column('preempted_by_id')
        batch_op.drop_column('queue_until')
        batch_op.drop_column('spec')
        batch_op.drop_column('price_per_gpu_hour')
        batch_op.drop_column('bid_per_gpu_hour')
        batch_op.drop_column('mig_profile')
        batch_op.drop_column('gpu_memory_mib')
        batch_op.drop_column('gpu_milli')
        batch_op.drop_column('kind')

    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.drop_column('memory_used_mib')
        batch_op.drop_column('milli_used')

    with op.batch_alter_table('accounts', schema=None) as batch_op:
        batch_op.drop_column('max_spend_per_hour')
        batch_op.drop_column('max_gpus')

    with op.batch_alter_table('gpu_allocations', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_gpu_allocations_rental_id'))
        batch_op.drop_index(batch_op.f('ix_gpu_allocations_gpu_id'))

    op.drop_table('gpu_allocations')
