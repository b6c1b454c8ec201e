"""accounts: the fair-share weight

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-27 10:00:00.000000

``accounts.fair_share_weight`` is the account's weight in the rental queue's fair share
(``master/scheduler/fairshare.py``, docs/placement.md "Fair queues"): a positive integer, 1 for
every account that exists (equal shares), set by an admin with ``PUT /accounts/{id}/fair-share``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0021'
down_revision = '0020'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('accounts') as batch:
        batch.add_column(sa.Column('fair_share_weight', sa.Integer(), server_default='1', nullable=False))
        batch.create_check_constraint('ck_accounts_fair_share_weight_positive', 'fair_share_weight > 0')


def downgrade() -> None:
    with op.batch_alter_table('accounts') as batch:
        batch.drop_constraint('ck_accounts_fair_share_weight_positive', type_='check')
        batch.drop_column('fair_share_weight')
