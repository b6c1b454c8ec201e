"""Renters' web ports: ``https://<rental>-<port>.<ports domain>:<port>/`` reaches that port of the rental.

A second TLS listener of the relay, for browsers. Each rental port has a host name of its own (a
label under ``domain``, which needs a wildcard DNS record and a wildcard certificate in
production; ``*.ports.localhost`` resolves to the loopback by itself in browsers), so the rental's
app is served at ``/`` (Jupyter, an inference server: nothing to configure), cookies never mix
between rentals, and one browser connection is always for one port: after the first request head
is checked, the connection is spliced whole to a stream on the host's agent link (keep-alive,
chunked bodies and websocket upgrades pass through untouched).

Who may: the renter follows the ``web_url`` the master's connect answer gives (its query holds a
connect token for that rental and port); the relay checks the token, answers ``302`` to the same
path without it and sets a session cookie (``gm_port``: HttpOnly, Secure, SameSite=Lax, this host
only) good for ``session_ttl``. Sessions live in this relay's memory, at most ``max_sessions``
(the oldest go first): a relay restart asks the renter to open the port again from the console.
The cookie is taken out of the request before it reaches the rental. Anything else: ``401``.

Errors are one-line ``text/plain`` answers: 400 (no or a malformed head), 401 (no or a bad
token/session), 404 (a host name that names no rental port), 502 (the host is not connected
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

from cryptography.hazmat.primitives.asymmetric import ec

from shared.clock import Clock
from shared.crypto.tokens import ConnectClaims, TokenError, verify_connect_token
from shared.streams import TUNNEL_REASONS, StreamLimitError, encode_open_header
from shared.streams.aio import Channel, ChannelReset, StreamLink

log = logging.getLogger(__name__)

COOKIE = "gm_port"
TOKEN_PARAM = "gm_token"
_LABEL = re.compile(r"^(r-[0-9a-f]{16})-([1-9][0-9]{0,4})$")
_STATUS = {302: "Found", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 502: "Bad Gateway", 503: "Service Unavailable"}


@dataclass(frozen=True, slots=True)
class _Session:
    claims: ConnectClaims
    expires: float  # monotonic


class _Refused(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


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
        max_sessions: int = 100_000,
        max_connections: int = 10_000,
    ) -> None:
        if min(head_timeout, session_ttl) <= 0 or min(max_head, max_sessions, max_connections) < 1:
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
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self.head_timeout):
                head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.LimitOverrunError, ValueError):
            await _answer(writer, 400, f"request head over {self.max_head} bytes")
            return
        except (TimeoutError, asyncio.IncompleteReadError):
            return
        try:
            method, target, headers = _parse_head(head)
            rental_id, port = self._target(headers)
            claims, cookie = self._authorize(target, headers, rental_id, port)
            if cookie is not None:  # a fresh token: set the session, drop the token from the address
                await _answer(writer, 302, "signed in to this port", headers=[("Location", _without_token(target)), ("Set-Cookie", cookie)])
                return
            link = self.links(claims.host_id)
            if link is None:
                raise _Refused(502, f"the host of rental {rental_id} is not connected to this relay; open the port again from the console")
            try:
                channel = link.open(encode_open_header(rental_id, port, "tcp"))
            except (StreamLimitError, ConnectionError) as exc:
                raise _Refused(503, f"the host's link is full ({exc}); try again shortly") from None
        except _Refused as refusal:
            self.refused[refusal.status] += 1
            await _answer(writer, refusal.status, refusal.text)
            return
        await _proxy(channel, _rewrite_head(method, target, headers), reader, writer)

    def _target(self, headers: list[tuple[str, str]]) -> tuple[str, int]:
        host = next((v for k, v in headers if k == "host"), "")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        name = name.lower().rstrip(".")
        suffix = "." + self.domain
        match = _LABEL.match(name[: -len(suffix)]) if name.endswith(suffix) else None
        if match is None or not 0 < int(match.group(2)) < 65536:
            raise _Refused(404, f"{host[:100]!r} names no rental port here (expected <rental>-<port>.{self.domain})")
        return match.group(1), int(match.group(2))

    def _authorize(self, target: str, headers: list[tuple[str, str]], rental_id: str, port: int) -> tuple[ConnectClaims, str | None]:
        query = dict(parse_qsl(urlsplit(target).query, max_num_fields=64))
        token = query.get(TOKEN_PARAM)
        now = self.clock.monotonic()
        if token:
            try:
                claims = verify_connect_token(self.token_key, token, now=self.clock.now().timestamp())
            except TokenError as exc:
                raise _Refused(401, exc.message) from None
            if (claims.rental_id, claims.kind, claims.port) != (rental_id, "tcp", port):
                raise _Refused(401, "this token is for another rental or port")
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
        raise _Refused(401, "open this port from the console (Rentals → Connect) or with the web_url of POST /rentals/{id}/connect")


# ---- HTTP bits (only the head of the first request is read; the rest passes through) ------------


def _parse_head(head: bytes) -> tuple[str, str, list[tuple[str, str]]]:
    lines = head.decode("latin-1")[:-4].split("\r\n")  # latin-1 decodes any byte
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[1].startswith("/"):
        raise _Refused(400, "not an HTTP/1.x request")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or any(c in name for c in " \t"):
            raise _Refused(400, "malformed header line")
        headers.append((name.lower(), value.strip()))
    return parts[0], parts[1], headers


def _cookies(headers: list[tuple[str, str]], name: str) -> list[str]:
    found = []
    for key, value in headers:
        if key == "cookie":
            for item in value.split(";"):
                k, _, v = item.strip().partition("=")
                if k == name and v:
                    found.append(v)
    return found


def _rewrite_head(method: str, target: str, headers: list[tuple[str, str]]) -> bytes:
    """The head as the rental sees it: our session cookie taken out, the rest as sent."""
    lines = [f"{method} {target} HTTP/1.1"]
    for key, value in headers:
        if key == "cookie":
            kept = [item.strip() for item in value.split(";") if item.strip() and item.strip().partition("=")[0] != COOKIE]
            if not kept:
                continue
            value = "; ".join(kept)
        lines.append(f"{key}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _without_token(target: str) -> str:
    parts = urlsplit(target)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True, max_num_fields=64) if k != TOKEN_PARAM]
    return urlunsplit(("", "", parts.path or "/", urlencode(query), ""))


async def _answer(writer: asyncio.StreamWriter, status: int, text: str, *, headers: list[tuple[str, str]] | None = None) -> None:
    body = (text + "\n").encode()
    head = [f"HTTP/1.1 {status} {_STATUS.get(status, 'Error')}", "Content-Type: text/plain; charset=utf-8",
            f"Content-Length: {len(body)}", "Connection: close", "Cache-Control: no-store"]
    head += [f"{k}: {v}" for k, v in headers or ()]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    with contextlib.suppress(ConnectionError, OSError):
        await writer.drain()


async def _proxy(channel: Channel, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Splice the browser's connection to the stream; a stream refused before any answer is a 502."""

    async def upstream() -> None:
        await channel.write(head)
        while data := await reader.read(64 * 1024):
            await channel.write(data)
        channel.close()

    sender = asyncio.ensure_future(upstream())
    answered = False
    try:
        while data := await channel.read():
            answered = True
            writer.write(data)
            await writer.drain()
    except ChannelReset as exc:
        if not answered:
            reason = TUNNEL_REASONS.get(exc.code, str(exc)) if exc.by_peer else str(exc)  # type: ignore[call-overload]
            await _answer(writer, 502, f"the rental did not answer: {reason}")
    except (ConnectionError, OSError):
        channel.reset()
    finally:
        sender.cancel()
        with contextlib.suppress(BaseException):
            await sender
        if channel.reset_error is None:
            channel.reset()
