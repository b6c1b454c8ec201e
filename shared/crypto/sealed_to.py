"""Secrets sealed to one holder of a P-256 private key (ECIES): the master seals, only that key opens.

Unlike ``sealed`` (secrets at rest under the master's own ``secrets_key``), a value sealed here crosses parts that must
not read it (the bus, Redis, the relay) to the one agent whose certificate's key it was sealed to. The scheme, from
``cryptography``'s primitives only:

1. a fresh ephemeral P-256 key per value; ECDH with the recipient's public key;
2. HKDF-SHA256 (salt: the ephemeral and the recipient's points, uncompressed; info: ``INFO`` and the ``context``)
   into a 256-bit key, used once;
3. AES-256-GCM under that key with a random 96-bit nonce and the associated data ``PREFIX`` + ``context``.

The token is text: ``ecies:v1:<ephemeral point>:<nonce>:<ciphertext and tag>``, each part URL-safe base64 without
padding. ``context`` names what the value is for (``registry_auth:<host id>:<command id>``): a token opened under
another context, with another key, or with any byte changed raises ``SealedToError``, which says nothing of the value.
Nothing here logs or keeps a plaintext.
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from shared.errors import GpumarketError

VERSION: Final = "v1"
PREFIX: Final = f"ecies:{VERSION}:"
INFO: Final = f"gpumarket ecies {VERSION} p256-hkdf-sha256-aes256gcm|".encode()
NONCE_BYTES: Final = 12
POINT_BYTES: Final = 65  # an uncompressed P-256 point
TAG_BYTES: Final = 16
_PART = r"[A-Za-z0-9_-]+"
# What a token looks like on the wire (protocol models check it before anything is opened).
TOKEN_PATTERN: Final = rf"^ecies:v1:{_PART}:{_PART}:{_PART}$"
_TOKEN = re.compile(TOKEN_PATTERN)


class SealedToError(GpumarketError, ValueError):
    """A token that does not open: not this format or version, another key or context, or altered."""

    code = "sealed_token_unreadable"


def is_sealed_to(value: str) -> bool:
    return _TOKEN.fullmatch(value) is not None


def seal_to(public_key: ec.EllipticCurvePublicKey, plaintext: bytes, context: str) -> str:
    """``plaintext`` sealed so that only the holder of ``public_key``'s private key opens it, under ``context``."""
    if not isinstance(public_key.curve, ec.SECP256R1):
        raise SealedToError("values are sealed to P-256 keys only")
    ephemeral = ec.generate_private_key(ec.SECP256R1())
    point = _point(ephemeral.public_key())
    key = _derive(ephemeral.exchange(ec.ECDH(), public_key), point, _point(public_key), context)
    nonce = secrets.token_bytes(NONCE_BYTES)
    ciphertext = AESGCM(key).encrypt(nonce, plaintext, _associated(context))
    return PREFIX + ":".join(_b64(part) for part in (point, nonce, ciphertext))


def open_with(private_key: ec.EllipticCurvePrivateKey, token: str, context: str) -> bytes:
    """The plaintext of a ``seal_to`` token sealed to ``private_key``'s public key under ``context``."""
    if not is_sealed_to(token):
        raise SealedToError(f"not a sealed token of version {VERSION} (ecies:{VERSION}:…)")
    try:
        point, nonce, ciphertext = (_unb64(part) for part in token[len(PREFIX) :].split(":"))
        if len(point) != POINT_BYTES or len(nonce) != NONCE_BYTES or len(ciphertext) < TAG_BYTES:
            raise ValueError("a part has the wrong length")
        ephemeral = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), point)
        key = _derive(private_key.exchange(ec.ECDH(), ephemeral), point, _point(private_key.public_key()), context)
        return AESGCM(key).decrypt(nonce, ciphertext, _associated(context))
    except (binascii.Error, ValueError, InvalidTag):
        raise SealedToError("the sealed token does not open with this key for this purpose: sealed to another key "
                            "or for another purpose, or altered") from None  # fmt: skip


def _derive(shared_secret: bytes, ephemeral_point: bytes, recipient_point: bytes, context: str) -> bytes:
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=ephemeral_point + recipient_point, info=INFO + context.encode())
    return hkdf.derive(shared_secret)


def _associated(context: str) -> bytes:
    return PREFIX.encode() + context.encode()


def _point(public_key: ec.EllipticCurvePublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
