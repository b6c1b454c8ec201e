"""Each account's security log: what happened to how it signs in, when, and from which address.

Written in the transaction of the change it records (a sign-up, a sign-in or a failed one, a verified address, a
password reset, signing out everywhere), so the log never says something happened that did not, nor misses
what did. The owner reads its own (``GET /audit-events``), newest first. The details never hold a secret: no
password, token or key, only what a person needs to recognise the event (the key's prefix, the session's id).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import AuditEvent
from shared.ids import new_id


class Audit(StrEnum):
    SIGNED_UP = "signed_up"
    EMAIL_VERIFIED = "email_verified"
    VERIFICATION_SENT = "verification_sent"
    SIGNED_IN = "signed_in"
    SIGN_IN_FAILED = "sign_in_failed"
    SIGNED_OUT = "signed_out"
    SIGNED_OUT_EVERYWHERE = "signed_out_everywhere"
    PASSWORD_RESET_REQUESTED = "password_reset_requested"
    PASSWORD_RESET = "password_reset"
    KEY_CREATED = "api_key_created"
    KEY_REVOKED = "api_key_revoked"
    TOTP_ENABLED = "totp_enabled"
    TOTP_DISABLED = "totp_disabled"
    RECOVERY_CODE_USED = "recovery_code_used"
    PASSKEY_ADDED = "passkey_added"
    PASSKEY_REMOVED = "passkey_removed"
    TEAM_CREATED = "team_created"
    MEMBER_INVITED = "member_invited"
    INVITATION_REVOKED = "invitation_revoked"
    MEMBER_ADDED = "member_added"
    MEMBER_ROLE_CHANGED = "member_role_changed"
    MEMBER_REMOVED = "member_removed"
    REGISTRY_CREDENTIAL_ADDED = "registry_credential_added"
    REGISTRY_CREDENTIAL_REMOVED = "registry_credential_removed"


def record(
    session: AsyncSession, account_id: str, kind: Audit, /, *, at: datetime, address: str | None = None, **detail: Any
) -> None:
    """Add an event to the account's log, in the caller's transaction."""
    session.add(AuditEvent(id=new_id("aud"), account_id=account_id, at=at, kind=kind.value, address=address, detail=detail))


def view(event: AuditEvent) -> dict[str, Any]:
    return {"id": event.id, "at": event.at.isoformat(), "kind": event.kind, "address": event.address, "detail": event.detail}


async def events(session: AsyncSession, account_id: str, *, limit: int, offset: int) -> tuple[Sequence[AuditEvent], int]:
    """The account's events, newest first, and how many there are."""
    query = select(AuditEvent).where(AuditEvent.account_id == account_id)
    total = await session.scalar(select(func.count()).select_from(query.subquery()))
    rows = await session.scalars(query.order_by(AuditEvent.at.desc(), AuditEvent.id.desc()).limit(limit).offset(offset))
    return rows.all(), int(total or 0)


async def audit_log(session: AsyncSession, account_id: str, *, limit: int, offset: int) -> tuple[list[dict[str, Any]], int]:
    """A page of the account's log as the API shows it, and the total."""
    rows, total = await events(session, account_id, limit=limit, offset=offset)
    return [view(row) for row in rows], total
