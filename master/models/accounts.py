"""Accounts and how they sign in: passwords, email tokens, API keys, console sessions, passkeys, SSH keys, the audit log."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    ForeignKey,
    LargeBinary,
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
    # person: someone who signs in; team: an account people act for (master/services/accounts/teams.py), which owns
    # rentals, clusters, services, SSH keys, credit and invoices like a person's and is reached through its members.
    kind: Mapped[str] = mapped_column(String(8), default="person", server_default="person")
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
    # Self-service accounts (master/services/accounts/signup.py): the address they signed up with, lower-case; NULL for
    # accounts an operator made (gpumarket admin create-account, the demo's), which sign in with API keys only.
    email: Mapped[str | None] = mapped_column(String(254), unique=True, default=None)
    # When the owner opened the verification link; an account with an email may rent only once it is set.
    email_verified_at: Mapped[datetime | None] = mapped_column(default=None)
    # Argon2id, in the PHC string format (parameters and salt included); NULL: no password sign-in.
    password_hash: Mapped[str | None] = mapped_column(String(256), default=None)
    # The TOTP second factor (master/services/accounts/totp.py): its secret once confirmed, one being set up (each
    # sealed under the secrets_key setting, ``sealed:v1:...``, or base32 in the clear on a master without one), the
    # last time step accepted (a code works once), and the SHA-256 of the unused recovery codes.
    totp_secret: Mapped[str | None] = mapped_column(String(128), default=None)
    totp_pending: Mapped[str | None] = mapped_column(String(128), default=None)
    totp_last_step: Mapped[int | None] = mapped_column(BigInteger, default=None)
    totp_recovery: Mapped[list[Any] | None] = mapped_column(default=None)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the whole key
    key_prefix: Mapped[str] = mapped_column(String(16))  # shown to users to tell keys apart
    created_at: Mapped[datetime] = mapped_column(default=_now)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)
    # What the account's owner calls it, and what it may do (master/services/accounts/keys.py): a list of scopes, or
    # NULL for every scope of the account (the keys operators and `gpumarket up` make).
    name: Mapped[str] = mapped_column(String(100), default="default", server_default="default")
    scopes: Mapped[list[Any] | None] = mapped_column(default=None)
    expires_at: Mapped[datetime | None] = mapped_column(default=None)
    allowed_networks: Mapped[list[Any] | None] = mapped_column(default=None)  # CIDRs it may be used from; NULL: any
    # A key made in a team's context acts for that team only, within its maker's role there (NULL: the maker's own).
    team_id: Mapped[str | None] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True, default=None)
    last_used_at: Mapped[datetime | None] = mapped_column(default=None)  # to the minute


class ConsoleSession(Base):
    """A web console sign-in (master/services/accounts/sessions.py): the browser holds only a random token in an
    HTTP-only cookie; the row holds its hash. Revoking the API key it was opened with ends it too."""

    __tablename__ = "console_sessions"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the cookie's value
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True)
    # The API key it was opened with (revoking it ends the session); NULL for a sign-in by password.
    api_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), index=True, default=None)
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
    # Who added it to a team's account (removing the member removes the keys they added); NULL: the account's own.
    added_by: Mapped[str | None] = mapped_column(ForeignKey("accounts.id", ondelete="SET NULL"), default=None)


class EmailToken(Base):
    """A link mailed to an account's address (``master/services/accounts/signup.py``): ``verify`` proves the address,
    ``reset`` sets a new password. The mail holds the token; the row its hash. Used once, then ``used_at`` is set."""

    __tablename__ = "email_tokens"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True)
    purpose: Mapped[str] = mapped_column(String(16))  # verify | reset
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=_now)
    expires_at: Mapped[datetime]
    used_at: Mapped[datetime | None] = mapped_column(default=None)


class AuditEvent(Base):
    """A security event of an account (``master/services/accounts/audit.py``): signed up, signed in (or failed to),
    verified, password reset, signed out everywhere. The owner reads its own (``GET /audit-events``)."""

    __tablename__ = "audit_events"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(default=_now, index=True)
    kind: Mapped[str] = mapped_column(String(40))
    address: Mapped[str | None] = mapped_column(String(64), default=None)  # the client address, where a request made it
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)


class DeviceCode(Base):
    """A CLI's sign-in through the browser (RFC 8628, ``master/services/accounts/devices.py``): the CLI holds the
    device code (the row keeps its hash) and shows the user code; a signed-in console approves the user code, and the
    CLI's next poll gets an API key of the scopes approved."""

    __tablename__ = "device_codes"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    device_code_hash: Mapped[str] = mapped_column(String(64), unique=True)
    user_code: Mapped[str] = mapped_column(String(16), unique=True)
    client_name: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(default=_now)
    expires_at: Mapped[datetime]
    account_id: Mapped[str | None] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), default=None)
    scopes: Mapped[list[Any] | None] = mapped_column(default=None)
    approved_at: Mapped[datetime | None] = mapped_column(default=None)
    used_at: Mapped[datetime | None] = mapped_column(default=None)


class TeamMember(Base):
    """A person's place in a team (``master/services/accounts/teams.py``): ``role`` is owner, admin, member or billing."""

    __tablename__ = "team_members"

    team_id: Mapped[str] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), primary_key=True, index=True)
    role: Mapped[str] = mapped_column(String(16))
    added_at: Mapped[datetime] = mapped_column(default=_now)
    added_by: Mapped[str | None] = mapped_column(ForeignKey("accounts.id", ondelete="SET NULL"), default=None)


class TeamInvitation(Base):
    """An invitation mailed to an address (``master/services/accounts/teams.py``): the mail holds the token, the row its
    hash; the account that accepts must have proved that address. Used once."""

    __tablename__ = "team_invitations"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    team_id: Mapped[str] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True)
    email: Mapped[str] = mapped_column(String(254))
    role: Mapped[str] = mapped_column(String(16))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    invited_by: Mapped[str | None] = mapped_column(ForeignKey("accounts.id", ondelete="SET NULL"), default=None)
    created_at: Mapped[datetime] = mapped_column(default=_now)
    expires_at: Mapped[datetime]
    accepted_at: Mapped[datetime | None] = mapped_column(default=None)
    accepted_by: Mapped[str | None] = mapped_column(ForeignKey("accounts.id", ondelete="SET NULL"), default=None)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)


class Passkey(Base):
    """A WebAuthn credential a person signs in with (``master/services/accounts/passkeys.py``): the authenticator keeps
    the private key; the row its credential id (base64url), COSE public key and signature counter."""

    __tablename__ = "passkeys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(100))
    credential_id: Mapped[str] = mapped_column(String(1400), unique=True)  # base64url, unpadded (at most 1023 bytes)
    public_key: Mapped[bytes] = mapped_column(LargeBinary)  # COSE_Key, as the attestation carried it
    sign_count: Mapped[int] = mapped_column(BigInteger, default=0)
    transports: Mapped[list[Any] | None] = mapped_column(default=None)  # what the browser said it reaches it by
    created_at: Mapped[datetime] = mapped_column(default=_now)
    last_used_at: Mapped[datetime | None] = mapped_column(default=None)


class PasskeyChallenge(Base):
    """A WebAuthn challenge handed out and not answered yet (``master/services/accounts/passkeys.py``): its SHA-256, for
    which purpose (``register``: bound to the account adding a passkey; ``sign_in``: to nobody) and until when. Each is
    deleted as it is answered, right or wrong, so it is good once."""

    __tablename__ = "passkey_challenges"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    challenge_hash: Mapped[str] = mapped_column(String(64), unique=True)
    purpose: Mapped[str] = mapped_column(String(16))  # register | sign_in
    account_id: Mapped[str | None] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True, default=None)
    created_at: Mapped[datetime] = mapped_column(default=_now)
    expires_at: Mapped[datetime] = mapped_column(index=True)


class RegistryCredential(Base):
    """A login to a private image registry (``master/services/accounts/registries.py``), for the images under
    ``prefix`` (``registry.example.com:5000/myorg/``): the longest prefix matching a rental's image is sent to its
    agent inside the start command, for that pull only. ``secret`` is the password or token sealed under the
    ``secrets_key`` setting for this account (``sealed:v1:...``); it is never shown again."""

    __tablename__ = "registry_credentials"
    __table_args__ = (UniqueConstraint("account_id", "prefix", name="uq_registry_credentials_account_prefix"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(255))
    username: Mapped[str] = mapped_column(String(255))
    secret: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=_now)
    updated_at: Mapped[datetime] = mapped_column(default=_now)
    last_used_at: Mapped[datetime | None] = mapped_column(default=None)  # the last start command it went out with
