"""ledger_transactions.volume_id: a volume's storage postings name it (issue 41, billing)

Revision ID: 0038
Revises: 0037
Create Date: 2026-12-03 12:00:00.000000

A volume is billed per GiB-hour (``billing/volumes.py``) with postings of kind ``storage``; each names its volume,
as usage postings name their rental, so invoices and statements read a line per volume and the API what a volume
has charged, summed in the database.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0038"
down_revision = "0037"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ledger_transactions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("volume_id", sa.String(length=40), nullable=True))
        batch_op.create_foreign_key("fk_ledger_transactions_volume_id", "volumes", ["volume_id"], ["id"])
        batch_op.create_index(batch_op.f("ix_ledger_transactions_volume_id"), ["volume_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("ledger_transactions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_ledger_transactions_volume_id"))
        batch_op.drop_constraint("fk_ledger_transactions_volume_id", type_="foreignkey")
        batch_op.drop_column("volume_id")
