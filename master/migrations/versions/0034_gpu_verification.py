"""GPU verification (issue 40): the challenges put to hosts' GPUs and what each GPU proved

Revision ID: 0034
Revises: 0033
Create Date: 2026-12-02 09:00:00.000000

A host proves by computation that its GPUs are what it claims (docs/verification.md): ``gpu_verifications`` keeps
each challenge (its secret seed and size, the deadline, the host's commitment, what was revealed, the verdict), and
``gpus`` the newest outcome of each GPU (when it last passed, the throughput measured, the memory proven, the reason
of a failure and how many failures in a row). Existing GPUs start never challenged.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0034'
down_revision = '0033'
branch_labels = None
depends_on = None

_GPU_COLUMNS = ("verified_at", "verified_tflops", "verified_vram_mib", "verification_outcome", "verification_reason",
                "verification_failures")  # fmt: skip


def upgrade() -> None:
    op.create_table(
        'gpu_verifications',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('host_id', sa.String(length=40), nullable=False),
        sa.Column('trigger', sa.String(length=16), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('gpu_uuids', sa.JSON(), nullable=False),
        sa.Column('seed', sa.String(length=64), nullable=False),
        sa.Column('size', sa.Integer(), nullable=False),
        sa.Column('dtype', sa.String(length=16), nullable=False),
        sa.Column('deadline_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('sent_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('committed_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('command_id', sa.String(length=40), nullable=True),
        sa.Column('commitment', sa.JSON(), nullable=True),
        sa.Column('reveal', sa.JSON(), nullable=True),
        sa.Column('result', sa.JSON(), nullable=True),
        sa.Column('reason_code', sa.String(length=64), nullable=True),
        sa.Column('reason', sa.Text(), nullable=True),
        sa.Column('requested_by', sa.String(length=40), nullable=True),
        sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_gpu_verifications_host_created', 'gpu_verifications', ['host_id', 'created_at'], unique=False)
    op.create_index(op.f('ix_gpu_verifications_state'), 'gpu_verifications', ['state'], unique=False)
    op.add_column('gpus', sa.Column('verified_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('gpus', sa.Column('verified_tflops', sa.Double(), nullable=True))
    op.add_column('gpus', sa.Column('verified_vram_mib', sa.Integer(), nullable=True))
    op.add_column('gpus', sa.Column('verification_outcome', sa.String(length=16), nullable=True))
    op.add_column('gpus', sa.Column('verification_reason', sa.String(length=64), nullable=True))
    op.add_column('gpus', sa.Column('verification_failures', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    for column in reversed(_GPU_COLUMNS):
        op.drop_column('gpus', column)
    op.drop_index(op.f('ix_gpu_verifications_state'), table_name='gpu_verifications')
    op.drop_index('ix_gpu_verifications_host_created', table_name='gpu_verifications')
    op.drop_table('gpu_verifications')
