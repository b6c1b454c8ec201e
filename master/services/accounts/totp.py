"""The TOTP second factor (RFC 6238 through pyotp): an authenticator app's 6-digit code at each password sign-in.

Setting it up takes two steps, so that a mistyped secret never locks anyone out: ``begin`` makes a secret (160 bits,
base32) and keeps it aside (``totp_pending``); ``confirm`` with a code from the app moves it to ``totp_secret`` and
answers ten recovery codes, shown once (the account keeps their SHA-256; each works once, in place of a code).
``disable`` takes a current code or a recovery code. Only a console session may change it (``routes_accounts``): an
API key never turns a second factor on or off.

A code is accepted within one 30-second step either way (clocks drift), and only once: the last accepted step is kept,
so a code seen over a shoulder cannot sign in again. Enabled, confirmed, disabled and recovery codes used are in the
audit log.

At rest the secrets are sealed (``shared.crypto.sealed``, AES-256-GCM under the ``secrets_key`` setting, bound to the
account's id) when the master has a key; without one they are kept as before, base32 in the clear. A secret stored in
the clear before the key was set still works, and is sealed the next time it is used. A sealed secret on a master
without the key (or with another) answers 503 saying to set the key it was sealed with.
"""

from __future__ import annotations

import hmac
import secrets
from datetime import datetime

import pyotp
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Account
from master.services.accounts import vault
from master.services.accounts.audit import Audit, record
from shared.crypto import sealed
from shared.errors import BadRequest, Conflict, Unauthorized
from shared.ids import secret_hash

ISSUER = "gpumarket"
RECOVERY_CODES = 10
STEP_S = 30


class InvalidTotp(Unauthorized):
    code = "invalid_totp"


class TotpRequired(Unauthorized):
    code = "totp_required"


PURPOSE = "totp"


def _stored(account: Account, secret: str, key: bytes | None) -> str:
    return secret if key is None else sealed.seal(key, secret, owner=vault.owner(PURPOSE, account.id))


def _read(account: Account, value: str, key: bytes | None) -> str:
    """The base32 secret of a stored value: sealed (opened with ``key``) or one kept in the clear."""
    if not sealed.is_sealed(value):
        return value
    if key is None:
        raise vault.SecretsKeyUnset("this account's second factor is sealed with a secrets_key this master lacks: its "
                                    "operator must set the secrets_key it was sealed with (docs/operations.md)")  # fmt: skip
    return sealed.unseal(key, value, owner=vault.owner(PURPOSE, account.id))


def _totp(secret: str) -> pyotp.TOTP:
    return pyotp.TOTP(secret, issuer=ISSUER, interval=STEP_S)


def _step(now: datetime) -> int:
    return int(now.timestamp()) // STEP_S


def _recovery_code() -> str:
    raw = secrets.token_hex(5)  # 40 bits each, ten of them, each good once
    return f"{raw[:5]}-{raw[5:]}"


def check(
    account: Account, code: str, *, now: datetime, address: str | None, session: AsyncSession, key: bytes | None = None
) -> bool:
    """Whether ``code`` (a current TOTP code, or an unused recovery code) is good for the account; a code is used up.
    ``key``: the master's ``secrets_key`` (``vault.key_of``); a secret kept in the clear is sealed with it here."""
    code = code.strip().replace(" ", "")
    if account.totp_secret is None or not code or len(code) > 32:
        return False
    if code.isdigit() and len(code) == 6:
        secret = _read(account, account.totp_secret, key)
        if key is not None and not sealed.is_sealed(account.totp_secret):
            account.totp_secret = _stored(account, secret, key)  # kept in the clear before the key was set: sealed now
        totp = _totp(secret)
        for step in (_step(now) - 1, _step(now), _step(now) + 1):
            if (account.totp_last_step is None or step > account.totp_last_step) and hmac.compare_digest(totp.at(step * STEP_S), code):
                account.totp_last_step = step
                return True
        return False
    hashed = secret_hash(code.lower())
    if hashed in (account.totp_recovery or []):
        account.totp_recovery = [h for h in account.totp_recovery or [] if h != hashed]
        record(session, account.id, Audit.RECOVERY_CODE_USED, at=now, address=address, left=len(account.totp_recovery))
        return True
    return False


def begin(account: Account, *, key: bytes | None = None) -> dict[str, str]:
    """A new secret to enter in an authenticator app (its ``otpauth://`` URI too), kept aside (sealed with ``key``)
    until ``confirm``."""
    if account.totp_secret is not None:
        raise Conflict("a second factor is on already; turn it off first to set up another", code="totp_enabled")
    secret = pyotp.random_base32(32)
    account.totp_pending = _stored(account, secret, key)
    label = account.email or account.name
    return {"secret": secret, "otpauth_uri": _totp(secret).provisioning_uri(name=label, issuer_name=ISSUER)}


def confirm(
    session: AsyncSession, account: Account, code: str, *, now: datetime, address: str | None, key: bytes | None = None
) -> list[str]:
    """Turn the pending secret on with a code from the app; returns the recovery codes (the only time they exist)."""
    if account.totp_pending is None:
        raise BadRequest("nothing to confirm: start setting up a second factor first", code="totp_not_started")
    code = code.strip().replace(" ", "")
    totp = _totp(_read(account, account.totp_pending, key))
    step = next((s for s in (_step(now) - 1, _step(now), _step(now) + 1) if code.isdigit() and hmac.compare_digest(totp.at(s * STEP_S), code)), None)
    if step is None:
        raise InvalidTotp("that code does not match; check the time on your phone and type the newest code")
    codes = [_recovery_code() for _ in range(RECOVERY_CODES)]
    account.totp_secret, account.totp_pending, account.totp_last_step = account.totp_pending, None, step
    account.totp_recovery = [secret_hash(c) for c in codes]
    record(session, account.id, Audit.TOTP_ENABLED, at=now, address=address)
    return codes


def disable(
    session: AsyncSession, account: Account, code: str, *, now: datetime, address: str | None, key: bytes | None = None
) -> None:
    if account.totp_secret is None:
        return
    if not check(account, code, now=now, address=address, session=session, key=key):
        raise InvalidTotp("that code does not match; type the newest code from your app, or a recovery code")
    account.totp_secret = account.totp_pending = account.totp_recovery = None
    account.totp_last_step = None
    record(session, account.id, Audit.TOTP_DISABLED, at=now, address=address)
