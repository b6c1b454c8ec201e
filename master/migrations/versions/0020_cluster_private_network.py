"""clusters: the private network between members

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-26 17:40:00.000000

``clusters.subnet`` is the cluster's /24 in 10.64.0.0/10 (``node-N`` is its ``N + 1``);
``clusters.private_network`` what the members' agents answered to ``create_cluster`` (each
member's key, endpoint and step) and the pairwise figures they measured
(``master/services/cluster_network.py``).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0020'
down_revision = '0019'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('clusters') as batch:
        batch.add_column(sa.Column('subnet', sa.String(length=18), nullable=True))
        batch.add_column(sa.Column('private_network', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('clusters') as batch:
        batch.drop_column('private_network')
        batch.drop_column('subnet')
