"""Enrollment: one-time tokens a provider creates, exchanged by an agent for a client certificate.

The agent's private key never leaves its host: it sends a CSR, and the master's CA
signs a certificate naming a *new* host id, whatever the CSR asked for.

Every certificate signed for a host (at enrollment and at each renewal) is recorded in
``host_certificates`` in the transaction that signs it. Revoking the host revokes every one of
them; a renewal's previous certificates are revoked once the host connects with the new one
(``retire_superseded``, on the hello a relay forwards with the connection's serial). Relays
refuse revoked serials, which reach them through the registry (``publish_revocations``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import Master
from master.models import EnrollmentToken, Gpu, Host, HostCertificate, Rental
from master.services import commands, market, rentals
from master.services.accounts import Principal
from master.services.lifecycle.hosts import record_initial_state, transition
from master.services.lifecycle.rentals import ACTIVE_STATES
from shared import protocol
from shared.crypto import IssuedCertificate, certificate_public_key, load_certificate, public_key_to_pem
from shared.errors import EnrollmentError, NotFound, SequenceJump
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


async def _usable_token(session: AsyncSession, token: str, now: datetime) -> EnrollmentToken:
    """The token's row if it can enroll a host at ``now``; else ``EnrollmentError`` saying why (its code: ``token_unknown``,
    ``token_used`` or ``token_expired``)."""
    row = await session.scalar(select(EnrollmentToken).where(EnrollmentToken.token_hash == secret_hash(token)))
    if row is None:
        raise EnrollmentError("unknown enrollment token; create a new one in the console", code="token_unknown")
    if row.used_at is not None:
        raise EnrollmentError("this enrollment token was already used; create a new one", code="token_used")
    if row.expires_at <= now:
        raise EnrollmentError("this enrollment token has expired; create a new one", code="token_expired")
    return row


async def check_token(master: Master, token: str) -> datetime:
    """Whether ``token`` can enroll a host now, without using it: its expiry, or the ``EnrollmentError`` that ``enroll``
    would raise. Changes nothing.

    The installer asks before it downloads anything, so that a refused token costs a provider no install;
    ``enroll`` checks again, since a token may be used or expire in between."""
    async with master.db.session() as session:
        row = await _usable_token(session, token, master.clock.now())
        return row.expires_at


def certificate_row(host_id: str, issued: IssuedCertificate, *, issued_at: datetime) -> HostCertificate:
    """The ``host_certificates`` row of a certificate just signed for ``host_id``, with its public key (what a
    start's registry login is sealed to)."""
    public_key = public_key_to_pem(certificate_public_key(load_certificate(issued.cert_pem)))
    return HostCertificate(serial=issued.serial_hex, host_id=host_id, issued_at=issued_at, not_after=issued.not_after,
                           public_key=public_key)  # fmt: skip


async def enroll(master: Master, token: str, csr_pem: str, *, hostname: str = "") -> EnrollmentResult:
    """Redeem a token: create the host and sign its certificate. A token works once."""
    now = master.clock.now()
    async with master.db.session() as session:
        row = await _usable_token(session, token, now)
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
        session.add(certificate_row(host_id, issued, issued_at=now))
        record_initial_state(session, host, cause="enrolled with a one-time token", actor=f"account:{row.account_id}")
    log.info("host %s enrolled for account %s", host_id, row.account_id)
    return EnrollmentResult(
        host_id=host_id,
        certificate_pem=issued.cert_pem.decode(),
        ca_certificate_pem=master.ca.cert_pem.decode(),
        relay_urls=list(master.settings.relay_urls),
        not_after=issued.not_after,
    )


async def renew(master: Master, session: AsyncSession, envelope: protocol.BusEnvelope) -> str | None:
    """Sign a connected agent's renewal CSR; returns the id of the ``install_certificate`` command.

    The request arrived over the agent's authenticated connection (the relay checked its
    certificate and that it names this host), so no token is needed. Once per
    ``(host, seq)``: a redelivered request signs nothing new.
    """
    message = envelope.message
    assert isinstance(message, protocol.RenewCertificate)
    host = await session.get(Host, message.host_id, with_for_update=True)
    if host is None or host.state == "revoked":
        log.warning("renewal from %s refused: %s", message.host_id, "unknown host" if host is None else "host is revoked")
        return None
    if message.seq <= host.last_renewal_seq:
        return None
    try:
        protocol.check_seq(message.seq, host.last_seq, host_id=host.id)  # or it would pin last_renewal_seq for good
    except SequenceJump as exc:
        log.warning("renewal refused: %s", exc)
        return None
    try:
        issued = master.ca.sign_agent_csr(
            message.body.csr.encode(), host_id=host.id, validity=timedelta(hours=master.settings.agent_cert_hours)
        )
    except EnrollmentError as exc:
        log.warning("renewal from %s refused: %s", host.id, exc)
        host.last_renewal_seq = message.seq
        return None
    host.last_renewal_seq = message.seq
    host.cert_serial, host.cert_not_after = issued.serial_hex, issued.not_after
    # The previous certificates stay valid until the agent connects with this one (``retire_superseded``):
    # revoking them now would close the connection the agent still uses, with a code that stops it.
    session.add(certificate_row(host.id, issued, issued_at=master.clock.now()))
    command = commands.new_command(
        session,
        host_id=host.id,
        command=protocol.InstallCertificate(certificate=issued.cert_pem.decode(), ca_certificate=master.ca.cert_pem.decode()),
        rental_id=None,
    )
    log.info("host %s renewed its certificate (serial %s, until %s)", host.id, issued.serial_hex, issued.not_after)
    return command.id


async def revoke_host(master: Master, principal: Principal, host_id: str) -> Host:
    """Revoke a host: every certificate it was ever issued is refused from now on, open connections are closed.

    Its active rentals fail (the host can no longer be trusted to run them) and free their
    GPUs. Idempotent: revoking a revoked host changes nothing (its serials are published again).
    """
    now = master.clock.now()
    async with master.db.session() as session:
        host = await session.get(Host, host_id, with_for_update=True)
        if host is None or (principal.role != "admin" and host.owner_id != principal.account_id):
            raise NotFound(f"no host {host_id!r} among your hosts", code="host_not_found")
        if host.state != "revoked":
            transition(session, host, "revoked", cause=f"revoked by {principal.name}", actor=f"account:{principal.account_id}")
            host.revoked_at = now
            active = (
                await session.scalars(
                    select(Rental).where(Rental.host_id == host.id, Rental.state.in_(ACTIVE_STATES)).with_for_update()
                )
            ).all()
            for rental in active:
                # Credited like a lost host's: the renter is not charged a minimum the host cannot serve.
                await rentals.fail_rental(session, rental, code=market.FailureCode.HOST_REVOKED, reason="the host was revoked", at=now, lost_at=now)
            await session.execute(update(Gpu).where(Gpu.host_id == host.id).values(present=False))
            await session.execute(
                update(HostCertificate)
                .where(HostCertificate.host_id == host.id, HostCertificate.revoked_at.is_(None))
                .values(revoked_at=now)
            )
        rows = await session.execute(
            select(HostCertificate.serial, HostCertificate.not_after).where(HostCertificate.host_id == host.id)
        )
        certificates = [(row.serial, row.not_after) for row in rows]
    count = await publish_revocations(master, certificates)
    log.warning("host %s revoked by %s (%d certificate(s) refused)", host_id, principal.name, count)
    return host


async def retire_superseded(master: Master, host_id: str, serial_in_use: str | None) -> int:
    """Revoke the host's certificates issued before ``serial_in_use``, the one its connection presents.

    Called for each hello (the first message of every connection), with the serial the relay
    read from the connection's certificate. Once a renewed certificate is in use, the ones
    before it are refused by every relay. Nothing happens for a serial that is not the host's,
    an already revoked one, or ``None`` (a relay that does not say). Returns how many were revoked.
    """
    if serial_in_use is None:
        return 0
    now = master.clock.now()
    async with master.db.session() as session:
        in_use = await session.get(HostCertificate, serial_in_use.lower())
        if in_use is None or in_use.host_id != host_id or in_use.revoked_at is not None:
            return 0
        older = (
            await session.scalars(
                select(HostCertificate)
                .where(HostCertificate.host_id == host_id, HostCertificate.revoked_at.is_(None),
                       HostCertificate.serial != in_use.serial, HostCertificate.issued_at <= in_use.issued_at)
                .with_for_update()
            )
        ).all()
        for certificate in older:
            certificate.revoked_at = now
        retired = [(c.serial, c.not_after) for c in older]
    if retired:
        await publish_revocations(master, retired)
        log.info("host %s connected with certificate %s; revoked the %d before it", host_id, serial_in_use, len(retired))
    return len(retired)


async def publish_revocations(master: Master, certificates: Sequence[tuple[str, datetime]] | None = None) -> int:
    """Tell the relays (through the registry) which certificate serials to refuse; returns how many.

    ``certificates`` are ``(serial, not_after)`` pairs; ``None`` reads every revoked certificate
    not yet expired from the database. Called on revocation and periodically, so a registry that
    lost its data (a Redis restart) is refilled within one period.
    """
    if certificates is None:
        now = master.clock.now()
        async with master.db.session() as session:
            rows = await session.execute(
                select(HostCertificate.serial, HostCertificate.not_after)
                .where(HostCertificate.revoked_at.is_not(None), HostCertificate.not_after > now)
            )
            certificates = [(row.serial, row.not_after) for row in rows]
    for serial, not_after in certificates:
        await master.registry.revoke(serial, until=not_after.timestamp())
    return len(certificates)


async def known_regions(master: Master) -> list[str]:
    """The regions a host may name (``install-agent.sh --region``): those of the live relays, sorted.

    A host measures its network to its own region's relay, so a region no relay serves is a typo."""
    return sorted({relay.region for relay in await master.registry.relays()})
