"""Secrets kept at rest, sealed: AES-256-GCM under the master's ``secrets_key``, bound to what they belong to.

A sealed value is text, ``sealed:v1:`` and the URL-safe base64 of a random 96-bit nonce and the ciphertext with its
tag. The associated data names the owner (``registry:<account id>``, ``totp:<account id>``): a value copied to
another account's row does not open. ``is_sealed`` tells a sealed value from one stored before sealing (kept working
where the caller allows it). Nothing here logs or keeps a secret; a value that does not open raises ``SealError``
without saying more than which owner it was for.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from shared.errors import ServiceUnavailable

PREFIX: Final = "sealed:v1:"
KEY_BYTES: Final = 32
NONCE_BYTES: Final = 12


class SealError(ServiceUnavailable):
    """A sealed value that does not open: another ``secrets_key`` sealed it, or it was altered (the operator's to
    mend, hence 503)."""

    code = "sealed_value_unreadable"


def new_key() -> str:
    """A fresh key for the ``secrets_key`` setting: 32 random bytes, URL-safe base64."""
    return base64.urlsafe_b64encode(secrets.token_bytes(KEY_BYTES)).decode()


def parse_key(text: str) -> bytes:
    """The 32 bytes of a ``secrets_key`` (URL-safe base64, padded or not); ``ValueError`` saying how to make one."""
    stripped = text.strip()
    try:
        raw = base64.urlsafe_b64decode(stripped + "=" * (-len(stripped) % 4))
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != KEY_BYTES or not stripped.isascii():
        raise ValueError("secrets_key must be 32 bytes in URL-safe base64, e.g. the output of "
                         "python3 -c 'import base64,os; print(base64.urlsafe_b64encode(os.urandom(32)).decode())'")  # fmt: skip
    return raw


def is_sealed(value: str) -> bool:
    return value.startswith(PREFIX)


def seal(key: bytes, plaintext: str, *, owner: str) -> str:
    nonce = secrets.token_bytes(NONCE_BYTES)
    sealed = AESGCM(key).encrypt(nonce, plaintext.encode(), owner.encode())
    return PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode()


def unseal(key: bytes, value: str, *, owner: str) -> str:
    """The plaintext of a ``seal``ed value; ``SealError`` when it does not open under this key and owner."""
    if not is_sealed(value):
        raise SealError(f"a secret of {owner.split(':', 1)[0]} is not a sealed value")
    try:
        raw = base64.urlsafe_b64decode(value[len(PREFIX) :].encode())
        return AESGCM(key).decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], owner.encode()).decode()
    except (binascii.Error, ValueError, InvalidTag):
        raise SealError(f"a sealed secret of {owner.split(':', 1)[0]} does not open with this secrets_key: was the key "
                        "changed? Set the key it was sealed with, or store the secret again") from None  # fmt: skip
