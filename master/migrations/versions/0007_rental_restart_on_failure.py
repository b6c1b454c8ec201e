"""rental restart on failure

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-22 07:21:15.686138
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('rentals', schema=None) as batch_op:
        batch_op.add_column(sa.Column('restart_on_failure', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('replaces_id', sa.String(length=40), nullable=True))
        batch_op.create_foreign_key('fk_rentals_replaces_id', 'rentals', ['replaces_id'], ['id'])



def downgrade() -> None:
    with op.batch_alter_table('rentals', schema=None) as batch_op:
        batch_op.drop_constraint('fk_rentals_replaces_id', type_='foreignkey')
        batch_op.drop_column('replaces_id')
        batch_op.drop_column('restart_on_failure')

