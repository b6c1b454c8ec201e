"""leases

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 04:54:08.194794
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('leases',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('holder', sa.String(length=128), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )


def downgrade() -> None:
    op.drop_table('leases')
