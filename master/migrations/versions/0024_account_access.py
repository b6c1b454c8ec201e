"""accounts: the access version and disabling

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-28 10:00:00.000000

``accounts.access_version`` counts the changes to who may log into the account's rentals (an SSH key
added or deleted, the account disabled or enabled again): each change sends the agents the whole key
list with the new version, and an agent ignores a list older than the one it holds
(``master/services/accounts/access.py``, docs/isolation.md "SSH into a rental"). ``accounts.disabled_at`` is
when an operator disabled the account (``gpumarket admin disable-account``): its API keys and console
sessions stop working and its rentals accept no SSH key.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0024'
down_revision = '0023'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('accounts') as batch:
        batch.add_column(sa.Column('access_version', sa.BigInteger(), server_default='0', nullable=False))
        batch.add_column(sa.Column('disabled_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('accounts') as batch:
        batch.drop_column('disabled_at')
        batch.drop_column('access_version')
