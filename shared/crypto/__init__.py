"""The gpumarket certificate authority, key handling and TLS contexts.

Owns: the CA the master runs (``ca.key`` / ``ca.crt`` on disk), signing agents'
CSRs into short-lived client certificates, issuing server certificates for relays
and the master's HTTPS, reading a host id back out of a peer certificate, and the
only two ``ssl.SSLContext`` factories the project uses (TLS 1.3 minimum, trusting
only the gpumarket CA).

Identity lives in the certificate the CA writes, never in what a CSR asks for: an
agent certificate names its host as ``CN=<host_id>`` and the URI SAN
``urn:gpumarket:host:<host_id>``. Revocation is by serial, recorded by the master;
there is no CRL here.

Modules: ``keys`` (private keys, key files, CSRs), ``certs`` (reading certificates and
the host id and serial they carry), ``ca`` (the ``CertificateAuthority``), ``tls`` (the
``ssl.SSLContext`` factories), ``sealed`` (secrets at rest under the master's ``secrets_key``), ``sealed_to``
(secrets sealed to one agent's key, ECIES, for what crosses the bus and the relay). This module is the package's
public API: import from ``shared.crypto``.

Must not import from agent/, access/, master/, console/ or billing/.
"""

from shared.crypto import sealed, sealed_to
from shared.crypto.ca import (
    CA_CERT_FILENAME,
    CA_KEY_FILENAME,
    CLOCK_SKEW,
    MAX_CSR_BYTES,
    CertificateAuthority,
    IssuedCertificate,
)
from shared.crypto.certs import (
    HOST_URI_PREFIX,
    ca_public_key,
    certificate_fingerprint,
    certificate_not_after,
    certificate_public_key,
    host_id_from_certificate,
    host_id_from_der,
    load_certificate,
    serial_hex_from_der,
)
from shared.crypto.keys import (
    generate_private_key,
    load_private_key,
    load_public_key,
    make_csr,
    private_key_to_pem,
    public_key_to_pem,
    write_private_key,
)
from shared.crypto.tls import client_ssl_context, server_ssl_context, web_ssl_context

__all__ = [
    "CA_CERT_FILENAME",
    "CA_KEY_FILENAME",
    "CLOCK_SKEW",
    "HOST_URI_PREFIX",
    "MAX_CSR_BYTES",
    "CertificateAuthority",
    "IssuedCertificate",
    "ca_public_key",
    "certificate_fingerprint",
    "certificate_not_after",
    "certificate_public_key",
    "client_ssl_context",
    "generate_private_key",
    "host_id_from_certificate",
    "host_id_from_der",
    "load_certificate",
    "load_private_key",
    "load_public_key",
    "make_csr",
    "private_key_to_pem",
    "public_key_to_pem",
    "sealed",
    "sealed_to",
    "serial_hex_from_der",
    "server_ssl_context",
    "web_ssl_context",
    "write_private_key",
]
