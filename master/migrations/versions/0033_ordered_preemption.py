"""rentals: a preemption in flight (``preempting_by_id``) and a preempted rental queued again (``requeued_from_id``)

Revision ID: 0033
Revises: 0032
Create Date: 2026-12-02 09:00:00.000000

A preemption no longer ends its victims when it is decided: they keep running, marked with the rental that takes
their GPUs (``preempting_by_id``), until that rental's agent has its image and stopped them — or its start fails,
and the mark is cleared (``master.services.rentals.preemption``). An interruptible rental sent with ``queue: true``
that is preempted goes back to the queue as a new rental that names it (``requeued_from_id``) and keeps its
request's creation time, so its place.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0033'
down_revision = '0032'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("rentals") as batch:
        batch.add_column(sa.Column("preempting_by_id", sa.String(length=40), nullable=True))
        batch.add_column(sa.Column("requeued_from_id", sa.String(length=40), nullable=True))
        batch.create_foreign_key("fk_rentals_preempting_by_id", "rentals", ["preempting_by_id"], ["id"])
        batch.create_foreign_key("fk_rentals_requeued_from_id", "rentals", ["requeued_from_id"], ["id"])
        batch.create_index("ix_rentals_preempting_by_id", ["preempting_by_id"])


def downgrade() -> None:
    with op.batch_alter_table("rentals") as batch:
        batch.drop_index("ix_rentals_preempting_by_id")
        batch.drop_constraint("fk_rentals_requeued_from_id", type_="foreignkey")
        batch.drop_constraint("fk_rentals_preempting_by_id", type_="foreignkey")
        batch.drop_column("requeued_from_id")
        batch.drop_column("preempting_by_id")
