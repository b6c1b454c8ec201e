"""accounts: private registry credentials (sealed), room for sealed TOTP secrets

Revision ID: 0027
Revises: 0026
Create Date: 2026-11-30 02:00:00.000000

``registry_credentials`` holds an account's logins to private image registries (``master/services/accounts/
registries.py``, docs/accounts.md), one per image prefix, the password or token sealed under the ``secrets_key``
setting. ``accounts.totp_secret`` and ``totp_pending`` grow to 128 characters: a sealed secret (``sealed:v1:`` and
base64) is longer than base32; the values already there, in the clear, stay and keep working.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0027'
down_revision = '0026'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('registry_credentials',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('account_id', sa.String(length=40), nullable=False),
    sa.Column('prefix', sa.String(length=255), nullable=False),
    sa.Column('username', sa.String(length=255), nullable=False),
    sa.Column('secret', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_used_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['account_id'], ['accounts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('account_id', 'prefix', name='uq_registry_credentials_account_prefix')
    )
    with op.batch_alter_table('registry_credentials', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_registry_credentials_account_id'), ['account_id'], unique=False)
    with op.batch_alter_table('accounts') as batch:
        batch.alter_column('totp_secret', existing_type=sa.String(length=64), type_=sa.String(length=128), existing_nullable=True)
        batch.alter_column('totp_pending', existing_type=sa.String(length=64), type_=sa.String(length=128), existing_nullable=True)


def downgrade() -> None:
    # A sealed TOTP secret does not fit the old width: those second factors are turned off (their owners set them up
    # again); secrets in the clear stay.
    op.execute("UPDATE accounts SET totp_secret = NULL, totp_pending = NULL, totp_recovery = NULL, totp_last_step = NULL "
               "WHERE totp_secret LIKE 'sealed:%' OR totp_pending LIKE 'sealed:%'")
    with op.batch_alter_table('accounts') as batch:
        batch.alter_column('totp_pending', existing_type=sa.String(length=128), type_=sa.String(length=64), existing_nullable=True)
        batch.alter_column('totp_secret', existing_type=sa.String(length=128), type_=sa.String(length=64), existing_nullable=True)
    with op.batch_alter_table('registry_credentials', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_registry_credentials_account_id'))
    op.drop_table('registry_credentials')
