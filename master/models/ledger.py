"""Money: the double-entry ledger's accounts, transactions and entries, and payouts to providers."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from sqlalchemy import (
    BigInteger,
    ForeignKey,
    Integer,
    Numeric,
    String,
    Text,
)
from sqlalchemy.orm import Mapped, mapped_column

from master.models.base import Base, _now


class LedgerAccount(Base):
    """One account of the double-entry ledger (billing/ledger.py): ``renter:<id>:credit``,
    ``provider:<id>:payable``, ``platform:fees``, ``platform:cash``."""

    __tablename__ = "ledger_accounts"

    code: Mapped[str] = mapped_column(String(96), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))  # asset | liability | revenue
    owner_id: Mapped[str | None] = mapped_column(ForeignKey("accounts.id"), default=None, index=True)
    created_at: Mapped[datetime] = mapped_column(default=_now)


class LedgerTransaction(Base):
    """A balanced posting: its entries sum to zero. ``key`` (unique) says what it records, so it is posted once."""

    __tablename__ = "ledger_transactions"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(String(255), unique=True)
    kind: Mapped[str] = mapped_column(String(32), index=True)  # top_up | usage | minimum | downtime_credit | storage | payout
    memo: Mapped[str] = mapped_column(Text, default="")
    rental_id: Mapped[str | None] = mapped_column(ForeignKey("rentals.id"), default=None, index=True)
    # A volume's storage (billing/volumes.py): its invoice line and what it has charged.
    volume_id: Mapped[str | None] = mapped_column(
        ForeignKey("volumes.id", name="fk_ledger_transactions_volume_id"), default=None, index=True
    )
    period_start: Mapped[datetime | None] = mapped_column(default=None)
    period_end: Mapped[datetime | None] = mapped_column(default=None)
    created_at: Mapped[datetime] = mapped_column(default=_now, index=True)


class LedgerEntry(Base):
    """One leg of a posting: ``amount`` > 0 debits the account, < 0 credits it (USD, six places)."""

    __tablename__ = "ledger_entries"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    transaction_id: Mapped[int] = mapped_column(ForeignKey("ledger_transactions.id", ondelete="CASCADE"), index=True)
    account: Mapped[str] = mapped_column(ForeignKey("ledger_accounts.code"), index=True)
    amount: Mapped[Decimal] = mapped_column(Numeric(20, 6))


class Payout(Base):
    """Money paid out to a provider from its payable balance (billing/payouts.py); posted with ``ledger_key``."""

    __tablename__ = "payouts"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    provider_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    amount: Mapped[Decimal] = mapped_column(Numeric(14, 2))
    currency: Mapped[str] = mapped_column(String(3), default="USD")
    batch: Mapped[str] = mapped_column(String(32), index=True)
    ledger_key: Mapped[str] = mapped_column(String(255), unique=True)
    state: Mapped[str] = mapped_column(String(16), default="pending")  # pending | exported
    export_ref: Mapped[str | None] = mapped_column(String(512), default=None)  # where the payout provider put it
    created_at: Mapped[datetime] = mapped_column(default=_now)
    exported_at: Mapped[datetime | None] = mapped_column(default=None)
