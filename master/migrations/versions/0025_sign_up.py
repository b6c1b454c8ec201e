"""accounts: sign-up by email and password, email tokens, the audit log

Revision ID: 0025
Revises: 0024
Create Date: 2026-11-29 22:00:00.000000

Self-service accounts (``master/services/accounts/signup.py``, docs/accounts.md): ``accounts.email`` (unique,
lower-case; NULL for accounts an operator made), ``email_verified_at``, ``password_hash`` (Argon2id, PHC string) and the TOTP second factor's columns.
``email_tokens`` holds the hashes of the mailed verification and password-reset links. ``audit_events`` is each
account's security log; ``device_codes`` the CLI's sign-ins through the browser. ``api_keys`` gain a name, scopes, an expiry, the networks they may be used from and when
they were last used (``master/services/accounts/keys.py``); the existing keys keep every scope (``scopes`` NULL). A console session opened by password has no API key: ``console_sessions.api_key_id`` may
be NULL.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0025'
down_revision = '0024'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('accounts') as batch:
        batch.add_column(sa.Column('email', sa.String(length=254), nullable=True))
        batch.add_column(sa.Column('email_verified_at', sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column('password_hash', sa.String(length=256), nullable=True))
        batch.add_column(sa.Column('totp_secret', sa.String(length=64), nullable=True))
        batch.add_column(sa.Column('totp_pending', sa.String(length=64), nullable=True))
        batch.add_column(sa.Column('totp_last_step', sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column('totp_recovery', sa.JSON(), nullable=True))
        batch.create_unique_constraint('uq_accounts_email', ['email'])
    with op.batch_alter_table('console_sessions') as batch:
        batch.alter_column('api_key_id', existing_type=sa.String(length=40), nullable=True)
    with op.batch_alter_table('api_keys') as batch:
        batch.add_column(sa.Column('name', sa.String(length=100), server_default='default', nullable=False))
        batch.add_column(sa.Column('scopes', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column('allowed_networks', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('last_used_at', sa.DateTime(timezone=True), nullable=True))
    op.create_table('email_tokens',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('account_id', sa.String(length=40), nullable=False),
    sa.Column('purpose', sa.String(length=16), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('used_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['account_id'], ['accounts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('token_hash')
    )
    with op.batch_alter_table('email_tokens', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_email_tokens_account_id'), ['account_id'], unique=False)
    op.create_table('device_codes',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('device_code_hash', sa.String(length=64), nullable=False),
    sa.Column('user_code', sa.String(length=16), nullable=False),
    sa.Column('client_name', sa.String(length=100), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('account_id', sa.String(length=40), nullable=True),
    sa.Column('scopes', sa.JSON(), nullable=True),
    sa.Column('approved_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('used_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['account_id'], ['accounts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('device_code_hash'),
    sa.UniqueConstraint('user_code')
    )
    op.create_table('audit_events',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('account_id', sa.String(length=40), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('kind', sa.String(length=40), nullable=False),
    sa.Column('address', sa.String(length=64), nullable=True),
    sa.Column('detail', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['account_id'], ['accounts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('audit_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_audit_events_account_id'), ['account_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_audit_events_at'), ['at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('audit_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_audit_events_at'))
        batch_op.drop_index(batch_op.f('ix_audit_events_account_id'))
    op.drop_table('audit_events')
    op.drop_table('device_codes')
    with op.batch_alter_table('email_tokens', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_email_tokens_account_id'))
    op.drop_table('email_tokens')
    with op.batch_alter_table('api_keys') as batch:
        for column in ('last_used_at', 'allowed_networks', 'expires_at', 'scopes', 'name'):
            batch.drop_column(column)
    op.execute("DELETE FROM console_sessions WHERE api_key_id IS NULL")
    with op.batch_alter_table('console_sessions') as batch:
        batch.alter_column('api_key_id', existing_type=sa.String(length=40), nullable=False)
    with op.batch_alter_table('accounts') as batch:
        batch.drop_constraint('uq_accounts_email', type_='unique')
        for column in ('totp_recovery', 'totp_last_step', 'totp_pending', 'totp_secret', 'password_hash'):
            batch.drop_column(column)
        batch.drop_column('email_verified_at')
        batch.drop_column('email')
