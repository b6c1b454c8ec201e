"""The relay's web ports (``access/webports.py``) against hostile browsers: a real TLS listener, raw
sockets for what a browser would never send, and an agent side whose streams answer as a rental would.

The whole path on ``gpumarket up`` with a container is in tests/test_tunnels.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import h11
import pytest

from access.webports import WebPorts
from shared.clock import SystemClock
from shared.crypto import CertificateAuthority, certificate_public_key, web_ssl_context
from shared.crypto.tokens import new_claims
from shared.streams import TunnelCode, decode_open_header
from shared.streams.aio import Channel, ChannelReset
from tests.test_stream_link import Pair

RENTAL, OTHER, HOST = "r-0123456789abcdef", "r-fedcba9876543210", "h-1"
DOMAIN = "ports.test"


class App:
    """A rental's HTTP/1.1 app on one stream, scripted by a test: reads requests with h11, answers with h11 or raw bytes."""

    def __init__(self, channel: Channel, seen: list[h11.Request]) -> None:
        self.channel = channel
        self.conn = h11.Connection(h11.SERVER)
        self.seen = seen

    async def request(self) -> tuple[h11.Request, bytes]:
        """The next request and its body."""
        if self.conn.states == {h11.CLIENT: h11.DONE, h11.SERVER: h11.DONE}:
            self.conn.start_next_cycle()
        request: h11.Request | None = None
        body = b""
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.channel.read())
            elif isinstance(event, h11.Request):
                request = event
                self.seen.append(event)
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                return request, body
            else:
                raise AssertionError(f"the app got {event!r}")

    async def answer(self, status: int, headers: list[tuple[str, str]], *chunks: bytes) -> None:
        out = [self.conn.send(h11.Response(status_code=status, headers=headers))]
        out += [self.conn.send(h11.Data(data=chunk)) for chunk in chunks]
        out.append(self.conn.send(h11.EndOfMessage()))
        await self.channel.write(b"".join(data for data in out if data))


Script = Callable[[App], Awaitable[None]]


class Rental:
    """The agent's side: port 8000 answers with the request head it saw (or runs the test's ``script``); any other
    port is refused."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self.seen: list[h11.Request] = []
        self.script: Script | None = None
        self.tasks: list[asyncio.Task[None]] = []

    def accept(self, channel: Channel) -> None:
        request = decode_open_header(channel.header)
        if request.port != 8000:
            channel.reset(TunnelCode.NOT_OFFERED)
            return
        self.tasks.append(asyncio.create_task(self._serve(channel)))

    async def _serve(self, channel: Channel) -> None:
        if self.script is not None:
            with contextlib.suppress(ChannelReset):  # the relay ends the stream when it closes the connection
                await self.script(App(channel, self.seen))
                channel.close()
            return
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
        for task in rental.tasks:
            task.cancel()
        await asyncio.gather(*rental.tasks, return_exceptions=True)
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
    b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X: 1\r\n" * 101 + b"\r\n",  # over max_headers (short of max_head)
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


# ---- every message of a connection (access/webproxy.py) -----------------------------------------

LABEL = f"{RENTAL}-8000.{DOMAIN}"


def session_of(answer: bytes) -> str:
    """``gm_port=<id>`` from the relay's sign-in answer."""
    return next(h for h in answer.decode().split("\r\n") if h.startswith("Set-Cookie: ")).split(": ", 1)[1].split(";")[0]


class Browser:
    """One connection to a web port as a browser holds it: raw requests out, answers read with h11."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, session: str) -> None:
        self.reader = reader
        self.writer = writer
        self.session = session
        self.conn = h11.Connection(h11.CLIENT)

    def request(self, method: str = "GET", path: str = "/", *extra: str, host: str = LABEL, body: bytes = b"") -> bytes:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Cookie: theme=dark; {self.session}; lang=en", *extra]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

    async def send(self, *requests: bytes) -> None:
        self.writer.write(b"".join(requests))
        await self.writer.drain()

    async def answer(self, method: str = "GET", *extra: tuple[str, str]) -> tuple[h11.Response | h11.InformationalResponse, bytes]:
        """The next answer (to a request of ``method``, headers ``extra``) and its body, as the browser reads them."""
        if self.conn.states == {h11.CLIENT: h11.DONE, h11.SERVER: h11.DONE}:
            self.conn.start_next_cycle()
        self.conn.send(h11.Request(method=method, target="/", headers=[("Host", LABEL), *extra]))
        self.conn.send(h11.EndOfMessage())
        head: h11.Response | h11.InformationalResponse | None = None
        body = b""
        async with asyncio.timeout(5):
            while True:
                event = self.conn.next_event()
                if event is h11.NEED_DATA:
                    self.conn.receive_data(await self.reader.read(65536))
                elif isinstance(event, h11.InformationalResponse) and event.status_code == 101:
                    return event, self.conn.trailing_data[0]
                elif isinstance(event, (h11.Response, h11.InformationalResponse)):
                    head = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    assert head is not None
                    return head, body
                else:
                    raise AssertionError(f"the browser got {event!r}")

    async def closed(self) -> bytes:
        """What the relay sends until it closes the connection."""
        async with asyncio.timeout(5):
            return await self.reader.read()


@contextlib.asynccontextmanager
async def browser(ports: dict[str, Any], script: Script) -> AsyncIterator[Browser]:
    """A signed-in browser connection to RENTAL's port 8000, whose app runs ``script``."""
    session = session_of(await ask(ports, get(f"/?gm_token={token(ports)}", LABEL)))
    ports["rental"].script = script
    reader, writer = await asyncio.open_connection("127.0.0.1", ports["web"].port, ssl=ports["client"], server_hostname=LABEL)
    try:
        yield Browser(reader, writer, session)
    finally:
        writer.close()


def cookies_seen(request: h11.Request) -> list[bytes]:
    return [value for name, value in request.headers if name == b"cookie"]


def set_cookies(answer: h11.Response | h11.InformationalResponse) -> list[bytes]:
    return [value for name, value in answer.headers if name == b"set-cookie"]


class TestCookies:
    async def test_domain_is_taken_out_of_every_set_cookie_of_every_answer(self, ports: dict[str, Any]) -> None:
        """An app's Set-Cookie headers reach the browser without Domain (any case, any place), on every answer of a
        keep-alive connection. Regression: the relay passed ``Domain=<ports domain>`` through, planting cookies on
        every other rental's host."""

        async def app(app: App) -> None:
            await app.request()
            await app.answer(200, [("Set-Cookie", f"a=1; Domain=.{DOMAIN}; Path=/"),
                                   ("Set-Cookie", f"b=2; Path=/; domain={DOMAIN}; HttpOnly"),
                                   ("Set-Cookie", f"c=3;DOMAIN={DOMAIN};Secure"), ("Content-Length", "2")], b"ok")  # fmt: skip
            await app.request()
            await app.answer(200, [("Set-Cookie", f"d=4; Path=/; Domain = {DOMAIN}"), ("Content-Length", "0")])

        async with browser(ports, app) as b:
            await b.send(b.request())
            first, body = await b.answer()
            assert body == b"ok" and set_cookies(first) == [b"a=1; Path=/", b"b=2; Path=/; HttpOnly", b"c=3;Secure"]
            await b.send(b.request())
            second, _ = await b.answer()
            assert set_cookies(second) == [b"d=4; Path=/"]

    async def test_an_app_cannot_set_the_relays_session_cookie(self, ports: dict[str, Any]) -> None:
        """A Set-Cookie of ``gm_port`` from the app is dropped (it would replace the renter's session); others pass."""

        async def app(app: App) -> None:
            await app.request()
            await app.answer(200, [("Set-Cookie", "gm_port=evil; Path=/"), ("Set-Cookie", "x=1"), ("Content-Length", "0")])

        async with browser(ports, app) as b:
            await b.send(b.request())
            answer, _ = await b.answer()
            assert set_cookies(answer) == [b"x=1"]

    async def test_a_keep_alive_second_request_reaches_the_app_without_gm_port(self, ports: dict[str, Any]) -> None:
        """Every request of a keep-alive connection loses gm_port and keeps the renter's other cookies. Regression: the
        connection was spliced whole after the first request, so the second one carried the session to the app."""

        async def app(app: App) -> None:
            for _ in range(2):
                await app.request()
                await app.answer(200, [("Content-Length", "2")], b"ok")

        async with browser(ports, app) as b:
            for _ in range(2):
                await b.send(b.request())
                assert (await b.answer())[1] == b"ok"
        seen = ports["rental"].seen
        assert [cookies_seen(r) for r in seen] == [[b"theme=dark; lang=en"]] * 2

    async def test_pipelined_requests_in_one_send_reach_the_app_without_gm_port_in_order(self, ports: dict[str, Any]) -> None:
        """Three requests written at once: each reaches the app without gm_port, and the answers come back in order."""

        async def app(app: App) -> None:
            for _ in range(3):
                request, _ = await app.request()
                await app.answer(200, [("Content-Length", str(len(request.target)))], request.target)

        async with browser(ports, app) as b:
            await b.send(b.request(path="/1"), b.request(path="/22"), b.request(path="/333"))
            assert [(await b.answer())[1] for _ in range(3)] == [b"/1", b"/22", b"/333"]
        seen = ports["rental"].seen
        assert [cookies_seen(r) for r in seen] == [[b"theme=dark; lang=en"]] * 3


class TestFraming:
    async def test_chunked_head_204_and_304_answers_keep_the_connection_framed(self, ports: dict[str, Any]) -> None:
        """A chunked answer, a HEAD answer with Content-Length and no body, a 204, a 304 and a chunked request body
        leave the connection in step: the next requests after each reach the app whole, and without gm_port."""
        posted = b"x" * 70_000

        async def app(app: App) -> None:
            await app.request()
            await app.answer(200, [("Transfer-Encoding", "chunked")], b"chunk-1;", b"chunk-2;", b"end")
            await app.request()
            await app.answer(200, [("Content-Length", "100")])  # HEAD: the length a GET would have, no body
            await app.request()
            await app.answer(204, [])
            await app.request()
            await app.answer(304, [("ETag", '"v1"')])
            _, body = await app.request()
            await app.answer(200, [("Content-Length", str(len(body)))], body)
            await app.request()
            await app.answer(200, [("Content-Length", "4")], b"last")

        async with browser(ports, app) as b:
            await b.send(b.request())
            assert (await b.answer())[1] == b"chunk-1;chunk-2;end"
            await b.send(b.request("HEAD"))
            head, body = await b.answer("HEAD")
            assert (head.status_code, body, dict(head.headers)[b"content-length"]) == (200, b"", b"100")
            await b.send(b.request())
            assert (await b.answer())[0].status_code == 204
            await b.send(b.request())
            assert (await b.answer())[0].status_code == 304
            chunked = b"".join(b"%x\r\n%s\r\n" % (len(posted[i:i + 30_000]), posted[i:i + 30_000]) for i in range(0, len(posted), 30_000))
            await b.send(b.request("POST", "/upload", "Transfer-Encoding: chunked", body=chunked + b"0\r\n\r\n"))
            assert (await b.answer())[1] == posted
            await b.send(b.request())
            assert (await b.answer())[1] == b"last"
        seen = ports["rental"].seen
        assert len(seen) == 6 and all(cookies_seen(r) == [b"theme=dark; lang=en"] for r in seen)

    async def test_an_answer_that_ends_at_the_apps_close_ends_the_connection(self, ports: dict[str, Any]) -> None:
        """An answer with no length (the app closes after it) reaches the browser whole, its cookies host-only, and
        the relay closes the browser's connection after it."""

        async def app(app: App) -> None:
            await app.request()
            await app.channel.write(b"HTTP/1.1 200 OK\r\nSet-Cookie: s=1; Domain=" + DOMAIN.encode() + b"\r\n\r\nall of it")

        async with browser(ports, app) as b:
            await b.send(b.request())
            answer, body = await b.answer()
            assert body == b"all of it" and set_cookies(answer) == [b"s=1"]
            assert await b.closed() == b""


class TestWebsocket:
    async def test_an_upgrade_after_a_keep_alive_request_is_spliced_raw_both_ways(self, ports: dict[str, Any]) -> None:
        """A websocket upgrade (the second request of the connection, as Jupyter's kernels may be) reaches the app
        without gm_port, its 101 reaches the browser, and from then on bytes pass raw both ways."""

        async def app(app: App) -> None:
            await app.request()
            await app.answer(200, [("Content-Length", "0")])
            await app.request()
            switched = app.conn.send(h11.InformationalResponse(status_code=101, headers=[("Upgrade", "websocket"), ("Connection", "Upgrade")]))
            assert switched is not None
            await app.channel.write(switched + b"hello ")  # the app's first frame in the same write as its 101
            pending = app.conn.trailing_data[0]
            while data := pending or await app.channel.read():
                pending = b""
                await app.channel.write(data.upper())

        upgrade = ("Connection", "Upgrade"), ("Upgrade", "websocket")
        async with browser(ports, app) as b:
            await b.send(b.request())
            await b.answer()
            await b.send(b.request("GET", "/api/kernels/1/channels", "Connection: Upgrade", "Upgrade: websocket") + b"ping ")
            switched, early = await b.answer("GET", *upgrade)
            assert switched.status_code == 101
            await b.send(b"pong")
            received = early
            async with asyncio.timeout(5):
                while received != b"hello PING PONG":
                    received += await b.reader.read(100)
        assert cookies_seen(ports["rental"].seen[1]) == [b"theme=dark; lang=en"]


async def answers_once_and_holds(app: App) -> None:
    """An app that answers one request with an empty 200, then holds the stream open: the relay is the one that ends it."""
    await app.request()
    await app.answer(200, [("Content-Length", "0")])
    await app.channel.read()


class TestMalformedLaterMessages:
    async def test_a_malformed_later_request_is_400_and_closes_the_connection(self, ports: dict[str, Any]) -> None:
        """A second request that is not HTTP is answered 400 and the connection closed; the app never sees it."""

        async with browser(ports, answers_once_and_holds) as b:
            await b.send(b.request())
            await b.answer()
            await b.send(b"GET / HTTP/1.1\r\nBad header line\r\n\r\n")
            rest = await b.closed()
            assert status(rest) == 400 and rest.endswith(b"\n"), rest
        assert len(ports["rental"].seen) == 1

    async def test_a_later_request_for_another_port_is_421(self, ports: dict[str, Any]) -> None:
        """A connection opened for one rental port serves no request whose Host names another (421, closed)."""

        async with browser(ports, answers_once_and_holds) as b:
            await b.send(b.request())
            await b.answer()
            await b.send(b.request(host=f"{OTHER}-8000.{DOMAIN}"))
            assert status(await b.closed()) == 421
        assert len(ports["rental"].seen) == 1

    async def test_a_malformed_answer_closes_the_connection(self, ports: dict[str, Any]) -> None:
        """An app whose answer is not HTTP gets the browser's connection closed, and nothing of the answer passes."""

        async def app(app: App) -> None:
            await app.request()
            await app.channel.write(b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\nbody")
            await app.channel.read()  # holds the stream open: the relay is the one that ends it

        async with browser(ports, app) as b:
            await b.send(b.request())
            assert await b.closed() == b""
