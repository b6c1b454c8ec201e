"""The only two ``ssl.SSLContext`` factories the project uses: TLS 1.3 minimum, trusting only the gpumarket CA."""

from __future__ import annotations

import ssl
from pathlib import Path

from shared.errors import ConfigError


def server_ssl_context(
    cert_file: Path,
    key_file: Path,
    ca_file: Path,
    *,
    require_client_cert: bool = True,
) -> ssl.SSLContext:
    """Return a TLS 1.3-only server context presenting ``cert_file``.

    With ``require_client_cert`` (relays) the handshake fails unless the client
    presents a clientAuth certificate that chains to ``ca_file``. Without it (the
    master's HTTPS, where agents enroll before they have a certificate) a client
    certificate is optional, but one that is presented must still chain to
    ``ca_file``.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    context.load_cert_chain(certfile=cert_file, keyfile=key_file)
    context.load_verify_locations(cafile=ca_file)
    context.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    return context


def client_ssl_context(
    ca_file: Path,
    *,
    cert_file: Path | None = None,
    key_file: Path | None = None,
) -> ssl.SSLContext:
    """Return a TLS 1.3-only client context that trusts only ``ca_file`` and checks hostnames.

    Pass ``cert_file`` (and ``key_file``, unless the key is in the same file) to
    present a client certificate. The system trust store is not loaded.
    """
    if key_file is not None and cert_file is None:
        raise ConfigError("key_file was given without cert_file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED by default
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cafile=ca_file)
    if cert_file is not None:
        context.load_cert_chain(certfile=cert_file, keyfile=key_file)
    return context


def web_ssl_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """A server context for browsers (a relay's web ports): TLS 1.2 or later, no client certificate
    asked for (a browser holding one would prompt its user to pick it)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certfile=cert_file, keyfile=key_file)
    context.verify_mode = ssl.CERT_NONE
    return context


__all__ = ["client_ssl_context", "server_ssl_context", "web_ssl_context"]
