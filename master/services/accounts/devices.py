"""The CLI signs in through the browser (OAuth 2.0's device authorization grant, RFC 8628, in its simplest form).

``gpumarket login --browser`` asks for a code pair (``start``): a secret *device code* the CLI keeps and polls with,
and a short *user code* it shows with the console's URL. The user, signed in to the console, opens
``#/device/<user code>``, sees which client asks, and approves it with the scopes it may have (``approve``; a
console session only, never an API key). The CLI's next poll (``exchange``) gets a new API key of the account with
those scopes, named after the client, once: the pair is then used up. Until approval a poll answers
``authorization_pending``; after ``DEVICE_TTL`` the pair has expired. Approvals and the keys they make are in the
audit log (``api_key_created``, with ``by: device``).
"""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import DeviceCode
from master.services.accounts import keys
from shared.errors import BadRequest, NotFound
from shared.ids import new_id, secret_hash

DEVICE_TTL = timedelta(minutes=10)
POLL_INTERVAL_S = 2
ALPHABET = "BCDFGHJKLMNPQRSTVWXZ"  # no vowels (no words), no digits (no 0/O, 1/I)


class AuthorizationPending(BadRequest):
    code = "authorization_pending"


class ExpiredCode(BadRequest):
    code = "expired_token"


def _user_code() -> str:
    raw = "".join(secrets.choice(ALPHABET) for _ in range(8))
    return f"{raw[:4]}-{raw[4:]}"


async def start(session: AsyncSession, *, client_name: str, now: datetime) -> dict[str, Any]:
    device_code = secrets.token_urlsafe(32)
    row = DeviceCode(id=new_id("dev"), device_code_hash=secret_hash(device_code), user_code=_user_code(),
                     client_name=client_name, created_at=now, expires_at=now + DEVICE_TTL)  # fmt: skip
    session.add(row)
    await session.flush()
    return {"device_code": device_code, "user_code": row.user_code, "expires_in": int(DEVICE_TTL.total_seconds()),
            "interval": POLL_INTERVAL_S}  # fmt: skip


async def _pending(session: AsyncSession, user_code: str, now: datetime) -> DeviceCode:
    row = await session.scalar(select(DeviceCode).where(DeviceCode.user_code == user_code.strip().upper()).with_for_update())
    if row is None or row.approved_at is not None or now >= row.expires_at:
        raise NotFound("no sign-in waits for that code (it was used, has expired, or is mistyped); run `gpumarket login --browser` again",
                       code="device_code_not_found")  # fmt: skip
    return row


async def describe(session: AsyncSession, user_code: str, *, now: datetime) -> dict[str, Any]:
    row = await _pending(session, user_code, now)
    return {"user_code": row.user_code, "client_name": row.client_name, "expires_at": row.expires_at.isoformat()}


async def approve(session: AsyncSession, user_code: str, account_id: str, *, scopes: list[str] | None, now: datetime) -> dict[str, Any]:
    row = await _pending(session, user_code, now)
    row.account_id, row.scopes, row.approved_at = account_id, scopes, now
    return {"user_code": row.user_code, "client_name": row.client_name, "approved": True}


async def exchange(session: AsyncSession, device_code: str, *, now: datetime, address: str | None) -> dict[str, Any]:
    """The API key for an approved pair (once); 400 ``authorization_pending`` or ``expired_token`` otherwise."""
    row = await session.scalar(select(DeviceCode).where(DeviceCode.device_code_hash == secret_hash(device_code)).with_for_update())
    if row is None or row.used_at is not None or now >= row.expires_at:
        raise ExpiredCode("this sign-in has expired or was used; run `gpumarket login --browser` again")
    if row.approved_at is None or row.account_id is None:
        raise AuthorizationPending("not approved yet: open the link and approve the code in the console")
    row.used_at = now
    key, secret = await keys.make_key(session, row.account_id, name=row.client_name, scopes=row.scopes, expires_at=None,
                                      allowed_networks=None, now=now, address=address)  # fmt: skip
    return {**keys.key_view(key, now=now), "key": secret}
