"""every certificate signed for a host, so that revoking the host refuses all of them

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-28 06:00:00.000000

``host_certificates``: one row per client certificate the CA signed for a host (enrollment and
each renewal), with ``revoked_at`` set when the host is revoked or once the host connected with a
newer certificate. Filled from ``hosts.cert_serial`` (the newest certificate of each host; older
ones were never recorded and expire within ``agent_cert_hours``).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('host_certificates',
    sa.Column('serial', sa.String(length=64), nullable=False),
    sa.Column('host_id', sa.String(length=40), nullable=False),
    sa.Column('issued_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('not_after', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('serial')
    )
    with op.batch_alter_table('host_certificates') as batch:
        batch.create_index(batch.f('ix_host_certificates_host_id'), ['host_id'], unique=False)
        batch.create_index(batch.f('ix_host_certificates_revoked_at'), ['revoked_at'], unique=False)
    op.execute(
        "INSERT INTO host_certificates (serial, host_id, issued_at, not_after, revoked_at) "
        "SELECT cert_serial, id, created_at, cert_not_after, revoked_at FROM hosts "
        "WHERE cert_serial IS NOT NULL AND cert_not_after IS NOT NULL"
    )


def downgrade() -> None:
    with op.batch_alter_table('host_certificates') as batch:
        batch.drop_index(batch.f('ix_host_certificates_revoked_at'))
        batch.drop_index(batch.f('ix_host_certificates_host_id'))
    op.drop_table('host_certificates')
