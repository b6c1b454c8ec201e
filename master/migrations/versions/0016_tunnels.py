"""renters' connections: the rental's SSH host key and the bytes moved through the relays

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-26 06:00:00.000000

``rentals.ssh_host_key``: the agent's SSH host key for the rental, pinned by renters' clients;
``rentals.workspace_until``: until when an ended rental's /workspace stays reachable over SFTP.
``tunnel_usage``: one row per agent report and rental (``(host_id, seq, rental_id)`` once, so a
redelivered report counts once); ``rentals.tunnel_bytes_in/out`` hold the sums.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('rentals') as batch:
        batch.add_column(sa.Column('ssh_host_key', sa.Text(), nullable=True))
        batch.add_column(sa.Column('workspace_until', sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column('tunnel_bytes_in', sa.BigInteger(), server_default='0', nullable=False))
        batch.add_column(sa.Column('tunnel_bytes_out', sa.BigInteger(), server_default='0', nullable=False))
    op.create_table('tunnel_usage',
    sa.Column('host_id', sa.String(length=40), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('rental_id', sa.String(length=40), nullable=False),
    sa.Column('bytes_in', sa.BigInteger(), nullable=False),
    sa.Column('bytes_out', sa.BigInteger(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['rental_id'], ['rentals.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('host_id', 'seq', 'rental_id')
    )
    with op.batch_alter_table('tunnel_usage') as batch:
        batch.create_index(batch.f('ix_tunnel_usage_rental_id'), ['rental_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('tunnel_usage') as batch:
        batch.drop_index(batch.f('ix_tunnel_usage_rental_id'))
    op.drop_table('tunnel_usage')
    with op.batch_alter_table('rentals') as batch:
        batch.drop_column('tunnel_bytes_out')
        batch.drop_column('tunnel_bytes_in')
        batch.drop_column('workspace_until')
        batch.drop_column('ssh_host_key')
