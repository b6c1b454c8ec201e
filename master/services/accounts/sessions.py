"""Web console sign-ins: server-side sessions behind an HTTP-only cookie, with a CSRF token each.

Signing in exchanges an email and password (``sign_in_password``), an API key (``sign_in``) or a passkey
(``passkeys.sign_in``, through ``open_session``) for a session. The browser keeps only a random token in a
cookie (``HttpOnly``, ``SameSite=Strict``; ``Secure`` over HTTPS) and never sees the key
again; the database keeps the token's hash, the account, the key it was opened with and a
CSRF token the console's scripts send back in ``X-CSRF-Token`` on every state-changing call
(the cookie alone, which a browser attaches to any request, is never enough to change
anything). A session ends when its owner signs out, after ``console_session_idle_s`` without
a request, ``console_session_max_s`` after it began, when its owner signs out everywhere or resets the password,
or when its API key (for one opened with a key) is revoked or its account disabled.

A password sign-in that fails says the same whether the address has an account or not, and takes as long
(``passwords.verify_password`` checks a dummy hash for an unknown address); the account's audit log has it.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Account, ApiKey, ConsoleSession
from master.services.accounts import passwords, totp, vault
from master.services.accounts.audit import Audit, record
from master.services.accounts.core import (
    InvalidEmail,
    Principal,
    account_disabled,
    authenticate_key,
    find_by_email,
    normalize_email,
)
from shared.errors import Forbidden, Unauthorized
from shared.ids import new_id, secret_hash
from shared.settings import MasterSettings

COOKIE = "gm_session"
CSRF_HEADER = "X-CSRF-Token"
TOKEN_BYTES = 32
# Refreshing last_seen_at on every call would make every read a write; once a minute is enough.
TOUCH_EVERY = timedelta(seconds=60)


class CsrfFailed(Forbidden):
    code = "csrf_failed"


@dataclass(frozen=True)
class SignedIn:
    """A live console session: who it is, its CSRF token and when it ends at the latest."""

    principal: Principal
    session_id: str
    csrf_token: str
    expires_at: datetime

    def view(self) -> dict[str, object]:
        return {
            "account": {"id": self.principal.account_id, "name": self.principal.name, "role": self.principal.role,
                        "email_verified": self.principal.email_verified},
            "csrf_token": self.csrf_token,
            "expires_at": self.expires_at.isoformat(),
        }

    def check_csrf(self, given: str | None) -> None:
        """Refuse a state-changing call whose ``X-CSRF-Token`` is missing or wrong (constant-time compare)."""
        if not given or not hmac.compare_digest(given.encode(), self.csrf_token.encode()):
            raise CsrfFailed(
                f"this change needs the {CSRF_HEADER} header of your console session; reload the console and try again"
            )


def _idle_end(row: ConsoleSession, settings: MasterSettings) -> datetime:
    return row.last_seen_at + timedelta(seconds=settings.console_session_idle_s)


async def sign_in(
    session: AsyncSession, api_key: str, *, settings: MasterSettings, now: datetime, address: str | None = None
) -> tuple[str, SignedIn]:
    """Open a session for a valid API key; returns the cookie's token (the only time it exists) and the session."""
    principal, key_id = await authenticate_key(session, api_key, address=address, now=now)
    token, signed_in = await _open(session, principal, key_id, settings=settings, now=now)
    record(session, principal.account_id, Audit.SIGNED_IN, at=now, address=address, method="api_key", session_id=signed_in.session_id)
    return token, signed_in


def wrong_password() -> Unauthorized:
    return Unauthorized("the email address or the password is wrong; try again, or reset your password from the sign-in page",
                        code="invalid_credentials")  # fmt: skip


async def sign_in_password(
    session: AsyncSession, email: str, password: str, *, settings: MasterSettings, now: datetime, address: str | None,
    totp_code: str | None = None,
) -> tuple[str, SignedIn] | Unauthorized:
    """Open a session for an account's email and password (and its TOTP code, when it has a second factor); else the
    401 to answer once the caller has committed the failure's audit record: ``wrong_password()`` (the same for an
    unknown address), ``totp_required`` (the password was right; ask for the code), ``invalid_totp``. A hash made
    under older settings is made again."""
    try:
        account = await find_by_email(session, normalize_email(email))
    except InvalidEmail:
        account = None
    matches, rehashed = await passwords.verify_password(account.password_hash if account else None, password, settings)
    if account is None or not matches:
        if account is not None:
            record(session, account.id, Audit.SIGN_IN_FAILED, at=now, address=address, method="password")
        return wrong_password()
    if account.disabled_at is not None:
        raise account_disabled()
    if rehashed is not None:
        account.password_hash = rehashed
    if account.totp_secret is not None:
        if not totp_code:
            return totp.TotpRequired("this account has a second factor: send totp_code, the code your authenticator app shows "
                                     "(or a recovery code)")  # fmt: skip
        if not totp.check(account, totp_code, now=now, address=address, session=session, key=vault.key_of(settings)):
            record(session, account.id, Audit.SIGN_IN_FAILED, at=now, address=address, method="totp")
            return totp.InvalidTotp("that code does not match (or was used already); type the newest code from your app")
    token, signed_in = await _open(session, Principal.of(account), None, settings=settings, now=now)
    record(session, account.id, Audit.SIGNED_IN, at=now, address=address, method="password", session_id=signed_in.session_id)
    return token, signed_in


async def open_session(
    session: AsyncSession, principal: Principal, *, settings: MasterSettings, now: datetime
) -> tuple[str, SignedIn]:
    """Open a session for an account a sign-in method has proved (``passkeys.sign_in``), with every scope."""
    return await _open(session, principal, None, settings=settings, now=now)


async def _open(
    session: AsyncSession, principal: Principal, key_id: str | None, *, settings: MasterSettings, now: datetime
) -> tuple[str, SignedIn]:
    # The account's dead sessions go as it opens a new one, so the table stays as small as the live ones.
    await session.execute(
        delete(ConsoleSession).where(
            ConsoleSession.account_id == principal.account_id,
            or_(ConsoleSession.expires_at <= now, ConsoleSession.ended_at.is_not(None),
                ConsoleSession.last_seen_at <= now - timedelta(seconds=settings.console_session_idle_s)),
        )
    )  # fmt: skip
    token = secrets.token_urlsafe(TOKEN_BYTES)
    row = ConsoleSession(
        id=new_id("sess"), token_hash=secret_hash(token), account_id=principal.account_id, api_key_id=key_id,
        csrf_token=secrets.token_urlsafe(TOKEN_BYTES), created_at=now, last_seen_at=now,
        expires_at=now + timedelta(seconds=settings.console_session_max_s),
    )  # fmt: skip
    session.add(row)
    await session.flush()
    return token, SignedIn(principal, row.id, row.csrf_token, row.expires_at)


async def resolve(session: AsyncSession, token: str, *, settings: MasterSettings, now: datetime) -> SignedIn:
    """The live session of a cookie's token; 401 ``session_expired`` or ``not_signed_in`` otherwise."""
    row = (
        await session.execute(
            select(ConsoleSession, Account, ApiKey)
            .join(Account, Account.id == ConsoleSession.account_id)
            .outerjoin(ApiKey, ApiKey.id == ConsoleSession.api_key_id)
            .where(ConsoleSession.token_hash == secret_hash(token))
        )
    ).first()
    if row is None:
        raise Unauthorized("you are not signed in; sign in again", code="not_signed_in")
    console, account, key = row
    if account.disabled_at is not None:
        raise account_disabled()
    if (ended := _ended(console, key, settings=settings, now=now)) is not None:
        raise ended
    if now - console.last_seen_at >= TOUCH_EVERY:
        await session.execute(update(ConsoleSession).where(ConsoleSession.id == console.id).values(last_seen_at=now))
    # A session opened with a key has that key's scopes: a read-only key cannot become a session that rents.
    return SignedIn(Principal.of(account, key), console.id, console.csrf_token, console.expires_at)


def _ended(console: ConsoleSession, key: ApiKey | None, *, settings: MasterSettings, now: datetime) -> Unauthorized | None:
    """Why the session is over (signed out, its key revoked, past its end or idle too long); ``None`` while it is live."""
    if console.ended_at is not None:
        return Unauthorized("you are not signed in; sign in again", code="not_signed_in")
    if key is not None and key.revoked_at is not None:
        return Unauthorized("the API key of this session was revoked; sign in with a valid key", code="session_expired")
    if now >= console.expires_at or now >= _idle_end(console, settings):
        return Unauthorized("your session expired; sign in again", code="session_expired")
    return None


async def is_live(session: AsyncSession, session_id: str, *, settings: MasterSettings, now: datetime) -> bool:
    """Whether the session is still signed in, by the rules of ``resolve``; a live stream asks at each poll.

    Reads only: unlike a request, a stream's poll is not activity that keeps the session from going idle."""
    row = (
        await session.execute(
            select(ConsoleSession, ApiKey, Account.disabled_at)
            .outerjoin(ApiKey, ApiKey.id == ConsoleSession.api_key_id)
            .join(Account, Account.id == ConsoleSession.account_id)
            .where(ConsoleSession.id == session_id)
        )
    ).first()
    return row is not None and row[2] is None and _ended(row[0], row[1], settings=settings, now=now) is None


async def sign_out(session: AsyncSession, session_id: str, *, now: datetime) -> bool:
    """End a session; idempotent (True when this call ended it)."""
    result = await session.execute(
        update(ConsoleSession).where(ConsoleSession.id == session_id, ConsoleSession.ended_at.is_(None)).values(ended_at=now)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


async def end_all(session: AsyncSession, account_id: str, *, now: datetime) -> int:
    """End every live console session of the account; how many."""
    result = await session.execute(
        update(ConsoleSession).where(ConsoleSession.account_id == account_id, ConsoleSession.ended_at.is_(None)).values(ended_at=now)
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


async def sign_out_everywhere(session: AsyncSession, account_id: str, *, now: datetime, address: str | None) -> int:
    """Sign the account out of every browser (its API keys keep working: revoke those one by one)."""
    ended = await end_all(session, account_id, now=now)
    record(session, account_id, Audit.SIGNED_OUT_EVERYWHERE, at=now, address=address, sessions_ended=ended)
    return ended
