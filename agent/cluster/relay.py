"""A cluster tunnel's path through the relays, for members whose hosts cannot reach each other directly.

WireGuard speaks UDP; the relays carry byte streams (docs/connect.md). So each datagram travels as
a 2-byte big-endian length and its bytes, over a ``wg`` stream:

* **the sending side** (``RelayedPeer``) binds a UDP socket on ``127.0.0.1`` and makes it the peer's
  endpoint in this member's ``wireguard-go``; what ``wireguard-go`` sends there goes, framed, over a
  websocket to the peer's relay (``wss://…/v1/connect`` with the master's ``wg`` token for the peer
  member, as a renter's client does), which opens a stream on the peer's agent link; what comes
  back is handed to ``wireguard-go`` from that socket. A dropped websocket is opened again (with a
  back-off) while the token is valid;
* **the receiving side** (``serve_stream``, for ``agent.reach.tunnels``) gives each such stream a UDP socket
  of its own on ``127.0.0.1`` and exchanges datagrams with the member's ``wireguard-go``, which sees
  the peer at that socket's address (WireGuard follows a peer that roams) and answers there.

WireGuard authenticates and encrypts every datagram end to end: the relays see sealed packets, and
a datagram from anyone but the member's peers is dropped by ``wireguard-go``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Final

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from shared.streams.aio import first_done

log = logging.getLogger(__name__)

MAX_DATAGRAM: Final = 65535
LENGTH: Final = 2


def frame(datagram: bytes) -> bytes:
    return len(datagram).to_bytes(LENGTH, "big") + datagram


class Deframer:
    """Datagrams out of a byte stream of ``frame``s, whatever the chunks it arrives in."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        out = []
        while len(self._buffer) >= LENGTH:
            size = int.from_bytes(self._buffer[:LENGTH], "big")
            if len(self._buffer) < LENGTH + size:
                break
            out.append(bytes(self._buffer[LENGTH:LENGTH + size]))
            del self._buffer[:LENGTH + size]
        return out


def _udp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sock.bind(("127.0.0.1", 0))
    return sock


async def pump(sock: socket.socket, wg_port: int, read: Callable[[], Awaitable[bytes]], write: Callable[[bytes], Awaitable[None]]) -> None:
    """Datagrams between ``sock`` (towards ``wireguard-go`` on ``127.0.0.1:wg_port``) and a stream (``read``: its next
    bytes, empty at its end; ``write``: send bytes) until either ends. Datagrams from anything but ``wireguard-go``
    are dropped."""
    loop = asyncio.get_running_loop()
    target = ("127.0.0.1", wg_port)

    async def to_stream() -> None:
        while True:
            datagram, source = await loop.sock_recvfrom(sock, MAX_DATAGRAM)
            if source == target:
                await write(frame(datagram))

    async def to_socket() -> None:
        deframer = Deframer()
        while data := await read():
            for datagram in deframer.feed(data):
                await loop.sock_sendto(sock, datagram, target)

    await first_done(to_stream(), to_socket())


async def serve_stream(wg_port: int, read: Callable[[], Awaitable[bytes]], write: Callable[[bytes], Awaitable[None]]) -> None:
    """The receiving side: one stream's datagrams to and from the member's ``wireguard-go``."""
    sock = _udp_socket()
    try:
        await pump(sock, wg_port, read, write)
    finally:
        sock.close()


class RelayedPeer:
    """The sending side for one peer: a local UDP endpoint for ``wireguard-go`` and a websocket to the peer's relay."""

    def __init__(self, url: str, token: str, wg_port: int, tls: ssl.SSLContext, *, max_backoff: float = 30.0) -> None:
        self.url = url
        self.token = token
        self.wg_port = wg_port
        self.tls = tls
        self.max_backoff = max_backoff
        self.sock = _udp_socket()
        self.port: int = self.sock.getsockname()[1]
        self.connected = asyncio.Event()
        self.last_error: str | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> int:
        """Start carrying datagrams; returns the local port ``wireguard-go`` should send this peer's datagrams to."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"cluster-relay-{self.port}")
        return self.port

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.sock.close()

    async def _run(self) -> None:
        delay = 0.5
        while True:
            try:
                async with asyncio.timeout(10):
                    ws = await self._open()
            except (OSError, TimeoutError, InvalidHandshake, InvalidURI, ssl.SSLError) as exc:
                self.last_error = _why(exc)
                if isinstance(exc, InvalidStatus) and exc.response.status_code == 401:
                    log.warning("relay path to %s refused its token (%s); it stays down until the master sends new peers", self.url, self.last_error)
                    return
                log.info("relay path to %s not open (%s); again in %.1fs", self.url, self.last_error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff)
                continue
            delay = 0.5
            self.connected.set()
            try:
                await pump(self.sock, self.wg_port, functools.partial(_recv, ws), ws.send)
            finally:
                self.connected.clear()
                await ws.close()

    async def _open(self) -> ClientConnection:
        return await connect(self.url, additional_headers={"Authorization": f"Bearer {self.token}"}, ssl=self.tls, proxy=None,
                             compression=None, open_timeout=10, ping_interval=20, ping_timeout=20, max_size=2**20)  # fmt: skip


async def _recv(ws: ClientConnection) -> bytes:
    try:
        message = await ws.recv()
    except ConnectionClosed:
        return b""
    return message if isinstance(message, bytes) else b""


def _why(exc: BaseException) -> str:
    if isinstance(exc, InvalidStatus):
        return f"HTTP {exc.response.status_code}"
    return str(exc) or type(exc).__name__
