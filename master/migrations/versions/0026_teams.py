"""accounts: teams (members, invitations), team-bound API keys, who added a team's SSH key

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-30 01:00:00.000000

A team is an account (``accounts.kind = 'team'``) that people act for (``master/services/accounts/teams.py``,
docs/accounts.md): it owns rentals, clusters, services, SSH keys, credit and invoices as a person's account does.
``team_members`` says who is in it and with what role; ``team_invitations`` holds the hashes of the mailed invitations.
``api_keys.team_id`` binds a key to a team; ``ssh_keys.added_by`` says which member added a team's key.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0026'
down_revision = '0025'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('accounts') as batch:
        batch.add_column(sa.Column('kind', sa.String(length=8), server_default='person', nullable=False))
    with op.batch_alter_table('api_keys') as batch:
        batch.add_column(sa.Column('team_id', sa.String(length=40), nullable=True))
        batch.create_foreign_key('fk_api_keys_team_id_accounts', 'accounts', ['team_id'], ['id'], ondelete='CASCADE')
        batch.create_index('ix_api_keys_team_id', ['team_id'], unique=False)
    with op.batch_alter_table('ssh_keys') as batch:
        batch.add_column(sa.Column('added_by', sa.String(length=40), nullable=True))
        batch.create_foreign_key('fk_ssh_keys_added_by_accounts', 'accounts', ['added_by'], ['id'], ondelete='SET NULL')
    op.create_table('team_members',
    sa.Column('team_id', sa.String(length=40), nullable=False),
    sa.Column('account_id', sa.String(length=40), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('added_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('added_by', sa.String(length=40), nullable=True),
    sa.ForeignKeyConstraint(['account_id'], ['accounts.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['added_by'], ['accounts.id'], ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['team_id'], ['accounts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('team_id', 'account_id')
    )
    with op.batch_alter_table('team_members', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_team_members_account_id'), ['account_id'], unique=False)
    op.create_table('team_invitations',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('team_id', sa.String(length=40), nullable=False),
    sa.Column('email', sa.String(length=254), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('invited_by', sa.String(length=40), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('accepted_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('accepted_by', sa.String(length=40), nullable=True),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['accepted_by'], ['accounts.id'], ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['invited_by'], ['accounts.id'], ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['team_id'], ['accounts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('token_hash')
    )
    with op.batch_alter_table('team_invitations', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_team_invitations_team_id'), ['team_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('team_invitations', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_team_invitations_team_id'))
    op.drop_table('team_invitations')
    with op.batch_alter_table('team_members', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_team_members_account_id'))
    op.drop_table('team_members')
    with op.batch_alter_table('ssh_keys') as batch:
        batch.drop_constraint('fk_ssh_keys_added_by_accounts', type_='foreignkey')
        batch.drop_column('added_by')
    op.execute("DELETE FROM api_keys WHERE team_id IS NOT NULL")
    with op.batch_alter_table('api_keys') as batch:
        batch.drop_index('ix_api_keys_team_id')
        batch.drop_constraint('fk_api_keys_team_id_accounts', type_='foreignkey')
        batch.drop_column('team_id')
    with op.batch_alter_table('accounts') as batch:
        batch.drop_column('kind')
