"""``gpumarket agent enroll``: trade a one-time token and a CSR for the host's certificate."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import aiohttp

from agent.state import AgentState, Identity, atomic_write
from shared.crypto import generate_private_key, make_csr, write_private_key
from shared.errors import ConfigError, EnrollmentError

log = logging.getLogger(__name__)


async def enroll(
    master_url: str,
    token: str,
    data_dir: Path,
    *,
    hostname: str | None = None,
    gpus: str | None = None,
    relay_url: str | None = None,
    timeout: float = 30.0,
) -> Identity:
    """Create a key on this host, send a CSR with the token, store the certificate.

    Refuses to overwrite an existing enrollment. The private key never leaves the host.
    """
    state = AgentState(data_dir)
    if state.enrolled:
        raise ConfigError(f"{data_dir} already holds host {state.identity().host_id}; use another --data-dir to enroll again")
    hostname = hostname or socket.gethostname()
    key = generate_private_key()
    csr = make_csr(key, hostname)
    url = master_url.rstrip("/") + "/api/v1/enroll"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http, http.post(
            url, json={"token": token, "csr": csr.decode(), "hostname": hostname}
        ) as response:
            body = await response.json(content_type=None)
            if response.status != 201:
                message = body.get("message") if isinstance(body, dict) else None
                raise EnrollmentError(f"the master refused enrollment: {message or response.reason}", code=str(body.get("code", "enrollment_refused")) if isinstance(body, dict) else None)
    except aiohttp.ClientError as exc:
        raise ConfigError(f"cannot reach the master at {master_url}: {exc}; check --master") from None
    state.secure()  # the data dir is the agent's alone before the key lands in it
    write_private_key(state.key_file, key)
    atomic_write(state.cert_file, body["certificate"].encode())
    atomic_write(state.ca_file, body["ca_certificate"].encode())
    relays = [relay_url] if relay_url else list(body.get("relay_urls") or [])
    identity = Identity(host_id=body["host_id"], master_url=master_url, relay_urls=relays, gpus=gpus)
    state.save_identity(identity)
    log.info("enrolled as host %s", identity.host_id)
    return identity
