"""The relay's web ports (``access/webports.py``) against hostile browsers: a real TLS listener, raw
sockets for what a browser would never send, and an agent side whose streams answer as a rental would.

The whole path on ``gpumarket up`` with a container is in tests/test_tunnels.py.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from access.webports import WebPorts
from shared.clock import SystemClock
from shared.crypto import CertificateAuthority, certificate_public_key, web_ssl_context
from shared.crypto.tokens import new_claims
from shared.streams import TunnelCode, decode_open_header
from shared.streams.aio import Channel
from tests.test_stream_link import Pair

RENTAL, OTHER, HOST = "r-0123456789abcdef", "r-fedcba9876543210", "h-1"
DOMAIN = "ports.test"


class Rental:
    """The agent's side: port 8000 answers with the request head it saw; any other port is refused."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self.tasks: list[asyncio.Task[None]] = []

    def accept(self, channel: Channel) -> None:
        request = decode_open_header(channel.header)
        if request.port != 8000:
            channel.reset(TunnelCode.NOT_OFFERED)
            return
        self.tasks.append(asyncio.create_task(self._serve(channel)))

    async def _serve(self, channel: Channel) -> None:
        head = b""
        while b"\r\n\r\n" not in head and (data := await channel.read()):
            head += data
        self.heads.append(head)
        body = b"seen"
        await channel.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        channel.close()


@pytest.fixture
async def ports(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca")
    key_file, cert_file = ca.write_server_certificate(tmp_path / "relay", ["localhost", f"*.{DOMAIN}"])
    rental = Rental()
    pair = Pair(rental.accept)
    connected = {HOST: pair.relay}
    web = WebPorts(token_key=certificate_public_key(ca.certificate), ssl_context=web_ssl_context(cert_file, key_file),
                   domain=DOMAIN, links=connected.get, clock=SystemClock(), head_timeout=0.5, max_head=4096)
    await web.start()
    client = ssl.create_default_context(cafile=str(ca.cert_path))
    try:
        yield {"ca": ca, "web": web, "client": client, "rental": rental, "connected": connected}
    finally:
        await web.close()
        await pair.close()


def token(ports: dict[str, Any], *, rental: str = RENTAL, port: int = 8000, ttl: float = 60.0) -> str:
    claims = new_claims(account_id="acct-1", rental_id=rental, host_id=HOST, kind="tcp", port=port, expires_at=time.time() + ttl)
    return str(ports["ca"].sign_connect_token(claims))


async def ask(ports: dict[str, Any], raw: bytes, *, host: str | None = None) -> bytes:
    """Send ``raw`` over TLS (SNI ``host``) and read until the relay closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", ports["web"].port, ssl=ports["client"],
                                                   server_hostname=host or f"{RENTAL}-8000.{DOMAIN}")
    writer.write(raw)
    await writer.drain()
    try:
        async with asyncio.timeout(5):
            return await reader.read()
    finally:
        writer.close()


def get(path: str, host: str, *extra: str) -> bytes:
    return ("\r\n".join([f"GET {path} HTTP/1.1", f"Host: {host}", *extra]) + "\r\n\r\n").encode()


def status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


async def test_a_token_becomes_a_session_cookie_and_the_cookie_never_reaches_the_rental(ports: dict[str, Any]) -> None:
    host = f"{RENTAL}-8000.{DOMAIN}:443"
    answer = await ask(ports, get(f"/lab?x=1&gm_token={token(ports)}", host))
    assert status(answer) == 302, answer
    headers = answer.decode().split("\r\n")
    assert "Location: /lab?x=1" in headers
    cookie = next(h for h in headers if h.startswith("Set-Cookie: ")).removeprefix("Set-Cookie: ")
    assert all(flag in cookie for flag in ("HttpOnly", "Secure", "SameSite=Lax", "Path=/")) and "Domain" not in cookie
    session = cookie.split(";")[0]
    answer = await ask(ports, get("/lab?x=1", host, f"Cookie: theme=dark; {session}"))
    assert status(answer) == 200 and answer.endswith(b"seen"), answer
    [seen] = ports["rental"].heads
    assert b"gm_port" not in seen and b"cookie: theme=dark" in seen.lower()


async def test_tokens_and_sessions_open_only_their_own_rental_and_port(ports: dict[str, Any]) -> None:
    other_port = await ask(ports, get(f"/?gm_token={token(ports, port=8001)}", f"{RENTAL}-8000.{DOMAIN}"))
    assert status(other_port) == 401 and b"another rental or port" in other_port
    expired = await ask(ports, get(f"/?gm_token={token(ports, ttl=-1)}", f"{RENTAL}-8000.{DOMAIN}"))
    assert status(expired) == 401 and b"expired" in expired
    good = token(ports)
    forged = good[:-6] + ("AAAAAA" if not good.endswith("AAAAAA") else "BBBBBB")
    assert status(await ask(ports, get(f"/?gm_token={forged}", f"{RENTAL}-8000.{DOMAIN}"))) == 401
    # A session for RENTAL's port 8000 opens nothing of OTHER (a look-alike Host cannot borrow it either).
    answer = await ask(ports, get(f"/?gm_token={good}", f"{RENTAL}-8000.{DOMAIN}"))
    session = next(h for h in answer.decode().split("\r\n") if h.startswith("Set-Cookie: ")).split(": ", 1)[1].split(";")[0]
    for host in (f"{OTHER}-8000.{DOMAIN}", f"{RENTAL}-8001.{DOMAIN}"):
        refused = await ask(ports, get("/", host, f"Cookie: {session}"), host=host)
        assert status(refused) == 401, refused
    assert status(await ask(ports, get("/", f"{RENTAL}-8000.{DOMAIN}"))) == 401  # no cookie at all


@pytest.mark.parametrize("host", [
    "example.com",  # not under the ports domain
    f"{RENTAL}-8000.{DOMAIN}.evil.example",
    f"{RENTAL}-8000x.{DOMAIN}",
    f"{RENTAL}-0.{DOMAIN}",
    f"{RENTAL}-70000.{DOMAIN}",
    f"r-0123456789abcdeф-8000.{DOMAIN}",  # a look-alike (Cyrillic) letter
    "",
])
async def test_a_host_name_that_names_no_rental_port_is_404(ports: dict[str, Any], host: str) -> None:
    answer = await ask(ports, get("/", host).replace(b"Host: \r\n", b""), host=f"{RENTAL}-8000.{DOMAIN}")
    assert status(answer) in (400, 404), answer


@pytest.mark.parametrize("raw", [
    b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Big: " + b"a" * 8000 + b"\r\n\r\n",  # over max_head
    b"NONSENSE\r\n\r\n",
    b"GET / HTTP/2\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nBad header line\r\n\r\n",
    b"GET / HTTP/1.1\r\n Folded: x\r\n\r\n",
])
async def test_malformed_or_oversized_heads_are_400(ports: dict[str, Any], raw: bytes) -> None:
    answer = await ask(ports, raw)
    assert status(answer) == 400, answer


async def test_a_head_that_never_ends_is_dropped_after_the_timeout(ports: dict[str, Any]) -> None:
    started = time.monotonic()
    answer = await ask(ports, b"GET / HTTP/1.1\r\nHost: x")  # and then nothing
    assert answer == b"" and time.monotonic() - started < 3


async def test_a_host_not_here_or_a_port_the_rental_refuses_is_502(ports: dict[str, Any]) -> None:
    host = f"{RENTAL}-8001.{DOMAIN}"
    refused = await ask(ports, get(f"/?gm_token={token(ports, port=8001)}", host), host=host)
    session = next(h for h in refused.decode().split("\r\n") if h.startswith("Set-Cookie: ")).split(": ", 1)[1].split(";")[0]
    answer = await ask(ports, get("/", host, f"Cookie: {session}"), host=host)
    assert status(answer) == 502 and b"does not serve that port" in answer, answer
    ports["connected"].clear()  # the host left this relay
    answer = await ask(ports, get("/", host, f"Cookie: {session}"), host=host)
    assert status(answer) == 502 and b"not connected to this relay" in answer, answer
