"""services: the streak of replicas that failed to start (back-off, the ``failing`` state)

Revision ID: 0032
Revises: 0031
Create Date: 2026-12-01 12:00:00.000000

A service whose replicas cannot start (an image that cannot be pulled) used to rent a replacement every autoscaler
pass for ever. ``master/services/endpoints/backoff.py`` now keeps the streak on the service: its code, owner and
last message, when it began, how many replicas it counts, the newest of them, when the next replacement may be
rented, and since when replicas count (``backoff_from``). ``state`` gains the value ``failing`` (no constraint
names the states, so only columns are added). Every existing service starts with no streak.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0032'
down_revision = '0031'
branch_labels = None
depends_on = None

_COLUMNS = ("backoff_from", "failure_code", "failure_owner", "failure_message", "failure_since", "failure_count",
            "failure_rental_id", "next_attempt_at")  # fmt: skip


def upgrade() -> None:
    op.add_column('services', sa.Column('backoff_from', sa.DateTime(timezone=True), nullable=True))
    op.add_column('services', sa.Column('failure_code', sa.String(length=64), nullable=True))
    op.add_column('services', sa.Column('failure_owner', sa.String(length=16), nullable=True))
    op.add_column('services', sa.Column('failure_message', sa.Text(), nullable=True))
    op.add_column('services', sa.Column('failure_since', sa.DateTime(timezone=True), nullable=True))
    op.add_column('services', sa.Column('failure_count', sa.Integer(), nullable=False, server_default='0'))
    op.add_column('services', sa.Column('failure_rental_id', sa.String(length=40), nullable=True))
    op.add_column('services', sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table('services', schema=None) as batch_op:
        batch_op.alter_column('failure_count', server_default=None)


def downgrade() -> None:
    op.execute("UPDATE services SET state = 'active' WHERE state = 'failing'")
    for column in reversed(_COLUMNS):
        op.drop_column('services', column)
