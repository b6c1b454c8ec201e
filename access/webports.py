"""Renters' web ports: ``https://<rental>-<port>.<ports domain>:<port>/`` reaches that port of the rental.

A second TLS listener of the relay, for browsers. Each rental port has a host name of its own (a
label under ``domain``, which needs a wildcard DNS record and a wildcard certificate in
production; ``*.ports.localhost`` resolves to the loopback by itself in browsers), so the rental's
app is served at ``/`` (Jupyter, an inference server: nothing to configure) and one browser
connection is always for one port: after the first request head is checked, the connection is
relayed to a stream on the host's agent link by ``access.webproxy``, which reads HTTP/1.1 both
ways for the connection's life (keep-alive, pipelining, chunked bodies; raw bytes after a websocket
upgrade) so that *every* request loses the ``gm_port`` cookie and every ``Set-Cookie`` of the app
loses its ``Domain``: a rental sets cookies on its own host name only, never on a neighbour's
(in production the ports domain also belongs on the Public Suffix List: docs/connect.md).

Who may: the renter follows the ``web_url`` the master's connect answer gives (its query holds a
connect token for that rental and port); the relay checks the token, answers ``302`` to the same
path without it and sets a session cookie (``gm_port``: HttpOnly, Secure, SameSite=Lax, this host
only) good for ``session_ttl``. Sessions live in this relay's memory, at most ``max_sessions``
(the oldest go first): a relay restart asks the renter to open the port again from the console.
The cookie is taken out of the request before it reaches the rental. Anything else: ``401``.

Errors are one-line ``text/plain`` answers: 400 (no or a malformed head, over ``max_head`` bytes
or ``max_headers`` lines), 401 (no or a bad token/session), 404 (a host name that names no rental
port), 421 (a later request on the connection for another port), 502 (the host is not connected
here; nothing listens on that port), 503 (the relay's or the rental's limits).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import secrets
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import h11
from cryptography.hazmat.primitives.asymmetric import ec

from access.webproxy import HttpRelay, Refused, answer_bytes, too_big
from shared.clock import Clock
from shared.crypto.tokens import ConnectClaims, TokenError, verify_connect_token
from shared.streams import StreamLimitError, encode_open_header
from shared.streams.aio import StreamLink

log = logging.getLogger(__name__)

COOKIE = "gm_port"
TOKEN_PARAM = "gm_token"
_LABEL = re.compile(r"^(r-[0-9a-f]{16})-([1-9][0-9]{0,4})$")


@dataclass(frozen=True, slots=True)
class _Session:
    claims: ConnectClaims
    expires: float  # monotonic


class WebPorts:
    def __init__(
        self,
        *,
        token_key: ec.EllipticCurvePublicKey,
        ssl_context: ssl.SSLContext,
        domain: str,
        links: Callable[[str], StreamLink | None],
        clock: Clock,
        host: str = "127.0.0.1",
        port: int = 0,
        public_port: int | None = None,
        # Timeouts
        head_timeout: float = 10.0,
        session_ttl: float = 8 * 3600.0,
        # Limits
        max_head: int = 16 * 1024,
        max_headers: int = 100,
        read_size: int = 64 * 1024,
        max_sessions: int = 100_000,
        max_connections: int = 10_000,
    ) -> None:
        if min(head_timeout, session_ttl) <= 0 or min(max_head, max_headers, read_size, max_sessions, max_connections) < 1:
            raise ValueError("web port timeouts and limits must be positive")
        self.token_key = token_key
        self.ssl_context = ssl_context
        self.domain = domain.lower().strip(".")
        self.links = links
        self.clock = clock
        self.host = host
        self.requested_port = port
        self._public_port = public_port
        self.head_timeout = head_timeout
        self.session_ttl = session_ttl
        self.max_head = max_head
        self.max_headers = max_headers
        self.read_size = read_size
        self.max_sessions = max_sessions
        self.max_connections = max_connections
        self._sessions: collections.OrderedDict[str, _Session] = collections.OrderedDict()
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self.port = 0
        self.refused: collections.Counter[int] = collections.Counter()

    @property
    def url_template(self) -> str:
        """What the relay publishes (``RelayRecord.ports_url``): ``{label}`` stands for ``<rental>-<port>``."""
        return f"https://{{label}}.{self.domain}:{self._public_port or self.port}/"

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._accept, self.host, self.requested_port, ssl=self.ssl_context, ssl_handshake_timeout=self.head_timeout,
            limit=self.max_head,
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info("web ports on %s:%d as %s", self.host, self.port, self.url_template)

    async def close(self) -> None:
        """Stop accepting and end every open connection (their streams are reset)."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._handlers) >= self.max_connections:
            await _answer(writer, 503, "this relay has as many web connections as it takes; try again shortly")
            return
        self._handlers.add(task)
        try:
            await self._handle(reader, writer)
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # close() ends the connection; ending quietly keeps asyncio's stream callback from logging it
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        browser = h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_head)
        try:
            async with asyncio.timeout(self.head_timeout):
                first = await _first_request(browser, reader, self.read_size)
        except TimeoutError:
            return
        except h11.RemoteProtocolError as exc:
            await _answer(writer, 400, f"not an HTTP/1.x request head of at most {self.max_head} bytes ({exc})")
            return
        if first is None:
            return
        try:
            target, headers = _decoded(first)
            if (why := too_big(first, max_head=self.max_head, max_headers=self.max_headers)) is not None:
                raise Refused(400, why)
            rental_id, port = self._target(headers)
            claims, cookie = self._authorize(target, headers, rental_id, port)
            if cookie is not None:  # a fresh token: set the session, drop the token from the address
                await _answer(writer, 302, "signed in to this port", headers=[("Location", _without_token(target)), ("Set-Cookie", cookie)])
                return
            link = self.links(claims.host_id)
            if link is None:
                raise Refused(502, f"the host of rental {rental_id} is not connected to this relay; open the port again from the console")
            try:
                channel = link.open(encode_open_header(rental_id, port, "tcp"))
            except (StreamLimitError, ConnectionError) as exc:
                raise Refused(503, f"the host's link is full ({exc}); try again shortly") from None
        except Refused as refusal:
            self.refused[refusal.status] += 1
            await _answer(writer, refusal.status, refusal.text)
            return

        def same_port(request: h11.Request) -> bool:
            try:
                return self._target(_decoded(request)[1]) == (rental_id, port)
            except Refused:
                return False

        relay = HttpRelay(channel, reader, writer, browser, first, same_port=same_port, max_head=self.max_head,
                          max_headers=self.max_headers, read_size=self.read_size)  # fmt: skip
        try:
            await relay.run()
        finally:
            if channel.reset_error is None:
                channel.reset()

    def _target(self, headers: list[tuple[str, str]]) -> tuple[str, int]:
        host = next((v for k, v in headers if k == "host"), "")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        name = name.lower().rstrip(".")
        suffix = "." + self.domain
        match = _LABEL.fullmatch(name[: -len(suffix)]) if name.endswith(suffix) else None
        if match is None or not 0 < int(match.group(2)) < 65536:
            raise Refused(404, f"{host[:100]!r} names no rental port here (expected <rental>-<port>.{self.domain})")
        return match.group(1), int(match.group(2))

    def _authorize(self, target: str, headers: list[tuple[str, str]], rental_id: str, port: int) -> tuple[ConnectClaims, str | None]:
        query = dict(parse_qsl(urlsplit(target).query, max_num_fields=64))
        token = query.get(TOKEN_PARAM)
        now = self.clock.monotonic()
        if token:
            try:
                claims = verify_connect_token(self.token_key, token, now=self.clock.now().timestamp())
            except TokenError as exc:
                raise Refused(401, exc.message) from None
            if (claims.rental_id, claims.kind, claims.port) != (rental_id, "tcp", port):
                raise Refused(401, "this token is for another rental or port")
            sid = secrets.token_urlsafe(24)
            self._sessions[sid] = _Session(claims, now + self.session_ttl)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
            cookie = f"{COOKIE}={sid}; Path=/; Max-Age={int(self.session_ttl)}; Secure; HttpOnly; SameSite=Lax"
            return claims, cookie
        for sid in _cookies(headers, COOKIE):
            session = self._sessions.get(sid)
            if session is None:
                continue
            if session.expires <= now:
                del self._sessions[sid]
                continue
            if (session.claims.rental_id, session.claims.port) == (rental_id, port):
                return session.claims, None
        raise Refused(401, "open this port from the console (Rentals → Connect) or with the web_url of POST /rentals/{id}/connect")


# ---- the first request (the rest of the connection is access.webproxy's) --------------------------


async def _first_request(browser: h11.Connection, reader: asyncio.StreamReader, read_size: int) -> h11.Request | None:
    """The connection's first request head (``None``: the browser left first); ``h11.RemoteProtocolError`` when malformed."""
    while True:
        event = browser.next_event()
        if event is h11.NEED_DATA:
            browser.receive_data(await reader.read(read_size))
        elif isinstance(event, h11.Request):
            return event
        else:
            return None


def _decoded(request: h11.Request) -> tuple[str, list[tuple[str, str]]]:
    """The request's target and headers (names lower case) as text; ``Refused`` (400) for what web ports never serve."""
    target = request.target.decode("latin-1")  # latin-1 decodes any byte
    if not target.startswith("/"):
        raise Refused(400, "web ports serve origin-form targets only (GET /path HTTP/1.1)")
    return target, [(name.decode("latin-1"), value.decode("latin-1")) for name, value in request.headers]


def _cookies(headers: list[tuple[str, str]], name: str) -> list[str]:
    found = []
    for key, value in headers:
        if key == "cookie":
            for item in value.split(";"):
                k, _, v = item.strip().partition("=")
                if k == name and v:
                    found.append(v)
    return found


def _without_token(target: str) -> str:
    parts = urlsplit(target)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True, max_num_fields=64) if k != TOKEN_PARAM]
    return urlunsplit(("", "", parts.path or "/", urlencode(query), ""))


async def _answer(writer: asyncio.StreamWriter, status: int, text: str, *, headers: list[tuple[str, str]] | None = None) -> None:
    writer.write(answer_bytes(status, text, headers=headers or ()))
    with contextlib.suppress(ConnectionError, OSError):
        await writer.drain()
