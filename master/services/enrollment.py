"""Enrollment: one-time tokens a provider creates, exchanged by an agent for a client certificate.

The agent's private key never leaves its host: it sends a CSR, and the master's CA
signs a certificate naming a *new* host id, whatever the CSR asked for.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select, update

from master.context import Master
from master.models import EnrollmentToken, Host
from master.services.hoststate import record_initial_state
from shared.errors import EnrollmentError
from shared.ids import new_id, new_secret, secret_hash

log = logging.getLogger(__name__)

TOKEN_PREFIX = "gmt"


@dataclass(frozen=True)
class EnrollmentResult:
    host_id: str
    certificate_pem: str
    ca_certificate_pem: str
    relay_urls: list[str]
    not_after: datetime


async def create_token(master: Master, account_id: str) -> tuple[str, datetime]:
    token = new_secret(TOKEN_PREFIX)
    expires_at = master.clock.now() + timedelta(minutes=master.settings.enrollment_token_minutes)
    async with master.db.session() as session:
        session.add(
            EnrollmentToken(id=new_id("tok"), account_id=account_id, token_hash=secret_hash(token), expires_at=expires_at)
        )
    return token, expires_at


async def enroll(master: Master, token: str, csr_pem: str, *, hostname: str = "") -> EnrollmentResult:
    """Redeem a token: create the host and sign its certificate. A token works once."""
    now = master.clock.now()
    async with master.db.session() as session:
        row = await session.scalar(select(EnrollmentToken).where(EnrollmentToken.token_hash == secret_hash(token)))
        if row is None:
            raise EnrollmentError("unknown enrollment token; create a new one in the console", code="token_unknown")
        if row.used_at is not None:
            raise EnrollmentError("this enrollment token was already used; create a new one", code="token_used")
        if row.expires_at <= now:
            raise EnrollmentError("this enrollment token has expired; create a new one", code="token_expired")
        host_id = new_id("h")
        # Conditional update: of two agents racing with one token, exactly one wins.
        claimed = await session.execute(
            update(EnrollmentToken)
            .where(EnrollmentToken.id == row.id, EnrollmentToken.used_at.is_(None))
            .values(used_at=now, host_id=host_id)
        )
        if claimed.rowcount != 1:  # type: ignore[attr-defined]
            raise EnrollmentError("this enrollment token was already used; create a new one", code="token_used")
        issued = master.ca.sign_agent_csr(
            csr_pem.encode(), host_id=host_id, validity=timedelta(hours=master.settings.agent_cert_hours)
        )
        host = Host(
            id=host_id,
            owner_id=row.account_id,
            name=hostname[:255],
            state="enrolling",
            cert_serial=issued.serial_hex,
            cert_not_after=issued.not_after,
        )
        session.add(host)
        await session.flush()
        record_initial_state(session, host, cause="enrolled with a one-time token", actor=f"account:{row.account_id}")
    log.info("host %s enrolled for account %s", host_id, row.account_id)
    return EnrollmentResult(
        host_id=host_id,
        certificate_pem=issued.cert_pem.decode(),
        ca_certificate_pem=master.ca.cert_pem.decode(),
        relay_urls=list(master.settings.relay_urls),
        not_after=issued.not_after,
    )
