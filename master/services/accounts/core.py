"""Accounts, roles and API keys (stored as SHA-256 hashes, shown once).

A disabled account (``master/services/accounts/access.py``, ``gpumarket admin disable-account``) authenticates with
none of its keys: 401 ``account_disabled``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from email_validator import EmailNotValidError, validate_email
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Account, ApiKey
from master.services.accounts import keys
from shared.clock import utcnow
from shared.errors import Conflict, Forbidden, Unauthorized, ValidationFailed
from shared.ids import new_id, new_secret, secret_hash
from shared.settings import MasterSettings

ROLES = ("renter", "provider", "admin")


@dataclass(frozen=True)
class Principal:
    """Who is calling: the account behind a valid API key or console session. ``email_verified``: false only for a
    self-service account whose address is not proved yet (it may not rent or enrol hosts)."""

    account_id: str
    name: str
    role: str
    email_verified: bool = True
    # The API key the request came with and its scopes (master/services/accounts/keys.py); None: a console session,
    # or a key with every scope.
    key_id: str | None = None
    scopes: frozenset[str] | None = None
    # Acting for a team (master/services/accounts/teams.py): ``account_id`` and ``name`` are the team's, ``person`` the
    # one who signed in and ``team_role`` their role there. ``key_team``: the team the API key was made for, if any.
    person: str | None = None
    team_role: str | None = None
    key_team: str | None = None

    @property
    def person_id(self) -> str:
        """The person behind the request (their own account's id), whether or not they act for a team."""
        return self.person or self.account_id

    @classmethod
    def of(cls, account: Account, key: ApiKey | None = None) -> Principal:
        return cls(account_id=account.id, name=account.name, role=account.role,
                   email_verified=account.email is None or account.email_verified_at is not None,
                   key_id=key.id if key is not None else None,
                   scopes=frozenset(key.scopes) if key is not None and key.scopes is not None else None,
                   key_team=key.team_id if key is not None else None)  # fmt: skip

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
    """A key with every scope of the account, named "default" (an operator's, the demo's)."""
    key = new_secret(keys.API_KEY_PREFIX)
    session.add(ApiKey(id=new_id("key"), account_id=account_id, key_hash=secret_hash(key), key_prefix=key[:12]))
    await session.flush()
    return key


async def authenticate(session: AsyncSession, api_key: str, *, address: str | None = None, now: datetime | None = None) -> Principal:
    return (await authenticate_key(session, api_key, address=address, now=now))[0]


# Writing last_used_at on every call would make every read a write; to the minute is enough.
TOUCH_EVERY = timedelta(seconds=60)


async def authenticate_key(
    session: AsyncSession, api_key: str, *, address: str | None = None, now: datetime | None = None
) -> tuple[Principal, str]:
    """The account behind a valid API key, and the key's id: 401 for an unknown, revoked or expired key, 403 for one
    called from outside its networks (``address``; not checked when ``None``)."""
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
    now = now or utcnow()
    if key.expires_at is not None and now >= key.expires_at:
        raise Unauthorized(f"this API key expired at {key.expires_at.isoformat()}; make a new one (gpumarket keys create)",
                           code="api_key_expired")  # fmt: skip
    if address is not None and not keys.allows(key.allowed_networks, address):
        raise keys.AddressNotAllowed(f"this API key works only from {', '.join(key.allowed_networks or [])}; this call came from {address}")
    if key.last_used_at is None or now - key.last_used_at >= TOUCH_EVERY:
        await session.execute(update(ApiKey).where(ApiKey.id == key.id).values(last_used_at=now))
    return Principal.of(account, key), key.id


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


def console_base(settings: MasterSettings) -> str:
    """The console's URL as people reach it (``public_url``, else the master's own address), without a trailing slash."""
    return (settings.public_url or f"http://{settings.http_host}:{settings.http_port}").rstrip("/")


def console_link(settings: MasterSettings, purpose: str, token: str) -> str:
    """A link into the console's page ``#/<purpose>/<token>`` (mailed: verification, resets, invitations)."""
    return f"{console_base(settings)}/#/{purpose}/{token}"


async def find_by_email(session: AsyncSession, email: str) -> Account | None:
    return await session.scalar(select(Account).where(Account.email == email))
