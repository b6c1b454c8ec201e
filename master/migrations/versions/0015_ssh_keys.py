"""renters' SSH public keys

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-26 03:20:00.000000

One row per key an account registered (``/api/v1/account/ssh-keys``); the agent's SSH server
authorises them for the account's rentals. A key is unique per account by its SHA256 fingerprint.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('ssh_keys',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('account_id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=100), nullable=False),
    sa.Column('algorithm', sa.String(length=40), nullable=False),
    sa.Column('public_key', sa.Text(), nullable=False),
    sa.Column('fingerprint', sa.String(length=60), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_used_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['account_id'], ['accounts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('account_id', 'fingerprint', name='uq_ssh_keys_account_fingerprint')
    )
    with op.batch_alter_table('ssh_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_ssh_keys_account_id'), ['account_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('ssh_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_ssh_keys_account_id'))
    op.drop_table('ssh_keys')
