"""gpu version keys

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-22 10:11:19.515849
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from master.models import version_key

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.add_column(sa.Column('compute_capability_key', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('cuda_version_key', sa.Integer(), nullable=True))
        batch_op.create_index(batch_op.f('ix_gpus_compute_capability_key'), ['compute_capability_key'], unique=False)
        batch_op.create_index(batch_op.f('ix_gpus_cuda_version_key'), ['cuda_version_key'], unique=False)

    # Fill the keys of the GPUs already known from their info JSON (master.models.version_key).
    gpus = sa.table("gpus", sa.column("id", sa.String), sa.column("info", sa.JSON),
                    sa.column("compute_capability_key", sa.Integer), sa.column("cuda_version_key", sa.Integer))
    bind = op.get_bind()
    for gpu_id, info in bind.execute(sa.select(gpus.c.id, gpus.c.info)).all():
        info = info or {}
        bind.execute(
            gpus.update().where(gpus.c.id == gpu_id).values(
                compute_capability_key=version_key(info.get("compute_capability")), cuda_version_key=version_key(info.get("cuda_driver_version"))
            )
        )


def downgrade() -> None:
    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_gpus_cuda_version_key'))
        batch_op.drop_index(batch_op.f('ix_gpus_compute_capability_key'))
        batch_op.drop_column('cuda_version_key')
        batch_op.drop_column('compute_capability_key')


