"""Connections to one replica: HTTP/1.1 over streams through the relay, pooled and reused.

A replica's container is reached the way a renter reaches it (docs/connect.md): a websocket to the
relay its host is connected to (``wss://<relay>/v1/connect``, TLS checked against the platform CA
only), authorised by a connect token the master signs for the service's renter, that replica and the
service's port. Each websocket is one byte stream to that port.

HTTP runs over those streams through aiohttp's client, so keep-alive, chunked bodies, streamed answers
and websocket upgrades are aiohttp's: ``RelayConnector`` is an aiohttp connector whose every new
connection is a fresh relay websocket that aiohttp's protocol reads and writes through a
``WebsocketTransport`` (``wstransport.py``: no socket between them). Each replica has one ``ReplicaPool`` (one ``ClientSession``) of at
most ``limit`` such connections, kept open ``keepalive_timeout`` seconds after their last request —
a little less than common servers' own idle limit (uvicorn's 5 s), so the pool rarely reuses a
connection the server is closing.

When the relay refuses (the host is not on it, a limit, the TLS or the token is wrong) or cannot be
reached, the connector raises ``UpstreamUnavailable`` before aiohttp writes anything: nothing of the
request left, so the gateway may send it to another replica whatever its method. Once a stream is
open, the relay may still close it with ``4404`` (the agent refused: the port is not open, the rental
is gone) or ``4410`` (reset: the rental stopped, the host's link went); the pool remembers that as
a failure of the replica (``failed_at``), which the balancer reads as passive health.

Ownership: every connection's task (``WebsocketTransport.run``) is in its pool's set; ``ReplicaPool.close``
closes the session (so every connection's transport) and then waits for them. Cancelling one is safe:
its websocket closes and aiohttp is told the connection is lost.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ClientRequest
from aiohttp.tracing import Trace
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidHandshake, InvalidStatus, InvalidURI

from master.services.gateway.wstransport import WebsocketTransport
from shared.streams import MAX_DATA

log = logging.getLogger(__name__)

CLOSE_STREAM_REFUSED = 4404  # the relay's close codes (access/tunnels.py) that mean the replica is not there
CLOSE_STREAM_RESET = 4410
REPLICA_GONE_CLOSES = frozenset({CLOSE_STREAM_REFUSED, CLOSE_STREAM_RESET})

# What aiohttp would add on its own; the gateway passes on what the client sent, nothing more.
SKIP_AUTO_HEADERS = frozenset({"Accept", "Accept-Encoding", "User-Agent", "Content-Type"})


class UpstreamUnavailable(aiohttp.ClientConnectionError):
    """The relay opened no stream to the replica: nothing of the request was sent."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        """The relay's HTTP answer (401, 404, 429) when it refused; ``None`` when it could not be reached."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where a replica's connections go: the rental, its host, the port, and the relay the host is on now."""

    rental_id: str
    host_id: str
    renter_id: str
    port: int
    relay_url: str | None
    """``wss://<relay>/v1/connect``; ``None`` while the host is on no live relay."""


Dial = Callable[[], Awaitable[ClientConnection]]


class RelayConnector(aiohttp.BaseConnector):
    """An aiohttp connector whose connections are relay streams (``dial``), each aiohttp's through a ``WebsocketTransport``."""

    def __init__(
        self, dial: Dial, *, on_close: Callable[[int | None], None], streams: set[asyncio.Task[None]], limit: int,
        keepalive_timeout: float,
    ) -> None:  # fmt: skip
        super().__init__(limit=limit, limit_per_host=0, keepalive_timeout=keepalive_timeout)
        self._dial = dial
        self._on_close = on_close
        self._streams = streams

    async def _create_connection(self, req: ClientRequest, traces: list[Trace], timeout: aiohttp.ClientTimeout) -> ResponseHandler:
        ws = await self._dial()  # UpstreamUnavailable: aiohttp has sent nothing yet
        protocol = self._factory()
        transport = WebsocketTransport(ws, protocol, on_close=self._on_close)
        task = asyncio.create_task(transport.run(), name="gateway-stream")
        self._streams.add(task)
        task.add_done_callback(self._streams.discard)
        return protocol


class ReplicaPool:
    """One replica's connections: an aiohttp session over ``RelayConnector``, and what the balancer reads.

    ``target`` may be replaced at any time (the host moved to another relay): new connections use the
    new one. ``sign`` makes the connect token for a target.
    """

    def __init__(
        self,
        target: Target,
        *,
        sign: Callable[[Target], str],
        ssl_context: ssl.SSLContext,
        clock: Callable[[], float],
        # Limits
        limit: int = 8,
        # Timeouts
        keepalive_timeout: float = 4.0,
        open_timeout: float = 10.0,
        close_timeout: float = 2.0,
        ping_interval: float = 20.0,
    ) -> None:
        self.target = target
        self.inflight = 0
        """Requests (and websockets) using this replica now, from this process."""
        self.failed_at: float | None = None
        """When the replica last failed (monotonic): no stream, or its stream refused or reset."""
        self.last_used = clock()
        self.dialed = 0
        """Relay streams this pool opened, ever (each a new connection to the replica)."""
        self._sign = sign
        self._ssl = ssl_context
        self._clock = clock
        self._open_timeout = open_timeout
        self._close_timeout = close_timeout
        self._ping_interval = ping_interval
        self._streams: set[asyncio.Task[None]] = set()
        connector = RelayConnector(self._dial, on_close=self._closed_by_relay, streams=self._streams, limit=limit,
                                   keepalive_timeout=keepalive_timeout)  # fmt: skip
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(), trust_env=False,
            skip_auto_headers=SKIP_AUTO_HEADERS, timeout=aiohttp.ClientTimeout(total=None),
        )  # fmt: skip

    @property
    def connections(self) -> int:
        """Relay streams open now (in use or idle in the pool)."""
        return len(self._streams)

    def failed(self) -> None:
        self.failed_at = self._clock()

    def recovered(self) -> None:
        """The replica answered its health probe: whatever failed before (a probe while it was starting) is over."""
        self.failed_at = None

    async def _dial(self) -> ClientConnection:
        target = self.target
        if target.relay_url is None:
            self.failed()
            raise UpstreamUnavailable(f"the host of replica {target.rental_id} is on no relay right now")
        where = target.relay_url
        try:
            stream = await connect(
                target.relay_url, additional_headers={"Authorization": f"Bearer {self._sign(target)}"}, ssl=self._ssl,
                proxy=None, compression=None, user_agent_header="gpumarket-gateway", open_timeout=self._open_timeout,
                close_timeout=self._close_timeout, ping_interval=self._ping_interval, ping_timeout=self._ping_interval,
                max_size=2 * MAX_DATA, max_queue=16, write_limit=2 * MAX_DATA,
            )  # fmt: skip
        except InvalidStatus as exc:
            status = exc.response.status_code
            if status != 429:  # a limit of the relay's says nothing about the replica
                self.failed()
            text = exc.response.body.decode(errors="replace").strip()[:200] if exc.response.body else ""
            raise UpstreamUnavailable(f"the relay refused a stream to replica {target.rental_id}: {text or status}",
                                      status=status) from None  # fmt: skip
        except (OSError, TimeoutError, InvalidURI, InvalidHandshake) as exc:
            self.failed()
            raise UpstreamUnavailable(f"cannot reach the relay at {where} for replica {target.rental_id}: "
                                      f"{exc or type(exc).__name__}") from None  # fmt: skip
        self.dialed += 1
        return stream

    def _closed_by_relay(self, code: int | None) -> None:
        if code in REPLICA_GONE_CLOSES:
            self.failed()

    async def close(self) -> None:
        """Close every connection and wait for their tasks."""
        await self.session.close()
        tasks = list(self._streams)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["ReplicaPool", "Target", "UpstreamUnavailable"]
