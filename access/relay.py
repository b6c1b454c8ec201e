"""One relay process: accepts agents over TLS 1.3 websockets, puts their messages on the bus,
and delivers the master's commands to them.

Per connection: the peer certificate names the host (``urn:gpumarket:host:<id>``);
every frame is decoded by ``shared.protocol`` and must name the same host, or the
connection is closed with the close code from ``shared.protocol.CLOSE_CODES``. A
message is acknowledged to the agent only after the bus accepted it, so an agent
never forgets a message the master has not durably received.

``/v1/speedtest`` (same client certificate) is served by ``access.speedtest``.

Shutdown sequence (``close``): stop accepting → tell every agent (and speed test) to move
(close 1001) → wait for the handlers → stop the command consumer → release the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from dataclasses import dataclass, field
from http import HTTPStatus

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from access import speedtest
from shared import protocol
from shared.bus import Bus
from shared.clock import Clock, SystemClock
from shared.crypto import host_id_from_der
from shared.errors import BusError, GpumarketError, ProtocolError

log = logging.getLogger(__name__)

AGENT_PATH = "/v1/agent"
SPEEDTEST_PATH = "/v1/speedtest"  # speed tests: access.speedtest
COMMAND_GROUP = "relay"


def _reason(text: str) -> str:
    """Websocket close reasons are limited to 123 bytes."""
    encoded = text.encode()[:120]
    return encoded.decode(errors="ignore")


@dataclass
class AgentLink:
    """One connected agent: its socket and a bounded queue of frames to send it."""

    host_id: str
    connection: ServerConnection
    outbound: asyncio.Queue[str]
    received: int = 0
    writer: asyncio.Task[None] | None = field(default=None, repr=False)


class Relay:
    def __init__(
        self,
        *,
        relay_id: str,
        bus: Bus,
        ssl_context: ssl.SSLContext,
        host: str = "127.0.0.1",
        port: int = 0,
        region: str = "local",
        clock: Clock | None = None,
        heartbeat_interval: float = 10.0,
        telemetry_interval: float = 10.0,
        # Timeouts
        open_timeout: float = 10.0,
        ping_interval: float = 20.0,
        ping_timeout: float = 20.0,
        close_timeout: float = 2.0,
        # Limits
        max_frame: int = protocol.DEFAULT_MAX_FRAME,
        max_outbound_queue: int = 256,
        max_connections: int = 10_000,
    ) -> None:
        self.relay_id = relay_id
        self.region = region
        self.bus = bus
        self.ssl_context = ssl_context
        self.host = host
        self.requested_port = port
        self.clock = clock or SystemClock()
        self.heartbeat_interval = heartbeat_interval
        self.telemetry_interval = telemetry_interval
        self.open_timeout = open_timeout
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self.close_timeout = close_timeout
        self.max_frame = max_frame
        self.max_outbound_queue = max_outbound_queue
        self.max_connections = max_connections
        self.agents: dict[str, AgentLink] = {}
        self.speedtests = speedtest.SpeedtestRegistry()  # speed tests running here, one per host
        self.messages_forwarded = 0
        self.commands_delivered = 0
        self._server: Server | None = None
        self._port: int | None = None
        self._closers: set[asyncio.Task[None]] = set()
        self._consumer: asyncio.Task[None] | None = None
        self._closing = False

    # ---- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        await self.bus.ensure_group(protocol.commands_stream(self.relay_id), COMMAND_GROUP)
        self._server = await serve(
            self._handle,
            self.host,
            self.requested_port,
            ssl=self.ssl_context,
            ssl_handshake_timeout=self.open_timeout,
            process_request=self._process_request,
            open_timeout=self.open_timeout,
            ping_interval=self.ping_interval,
            ping_timeout=self.ping_timeout,
            close_timeout=self.close_timeout,
            max_size=self.max_frame,
            max_queue=16,
            compression=None,
            server_header=None,
        )
        self._port = int(self._server.sockets[0].getsockname()[1])
        self._consumer = asyncio.create_task(self._consume_commands(), name=f"relay-{self.relay_id}-commands")
        log.info("relay %s (%s) listening on %s", self.relay_id, self.region, self.url)

    @property
    def port(self) -> int:
        """The bound port (still known after ``close()``)."""
        assert self._port is not None, "start() first"
        return self._port

    @property
    def url(self) -> str:
        return f"wss://{self.host}:{self.port}{AGENT_PATH}"

    async def close(self) -> None:
        """Graceful shutdown; see the module docstring for the sequence."""
        if self._server is None or self._closing:
            return
        self._closing = True
        self._server.close(close_connections=False)  # 1. stop accepting
        links = list(self.agents.values())
        await asyncio.gather(  # 2. tell agents to move
            *(link.connection.close(protocol.CLOSE_GOING_AWAY, "relay shutting down; reconnect to another relay") for link in links),
            *(test.close(protocol.CLOSE_GOING_AWAY, "relay shutting down") for test in self.speedtests.connections()),
            return_exceptions=True,
        )
        with contextlib.suppress(TimeoutError):  # 3. wait for handlers
            async with asyncio.timeout(self.close_timeout + 1):
                await self._server.wait_closed()
                await asyncio.gather(*self._closers, return_exceptions=True)
        if self._consumer is not None:  # 4. stop the command consumer
            self._consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._consumer
        log.info("relay %s closed", self.relay_id)

    # ---- HTTP side: health and routing ----------------------------------------------

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        if request.path == "/health":
            body = json.dumps(
                {
                    "relay_id": self.relay_id,
                    "region": self.region,
                    "status": "draining" if self._closing else "ok",
                    "agents": len(self.agents),
                    "max_connections": self.max_connections,
                    "messages_forwarded": self.messages_forwarded,
                    "commands_delivered": self.commands_delivered,
                }
            )
            response = connection.respond(HTTPStatus.OK, body + "\n")
            # Headers is a multidict: assigning adds a second Content-Type after respond()'s text/plain.
            del response.headers["Content-Type"]
            response.headers["Content-Type"] = "application/json"
            return response
        if request.path not in (AGENT_PATH, SPEEDTEST_PATH):
            return connection.respond(HTTPStatus.NOT_FOUND, f"agents connect to {AGENT_PATH}\n")
        return None

    # ---- one agent ------------------------------------------------------------------

    async def _handle(self, connection: ServerConnection) -> None:
        ssl_object = connection.transport.get_extra_info("ssl_object")
        try:
            host_id = host_id_from_der(ssl_object.getpeercert(binary_form=True) if ssl_object else None)
        except GpumarketError as exc:
            log.warning("refused a connection from %s: %s", connection.remote_address, exc)
            await connection.close(protocol.CLOSE_IDENTITY_MISMATCH, _reason(f"no usable client certificate: {exc}"))
            return
        if connection.request is not None and connection.request.path == SPEEDTEST_PATH:  # speed test, not an agent link
            await speedtest.handle(connection, host_id=host_id, registry=self.speedtests, max_frame=self.max_frame)
            return
        if len(self.agents) >= self.max_connections and host_id not in self.agents:
            log.warning("refused host %s: relay full (%d connections)", host_id, self.max_connections)
            await connection.close(protocol.CLOSE_TOO_MANY_CONNECTIONS, "relay full; try another relay")
            return
        link = AgentLink(host_id=host_id, connection=connection, outbound=asyncio.Queue(self.max_outbound_queue))
        # Swap in the new link before awaiting anything, so racing reconnects cannot leave one untracked.
        previous, self.agents[host_id] = self.agents.get(host_id), link
        if previous is not None:
            log.info("host %s reconnected; closing its previous connection", host_id)
            await previous.connection.close(protocol.CLOSE_REPLACED, "replaced by a newer connection of this host")
        link.writer = asyncio.create_task(self._write(link), name=f"relay-write-{host_id}")
        log.info("host %s connected from %s", host_id, connection.remote_address)
        try:
            welcome = protocol.Welcome(
                body=protocol.WelcomeBody(
                    relay_id=self.relay_id,
                    host_id=host_id,
                    heartbeat_interval=self.heartbeat_interval,
                    telemetry_interval=self.telemetry_interval,
                    max_frame=self.max_frame,
                )
            )
            self._send(link, protocol.encode(welcome))
            await self._receive(link)
        except ConnectionClosed as exc:
            log.info("host %s disconnected (%s)", host_id, exc)
        finally:
            if self.agents.get(host_id) is link:
                del self.agents[host_id]
            link.writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await link.writer

    async def _receive(self, link: AgentLink) -> None:
        async for frame in link.connection:
            try:
                message = protocol.decode_agent_frame(frame, max_frame=self.max_frame)
                protocol.check_identity(message, link.host_id)
            except ProtocolError as exc:
                log.warning("closing host %s: %s (%s)", link.host_id, exc.message, exc.code)
                await link.connection.close(exc.close_code, _reason(exc.message))
                return
            try:
                await self.bus.publish(
                    protocol.AGENT_EVENTS_STREAM, protocol.encode_bus_envelope(self.relay_id, message, self.clock.now())
                )
            except BusError as exc:
                # Not acknowledged: the agent keeps the message and replays it elsewhere.
                log.error("bus unavailable, dropping host %s to another relay: %s", link.host_id, exc)
                await link.connection.close(protocol.CLOSE_BUS_UNAVAILABLE, "relay cannot reach the master; reconnect elsewhere")
                return
            link.received += 1
            self.messages_forwarded += 1
            self._send(link, protocol.encode(protocol.Ack(body=protocol.AckBody(seq=message.seq))))

    def _send(self, link: AgentLink, frame: str) -> None:
        try:
            link.outbound.put_nowait(frame)
        except asyncio.QueueFull:
            log.warning("host %s is not reading (%d frames queued); disconnecting it", link.host_id, link.outbound.qsize())
            if link.writer is not None:
                link.writer.cancel()
            task = asyncio.create_task(link.connection.close(protocol.CLOSE_SLOW_CONSUMER, "too slow reading; reconnect"))
            self._closers.add(task)  # owned: close() awaits whatever is still running
            task.add_done_callback(self._closers.discard)

    async def _write(self, link: AgentLink) -> None:
        with contextlib.suppress(ConnectionClosed):
            while True:
                frame = await link.outbound.get()
                await link.connection.send(frame)

    # ---- the master's commands ---------------------------------------------------------

    async def _consume_commands(self) -> None:
        """Deliver commands to connected agents. Cancelling is safe: undelivered ones stay pending."""
        stream = protocol.commands_stream(self.relay_id)
        backoff = 0.5
        first = True
        while True:
            try:
                if first:
                    # Whatever a previous run of this relay left pending: deliver or drop (the master resends).
                    batch = await self.bus.claim_stale(stream, COMMAND_GROUP, self.relay_id, min_idle=0)
                    first = False
                else:
                    batch = await self.bus.read(stream, COMMAND_GROUP, self.relay_id, count=100, block=1.0)
                for item in batch:
                    self._deliver(item.payload)
                if batch:
                    await self.bus.ack(stream, COMMAND_GROUP, [m.id for m in batch])
                backoff = 0.5
            except BusError as exc:
                log.warning("command stream unavailable (%s); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    def _deliver(self, payload: bytes) -> None:
        try:
            delivery = protocol.decode_command_delivery(payload)
        except ProtocolError as exc:
            log.error("dropping malformed command record: %s", exc)
            return
        link = self.agents.get(delivery.host_id)
        if link is None:
            log.info("host %s not connected here; command %s waits for the master to resend", delivery.host_id, delivery.command.body.command_id)
            return
        self._send(link, protocol.encode(delivery.command))
        self.commands_delivered += 1
