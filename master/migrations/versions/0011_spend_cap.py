"""spend cap

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-22 09:40:32.781056
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('accounts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('monthly_spend_cap', sa.Numeric(precision=14, scale=2), nullable=True))



def downgrade() -> None:
    with op.batch_alter_table('accounts', schema=None) as batch_op:
        batch_op.drop_column('monthly_spend_cap')

