"""ledger

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-22 09:23:54.444796
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('ledger_accounts',
    sa.Column('code', sa.String(length=96), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('owner_id', sa.String(length=40), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['owner_id'], ['accounts.id'], ),
    sa.PrimaryKeyConstraint('code')
    )
    with op.batch_alter_table('ledger_accounts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_ledger_accounts_owner_id'), ['owner_id'], unique=False)

    op.create_table('ledger_transactions',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('memo', sa.Text(), nullable=False),
    sa.Column('rental_id', sa.String(length=40), nullable=True),
    sa.Column('period_start', sa.DateTime(timezone=True), nullable=True),
    sa.Column('period_end', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['rental_id'], ['rentals.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('key')
    )
    with op.batch_alter_table('ledger_transactions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_ledger_transactions_created_at'), ['created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_ledger_transactions_kind'), ['kind'], unique=False)
        batch_op.create_index(batch_op.f('ix_ledger_transactions_rental_id'), ['rental_id'], unique=False)

    op.create_table('ledger_entries',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('transaction_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('account', sa.String(length=96), nullable=False),
    sa.Column('amount', sa.Numeric(precision=20, scale=6), nullable=False),
    sa.ForeignKeyConstraint(['account'], ['ledger_accounts.code'], ),
    sa.ForeignKeyConstraint(['transaction_id'], ['ledger_transactions.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('ledger_entries', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_ledger_entries_account'), ['account'], unique=False)
        batch_op.create_index(batch_op.f('ix_ledger_entries_transaction_id'), ['transaction_id'], unique=False)

    with op.batch_alter_table('rentals', schema=None) as batch_op:
        batch_op.add_column(sa.Column('rated_until', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('billed_seconds', sa.Integer(), server_default='0', nullable=False))



def downgrade() -> None:
    with op.batch_alter_table('rentals', schema=None) as batch_op:
        batch_op.drop_column('billed_seconds')
        batch_op.drop_column('rated_until')

    with op.batch_alter_table('ledger_entries', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_ledger_entries_transaction_id'))
        batch_op.drop_index(batch_op.f('ix_ledger_entries_account'))

    op.drop_table('ledger_entries')
    with op.batch_alter_table('ledger_transactions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_ledger_transactions_rental_id'))
        batch_op.drop_index(batch_op.f('ix_ledger_transactions_kind'))
        batch_op.drop_index(batch_op.f('ix_ledger_transactions_created_at'))

    op.drop_table('ledger_transactions')
    with op.batch_alter_table('ledger_accounts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_ledger_accounts_owner_id'))

    op.drop_table('ledger_accounts')
