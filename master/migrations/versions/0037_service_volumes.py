"""services: the volumes every replica mounts (read-only shared weights; docs/volumes.md)

Revision ID: 0037
Revises: 0035
Create Date: 2026-12-03 10:00:00.000000

``services.volumes``: the service's volume entries (``[{"name" | "id", "mount", "read_only": true}]``; entries at one
mount point are copies on different hosts: a replica goes to a host with one of each). NULL for every existing
service: none mounts a volume.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0037"
down_revision = "0035"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("services", sa.Column("volumes", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("services") as batch:
        batch.drop_column("volumes")
