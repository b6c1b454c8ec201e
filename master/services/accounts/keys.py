"""API keys an account manages: several, named, each with scopes, an optional expiry and the networks it may be used
from; made (the secret shown once), listed and revoked by their owner.

A key's **scopes** say which routes it may call; each route of the table declares the one it needs
(``master/api/base.py``: ``Route.needs``): ``read`` every GET, ``rent`` rentals, clusters, services, SSH keys and
connections, ``billing`` credit and the spend cap, ``provider`` hosts, listings and enrolment, ``admin`` the
operators' routes. The role still decides first (a renter's key with the ``provider`` scope is no provider's). A key
whose ``scopes`` is NULL has them all (the keys operators and ``gpumarket up`` make); a console session too.

A key may make keys with at most its own scopes, and revoke only keys whose scopes are within its own (or itself):
a key leaked with ``read`` cannot mint a ``rent`` key or revoke the owner's. Revoking takes effect on the next
request on every master (keys are looked up per request) and ends the console sessions opened with the key. An
expired key answers 401 ``api_key_expired``; one called from outside its networks 403 ``address_not_allowed``.
Made and revoked keys are in the audit log.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import ApiKey
from master.services.accounts.audit import Audit, record
from shared.errors import Forbidden, NotFound, ValidationFailed
from shared.ids import new_id, new_secret, secret_hash

API_KEY_PREFIX = "gmk"
MAX_KEYS = 50  # live keys per account
MAX_NETWORKS = 20


class Scope(StrEnum):
    READ = "read"
    RENT = "rent"
    BILLING = "billing"
    PROVIDER = "provider"
    ADMIN = "admin"


ALL_SCOPES = frozenset(Scope)
ORDER = [scope.value for scope in Scope]  # read, rent, billing, provider, admin: how lists show them


class ScopeMissing(Forbidden):
    code = "scope_missing"


class AddressNotAllowed(Forbidden):
    code = "address_not_allowed"


def normalize_networks(networks: Sequence[str] | None) -> list[str] | None:
    """CIDRs (or single addresses) in canonical form; 422 for one that is not."""
    if networks is None:
        return None
    if not networks or len(networks) > MAX_NETWORKS:
        raise ValidationFailed(f"allowed_networks: give 1 to {MAX_NETWORKS} networks, or leave it out for any address")
    canonical = []
    for text in networks:
        try:
            # As given: a trailing newline or a look-alike digit is a mistake to report, not to mend.
            canonical.append(str(ipaddress.ip_network(text if text.isascii() and text == text.strip() else "?", strict=False)))
        except ValueError:
            raise ValidationFailed(f"allowed_networks: {text[:60]!r} is not an address or a network such as 203.0.113.0/24") from None
    return canonical


def allows(networks: Sequence[str] | None, address: str | None) -> bool:
    if networks is None:
        return True
    try:
        ip = ipaddress.ip_address(address or "")
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in ipaddress.ip_network(network) for network in networks)


def _scope_list(scopes: Sequence[str] | None) -> list[str] | None:
    return None if scopes is None else sorted(set(scopes), key=ORDER.index)


async def make_key(
    session: AsyncSession, account_id: str, *, name: str, scopes: Sequence[str] | None, expires_at: datetime | None,
    allowed_networks: Sequence[str] | None, now: datetime, granted_by: frozenset[str] | None = None,
    address: str | None = None, team_id: str | None = None,
) -> tuple[ApiKey, str]:
    """Make a key; returns its row and its secret (the only time it exists). ``granted_by``: the scopes of the key the
    request came with (``None``: a console session or a key with every scope), which the new key may not exceed.
    ``team_id``: the key acts for that team only (made in the team's context; ``granted_by`` holds the role's rights)."""
    if scopes is not None and not scopes:
        raise ValidationFailed("scopes: give at least one of read, rent, billing, provider, admin")
    wanted = frozenset(scopes) if scopes is not None else ALL_SCOPES
    if granted_by is not None and not wanted <= granted_by:
        more = ", ".join(sorted(wanted - granted_by))
        raise ScopeMissing(f"a key may make keys with at most its own scopes; this one lacks {more} (use the console or a key that has it)")
    if expires_at is not None and expires_at <= now:
        raise ValidationFailed("expires_at: must be in the future")
    live = await session.scalar(
        select(ApiKey.id).where(ApiKey.account_id == account_id, ApiKey.revoked_at.is_(None)).offset(MAX_KEYS - 1).limit(1)
    )
    if live is not None:
        raise ValidationFailed(f"an account may hold {MAX_KEYS} live keys; revoke one first")
    secret = new_secret(API_KEY_PREFIX)
    row = ApiKey(id=new_id("key"), account_id=account_id, key_hash=secret_hash(secret), key_prefix=secret[:12], created_at=now,
                 name=name, scopes=_scope_list(scopes), expires_at=expires_at, allowed_networks=normalize_networks(allowed_networks),
                 team_id=team_id)  # fmt: skip
    session.add(row)
    await session.flush()
    record(session, account_id, Audit.KEY_CREATED, at=now, address=address, key_id=row.id, prefix=row.key_prefix, name=name,
           scopes=row.scopes or "all")  # fmt: skip
    return row, secret


def key_view(row: ApiKey, *, now: datetime) -> dict[str, Any]:
    state = "revoked" if row.revoked_at else "expired" if row.expires_at is not None and now >= row.expires_at else "active"
    return {
        "id": row.id, "name": row.name, "prefix": row.key_prefix, "scopes": row.scopes or ORDER,
        "all_scopes": row.scopes is None, "state": state, "created_at": row.created_at.isoformat(),
        "expires_at": row.expires_at.isoformat() if row.expires_at else None,
        "allowed_networks": row.allowed_networks, "last_used_at": row.last_used_at.isoformat() if row.last_used_at else None,
        "revoked_at": row.revoked_at.isoformat() if row.revoked_at else None, "team_id": row.team_id,
    }  # fmt: skip


async def list_keys(session: AsyncSession, account_id: str, *, now: datetime) -> list[dict[str, Any]]:
    rows = await session.scalars(select(ApiKey).where(ApiKey.account_id == account_id).order_by(ApiKey.created_at, ApiKey.id))
    return [key_view(row, now=now) for row in rows]


async def revoke_key(
    session: AsyncSession, account_id: str, key_id: str, *, now: datetime, revoked_by: tuple[str | None, frozenset[str] | None],
    address: str | None = None,
) -> dict[str, Any]:
    """Revoke one of the account's keys (idempotent). ``revoked_by``: the id and scopes of the key the request came with
    (``(None, None)`` for a console session). 404 ``api_key_not_found`` for another account's or an unknown id."""
    row = await session.scalar(select(ApiKey).where(ApiKey.id == key_id, ApiKey.account_id == account_id).with_for_update())
    if row is None:
        raise NotFound(f"no API key {key_id[:60]!r} in this account", code="api_key_not_found")
    by_id, by_scopes = revoked_by
    if by_scopes is not None and by_id != row.id and not frozenset(row.scopes or ALL_SCOPES) <= by_scopes:
        raise ScopeMissing("a key may revoke only itself or keys with at most its own scopes (use the console)")
    if row.revoked_at is None:
        await session.execute(update(ApiKey).where(ApiKey.id == row.id).values(revoked_at=now))
        row.revoked_at = now
        record(session, account_id, Audit.KEY_REVOKED, at=now, address=address, key_id=row.id, prefix=row.key_prefix, name=row.name)
    return key_view(row, now=now)
