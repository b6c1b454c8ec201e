"""Accounts, roles and API keys (stored as SHA-256 hashes, shown once).

A disabled account (``master/services/accounts/access.py``, ``gpumarket admin disable-account``) authenticates with
none of its keys: 401 ``account_disabled``.
"""

from __future__ import annotations

from dataclasses import dataclass

from email_validator import EmailNotValidError, validate_email
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Account, ApiKey
from shared.errors import Conflict, Forbidden, Unauthorized, ValidationFailed
from shared.ids import new_id, new_secret, secret_hash

ROLES = ("renter", "provider", "admin")
API_KEY_PREFIX = "gmk"


@dataclass(frozen=True)
class Principal:
    """Who is calling: the account behind a valid API key or console session. ``email_verified``: false only for a
    self-service account whose address is not proved yet (it may not rent or enrol hosts)."""

    account_id: str
    name: str
    role: str
    email_verified: bool = True

    @classmethod
    def of(cls, account: Account) -> Principal:
        return cls(account_id=account.id, name=account.name, role=account.role,
                   email_verified=account.email is None or account.email_verified_at is not None)  # fmt: skip

    def require(self, *roles: str) -> None:
        if self.role not in roles and self.role != "admin":
            raise Forbidden(f"this needs a {' or '.join(roles)} account; you are signed in as a {self.role}")


async def create_account(session: AsyncSession, name: str, role: str) -> tuple[Account, str]:
    """Create an account and its first API key; returns the key in clear (the only time it exists)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}")
    if await session.scalar(select(Account).where(Account.name == name)) is not None:
        raise Conflict(f"an account named {name!r} already exists", code="account_exists")
    account = Account(id=new_id("acct"), name=name, role=role)
    session.add(account)
    await session.flush()
    return account, await create_api_key(session, account.id)


async def create_api_key(session: AsyncSession, account_id: str) -> str:
    key = new_secret(API_KEY_PREFIX)
    session.add(ApiKey(id=new_id("key"), account_id=account_id, key_hash=secret_hash(key), key_prefix=key[:12]))
    await session.flush()
    return key


async def authenticate(session: AsyncSession, api_key: str) -> Principal:
    return (await authenticate_key(session, api_key))[0]


async def authenticate_key(session: AsyncSession, api_key: str) -> tuple[Principal, str]:
    """The account behind a valid API key, and the key's id."""
    row = (
        await session.execute(
            select(Account, ApiKey)
            .join(ApiKey, ApiKey.account_id == Account.id)
            .where(ApiKey.key_hash == secret_hash(api_key), ApiKey.revoked_at.is_(None))
        )
    ).first()
    if row is None:
        raise Unauthorized("the API key is unknown or revoked; check it, or ask for a new one", code="invalid_api_key")
    account, key = row
    if account.disabled_at is not None:
        raise account_disabled()
    return Principal.of(account), key.id


def account_disabled() -> Unauthorized:
    return Unauthorized("this account is disabled; its API keys, sessions and SSH keys do not work (ask the operator)",
                        code="account_disabled")  # fmt: skip


async def key_is_valid(session: AsyncSession, api_key: str) -> bool:
    try:
        await authenticate(session, api_key)
    except Unauthorized:
        return False
    return True


class InvalidEmail(ValidationFailed):
    code = "invalid_email"


def normalize_email(raw: str) -> str:
    """The address as stored and compared: checked by ``email_validator`` (no DNS lookup), ASCII only (a look-alike
    Unicode domain cannot pass for a Latin one), lower-case. 422 ``invalid_email`` saying what is wrong."""
    try:
        checked = validate_email(raw, check_deliverability=False, allow_smtputf8=False)
    except EmailNotValidError as exc:
        raise InvalidEmail(f"email: {exc}") from None
    if not checked.normalized.isascii():
        raise InvalidEmail("email: use the address's ASCII form (internationalised domains are not accepted)")
    return checked.normalized.lower()


async def find_by_email(session: AsyncSession, email: str) -> Account | None:
    return await session.scalar(select(Account).where(Account.email == email))
