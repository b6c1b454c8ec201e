"""Reading certificates: PEM parsing, fingerprints, expiry, and the host id and serial a peer certificate carries."""

from __future__ import annotations

import contextlib
import re
from datetime import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from shared.errors import BadRequest, ConfigError, Unauthorized

HOST_URI_PREFIX = "urn:gpumarket:host:"


# Host ids go into a CN (at most 64 characters) and a URN, so keep them short and
# free of anything that needs escaping.
HOST_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def load_certificate(pem: bytes) -> x509.Certificate:
    """Parse one PEM certificate (the first, if ``pem`` holds a chain)."""
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise BadRequest(f"not a PEM certificate: {exc}", code="bad_certificate") from exc


def certificate_fingerprint(cert_pem: bytes) -> str:
    """Return the lowercase hex SHA-256 of the certificate's DER encoding."""
    return load_certificate(cert_pem).fingerprint(hashes.SHA256()).hex()


def certificate_not_after(cert_pem: bytes) -> datetime:
    """Return when the certificate expires, as an aware UTC datetime."""
    return load_certificate(cert_pem).not_valid_after_utc


def host_id_from_certificate(cert: x509.Certificate) -> str:
    """Return the host id an agent certificate names.

    Reads the ``urn:gpumarket:host:<id>`` URI SAN, falling back to the subject CN
    when the certificate has no such SAN. Raises ``Unauthorized`` when neither
    yields a well-formed host id, or when the SANs name two different hosts.

    This does not verify the certificate: call it on a peer certificate that the
    TLS handshake already checked against the CA.
    """
    host_ids: set[str] = set()
    with contextlib.suppress(x509.ExtensionNotFound):
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
            if uri.startswith(HOST_URI_PREFIX):
                host_ids.add(uri.removeprefix(HOST_URI_PREFIX))
    if len(host_ids) > 1:
        raise Unauthorized("certificate names more than one host", code="bad_certificate")
    if not host_ids:
        common_names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if common_names:
            value = common_names[0].value
            host_ids.add(value if isinstance(value, str) else value.decode("utf-8", "replace"))
    if not host_ids:
        raise Unauthorized("certificate does not name a host", code="bad_certificate")
    (host_id,) = host_ids
    if not HOST_ID_PATTERN.fullmatch(host_id):
        raise Unauthorized(f"certificate names a malformed host id {host_id!r}", code="bad_certificate")
    return host_id


def host_id_from_der(der: bytes | None) -> str:
    """Return the host id in a DER certificate, as ``getpeercert(binary_form=True)`` gives it.

    ``None`` (the peer sent no certificate) raises ``Unauthorized``, so callers can
    pass ``getpeercert``'s result straight in.
    """
    return host_id_from_certificate(_peer_certificate(der))


def serial_hex_from_der(der: bytes | None) -> str:
    """Return a DER certificate's serial as 40 lowercase hex digits, like ``IssuedCertificate.serial_hex``.

    This is the form revocations are recorded in (``shared.registry``). ``None`` (the
    peer sent no certificate) and bytes that are not a certificate raise ``Unauthorized``.
    """
    return f"{_peer_certificate(der).serial_number:040x}"


def _peer_certificate(der: bytes | None) -> x509.Certificate:
    """A peer's DER certificate parsed; ``Unauthorized`` when there is none or it does not parse."""
    if der is None:
        raise Unauthorized("peer presented no certificate", code="bad_certificate")
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise Unauthorized(f"peer certificate is not valid DER: {exc}", code="bad_certificate") from exc
    return cert


__all__ = [
    "HOST_ID_PATTERN", "HOST_URI_PREFIX", "certificate_fingerprint", "certificate_not_after", "host_id_from_certificate",
    "host_id_from_der", "load_certificate", "serial_hex_from_der",
]  # fmt: skip


def certificate_public_key(certificate: x509.Certificate) -> ec.EllipticCurvePublicKey:
    """The P-256 public key of a gpumarket certificate (the CA's verifies connect tokens)."""
    key = certificate.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ConfigError("expected a certificate with an elliptic-curve (P-256) key, as the gpumarket CA's")
    return key


def ca_public_key(ca_file: Path) -> ec.EllipticCurvePublicKey:
    """The public key of the CA certificate in ``ca_file``."""
    return certificate_public_key(load_certificate(ca_file.read_bytes()))
