"""Certificates for tests: relay server contexts and agent client certificates from a test CA."""

from __future__ import annotations

import ssl
from pathlib import Path

from shared.crypto import (
    CertificateAuthority,
    client_ssl_context,
    generate_private_key,
    make_csr,
    server_ssl_context,
    write_private_key,
)


def relay_server_context(ca: CertificateAuthority, directory: Path) -> ssl.SSLContext:
    """A relay's TLS context for 127.0.0.1/localhost as production builds it: a client certificate from ``ca``
    is asked for, not required (renters have none; the agent endpoint closes a connection without one)."""
    key_file, cert_file = ca.write_server_certificate(directory, ["127.0.0.1", "localhost"])
    return server_ssl_context(cert_file, key_file, ca.cert_path, require_client_cert=False)


def write_agent_certificate(signer: CertificateAuthority, directory: Path, host_id: str) -> tuple[Path, Path]:
    """An agent key and certificate for ``host_id`` signed by ``signer``; returns (key_file, cert_file)."""
    key = generate_private_key()
    issued = signer.sign_agent_csr(make_csr(key, host_id), host_id=host_id)
    key_file, cert_file = directory / "agent.key", directory / "agent.crt"
    write_private_key(key_file, key)
    cert_file.write_bytes(issued.cert_pem)
    return key_file, cert_file


def agent_client_context(trusted: CertificateAuthority, directory: Path, host_id: str, *,
                         signer: CertificateAuthority | None = None) -> ssl.SSLContext:
    """A client context presenting ``host_id``'s certificate (signed by ``signer``, default ``trusted``)."""
    key_file, cert_file = write_agent_certificate(signer or trusted, directory, host_id)
    return client_ssl_context(trusted.cert_path, cert_file=cert_file, key_file=key_file)
