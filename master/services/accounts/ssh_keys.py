"""Renters' SSH public keys: parsed strictly, stored in canonical OpenSSH form, authorised by the agent's SSH server.

An account registers a key by pasting one line of its ``.pub`` file (``type base64 [comment]``).
Accepted types are Ed25519, ECDSA on NIST P-256/384/521 and RSA of 2048 bits or more; DSA,
short RSA keys, certificates, authorized_keys options and private keys pasted by mistake are
refused with a stable code and a message that says what to paste instead. The key is kept as
``type base64`` (the comment dropped) with its SHA256 fingerprint exactly as ``ssh-keygen -lf``
prints it; the comment becomes the key's name unless one is given.

A key is unique per account by its fingerprint: posting it again is 409 ``ssh_key_exists`` (the
existing key's id in ``details``), never a second row. An account holds at most
``MAX_KEYS_PER_ACCOUNT`` keys. Nobody reads or deletes another account's keys, admins included:
another account's key id answers 404 exactly as an unknown one.

``authorized_keys`` is what the agent's SSH server authorises; a change reaches the account's running
rentals through ``master/services/accounts/access.py`` (the caller's ``access_changed``, in the same transaction).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_ssh_public_key
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Account, SshKey
from shared.errors import Conflict, NotFound, ValidationFailed
from shared.ids import new_id

MAX_KEY_BYTES = 16 * 1024
"""The longest line accepted (an RSA 16384-bit key is about 2.8 KiB)."""
MAX_NAME_CHARS = 100
MAX_KEYS_PER_ACCOUNT = 50
MIN_RSA_BITS = 2048
ALGORITHMS = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521", "ssh-rsa")

WHAT_TO_PASTE = (
    "paste one line of your public key file (~/.ssh/id_ed25519.pub): "
    "'ssh-ed25519 AAAA... comment'; make one with: ssh-keygen -t ed25519"
)
_PEM_PRIVATE = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----")
# Bidirectional overrides and isolates: they would make a name read differently from what it is.
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


@dataclass(frozen=True)
class ParsedKey:
    algorithm: str  # the key type, e.g. "ssh-ed25519"
    public_key: str  # canonical OpenSSH: "type base64", no comment
    fingerprint: str  # "SHA256:" + unpadded base64 of the blob's SHA-256, as ssh-keygen -lf prints it
    comment: str  # what followed the base64 ("" when nothing)
    bits: int | None = None  # RSA only


def _invalid(problem: str, *, code: str = "invalid_ssh_key", field: str = "public_key") -> ValidationFailed:
    return ValidationFailed(f"{field}: {problem}", code=code, details={"problems": [{"field": field, "problem": problem}]})


def _control_character(text: str, *, allow_tab: bool) -> str | None:
    for char in text:
        # Cc: control characters; Cs: a lone surrogate (JSON can carry one; no database stores it).
        category = unicodedata.category(char)
        if (category == "Cc" and not (allow_tab and char == "\t")) or category == "Cs" or char in _BIDI_CONTROLS:
            return f"U+{ord(char):04X}"
    return None


def fingerprint_of(blob: bytes) -> str:
    """The key blob's fingerprint as OpenSSH prints it: ``SHA256:`` and the digest in unpadded base64."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def parse_public_key(text: str) -> ParsedKey:
    """One OpenSSH public key line, checked strictly; ``ValidationFailed`` (422) with a stable code otherwise:
    ``private_key_pasted``, ``ssh_key_too_weak`` (DSA, RSA under 2048 bits) or ``invalid_ssh_key``."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise _invalid(f"longer than {MAX_KEY_BYTES // 1024} KiB: that is not one public key; {WHAT_TO_PASTE}")
    if _PEM_PRIVATE.search(text) or text.lstrip().startswith("PuTTY-User-Key-File-"):
        raise _invalid(
            "that is a private key; paste the .pub file (e.g. ~/.ssh/id_ed25519.pub) instead, and keep the private key "
            "to yourself",
            code="private_key_pasted",
        )
    line = text.strip()
    if not line:
        raise _invalid(f"empty; {WHAT_TO_PASTE}")
    if line.startswith(("-----BEGIN", "---- BEGIN SSH2 PUBLIC KEY")):
        raise _invalid("that is a public key in PEM or RFC 4716 form; paste the OpenSSH line instead (ssh-keygen -i -m PKCS8 "
                       "-f key.pem, or ssh-keygen -i -f key.pub, prints it), or the .pub file ssh-keygen made")  # fmt: skip
    if "\n" in line or "\r" in line:
        raise _invalid(f"several lines; add one key at a time: {WHAT_TO_PASTE}")
    if (char := _control_character(line, allow_tab=True)) is not None:
        raise _invalid(f"it holds a control character ({char}); {WHAT_TO_PASTE}")
    parts = line.split(None, 2)
    key_type = parts[0]
    if key_type.endswith("-cert-v01@openssh.com"):
        raise _invalid(f"that is an OpenSSH certificate, not a public key; {WHAT_TO_PASTE}")
    if key_type == "ssh-dss":
        raise _invalid("DSA keys are no longer safe and OpenSSH refuses them; make an Ed25519 key with "
                       "ssh-keygen -t ed25519 and paste its .pub file", code="ssh_key_too_weak")  # fmt: skip
    if key_type not in ALGORITHMS:
        hint = " (authorized_keys options are not accepted: paste the key alone)" if ("=" in key_type or "," in key_type) else ""
        raise _invalid(f"unsupported key type {key_type[:40]!r}{hint}; accepted: {', '.join(ALGORITHMS)}; {WHAT_TO_PASTE}")
    if len(parts) < 2:
        raise _invalid(f"the key's base64 is missing after {key_type!r}; {WHAT_TO_PASTE}")
    encoded, comment = parts[1], (parts[2].strip() if len(parts) > 2 else "")
    try:
        blob = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise _invalid(f"the key's base64 is not valid (cut short or altered?); {WHAT_TO_PASTE}") from None
    try:
        key = load_ssh_public_key(f"{key_type} {encoded}".encode("ascii"))
    except (ValueError, TypeError, NotImplementedError, UnsupportedAlgorithm):  # NotImplementedError: a compressed EC point
        raise _invalid(f"not a valid {key_type} key (cut short or altered?); {WHAT_TO_PASTE}") from None
    bits = None
    if isinstance(key, rsa.RSAPublicKey):
        bits = key.key_size
        if bits < MIN_RSA_BITS:
            raise _invalid(f"an RSA key of {bits} bits is too weak (at least {MIN_RSA_BITS}); make an Ed25519 key with "
                           "ssh-keygen -t ed25519 and paste its .pub file", code="ssh_key_too_weak")  # fmt: skip
    canonical = key.public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH).decode("ascii")
    canonical_type, canonical_b64 = canonical.split(" ", 1)
    if canonical_type != key_type or base64.b64decode(canonical_b64) != blob:
        raise _invalid(f"the key is not in OpenSSH's canonical encoding; {WHAT_TO_PASTE}")
    return ParsedKey(algorithm=key_type, public_key=canonical, fingerprint=fingerprint_of(blob), comment=comment, bits=bits)


def key_name(name: str | None, parsed: ParsedKey) -> str:
    """The name to store: the one given (checked) or else the key's comment (cut to fit), NFC-normalised; at most
    ``MAX_NAME_CHARS`` characters. Without either, the key type and the fingerprint's start."""
    if name is not None and name.strip():
        chosen = unicodedata.normalize("NFC", name.strip())
        if (char := _control_character(chosen, allow_tab=False)) is not None:
            raise _invalid(f"it holds a control character ({char})", code="invalid_ssh_key_name", field="name")
        if len(chosen) > MAX_NAME_CHARS:
            raise _invalid(f"at most {MAX_NAME_CHARS} characters", code="invalid_ssh_key_name", field="name")
        return chosen
    comment = unicodedata.normalize("NFC", " ".join(parsed.comment.split()))[:MAX_NAME_CHARS].strip()
    return comment or f"{parsed.algorithm} {parsed.fingerprint[7:15]}"


def not_found(key_id: str) -> NotFound:
    return NotFound(f"no SSH key {key_id[:60]!r} on your account; GET /api/v1/account/ssh-keys lists them", code="ssh_key_not_found")


async def list_keys(session: AsyncSession, account_id: str) -> Sequence[SshKey]:
    """The account's keys, oldest first."""
    query = select(SshKey).where(SshKey.account_id == account_id).order_by(SshKey.created_at, SshKey.id)
    return (await session.scalars(query)).all()


async def add_key(
    session: AsyncSession, account_id: str, public_key: str, *, name: str | None = None, now: datetime,
    max_keys: int = MAX_KEYS_PER_ACCOUNT, added_by: str | None = None,
) -> SshKey:  # fmt: skip
    """Register ``public_key`` on the account. 422 as ``parse_public_key`` (and ``invalid_ssh_key_name``); 409
    ``ssh_key_exists`` when the account has it already, ``too_many_ssh_keys`` at ``max_keys``. ``added_by``: the member
    who adds it to a team's account (removing the member removes it: ``teams.remove_member``)."""
    parsed = parse_public_key(public_key)
    stored_name = key_name(name, parsed)
    # Two adds of one account are serialised, so the limit and the duplicate check hold: a write to the account's
    # row that changes nothing takes its row lock on PostgreSQL and the database's write lock on SQLite (where a
    # SELECT ... FOR UPDATE would lock nothing), both until this transaction ends.
    await session.execute(
        update(Account).where(Account.id == account_id).values(name=Account.name).execution_options(synchronize_session=False)
    )
    existing = await session.scalar(select(SshKey).where(SshKey.account_id == account_id, SshKey.fingerprint == parsed.fingerprint))
    if existing is not None:
        raise _exists(existing)
    count = await session.scalar(select(func.count()).select_from(SshKey).where(SshKey.account_id == account_id)) or 0
    if count >= max_keys:
        raise Conflict(f"your account has {count} SSH keys, the most it may hold ({max_keys}); delete one you no longer use "
                       "first", code="too_many_ssh_keys")  # fmt: skip
    key = SshKey(id=new_id("sshk"), account_id=account_id, name=stored_name, algorithm=parsed.algorithm,
                 public_key=parsed.public_key, fingerprint=parsed.fingerprint, created_at=now, added_by=added_by)  # fmt: skip
    try:
        async with session.begin_nested():
            session.add(key)
            await session.flush()
    except IntegrityError:  # the same key added at the same moment by another request
        existing = await session.scalar(select(SshKey).where(SshKey.account_id == account_id, SshKey.fingerprint == parsed.fingerprint))
        if existing is None:
            raise
        raise _exists(existing) from None
    return key


def _exists(existing: SshKey) -> Conflict:
    return Conflict(f"this key is already on your account as {existing.name!r} ({existing.fingerprint})",
                    code="ssh_key_exists", details={"id": existing.id})  # fmt: skip


async def delete_key(session: AsyncSession, account_id: str, key_id: str) -> SshKey:
    """Delete the account's key ``key_id``; 404 ``ssh_key_not_found`` when it is unknown or another account's."""
    # Serialised with the account's other key changes and placements, as in ``add_key``.
    await session.execute(
        update(Account).where(Account.id == account_id).values(name=Account.name).execution_options(synchronize_session=False)
    )
    key = await session.get(SshKey, key_id) if len(key_id) <= 40 else None
    if key is None or key.account_id != account_id:
        raise not_found(key_id)
    await session.delete(key)
    return key


async def authorized_keys(session: AsyncSession, account_id: str) -> list[str]:
    """The canonical lines (``type base64``) the account's rentals authorise, oldest key first."""
    return [key.public_key for key in await list_keys(session, account_id)]


async def mark_used(session: AsyncSession, account_id: str, fingerprint: str, *, now: datetime) -> bool:
    """Record that the account's key ``fingerprint`` just opened a session; False when the account has no such key."""
    key = await session.scalar(select(SshKey).where(SshKey.account_id == account_id, SshKey.fingerprint == fingerprint))
    if key is None:
        return False
    key.last_used_at = now
    return True


def key_view(key: SshKey) -> dict[str, Any]:
    return {
        "id": key.id,
        "name": key.name,
        "algorithm": key.algorithm,
        "fingerprint": key.fingerprint,
        "public_key": key.public_key,
        "created_at": key.created_at.isoformat(),
        "last_used_at": key.last_used_at.isoformat() if key.last_used_at else None,
    }
