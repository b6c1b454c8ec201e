"""Private registry credentials: an account's logins to image registries, one per image prefix, sealed at rest.

A credential is for the images under its ``prefix``: a registry host (``registry.example.com:5000/``, every image
there) or a path under it (``registry.example.com:5000/myorg/``); ``docker.io/myorg/`` for Docker Hub. A rental's
image gets the credential of the longest prefix it falls under (path components match whole: ``…/myorg/`` is not
``…/myorg2/``).

Where the secret lives: the API takes it once (``add``) and seals it at once (``shared.crypto.sealed``, AES-256-GCM
under the ``secrets_key`` setting, bound to the account and the credential's id): the row holds only the sealed
value, no answer holds it, no log line or audit event names it. A start command's row (``commands.args``) never
holds it either: ``RegistryLogins.extra_args`` opens it as the command is sent (``master.services.commands.
publish``), each time it is sent, seals it to the host's certificate key (``shared.crypto.sealed_to``) and adds that
as ``sealed_registry_auth`` to the delivery only; only the agent opens it, for that pull, and keeps nothing. A credential added, replaced or removed before a start command goes out is the one it takes.
A master without ``secrets_key`` refuses to store one (503 ``secrets_key_unset``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final

from cryptography.hazmat.primitives.asymmetric import ec
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Account, Command, HostCertificate, RegistryCredential, Rental
from master.services.accounts import vault
from master.services.accounts.audit import Audit, record
from shared import protocol
from shared.crypto import load_public_key, sealed, sealed_to
from shared.errors import ConfigError, Conflict, GpumarketError, NotFound, ValidationFailed
from shared.ids import new_id
from shared.imageref import parse_image_reference
from shared.settings import MasterSettings

log = logging.getLogger(__name__)

MAX_CREDENTIALS: Final = 50  # per account
PURPOSE: Final = "registry"
DOCKER_HUB: Final = "docker.io"
_DOMAIN_COMPONENT = r"(?:[a-z0-9]|[a-z0-9][a-z0-9-]*[a-z0-9])"
_PATH_COMPONENT = r"(?:[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*)"
PREFIX_RE: Final = re.compile(
    rf"(?P<host>{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*(?::[0-9]{{1,5}})?)(?P<path>(?:/{_PATH_COMPONENT})*)/?"
)
PREFIX_HINT: Final = "a registry host and optionally a path, e.g. registry.example.com:5000/myorg/ (docker.io/myorg/ for Docker Hub)"


class RegistryCredentialNotFound(NotFound):
    code = "registry_credential_not_found"


def normalize_prefix(text: str) -> str:
    """``host[:port]/[path/]`` with the host lower-case and one trailing slash; 422 for anything else, as given (a
    trailing newline or a scheme is a mistake to report, not to mend)."""
    candidate = text.lower() if text.isascii() else ""
    match = PREFIX_RE.fullmatch(candidate)
    host = match.group("host") if match else ""
    if match is None or len(text) > 255 or not ("." in host or ":" in host or host == "localhost"):
        raise ValidationFailed(f"prefix: {text[:80]!r} is not {PREFIX_HINT}")
    return f"{host}{match.group('path')}/"


def prefix_matches(prefix: str, image: str) -> bool:
    """Whether ``image`` (a reference as a rental names it) is under the normalized ``prefix``."""
    try:
        reference = parse_image_reference(image)
    except ValueError:
        return False
    return f"{reference.registry.lower()}/{reference.repository}/".startswith(prefix)


def view(row: RegistryCredential) -> dict[str, Any]:
    """What the API shows of a credential: never its secret."""
    return {
        "id": row.id, "prefix": row.prefix, "username": row.username, "created_at": row.created_at.isoformat(),
        "updated_at": row.updated_at.isoformat(), "last_used_at": row.last_used_at.isoformat() if row.last_used_at else None,
    }  # fmt: skip


def _owner(account_id: str, credential_id: str) -> str:
    return vault.owner(PURPOSE, f"{account_id}:{credential_id}")


async def add(
    session: AsyncSession,
    account_id: str,
    *,
    prefix: str,
    username: str,
    password: str,
    settings: MasterSettings,
    now: datetime,
    address: str | None = None,
) -> tuple[RegistryCredential, bool]:
    """Store (or replace: one per prefix, as ``docker login`` does) the account's login for ``prefix``; returns the
    row and whether it is new. 503 ``secrets_key_unset`` on a master without the key; 409 past ``MAX_CREDENTIALS``."""
    key = vault.require_key(settings, "registry credentials")
    normalized = normalize_prefix(prefix)
    # Two adds of one account are serialised (as SSH keys' are): the limit and the one-per-prefix rule hold.
    await session.execute(
        update(Account)
        .where(Account.id == account_id)
        .values(name=Account.name)
        .execution_options(synchronize_session=False)
    )
    row = await session.scalar(
        select(RegistryCredential).where(
            RegistryCredential.account_id == account_id, RegistryCredential.prefix == normalized
        )
    )
    created = row is None
    if row is None:
        count = await session.scalar(
            select(func.count())
            .select_from(RegistryCredential)
            .where(RegistryCredential.account_id == account_id)
        )
        if (count or 0) >= MAX_CREDENTIALS:
            raise Conflict(f"your account has {count} registry credentials, the most it may hold ({MAX_CREDENTIALS}); remove one "
                           "you no longer use first", code="too_many_registry_credentials")  # fmt: skip
        credential_id = new_id("regc")
        row = RegistryCredential(id=credential_id, account_id=account_id, prefix=normalized, username=username,
                                 secret=sealed.seal(key, password, owner=_owner(account_id, credential_id)), created_at=now, updated_at=now)  # fmt: skip
        try:
            async with session.begin_nested():
                session.add(row)
                await session.flush()
        except IntegrityError:  # the same prefix added at the same moment by another request
            raise Conflict(f"a credential for {normalized} was added at the same moment; list them and try again",
                           code="registry_credential_exists") from None  # fmt: skip
    else:
        row.username, row.updated_at = username, now
        row.secret = sealed.seal(key, password, owner=_owner(account_id, row.id))
    record(session, account_id, Audit.REGISTRY_CREDENTIAL_ADDED, at=now, address=address, credential_id=row.id, prefix=normalized,
           username=username, replaced=not created)  # fmt: skip
    return row, created


async def list_credentials(session: AsyncSession, account_id: str) -> list[dict[str, Any]]:
    rows = await session.scalars(
        select(RegistryCredential)
        .where(RegistryCredential.account_id == account_id)
        .order_by(RegistryCredential.prefix)
    )
    return [view(row) for row in rows]


async def remove(
    session: AsyncSession, account_id: str, credential_id: str, *, now: datetime, address: str | None = None
) -> dict[str, Any]:
    """Delete one of the account's credentials; 404 ``registry_credential_not_found`` for another account's or an unknown id."""
    row = await session.scalar(
        select(RegistryCredential).where(
            RegistryCredential.id == credential_id, RegistryCredential.account_id == account_id
        )
    )
    if row is None:
        raise RegistryCredentialNotFound(f"no registry credential {credential_id[:60]!r} in this account; list them with "
                                         "GET /registry-credentials")  # fmt: skip
    answer = view(row)
    await session.delete(row)
    record(
        session,
        account_id,
        Audit.REGISTRY_CREDENTIAL_REMOVED,
        at=now,
        address=address,
        credential_id=row.id,
        prefix=row.prefix,
    )
    return answer


def choose(rows: Sequence[RegistryCredential], image: str) -> RegistryCredential | None:
    """The credential of the longest prefix ``image`` is under, if any."""
    matching = [row for row in rows if prefix_matches(row.prefix, image)]
    return max(matching, key=lambda row: len(row.prefix), default=None)


def server_of(prefix: str) -> str:
    return prefix.split("/", 1)[0]


class RegistryLogins:
    """``master.context.CommandSecrets`` for registry logins: what a start command carries besides its stored args."""

    def __init__(self, settings: MasterSettings) -> None:
        self.settings = settings

    async def extra_args(
        self, session: AsyncSession, commands: Sequence[Command], *, now: datetime
    ) -> dict[str, dict[str, Any]]:
        """Per command id, ``{"sealed_registry_auth": <ecies:v1 token>}`` for the start commands whose container image is
        under one of their renter's credentials (its ``last_used_at`` set): the login sealed to the key of the host's
        newest unrevoked certificate, bound to the host and the command (``protocol.registry_auth_context``), so that
        neither the bus nor the relay reads it. A credential that does not open, or a host with no known key, is left
        out and logged (ids, never the secret): the pull then goes without it."""
        starts = {
            c.rental_id: c
            for c in commands
            if c.kind == START and c.rental_id is not None and _image(c.args) is not None
        }
        if not starts:
            return {}
        renters = {
            r: a
            for r, a in (
                await session.execute(select(Rental.id, Rental.renter_id).where(Rental.id.in_(list(starts))))
            ).all()
        }
        rows = (
            await session.scalars(
                select(RegistryCredential).where(RegistryCredential.account_id.in_(set(renters.values())))
            )
        ).all()
        if not rows:
            return {}
        key = vault.key_of(self.settings)
        host_keys = await _host_keys(session, {c.host_id for c in starts.values()}, now=now)
        extra: dict[str, dict[str, Any]] = {}
        for rental_id, command in starts.items():
            account_id = renters.get(rental_id)
            image = _image(command.args)
            row = choose([r for r in rows if r.account_id == account_id], image or "") if account_id else None
            if row is None:
                continue
            host_key = host_keys.get(command.host_id)
            if host_key is None:
                log.error("registry credential %s (%s) of account %s not sent to host %s: the host has no certificate "
                          "whose key is known (signed before keys were recorded? it gets one at its next renewal); "
                          "rental %s pulls without it", row.id, row.prefix, row.account_id, command.host_id, rental_id)  # fmt: skip
                continue
            try:
                if key is None:
                    raise vault.SecretsKeyUnset("secrets_key is unset")
                password = sealed.unseal(key, row.secret, owner=_owner(row.account_id, row.id))
            except GpumarketError as exc:
                log.error("registry credential %s (%s) of account %s does not open (%s): rental %s pulls without it",
                          row.id, row.prefix, row.account_id, exc.code, rental_id)  # fmt: skip
                continue
            auth = protocol.RegistryAuth(server=server_of(row.prefix), username=row.username, password=password)
            context = protocol.registry_auth_context(command.host_id, command.id)
            token = sealed_to.seal_to(host_key, auth.model_dump_json().encode(), context)
            extra[command.id] = {"sealed_registry_auth": token}
            row.last_used_at = now
        return extra


async def _host_keys(
    session: AsyncSession, host_ids: set[str], *, now: datetime
) -> dict[str, ec.EllipticCurvePublicKey]:
    """Per host, the public key of its newest certificate that is neither revoked nor expired: the one its agent
    holds the key of (a renewal's new key waits in the agent's ``key.next.pem`` from before the master signs it,
    and the agent tries it too: ``agent/certificates.py``). A host whose newest certificate has no recorded key
    (signed before keys were) is left out."""
    rows = await session.execute(
        select(HostCertificate.host_id, HostCertificate.public_key)
        .where(HostCertificate.host_id.in_(host_ids), HostCertificate.revoked_at.is_(None), HostCertificate.not_after > now)
        .order_by(HostCertificate.host_id, HostCertificate.issued_at.desc(), HostCertificate.serial.desc())
    )
    newest: dict[str, str | None] = {}
    for host_id, public_key in rows.all():
        newest.setdefault(host_id, public_key)
    keys: dict[str, ec.EllipticCurvePublicKey] = {}
    for host_id, pem in newest.items():
        if pem is None:
            continue
        try:
            keys[host_id] = load_public_key(pem)
        except ConfigError as exc:
            log.error("host %s: its certificate's recorded key does not load (%s)", host_id, exc)
    return keys


host_certificate_keys = _host_keys  # also what a volume copy's login is sealed to (master/services/volumes/copy.py)

START: Final = protocol.StartWorkload.model_fields["kind"].default


def _image(args: dict[str, Any]) -> str | None:
    workload = args.get("workload")
    if (
        isinstance(workload, dict)
        and workload.get("kind") == "container"
        and isinstance(workload.get("image"), str)
    ):
        return str(workload["image"])
    return None
