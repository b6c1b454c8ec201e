"""The host's certificate over its life: its lifetime checked at start and before each connection, a renewal asked
for at ``renew_at_fraction`` of it (a CSR for a fresh key, kept in ``key.next.pem`` until the certificate comes), and
the renewed certificate installed when the master sends it (``install_certificate``, idempotent).

An expired certificate cannot be renewed: the host must enroll again (``ConfigError`` says how).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

from agent.state import AgentState, atomic_write
from shared import protocol
from shared.crypto import (
    generate_private_key,
    host_id_from_certificate,
    load_certificate,
    load_private_key,
    make_csr,
    write_private_key,
)
from shared.errors import ConfigError

log = logging.getLogger(__name__)


class CertificateKeeper:
    """This host's certificate: its lifetime, its renewal, the installation of a renewed one."""

    def __init__(
        self, state: AgentState, host_id: str, send: Callable[[protocol.RenewCertificateBody], Awaitable[None]],
        *, renew_at_fraction: float, renewal_retry: float,
    ) -> None:  # fmt: skip
        """``send`` writes a renewal request to the master (through the agent's outbound window)."""
        self.state = state
        self.host_id = host_id
        self._send = send
        self.renew_at_fraction = renew_at_fraction
        self.renewal_retry = renewal_retry
        self._renewed = asyncio.Event()
        self.check()

    def check(self) -> None:
        """Load the certificate's lifetime; an expired one means re-enrolling (a token is needed)."""
        cert = load_certificate(self.state.cert_file.read_bytes())
        self.not_before = cert.not_valid_before_utc
        self.not_after = cert.not_valid_after_utc
        if self.not_after <= datetime.now(UTC):
            raise ConfigError(
                f"this host's certificate expired at {self.not_after:%Y-%m-%d %H:%M UTC}: an agent that stayed offline "
                "past its certificate's lifetime must enroll again with a new token (move the data dir "
                f"{self.state.dir} away, then run `gpumarket agent enroll --master URL --token TOKEN`)"
            )

    @property
    def renew_at(self) -> datetime:
        lifetime = self.not_after - self.not_before
        return self.not_before + lifetime * self.renew_at_fraction

    @property
    def _next_key_file(self) -> Path:
        return self.state.next_key_file

    async def request_renewal(self) -> None:
        """Send a CSR for a fresh key (kept in ``key.next.pem`` until the certificate arrives)."""
        if self._next_key_file.exists():
            key = load_private_key(self._next_key_file.read_bytes())
        else:
            key = generate_private_key()
            write_private_key(self._next_key_file, key)
        csr = make_csr(key, self.host_id).decode()
        await self._send(protocol.RenewCertificateBody(csr=csr))
        log.info("host %s asked for a new certificate (current one valid until %s)", self.host_id, self.not_after)

    async def run(self, connected: asyncio.Event) -> None:
        """Ask for a renewal when it is due and the agent is connected, again each ``renewal_retry`` until one comes."""
        while True:
            wait = (self.renew_at - datetime.now(UTC)).total_seconds()
            if wait > 0:
                await asyncio.sleep(min(wait, 3600.0))
                continue
            await connected.wait()
            self._renewed.clear()
            await self.request_renewal()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.renewal_retry):
                    await self._renewed.wait()

    async def install(self, command: protocol.InstallCertificate) -> protocol.CertificateInstalled:
        """Install a renewed certificate for the key we generated; idempotent."""
        pem = command.certificate.encode()
        cert = load_certificate(pem)
        if host_id_from_certificate(cert) != self.host_id:
            raise ConfigError("the certificate offered is for another host; not installed")
        offered = cert.public_key().public_numbers()  # type: ignore[union-attr]
        candidates = [self._next_key_file, self.state.key_file]
        match = next(
            (f for f in candidates if f.exists() and load_private_key(f.read_bytes()).public_key().public_numbers() == offered),
            None,
        )
        if match is None:
            raise ConfigError("the certificate offered does not match this host's key; not installed")
        atomic_write(self.state.ca_file, (command.ca_certificate or self.state.ca_file.read_text()).encode())
        atomic_write(self.state.cert_file, pem)
        if match == self._next_key_file:
            # The replaced key stays (key.prev.pem) until the next renewal: a registry login sealed to it just before
            # the master signed this certificate may still be on its way (AgentState.opening_keys).
            atomic_write(self.state.previous_key_file, self.state.key_file.read_bytes())
            self._next_key_file.replace(self.state.key_file)  # atomic: cert and key now belong together
        self.check()
        self._renewed.set()
        log.info("host %s installed a new certificate valid until %s", self.host_id, self.not_after)
        return protocol.CertificateInstalled(serial=format(cert.serial_number, "040x"), not_after=self.not_after.isoformat())
