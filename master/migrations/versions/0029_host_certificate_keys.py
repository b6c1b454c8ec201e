"""hosts: each certificate's public key, what a start's registry login is sealed to

Revision ID: 0029
Revises: 0028
Create Date: 2026-11-30 03:00:00.000000

``host_certificates.public_key`` (SubjectPublicKeyInfo PEM) is recorded for every certificate signed from now on
(enrollment and renewal). A certificate signed before has none: its host gets no registry login until its next
renewal (docs/accounts.md, Private registries).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0029'
down_revision = '0028'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('host_certificates') as batch:
        batch.add_column(sa.Column('public_key', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('host_certificates') as batch:
        batch.drop_column('public_key')
