"""Accounts and how they sign in: API keys, console sessions, SSH keys."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    ForeignKey,
    Numeric,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from master.models.base import Base, _now


class Account(Base):
    __tablename__ = "accounts"
    __table_args__ = (CheckConstraint("fair_share_weight > 0", name="ck_accounts_fair_share_weight_positive"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    role: Mapped[str] = mapped_column(String(16))  # renter | provider | admin
    created_at: Mapped[datetime] = mapped_column(default=_now)
    # Quotas enforced at placement (NULL: the master's default_max_* settings apply).
    max_gpus: Mapped[Decimal | None] = mapped_column(Numeric(10, 3), default=None)
    max_spend_per_hour: Mapped[Decimal | None] = mapped_column(Numeric(14, 6), default=None)
    # The renter's own hard cap on what its rentals may charge in a calendar month (UTC); NULL: none.
    monthly_spend_cap: Mapped[Decimal | None] = mapped_column(Numeric(14, 2), default=None)
    # The account's weight in the queue's fair share (master/scheduler/fairshare.py): relative, > 0; set by an admin.
    fair_share_weight: Mapped[int] = mapped_column(default=1, server_default="1")
    # Counts the changes to who may log into the account's rentals (SSH keys, disabling): master/services/accounts/access.py.
    access_version: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # When an operator disabled the account: its API keys, console sessions and rentals' SSH keys stop working.
    disabled_at: Mapped[datetime | None] = mapped_column(default=None)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the whole key
    key_prefix: Mapped[str] = mapped_column(String(16))  # shown to users to tell keys apart
    created_at: Mapped[datetime] = mapped_column(default=_now)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)


class ConsoleSession(Base):
    """A web console sign-in (master/services/accounts/sessions.py): the browser holds only a random token in an
    HTTP-only cookie; the row holds its hash. Revoking the API key it was opened with ends it too."""

    __tablename__ = "console_sessions"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the cookie's value
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True)
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), index=True)
    csrf_token: Mapped[str] = mapped_column(String(64))  # sent back in X-CSRF-Token on every state-changing call
    created_at: Mapped[datetime] = mapped_column(default=_now)
    last_seen_at: Mapped[datetime] = mapped_column(default=_now)
    expires_at: Mapped[datetime]  # absolute end, whatever the activity
    ended_at: Mapped[datetime | None] = mapped_column(default=None)  # signed out


class SshKey(Base):
    """A renter's SSH public key (``master/services/accounts/ssh_keys.py``): the agent's SSH server authorises it
    for the account's rentals. ``public_key`` is canonical OpenSSH (``type base64``, no comment);
    ``fingerprint`` is as ``ssh-keygen -lf`` prints it (``SHA256:`` and unpadded base64)."""

    __tablename__ = "ssh_keys"
    __table_args__ = (UniqueConstraint("account_id", "fingerprint", name="uq_ssh_keys_account_fingerprint"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(100))
    algorithm: Mapped[str] = mapped_column(String(40))
    public_key: Mapped[str] = mapped_column(Text)
    fingerprint: Mapped[str] = mapped_column(String(60))
    created_at: Mapped[datetime] = mapped_column(default=_now)
    last_used_at: Mapped[datetime | None] = mapped_column(default=None)
