"""The ``CertificateAuthority``: the CA's key and certificate on disk, agent and server certificates.

The CA signs agents' CSRs into short-lived clientAuth certificates whose identity (CN and
``urn:gpumarket:host:<id>`` SAN) it writes itself, and issues server certificates for relays
and the master's HTTPS. ``IssuedCertificate`` carries what the master records about each.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.crypto.certs import HOST_ID_PATTERN, HOST_URI_PREFIX, certificate_fingerprint
from shared.crypto.keys import (
    PEM_CERT_MODE,
    PEM_PRIVATE_KEY_MODE,
    atomic_write,
    generate_private_key,
    load_private_key,
    private_key_to_pem,
    write_private_key,
)
from shared.crypto.tokens import ConnectClaims, sign_connect_token
from shared.errors import BadRequest, ConfigError, EnrollmentError

CA_KEY_FILENAME = "ca.key"
CA_CERT_FILENAME = "ca.crt"

# Certificates start this long before "now" so a peer whose clock runs a little
# behind the master's still accepts a certificate issued a moment ago.
CLOCK_SKEW = timedelta(minutes=5)

# Limits. A CSR for a P-256 or RSA-4096 key is well under 2 KiB; anything much
# bigger is not a CSR we would sign.
MAX_CSR_BYTES = 16 * 1024
MIN_RSA_KEY_BITS = 2048
MIN_EC_KEY_BITS = 256

_DNS_LABEL = r"(?:[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)"
_DNS_NAME_PATTERN = re.compile(rf"(?:\*\.)?{_DNS_LABEL}(?:\.{_DNS_LABEL})*\.?")
_MAX_DNS_NAME_LENGTH = 253
_MAX_CN_LENGTH = 64


@dataclass(frozen=True)
class IssuedCertificate:
    """A certificate the CA just signed, with the facts the master records about it."""

    cert_pem: bytes
    serial: int
    not_before: datetime  # aware UTC, as written in the certificate (whole seconds)
    not_after: datetime  # aware UTC, as written in the certificate (whole seconds)

    @property
    def serial_hex(self) -> str:
        """The serial as 40 lowercase hex digits (RFC 5280 serials fit in 20 octets)."""
        return f"{self.serial:040x}"

    @property
    def fingerprint(self) -> str:
        """Lowercase hex SHA-256 of the certificate's DER encoding."""
        return certificate_fingerprint(self.cert_pem)


class CertificateAuthority:
    """The gpumarket CA: a P-256 key and a self-signed certificate in one directory.

    Build it with ``load_or_create``; the same directory gives the same CA across
    restarts.
    """

    def __init__(
        self,
        *,
        key: ec.EllipticCurvePrivateKey,
        certificate: x509.Certificate,
        directory: Path,
    ) -> None:
        _require_matching_pair(key, certificate, where=directory)
        self._key = key
        self._certificate = certificate
        self._cert_pem = certificate.public_bytes(serialization.Encoding.PEM)
        self._directory = directory

    @classmethod
    def load_or_create(
        cls,
        directory: Path,
        *,
        common_name: str = "gpumarket CA",
        validity: timedelta = timedelta(days=3650),
    ) -> CertificateAuthority:
        """Load the CA stored in ``directory``, creating it there first if absent.

        Writes ``ca.key`` (mode 0600) and ``ca.crt``. ``common_name`` and
        ``validity`` only apply when the CA is created. Raises ``ConfigError`` when
        only one of the two files exists, when they do not belong together, or when
        ``ca.crt`` is not a CA certificate. Concurrent callers on one host are
        serialized by a lock file, so they all end up with the same CA. Loading an
        existing CA writes nothing, not even the lock file, so ``directory`` may be a
        read-only mount (a Kubernetes Secret, a compose volume mounted ``:ro``).
        """
        key_path = directory / CA_KEY_FILENAME
        cert_path = directory / CA_CERT_FILENAME
        if key_path.exists() and cert_path.exists():
            # No lock needed: both writes below are atomic and the certificate comes last,
            # so a certificate on disk means its key is complete too.
            return cls._load(key_path, cert_path, directory)
        directory.mkdir(parents=True, exist_ok=True)
        with _exclusive_lock(directory / ".ca.lock"):
            key_exists, cert_exists = key_path.exists(), cert_path.exists()
            if key_exists and cert_exists:  # another caller created it while we waited for the lock
                return cls._load(key_path, cert_path, directory)
            if key_exists or cert_exists:
                present, missing = (key_path, cert_path) if key_exists else (cert_path, key_path)
                raise ConfigError(
                    f"{present} exists but {missing} does not; restore the missing file "
                    f"or remove both to create a new CA (which invalidates every issued certificate)"
                )
            if validity <= timedelta(0):
                raise BadRequest(f"CA validity must be positive, got {validity}")
            key = generate_private_key()
            certificate = _build_ca_certificate(key, common_name=common_name, validity=validity)
            # Key first: a crash in between leaves a lone key, which the next start
            # reports instead of silently replacing.
            write_private_key(key_path, key)
            atomic_write(
                cert_path, certificate.public_bytes(serialization.Encoding.PEM), mode=PEM_CERT_MODE
            )
            return cls(key=key, certificate=certificate, directory=directory)

    @classmethod
    def _load(cls, key_path: Path, cert_path: Path, directory: Path) -> CertificateAuthority:
        key = load_private_key(key_path.read_bytes())
        try:
            certificate = x509.load_pem_x509_certificate(cert_path.read_bytes())
        except ValueError as exc:
            raise ConfigError(f"{cert_path} is not a PEM certificate: {exc}") from exc
        return cls(key=key, certificate=certificate, directory=directory)

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate, PEM: what every peer trusts."""
        return self._cert_pem

    @property
    def cert_path(self) -> Path:
        """Where the CA certificate is stored (the ``ca_file`` for the SSL contexts)."""
        return self._directory / CA_CERT_FILENAME

    @property
    def key_path(self) -> Path:
        return self._directory / CA_KEY_FILENAME

    @property
    def certificate(self) -> x509.Certificate:
        return self._certificate

    def sign_connect_token(self, claims: ConnectClaims) -> str:
        """A renter's connect token (``shared.crypto.tokens``), signed with the CA's key."""
        return sign_connect_token(self._key, claims)

    def sign_agent_csr(
        self,
        csr_pem: bytes,
        *,
        host_id: str,
        validity: timedelta = timedelta(hours=24),
        now: datetime | None = None,
        max_csr_bytes: int = MAX_CSR_BYTES,
    ) -> IssuedCertificate:
        """Sign an agent's CSR into a client certificate for ``host_id``.

        The CSR only contributes its public key (after its self-signature is
        checked); the subject and any requested extensions are ignored. The
        certificate says ``CN=<host_id>``, URI SAN ``urn:gpumarket:host:<host_id>``,
        clientAuth only, not a CA. It is valid from ``now - CLOCK_SKEW`` until
        ``now + validity``, cut to the CA's own expiry.

        Raises ``EnrollmentError`` for a CSR that is too big, unparseable, badly
        signed, or for a key that is neither EC (P-256 or larger) nor RSA of at
        least 2048 bits; ``BadRequest`` for a malformed ``host_id``.
        """
        _require_host_id(host_id)
        if len(csr_pem) > max_csr_bytes:
            raise EnrollmentError(
                f"CSR is {len(csr_pem)} bytes; the limit is {max_csr_bytes}", code="bad_csr"
            )
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError as exc:
            raise EnrollmentError(f"not a PEM certificate signing request: {exc}", code="bad_csr") from exc
        try:
            public_key = csr.public_key()
            signature_ok = csr.is_signature_valid
        except (ValueError, UnsupportedAlgorithm) as exc:
            raise EnrollmentError(f"CSR key or signature is not supported: {exc}", code="bad_csr") from exc
        if not signature_ok:
            raise EnrollmentError(
                "CSR signature does not verify; generate the CSR with the key it names", code="bad_csr"
            )
        if isinstance(public_key, rsa.RSAPublicKey):
            if public_key.key_size < MIN_RSA_KEY_BITS:
                raise EnrollmentError(
                    f"RSA key of {public_key.key_size} bits is too small; use at least {MIN_RSA_KEY_BITS} bits or EC P-256",
                    code="weak_key",
                )
        elif isinstance(public_key, ec.EllipticCurvePublicKey):
            if public_key.curve.key_size < MIN_EC_KEY_BITS:
                raise EnrollmentError(
                    f"EC curve {public_key.curve.name} is too small; use P-256 or larger", code="weak_key"
                )
        else:
            raise EnrollmentError(
                f"{type(public_key).__name__} keys are not accepted; use EC P-256 or RSA >= {MIN_RSA_KEY_BITS} bits",
                code="weak_key",
            )

        builder = self._leaf_builder(
            subject=x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host_id)]),
            public_key=public_key,
            validity=validity,
            now=now,
        )
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(f"{HOST_URI_PREFIX}{host_id}")]),
            critical=False,
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        return self._sign(builder)

    def issue_server_certificate(
        self,
        names: Sequence[str],
        *,
        validity: timedelta = timedelta(days=90),
        now: datetime | None = None,
    ) -> tuple[bytes, bytes]:
        """Return ``(key_pem, cert_pem)``: a new P-256 key and a serverAuth certificate for it.

        ``names`` are DNS names (``relay1.example.com``, ``*.example.com``) or IP
        addresses, which get IPAddress SANs so clients can connect by address. The
        first name is also the subject CN when it fits.
        """
        alt_names = _server_alt_names(names)
        key = generate_private_key()
        first = names[0]
        subject = (
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, first)])
            if len(first) <= _MAX_CN_LENGTH
            else x509.Name([])
        )
        builder = self._leaf_builder(subject=subject, public_key=key.public_key(), validity=validity, now=now)
        builder = builder.add_extension(
            # An empty subject requires a critical SAN (RFC 5280 4.2.1.6).
            x509.SubjectAlternativeName(alt_names),
            critical=not subject.rdns,
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        issued = self._sign(builder)
        return private_key_to_pem(key), issued.cert_pem

    def write_server_certificate(
        self,
        directory: Path,
        names: Sequence[str],
        *,
        basename: str = "server",
        validity: timedelta = timedelta(days=90),
        now: datetime | None = None,
    ) -> tuple[Path, Path]:
        """Issue a server certificate and write ``<basename>.key`` (0600) and ``<basename>.crt``.

        Returns ``(key_path, cert_path)``. Both writes are atomic; the key is written
        first so a reader never pairs a new certificate with an old key for long.
        """
        if not basename or "/" in basename or basename.startswith("."):
            raise BadRequest(f"basename must be a plain file name, got {basename!r}")
        key_pem, cert_pem = self.issue_server_certificate(names, validity=validity, now=now)
        key_path = directory / f"{basename}.key"
        cert_path = directory / f"{basename}.crt"
        atomic_write(key_path, key_pem, mode=PEM_PRIVATE_KEY_MODE)
        atomic_write(cert_path, cert_pem, mode=PEM_CERT_MODE)
        return key_path, cert_path

    def _leaf_builder(
        self,
        *,
        subject: x509.Name,
        public_key: CertificatePublicKeyTypes,
        validity: timedelta,
        now: datetime | None,
    ) -> x509.CertificateBuilder:
        if validity <= timedelta(0):
            raise BadRequest(f"certificate validity must be positive, got {validity}")
        issued_at = _aware_utc(now)
        not_before = issued_at - CLOCK_SKEW
        ca_not_after = self._certificate.not_valid_after_utc
        if issued_at >= ca_not_after:
            raise ConfigError(
                f"the CA certificate {self.cert_path} expired at {ca_not_after.isoformat()}; "
                f"create a new CA and re-enroll every host"
            )
        # A certificate that outlives its issuer fails verification anyway; say so honestly.
        not_after = min(issued_at + validity, ca_not_after)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._certificate.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(digital_signature=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False
            )
        )

    def _sign(self, builder: x509.CertificateBuilder) -> IssuedCertificate:
        certificate = builder.sign(self._key, hashes.SHA256())
        return IssuedCertificate(
            cert_pem=certificate.public_bytes(serialization.Encoding.PEM),
            serial=certificate.serial_number,
            not_before=certificate.not_valid_before_utc,
            not_after=certificate.not_valid_after_utc,
        )


def _build_ca_certificate(
    key: ec.EllipticCurvePrivateKey, *, common_name: str, validity: timedelta
) -> x509.Certificate:
    now = datetime.now(UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    public_key = key.public_key()
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + validity)
        # path_length=0: this CA signs leaves only, never intermediates.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True, crl_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public_key), critical=False)
        .sign(key, hashes.SHA256())
    )


def _key_usage(
    *, digital_signature: bool = False, key_cert_sign: bool = False, crl_sign: bool = False
) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=crl_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _require_matching_pair(
    key: ec.EllipticCurvePrivateKey, certificate: x509.Certificate, *, where: Path
) -> None:
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != certificate.public_key().public_bytes(*spki):
        raise ConfigError(
            f"{where / CA_KEY_FILENAME} does not match {where / CA_CERT_FILENAME}; "
            f"restore the matching pair or remove both to create a new CA"
        )
    try:
        constraints = certificate.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        constraints = None
    if constraints is None or not constraints.ca:
        raise ConfigError(f"{where / CA_CERT_FILENAME} is not a CA certificate")


def _require_host_id(host_id: str) -> None:
    if not HOST_ID_PATTERN.fullmatch(host_id):
        raise BadRequest(
            f"host id {host_id!r} must be 1-64 characters of letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit",
            code="bad_host_id",
        )


def _server_alt_names(names: Sequence[str]) -> list[x509.GeneralName]:
    if isinstance(names, str):  # a str is a Sequence[str]; "relay" would become r, e, l, a, y
        raise BadRequest("names must be a list of names, not a single string")
    if not names:
        raise BadRequest("a server certificate needs at least one DNS name or IP address")
    alt_names: list[x509.GeneralName] = []
    for name in names:
        general_name: x509.GeneralName
        try:
            general_name = x509.IPAddress(ipaddress.ip_address(name))
        except ValueError:
            if len(name) > _MAX_DNS_NAME_LENGTH or not _DNS_NAME_PATTERN.fullmatch(name):
                raise BadRequest(f"{name!r} is neither an IP address nor a DNS name") from None
            general_name = x509.DNSName(name)
        if general_name not in alt_names:
            alt_names.append(general_name)
    return alt_names


def _aware_utc(now: datetime | None) -> datetime:
    if now is None:
        return datetime.now(UTC)
    if now.tzinfo is None or now.utcoffset() is None:
        raise BadRequest("now must be timezone-aware")
    return now.astimezone(UTC)


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


__all__ = [
    "CA_CERT_FILENAME", "CA_KEY_FILENAME", "CLOCK_SKEW", "MAX_CSR_BYTES", "MIN_EC_KEY_BITS", "MIN_RSA_KEY_BITS",
    "CertificateAuthority", "IssuedCertificate",
]  # fmt: skip
