"""Tests for shared.crypto: the CA, key files, and real TLS 1.3 handshakes on loopback."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import ipaddress
import ssl
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.crypto import (
    HOST_URI_PREFIX,
    CertificateAuthority,
    certificate_fingerprint,
    certificate_not_after,
    client_ssl_context,
    generate_private_key,
    host_id_from_certificate,
    host_id_from_der,
    load_certificate,
    load_private_key,
    load_public_key,
    make_csr,
    private_key_to_pem,
    public_key_to_pem,
    server_ssl_context,
    write_private_key,
)
from shared.crypto.sealed_to import PREFIX, SealedToError, is_sealed_to, open_with, seal_to
from shared.errors import BadRequest, ConfigError, EnrollmentError, Unauthorized

# Every network step in these tests is on loopback; a hang means a bug, not a slow network.
IO_TIMEOUT = 5.0

# Fixtures and helpers


@dataclass(frozen=True)
class ClientFiles:
    cert_file: Path
    key_file: Path

    def context(self, ca: CertificateAuthority) -> ssl.SSLContext:
        """A client context presenting this certificate and trusting ``ca``."""
        return client_ssl_context(ca.cert_path, cert_file=self.cert_file, key_file=self.key_file)


def enroll(
    ca: CertificateAuthority,
    directory: Path,
    *,
    host_id: str,
    validity: timedelta = timedelta(hours=1),
    now: datetime | None = None,
) -> ClientFiles:
    """Do what an agent does: make a key and CSR, have ``ca`` sign it, write both to disk."""
    key = generate_private_key()
    issued = ca.sign_agent_csr(make_csr(key, host_id), host_id=host_id, validity=validity, now=now)
    key_file = directory / f"{host_id}.key"
    cert_file = directory / f"{host_id}.crt"
    write_private_key(key_file, key)
    cert_file.write_bytes(issued.cert_pem)
    return ClientFiles(cert_file=cert_file, key_file=key_file)


@dataclass
class TlsServer:
    """A TLS echo-of-identity server: it greets every accepted client with its host id."""

    port: int
    accepted_host_ids: list[str] = field(default_factory=list)


async def start_identity_server(context: ssl.SSLContext) -> tuple[asyncio.Server, TlsServer]:
    state = TlsServer(port=0)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ssl_object = writer.get_extra_info("ssl_object")
        assert isinstance(ssl_object, ssl.SSLObject)
        host_id = host_id_from_der(ssl_object.getpeercert(binary_form=True))
        state.accepted_host_ids.append(host_id)
        writer.write(f"hello {host_id}\n".encode())
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await writer.drain()
        writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await writer.wait_closed()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    state.port = server.sockets[0].getsockname()[1]
    return server, state


@contextlib.asynccontextmanager
async def running_server(context: ssl.SSLContext) -> AsyncIterator[TlsServer]:
    server, state = await start_identity_server(context)
    try:
        yield state
    finally:
        server.close()
        await server.wait_closed()


@pytest.fixture
def server_files(ca: CertificateAuthority, tmp_path: Path) -> tuple[Path, Path]:
    """A relay's key and certificate from ``ca``, valid for localhost and 127.0.0.1."""
    return ca.write_server_certificate(tmp_path / "relay", ["localhost", "127.0.0.1"], basename="relay")


@pytest.fixture
async def relay(ca: CertificateAuthority, server_files: tuple[Path, Path]) -> AsyncIterator[TlsServer]:
    """A server that requires client certificates from ``ca``."""
    key_file, cert_file = server_files
    async with running_server(server_ssl_context(cert_file, key_file, ca.cert_path)) as state:
        yield state


async def greet(port: int, context: ssl.SSLContext, *, server_hostname: str) -> bytes:
    """Connect, complete the handshake and read the server's greeting."""
    async with asyncio.timeout(IO_TIMEOUT):
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname=server_hostname
        )
        try:
            return await reader.readline()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await writer.wait_closed()


async def assert_refused(port: int, context: ssl.SSLContext, *, server_hostname: str = "localhost") -> None:
    """Assert the server refuses the connection.

    In TLS 1.3 the client's handshake completes before the server has checked the
    client's certificate, so the server's refusal may only show on the first read:
    as an SSL alert, a reset, or a bare EOF.
    """
    try:
        greeting = await greet(port, context, server_hostname=server_hostname)
    except (ssl.SSLError, ConnectionError, asyncio.IncompleteReadError):
        return
    assert greeting == b"", f"server accepted the connection and said {greeting!r}"


# TLS handshakes


class TestMutualTls:
    async def test_client_with_certificate_from_the_ca_is_identified_by_host_id(
        self, ca: CertificateAuthority, relay: TlsServer, tmp_path: Path
    ) -> None:
        """A client certificate from the CA completes the handshake and the server reads its host id."""
        client = enroll(ca, tmp_path, host_id="host-42")
        context = client.context(ca)

        greeting = await greet(relay.port, context, server_hostname="localhost")

        assert greeting == b"hello host-42\n"
        assert relay.accepted_host_ids == ["host-42"]

    async def test_client_connects_by_ip_address_through_ip_san(
        self, ca: CertificateAuthority, relay: TlsServer, tmp_path: Path
    ) -> None:
        """A client verifying the server as 127.0.0.1 accepts the IPAddress SAN."""
        client = enroll(ca, tmp_path, host_id="host-ip")
        context = client.context(ca)

        greeting = await greet(relay.port, context, server_hostname="127.0.0.1")

        assert greeting == b"hello host-ip\n"

    async def test_client_without_certificate_is_refused(
        self, ca: CertificateAuthority, relay: TlsServer
    ) -> None:
        """A client that presents no certificate never reaches the handler."""
        await assert_refused(relay.port, client_ssl_context(ca.cert_path))
        assert relay.accepted_host_ids == []

    async def test_client_with_certificate_from_another_ca_is_refused(
        self, ca: CertificateAuthority, other_ca: CertificateAuthority, relay: TlsServer, tmp_path: Path
    ) -> None:
        """A well-formed client certificate from a different CA is refused."""
        client = enroll(other_ca, tmp_path, host_id="host-42")
        context = client.context(ca)

        await assert_refused(relay.port, context)
        assert relay.accepted_host_ids == []

    async def test_expired_client_certificate_is_refused(
        self, ca: CertificateAuthority, relay: TlsServer, tmp_path: Path
    ) -> None:
        """A client certificate from the CA that expired an hour ago is refused."""
        client = enroll(
            ca,
            tmp_path,
            host_id="host-old",
            validity=timedelta(hours=1),
            now=datetime.now(UTC) - timedelta(hours=2),
        )
        context = client.context(ca)

        await assert_refused(relay.port, context)
        assert relay.accepted_host_ids == []

    async def test_server_certificate_used_as_client_certificate_is_refused(
        self, ca: CertificateAuthority, relay: TlsServer, server_files: tuple[Path, Path]
    ) -> None:
        """A relay's serverAuth certificate cannot stand in for an agent's clientAuth one."""
        key_file, cert_file = server_files
        context = client_ssl_context(ca.cert_path, cert_file=cert_file, key_file=key_file)

        await assert_refused(relay.port, context)
        assert relay.accepted_host_ids == []

    async def test_tls_1_2_client_is_refused(
        self, ca: CertificateAuthority, relay: TlsServer, tmp_path: Path
    ) -> None:
        """A client that cannot speak TLS 1.3 is refused even with a valid certificate."""
        client = enroll(ca, tmp_path, host_id="host-12")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.maximum_version = ssl.TLSVersion.TLSv1_2
        context.load_verify_locations(cafile=ca.cert_path)
        context.load_cert_chain(certfile=client.cert_file, keyfile=client.key_file)

        # The server answers the ClientHello with a protocol_version alert and closes,
        # so the client sees the alert or, if the close wins the race, a reset.
        with pytest.raises((ssl.SSLError, ConnectionResetError)):
            await greet(relay.port, context, server_hostname="localhost")
        assert relay.accepted_host_ids == []

    async def test_client_refuses_server_with_certificate_from_another_ca(
        self, ca: CertificateAuthority, other_ca: CertificateAuthority, tmp_path: Path
    ) -> None:
        """An agent that trusts the CA refuses a server whose certificate another CA issued."""
        key_file, cert_file = other_ca.write_server_certificate(tmp_path / "impostor", ["localhost"])
        client = enroll(ca, tmp_path, host_id="host-42")
        context = client.context(ca)

        async with running_server(server_ssl_context(cert_file, key_file, ca.cert_path)) as impostor:
            with pytest.raises(ssl.SSLCertVerificationError):
                await greet(impostor.port, context, server_hostname="localhost")
            assert impostor.accepted_host_ids == []

    async def test_client_refuses_server_certificate_for_another_name(
        self, ca: CertificateAuthority, tmp_path: Path
    ) -> None:
        """Hostname checking is on: a certificate for relay.example does not pass for localhost."""
        key_file, cert_file = ca.write_server_certificate(tmp_path / "relay", ["relay.example"])
        client = enroll(ca, tmp_path, host_id="host-42")
        context = client.context(ca)

        async with running_server(server_ssl_context(cert_file, key_file, ca.cert_path)) as server:
            with pytest.raises(ssl.SSLCertVerificationError):
                await greet(server.port, context, server_hostname="localhost")

    async def test_agent_certificate_cannot_serve(self, ca: CertificateAuthority, tmp_path: Path) -> None:
        """An agent's clientAuth certificate cannot impersonate a relay, whatever hostname is asked for."""
        agent = enroll(ca, tmp_path, host_id="localhost")
        client = enroll(ca, tmp_path / "client", host_id="host-42")
        context = client.context(ca)

        async with running_server(
            server_ssl_context(agent.cert_file, agent.key_file, ca.cert_path)
        ) as server:
            with pytest.raises(ssl.SSLCertVerificationError):
                await greet(server.port, context, server_hostname="localhost")

    async def test_optional_client_certificate_accepts_anonymous_clients(
        self, ca: CertificateAuthority, server_files: tuple[Path, Path]
    ) -> None:
        """With require_client_cert=False (the master's HTTPS) a client without a certificate gets in."""
        key_file, cert_file = server_files
        context = server_ssl_context(cert_file, key_file, ca.cert_path, require_client_cert=False)
        assert context.verify_mode == ssl.CERT_OPTIONAL
        connected = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            ssl_object = writer.get_extra_info("ssl_object")
            assert isinstance(ssl_object, ssl.SSLObject)
            assert ssl_object.getpeercert(binary_form=True) is None
            connected.set()
            writer.write(b"hello anonymous\n")
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
        try:
            port = server.sockets[0].getsockname()[1]
            greeting = await greet(port, client_ssl_context(ca.cert_path), server_hostname="localhost")
        finally:
            server.close()
            await server.wait_closed()
        assert greeting == b"hello anonymous\n"
        assert connected.is_set()


class TestSslContexts:
    def test_contexts_require_tls_1_3(
        self, ca: CertificateAuthority, server_files: tuple[Path, Path]
    ) -> None:
        """Both factories refuse anything older than TLS 1.3 and verify certificates."""
        key_file, cert_file = server_files
        server = server_ssl_context(cert_file, key_file, ca.cert_path)
        client = client_ssl_context(ca.cert_path)

        assert server.minimum_version == ssl.TLSVersion.TLSv1_3
        assert server.verify_mode == ssl.CERT_REQUIRED
        assert client.minimum_version == ssl.TLSVersion.TLSv1_3
        assert client.verify_mode == ssl.CERT_REQUIRED
        assert client.check_hostname is True

    def test_client_context_trusts_only_the_ca(self, ca: CertificateAuthority) -> None:
        """The system trust store is not loaded: the CA is the only trust anchor."""
        context = client_ssl_context(ca.cert_path)
        assert context.cert_store_stats()["x509_ca"] == 1

    def test_key_file_without_cert_file_is_a_config_error(
        self, ca: CertificateAuthority, tmp_path: Path
    ) -> None:
        """Passing a key without its certificate is a mistake worth naming."""
        with pytest.raises(ConfigError):
            client_ssl_context(ca.cert_path, key_file=tmp_path / "agent.key")


# The certificate authority


class TestLoadOrCreate:
    def test_second_call_loads_the_same_ca(self, tmp_path: Path) -> None:
        """A restart finds the stored CA instead of making a new one."""
        first = CertificateAuthority.load_or_create(tmp_path / "ca")
        second = CertificateAuthority.load_or_create(tmp_path / "ca")

        assert second.cert_pem == first.cert_pem
        assert second.key_path.read_bytes() == first.key_path.read_bytes()

    def test_certificates_from_a_restarted_ca_verify_against_the_first(self, tmp_path: Path) -> None:
        """A certificate signed after a restart chains to the CA certificate written before it."""
        first = CertificateAuthority.load_or_create(tmp_path / "ca")
        second = CertificateAuthority.load_or_create(tmp_path / "ca")
        issued = second.sign_agent_csr(make_csr(generate_private_key(), "x"), host_id="host-1")

        load_certificate(issued.cert_pem).verify_directly_issued_by(first.certificate)

    def test_concurrent_first_starts_agree_on_one_ca(self, tmp_path: Path) -> None:
        """Processes starting together on an empty directory all end up with the same CA."""
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            cas = list(pool.map(lambda _: CertificateAuthority.load_or_create(tmp_path / "ca"), range(8)))

        assert len({ca.cert_pem for ca in cas}) == 1
        assert cas[0].cert_pem == (tmp_path / "ca" / "ca.crt").read_bytes()

    def test_ca_key_is_private_and_certificate_is_readable(self, tmp_path: Path) -> None:
        """ca.key is mode 0600; ca.crt, which every peer needs, is not secret."""
        ca = CertificateAuthority.load_or_create(tmp_path / "deep" / "ca")

        assert stat.S_IMODE(ca.key_path.stat().st_mode) == 0o600
        assert ca.cert_path == tmp_path / "deep" / "ca" / "ca.crt"
        assert stat.S_IMODE(ca.cert_path.stat().st_mode) == 0o644

    def test_ca_certificate_is_a_ca(self, ca: CertificateAuthority) -> None:
        """The CA certificate may sign leaves and nothing below them."""
        constraints = ca.certificate.extensions.get_extension_for_class(x509.BasicConstraints)
        assert constraints.critical
        assert constraints.value.ca
        assert constraints.value.path_length == 0
        assert ca.certificate.subject.rfc4514_string() == "CN=gpumarket CA"

    def test_mismatched_key_and_certificate_are_refused(self, tmp_path: Path) -> None:
        """A ca.key that does not belong to ca.crt is a ConfigError, not a silent new CA."""
        ca = CertificateAuthority.load_or_create(tmp_path / "ca")
        write_private_key(ca.key_path, generate_private_key())

        with pytest.raises(ConfigError, match="does not match"):
            CertificateAuthority.load_or_create(tmp_path / "ca")

    @pytest.mark.parametrize("missing", ["ca.key", "ca.crt"])
    def test_half_a_ca_is_refused(self, tmp_path: Path, missing: str) -> None:
        """With one of the two files gone the CA is not silently replaced."""
        CertificateAuthority.load_or_create(tmp_path / "ca")
        (tmp_path / "ca" / missing).unlink()

        with pytest.raises(ConfigError, match="does not"):
            CertificateAuthority.load_or_create(tmp_path / "ca")


class TestKeys:
    def test_write_private_key_is_0600_and_round_trips(self, tmp_path: Path) -> None:
        """The key file is created 0600 with its parents and reads back as the same key."""
        key = generate_private_key()
        path = tmp_path / "a" / "b" / "agent.key"

        write_private_key(path, key)

        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert private_key_to_pem(load_private_key(path.read_bytes())) == private_key_to_pem(key)
        assert list(path.parent.iterdir()) == [path]  # no temporary file left behind

    def test_write_private_key_replaces_a_wider_file(self, tmp_path: Path) -> None:
        """Overwriting a world-readable file leaves a 0600 file."""
        path = tmp_path / "agent.key"
        path.write_bytes(b"old")
        path.chmod(0o644)

        write_private_key(path, generate_private_key())

        assert stat.S_IMODE(path.stat().st_mode) == 0o600

    def test_generated_keys_are_p256(self) -> None:
        assert isinstance(generate_private_key().curve, ec.SECP256R1)

    def test_load_private_key_refuses_rsa(self) -> None:
        rsa_pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        with pytest.raises(ConfigError, match="EC"):
            load_private_key(rsa_pem)

    def test_load_private_key_refuses_garbage(self) -> None:
        with pytest.raises(ConfigError):
            load_private_key(b"not a key")


class TestSignAgentCsr:
    def test_certificate_names_the_host_whatever_the_csr_asks(self, ca: CertificateAuthority) -> None:
        """A CSR asking for CN=someone-else gets a certificate for the host id the master chose."""
        csr = make_csr(generate_private_key(), "someone-else")

        issued = ca.sign_agent_csr(csr, host_id="host-7")

        cert = load_certificate(issued.cert_pem)
        assert cert.subject.rfc4514_string() == "CN=host-7"
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["urn:gpumarket:host:host-7"]
        assert "someone-else" not in repr(list(cert.extensions))
        assert host_id_from_certificate(cert) == "host-7"
        assert host_id_from_der(cert.public_bytes(serialization.Encoding.DER)) == "host-7"

    def test_requested_extensions_are_ignored(self, ca: CertificateAuthority) -> None:
        """A CSR asking to be a CA, or for other names, gets neither."""
        key = generate_private_key()
        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "host-7")]))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(f"{HOST_URI_PREFIX}host-1")]),
                critical=False,
            )
            .sign(key, hashes.SHA256())
            .public_bytes(serialization.Encoding.PEM)
        )

        cert = load_certificate(ca.sign_agent_csr(csr, host_id="host-7").cert_pem)

        assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
        assert host_id_from_certificate(cert) == "host-7"

    def test_certificate_is_for_client_auth_only(self, ca: CertificateAuthority) -> None:
        cert = load_certificate(
            ca.sign_agent_csr(make_csr(generate_private_key(), "x"), host_id="host-7").cert_pem
        )

        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
        key_usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
        assert key_usage.digital_signature
        assert not key_usage.key_cert_sign
        cert.verify_directly_issued_by(ca.certificate)

    def test_validity_allows_for_clock_skew(self, ca: CertificateAuthority) -> None:
        """The certificate starts five minutes before issue and lasts ``validity`` after it."""
        now = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
        issued = ca.sign_agent_csr(
            make_csr(generate_private_key(), "x"), host_id="host-7", validity=timedelta(hours=24), now=now
        )

        assert issued.not_before == now - timedelta(minutes=5)
        assert issued.not_after == now + timedelta(hours=24)
        assert issued.not_after.tzinfo is not None
        assert certificate_not_after(issued.cert_pem) == issued.not_after

    def test_serials_are_random_and_recorded(self, ca: CertificateAuthority) -> None:
        csr = make_csr(generate_private_key(), "x")
        first = ca.sign_agent_csr(csr, host_id="host-7")
        second = ca.sign_agent_csr(csr, host_id="host-7")

        assert first.serial != second.serial
        assert first.serial.bit_length() > 64
        assert load_certificate(first.cert_pem).serial_number == first.serial
        assert int(first.serial_hex, 16) == first.serial
        assert len(first.serial_hex) == 40
        assert first.fingerprint == certificate_fingerprint(first.cert_pem)
        assert len(first.fingerprint) == 64

    def test_validity_is_cut_to_the_ca_expiry(self, tmp_path: Path) -> None:
        """A certificate never outlives the CA that signed it."""
        ca = CertificateAuthority.load_or_create(tmp_path / "ca", validity=timedelta(days=1))

        issued = ca.sign_agent_csr(
            make_csr(generate_private_key(), "x"), host_id="host-7", validity=timedelta(days=30)
        )

        assert issued.not_after == ca.certificate.not_valid_after_utc

    @pytest.mark.parametrize("csr", [b"", b"garbage", b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END"])
    def test_garbage_csr_is_an_enrollment_error(self, ca: CertificateAuthority, csr: bytes) -> None:
        with pytest.raises(EnrollmentError, match="certificate signing request"):
            ca.sign_agent_csr(csr, host_id="host-7")

    def test_csr_with_a_bad_signature_is_an_enrollment_error(self, ca: CertificateAuthority) -> None:
        """A CSR whose public key is not the key that signed it is refused."""
        csr = x509.load_pem_x509_csr(make_csr(generate_private_key(), "x"))
        # Re-encode with another key's SubjectPublicKeyInfo, keeping the old signature.
        good_spki = csr.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        other_spki = (
            generate_private_key()
            .public_key()
            .public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
        tampered_der = csr.public_bytes(serialization.Encoding.DER).replace(good_spki, other_spki)
        tampered = x509.load_der_x509_csr(tampered_der).public_bytes(serialization.Encoding.PEM)

        with pytest.raises(EnrollmentError, match="signature does not verify"):
            ca.sign_agent_csr(tampered, host_id="host-7")

    def test_oversized_csr_is_an_enrollment_error(self, ca: CertificateAuthority) -> None:
        with pytest.raises(EnrollmentError, match="limit"):
            ca.sign_agent_csr(b"x" * 100, host_id="host-7", max_csr_bytes=99)

    def test_small_rsa_key_is_refused(self, ca: CertificateAuthority) -> None:
        key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")]))
            .sign(key, hashes.SHA256())
            .public_bytes(serialization.Encoding.PEM)
        )
        with pytest.raises(EnrollmentError, match="too small"):
            ca.sign_agent_csr(csr, host_id="host-7")

    def test_rsa_2048_key_is_accepted(self, ca: CertificateAuthority) -> None:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")]))
            .sign(key, hashes.SHA256())
            .public_bytes(serialization.Encoding.PEM)
        )
        assert (
            host_id_from_certificate(load_certificate(ca.sign_agent_csr(csr, host_id="h1").cert_pem)) == "h1"
        )

    @pytest.mark.parametrize("host_id", ["", "-leading-dash", "has space", "a/b", "x" * 65])
    def test_malformed_host_id_is_refused(self, ca: CertificateAuthority, host_id: str) -> None:
        with pytest.raises(BadRequest):
            ca.sign_agent_csr(make_csr(generate_private_key(), "x"), host_id=host_id)

    def test_naive_now_is_refused(self, ca: CertificateAuthority) -> None:
        with pytest.raises(BadRequest, match="timezone"):
            ca.sign_agent_csr(
                make_csr(generate_private_key(), "x"),
                host_id="host-7",
                now=datetime(2030, 1, 1),  # noqa: DTZ001 - the naive datetime is the point
            )


class TestServerCertificates:
    def test_ip_addresses_get_ip_sans_and_names_get_dns_sans(self, ca: CertificateAuthority) -> None:
        key_pem, cert_pem = ca.issue_server_certificate(["relay1.example.com", "127.0.0.1", "::1"])

        cert = load_certificate(cert_pem)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.DNSName) == ["relay1.example.com"]
        assert san.get_values_for_type(x509.IPAddress) == [
            ipaddress.ip_address("127.0.0.1"),
            ipaddress.ip_address("::1"),
        ]
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
        assert cert.subject.rfc4514_string() == "CN=relay1.example.com"
        spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        assert load_private_key(key_pem).public_key().public_bytes(*spki) == cert.public_key().public_bytes(
            *spki
        )

    def test_write_server_certificate_writes_a_private_key(
        self, ca: CertificateAuthority, tmp_path: Path
    ) -> None:
        key_path, cert_path = ca.write_server_certificate(tmp_path / "certs", ["relay1"], basename="relay1")

        assert key_path == tmp_path / "certs" / "relay1.key"
        assert cert_path == tmp_path / "certs" / "relay1.crt"
        assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
        load_certificate(cert_path.read_bytes()).verify_directly_issued_by(ca.certificate)

    @pytest.mark.parametrize("names", [[], ["not a name"], ["a..b"]])
    def test_bad_names_are_refused(self, ca: CertificateAuthority, names: list[str]) -> None:
        with pytest.raises(BadRequest):
            ca.issue_server_certificate(names)

    def test_a_bare_string_is_refused(self, ca: CertificateAuthority) -> None:
        """``"relay"`` is a Sequence[str] too; it must not become five one-letter names."""
        with pytest.raises(BadRequest, match="list"):
            ca.issue_server_certificate("relay")


class TestHostIdFromCertificate:
    def test_missing_certificate_is_unauthorized(self) -> None:
        with pytest.raises(Unauthorized, match="no certificate"):
            host_id_from_der(None)

    def test_falls_back_to_common_name(self, ca: CertificateAuthority) -> None:
        """A certificate without the gpumarket URI SAN names its host by CN."""
        _, cert_pem = ca.issue_server_certificate(["host-9"])
        assert host_id_from_certificate(load_certificate(cert_pem)) == "host-9"

    def test_wildcard_common_name_is_not_a_host_id(self, ca: CertificateAuthority) -> None:
        """The CN fallback still insists on a well-formed host id."""
        _, cert_pem = ca.issue_server_certificate(["127.0.0.1"])  # CN "127.0.0.1" is fine...
        assert host_id_from_certificate(load_certificate(cert_pem)) == "127.0.0.1"
        _, cert_pem = ca.issue_server_certificate(["*.example.com"])  # ...a wildcard is not a host id
        with pytest.raises(Unauthorized, match="malformed"):
            host_id_from_certificate(load_certificate(cert_pem))


class TestSealedTo:
    CONTEXT = "registry_auth:h_1:cmd_1"
    SECRET = b"s3cret-registry-token"

    def test_a_sealed_value_opens_with_the_recipients_key_under_its_context(self) -> None:
        """A round trip: sealed to the public key, opened with the private key, under the same context."""
        key = generate_private_key()
        token = seal_to(key.public_key(), self.SECRET, self.CONTEXT)
        assert open_with(key, token, self.CONTEXT) == self.SECRET
        assert self.SECRET.decode() not in token and is_sealed_to(token)

    def test_each_sealing_is_fresh(self) -> None:
        """Two sealings of one value share no ephemeral key, nonce or ciphertext."""
        key = generate_private_key()
        first, second = (seal_to(key.public_key(), self.SECRET, self.CONTEXT) for _ in range(2))
        assert set(first.split(":")[2:]).isdisjoint(second.split(":")[2:])

    def test_the_format_is_versioned_and_self_describing(self) -> None:
        """``ecies:v1:<point>:<nonce>:<ciphertext>``: a 65-byte point, a 12-byte nonce, the ciphertext and its tag."""
        token = seal_to(generate_private_key().public_key(), self.SECRET, self.CONTEXT)
        scheme, version, point, nonce, ciphertext = token.split(":")
        assert (scheme, version) == ("ecies", "v1") and token.startswith(PREFIX)
        lengths = [len(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))) for part in (point, nonce, ciphertext)]
        assert lengths == [65, 12, len(self.SECRET) + 16]
        with pytest.raises(SealedToError):
            open_with(generate_private_key(), token.replace("ecies:v1:", "ecies:v2:"), self.CONTEXT)

    def test_another_key_does_not_open_it(self) -> None:
        token = seal_to(generate_private_key().public_key(), self.SECRET, self.CONTEXT)
        with pytest.raises(SealedToError) as refused:
            open_with(generate_private_key(), token, self.CONTEXT)
        assert self.SECRET.decode() not in str(refused.value) and refused.value.code == "sealed_token_unreadable"

    @pytest.mark.parametrize("context", ["registry_auth:h_2:cmd_1", "registry_auth:h_1:cmd_2", ""])
    def test_another_context_does_not_open_it(self, context: str) -> None:
        """A token copied to another host's or another command's delivery does not open there."""
        key = generate_private_key()
        token = seal_to(key.public_key(), self.SECRET, self.CONTEXT)
        with pytest.raises(SealedToError):
            open_with(key, token, context)

    def test_a_flipped_byte_anywhere_does_not_open(self) -> None:
        """Every byte of the point, the nonce and the ciphertext (tag included) is checked."""
        key = generate_private_key()
        token = seal_to(key.public_key(), self.SECRET, self.CONTEXT)
        parts = token[len(PREFIX):].split(":")
        for index, part in enumerate(parts):
            raw = bytearray(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
            for position in (0, len(raw) // 2, len(raw) - 1):
                changed = bytearray(raw)
                changed[position] ^= 0x01
                altered = list(parts)
                altered[index] = base64.urlsafe_b64encode(bytes(changed)).decode().rstrip("=")
                with pytest.raises(SealedToError):
                    open_with(key, PREFIX + ":".join(altered), self.CONTEXT)

    @pytest.mark.parametrize("token", ["", "sealed:v1:abc", "ecies:v1:a:b", "ecies:v1:a:b:c", "ecies:v1:a:b:c:d",
                                       "ecies:v1:AAAA:AAAA:AAAA"])  # fmt: skip
    def test_what_is_not_a_token_is_refused(self, token: str) -> None:
        with pytest.raises(SealedToError):
            open_with(generate_private_key(), token, self.CONTEXT)

    def test_a_public_key_survives_its_pem(self) -> None:
        """The master keeps a certificate's key as PEM and seals to what it reads back."""
        key = generate_private_key()
        token = seal_to(load_public_key(public_key_to_pem(key.public_key())), self.SECRET, self.CONTEXT)
        assert open_with(key, token, self.CONTEXT) == self.SECRET
        with pytest.raises(ConfigError):
            load_public_key("not a key")
