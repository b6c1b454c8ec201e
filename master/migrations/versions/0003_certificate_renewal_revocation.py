"""certificate renewal and revocation

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 03:52:27.978407
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('hosts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('last_renewal_seq', sa.BigInteger(), nullable=False, server_default='-1'))
        batch_op.add_column(sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True))



def downgrade() -> None:
    with op.batch_alter_table('hosts', schema=None) as batch_op:
        batch_op.drop_column('revoked_at')
        batch_op.drop_column('last_renewal_seq')

