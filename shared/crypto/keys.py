"""Private keys, key files and certificate signing requests.

Agents make a P-256 key and a CSR (``generate_private_key``, ``make_csr``) and keep the key in
a file only they can read (``write_private_key``); ``atomic_write`` is how every key and
certificate file here is written.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from shared.errors import ConfigError

PEM_PRIVATE_KEY_MODE = 0o600
PEM_CERT_MODE = 0o644


def generate_private_key() -> ec.EllipticCurvePrivateKey:
    """Return a new ECDSA P-256 private key."""
    return ec.generate_private_key(ec.SECP256R1())


def private_key_to_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """Serialize ``key`` as unencrypted PKCS#8 PEM."""
    return key.private_bytes(
        encoding=serialization.Encoding.PEM,
        format=serialization.PrivateFormat.PKCS8,
        encryption_algorithm=serialization.NoEncryption(),
    )


def load_private_key(pem: bytes) -> ec.EllipticCurvePrivateKey:
    """Parse an unencrypted PEM private key; it must be an EC key.

    Raises ``ConfigError`` for anything else: keys are read from the files this
    module wrote, so a bad one means a broken installation, not a bad request.
    """
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"cannot read private key: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"expected an EC private key, got {type(key).__name__}")
    return key


def public_key_to_pem(key: ec.EllipticCurvePublicKey) -> str:
    """Serialize ``key`` as SubjectPublicKeyInfo PEM (how the master records a host certificate's key)."""
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def load_public_key(pem: str | bytes) -> ec.EllipticCurvePublicKey:
    """Parse a PEM public key; it must be an EC key (``ConfigError`` otherwise: it was written by ``public_key_to_pem``)."""
    try:
        key = serialization.load_pem_public_key(pem.encode() if isinstance(pem, str) else pem)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"cannot read public key: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ConfigError(f"expected an EC public key, got {type(key).__name__}")
    return key


def write_private_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """Write ``key`` to ``path`` as PKCS#8 PEM, atomically, with mode 0600.

    Parent directories are created. The file is never visible with wider
    permissions or partially written.
    """
    atomic_write(path, private_key_to_pem(key), mode=PEM_PRIVATE_KEY_MODE)


def make_csr(key: ec.EllipticCurvePrivateKey, common_name: str) -> bytes:
    """Return a PEM certificate signing request for ``key``.

    The CA ignores the subject: ``common_name`` is only a hint for humans reading
    the CSR.
    """
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    csr = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, hashes.SHA256())
    return csr.public_bytes(serialization.Encoding.PEM)


def atomic_write(path: Path, data: bytes, *, mode: int) -> None:
    """Write ``data`` to ``path`` via a temporary file and ``os.replace``, with ``mode`` from the start."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # mkstemp creates the file 0600, so a key is never briefly world-readable.
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as tmp:
            os.fchmod(tmp.fileno(), mode)
            tmp.write(data)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = [
    "PEM_CERT_MODE", "PEM_PRIVATE_KEY_MODE", "atomic_write", "generate_private_key", "load_private_key", "load_public_key",
    "make_csr", "private_key_to_pem", "public_key_to_pem", "write_private_key",
]  # fmt: skip
