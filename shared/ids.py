"""Identifiers and secrets: prefixed random ids, API keys and tokens stored only as hashes."""

from __future__ import annotations

import hashlib
import secrets


def new_id(prefix: str) -> str:
    """A random id such as ``h-3f9a0c1d2b4e5f60`` (valid as a protocol host id)."""
    return f"{prefix}-{secrets.token_hex(8)}"


def new_secret(prefix: str) -> str:
    """A bearer secret (API key, enrollment token): shown once, stored as ``secret_hash``."""
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()
