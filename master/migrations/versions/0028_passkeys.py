"""accounts: passkeys (WebAuthn credentials) and the challenges handed out for them

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-01 01:00:00.000000

A person signs in with a passkey (``master/services/accounts/passkeys.py``, docs/accounts.md): ``passkeys`` holds each
credential's id, COSE public key and signature counter; ``passkey_challenges`` the SHA-256 of each challenge handed out
and not yet answered (good once, for ``passkey_challenge_ttl_s``).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "passkeys",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("account_id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("credential_id", sa.String(length=1400), nullable=False),
        sa.Column("public_key", sa.LargeBinary(), nullable=False),
        sa.Column("sign_count", sa.BigInteger(), nullable=False),
        sa.Column("transports", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["account_id"], ["accounts.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("credential_id"),
    )
    with op.batch_alter_table("passkeys", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_passkeys_account_id"), ["account_id"], unique=False)
    op.create_table(
        "passkey_challenges",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("challenge_hash", sa.String(length=64), nullable=False),
        sa.Column("purpose", sa.String(length=16), nullable=False),
        sa.Column("account_id", sa.String(length=40), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["account_id"], ["accounts.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("challenge_hash"),
    )
    with op.batch_alter_table("passkey_challenges", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_passkey_challenges_account_id"), ["account_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_passkey_challenges_expires_at"), ["expires_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("passkey_challenges", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_passkey_challenges_expires_at"))
        batch_op.drop_index(batch_op.f("ix_passkey_challenges_account_id"))
    op.drop_table("passkey_challenges")
    with op.batch_alter_table("passkeys", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_passkeys_account_id"))
    op.drop_table("passkeys")
