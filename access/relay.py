"""One relay process: accepts agents over TLS 1.3 websockets, puts their messages on the bus,
and delivers the master's commands to them.

Per connection: the peer certificate names the host (``urn:gpumarket:host:<id>``);
every frame is decoded (``access.forwarding``: what ``shared.protocol`` decodes, in one pass)
and must name the same host, or the connection is closed with the close code from
``shared.protocol.CLOSE_CODES``. A
message is acknowledged to the agent only after the bus accepted it, so an agent
never forgets a message the master has not durably received. Each bus record names the
connection's certificate serial (the master retires a renewed host's older certificates once
it sees the new one in use).

``/v1/speedtest`` (same client certificate) is served by ``access.speedtest``.

Limits (each a keyword argument of ``Relay`` and an ``AccessSettings`` field):

* per source address, new websocket connections (agent and speed test; not ``/health``)
  are a token bucket of ``max_connections_per_source_per_minute`` with a burst of
  ``connection_burst_per_source``. Beyond it the upgrade request is answered
  **HTTP 429** with ``Retry-After`` (seconds), before any websocket state exists. IPv6
  sources count per /64, since one host can rotate addresses inside its prefix. At most
  ``max_tracked_sources`` buckets are kept: a bucket that has refilled is dropped (it is
  the same as no bucket), and over the cap the least recently seen source is forgotten.
  Behind a proxy that terminates TLS every connection has the proxy's address: raise the
  limit there.
* per agent connection, messages are a token bucket of ``max_messages_per_second`` with a
  burst of ``message_burst``. A frame beyond it closes that connection with 4004
  (``CLOSE_RATE_LIMITED``); the acks of everything before it are still sent first, so a
  reconnecting agent never replays what was already forwarded.
* ``max_connections`` agents at once (4009 beyond), ``max_outbound_queue`` frames queued
  for one agent (4007 beyond), ``max_frame`` bytes per frame (1009 beyond).
* every websocket (agent, renter, speed test) is pinged every ``ping_interval`` seconds and closed
  with 1011 without a pong within ``ping_timeout`` seconds, by one task for the whole relay
  (``access.keepalive``), not websockets' task per connection.
* per connection buffers: ``max_queue`` received frames not yet read (then websockets stops
  reading), ``write_limit`` bytes written but not yet sent (then the agent's receive loop
  waits: an agent that does not read its acks stops being read, see ``access.agentlink``),
  ``tls_read_limit`` received bytes not yet decrypted; every connection reads through one
  TLS read buffer shared by the event loop (``access.tls``).

Revocation and registration (with a ``registry``, ``access.registration``): the peer
certificate's serial is checked when the connection opens (close 4005), and the revoked list
is read every ``revocation_poll_interval`` seconds; open agent connections and speed tests
whose serial appears there are closed with 4005. The relay's ``RelayRecord`` is published
every ``register_interval`` seconds and expires after three.

Shutdown sequence (``close``): publish ``draining`` → stop accepting (a handshake in progress
gets HTTP 503) → send every agent in session a ``move`` frame, after the acks already queued
for it, then close it with 1001 (speed tests: 1001) → wait for the handlers, at most
``drain_timeout`` seconds, then drop whatever is left → stop the command consumer and the
registry tasks and the keepalive → remove the record from the registry.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import ssl
from http import HTTPStatus
from typing import Literal
from urllib.parse import urlsplit

from cryptography.hazmat.primitives.asymmetric import ec
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from access import speedtest
from access.agentlink import AgentLink, StreamOptions, close_reason, forget_handshake
from access.commands import COMMAND_GROUP, consume_commands, deliver
from access.forwarding import decode_agent_frame, encode_ack, encode_bus_envelope
from access.keepalive import Keepalive
from access.linkevents import announce, new_connection_id
from access.registration import RegistryLink, stop_task
from access.tls import no_session_tickets, peer_identity, tracking_connection_class
from access.tunnels import RenterGate, refusal_response
from access.webports import WebPorts
from shared import protocol
from shared.bus import Bus
from shared.clock import Clock, SystemClock
from shared.errors import BusError, ConfigError, GpumarketError, ProtocolError
from shared.ratelimit import SourceRateLimiter, TokenBucket, source_key
from shared.registry import Registry, RelayRecord
from shared.streams import CONNECT_PATH, StreamProtocolError
from shared.streams.aio import StreamLink, bound_send_buffer

log = logging.getLogger(__name__)

AGENT_PATH = "/v1/agent"
SPEEDTEST_PATH = "/v1/speedtest"  # speed tests: access.speedtest
REVOKED_REASON = "certificate revoked; re-enroll with a new token"
GOING_AWAY_REASON = "relay shutting down; reconnect to another relay"


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
        registry: Registry | None = None,
        public_url: str | None = None,
        public_host: str | None = None,
        public_port: int | None = None,
        heartbeat_interval: float = 10.0,
        telemetry_interval: float = 10.0,
        # Timeouts
        open_timeout: float = 10.0,
        ping_interval: float = 10.0,
        ping_timeout: float = 10.0,
        close_timeout: float = 2.0,
        drain_timeout: float = 5.0,
        register_interval: float = 5.0,
        revocation_poll_interval: float = 2.0,
        registry_timeout: float = 2.0,
        link_event_timeout: float = 2.0,
        # Limits
        max_frame: int = protocol.DEFAULT_MAX_FRAME,
        max_outbound_queue: int = 256,
        max_connections: int = 10_000,
        max_messages_per_second: float = 50.0,
        message_burst: int = 100,
        max_connections_per_source_per_minute: float = 30.0,
        connection_burst_per_source: int = 10,
        max_tracked_sources: int = 100_000,
        # Per connection buffers: what one agent can make the relay hold
        max_queue: int = 4,
        write_limit: int = 32 << 10,
        tls_read_limit: int = 64 << 10,
        # Renters' streams (``access.tunnels``); without a ``token_key`` renters are refused
        token_key: ec.EllipticCurvePublicKey | None = None,
        max_streams_per_agent: int = 256,
        max_streams_per_rental: int = 16,
        max_stream_buffer_per_agent: int = 64 << 20,
        stream_window: int = 1 << 20,  # per stream while the agent's link has room (shared.streams)
        stream_turn_bytes: int = 64 << 10,
        link_send_buffer: int = 128 << 10,
        max_renter_connections_per_source_per_minute: float = 120.0,
        renter_connection_burst_per_source: int = 30,
        # Renters' web ports (``access.webports``): with a domain and a TLS context for browsers
        ports_domain: str | None = None,
        ports_ssl_context: ssl.SSLContext | None = None,
        ports_port: int = 0,
        ports_public_port: int | None = None,
    ) -> None:
        timeouts = (open_timeout, ping_interval, ping_timeout, close_timeout, drain_timeout,
                    register_interval, revocation_poll_interval, registry_timeout, link_event_timeout)
        if min(timeouts) <= 0:
            raise ConfigError("relay timeouts and intervals must be positive")
        if min(max_frame, max_outbound_queue, max_connections, message_burst, connection_burst_per_source,
               max_tracked_sources, max_queue, write_limit, tls_read_limit) < 1 or max_messages_per_second <= 0 or max_connections_per_source_per_minute <= 0:
            raise ConfigError("relay limits must be positive")
        self.relay_id = relay_id
        self.region = region
        self.bus = bus
        self.ssl_context = ssl_context
        self.host = host
        self.requested_port = port
        self.clock = clock or SystemClock()
        self.registry = registry
        self._public_url = public_url
        parsed = urlsplit(public_url) if public_url else None
        self.public_host = public_host or (parsed.hostname if parsed else None) or host
        self._public_port = public_port or (parsed.port if parsed else None)
        self.heartbeat_interval = heartbeat_interval
        self.telemetry_interval = telemetry_interval
        self.open_timeout = open_timeout
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self.close_timeout = close_timeout
        self.drain_timeout = drain_timeout
        self.register_interval = register_interval
        self.revocation_poll_interval = revocation_poll_interval
        self.registry_timeout = registry_timeout
        self.link_event_timeout = link_event_timeout
        self.max_frame = max_frame
        self.max_queue = max_queue
        self.write_limit = write_limit
        self.tls_read_limit = tls_read_limit
        self.max_outbound_queue = max_outbound_queue
        self.max_connections = max_connections
        self.max_messages_per_second = max_messages_per_second
        self.message_burst = message_burst
        self.sources = SourceRateLimiter(
            rate=max_connections_per_source_per_minute / 60.0, burst=connection_burst_per_source, max_sources=max_tracked_sources
        )
        self.stream_options = StreamOptions(
            max_streams_per_agent, max_stream_buffer_per_agent, stream_turn_bytes, stream_window, link_send_buffer)  # fmt: skip
        self.renters = (
            RenterGate(token_key=token_key, clock=self.clock, max_streams_per_rental=max_streams_per_rental)
            if token_key is not None else None
        )
        self.renter_sources = SourceRateLimiter(
            rate=max_renter_connections_per_source_per_minute / 60.0, burst=renter_connection_burst_per_source,
            max_sources=max_tracked_sources,
        )
        self._renter_connections: set[ServerConnection] = set()
        self.web_ports = (
            WebPorts(token_key=token_key, ssl_context=ports_ssl_context, domain=ports_domain, links=self._links_of,
                     clock=self.clock, host=host, port=ports_port, public_port=ports_public_port)
            if token_key is not None and ports_domain and ports_ssl_context is not None else None
        )
        self.agents: dict[str, AgentLink] = {}
        self.speedtests = speedtest.SpeedtestRegistry()  # speed tests running here, one per host
        self.messages_forwarded = 0
        self.commands_delivered = 0
        self.refused: collections.Counter[str] = collections.Counter()  # connections refused or closed, by reason
        self._speedtest_serials: dict[ServerConnection, str] = {}
        self._open_connections: set[ServerConnection] = set()  # from TLS accept to close, handshakes included
        self._server: Server | None = None
        self._port: int | None = None
        self._closers: set[asyncio.Task[None]] = set()
        self._consumer: asyncio.Task[None] | None = None
        # One task pings every websocket (agents, renters, speed tests), not one task per connection.
        self.keepalive = Keepalive(ping_interval=ping_interval, ping_timeout=ping_timeout, close_timeout=close_timeout)
        self._keepalive: asyncio.Task[None] | None = None
        self._registration = (
            RegistryLink(registry, relay_id=relay_id, record=self.record, on_revoked=self._close_revoked,
                         register_interval=register_interval, revocation_poll_interval=revocation_poll_interval,
                         timeout=registry_timeout)
            if registry is not None else None
        )
        self._closing = False

    # ---- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Listen, start consuming commands and (with a registry) publish the record and poll revocations.

        Not meant to be cancelled; if it is, ``close()`` releases whatever was started.
        """
        await self.bus.ensure_group(protocol.commands_stream(self.relay_id), COMMAND_GROUP)
        no_session_tickets(self.ssl_context)  # agents never resume a TLS session
        self._server = await serve(
            self._handle,
            self.host,
            self.requested_port,
            ssl=self.ssl_context,
            ssl_handshake_timeout=self.open_timeout,
            process_request=self._process_request,
            open_timeout=self.open_timeout,
            ping_interval=None,  # self.keepalive pings them all
            close_timeout=self.close_timeout,
            max_size=self.max_frame,
            max_queue=self.max_queue,
            write_limit=self.write_limit,
            compression=None,
            server_header=None,
            create_connection=tracking_connection_class(self._open_connections, self.tls_read_limit, self.keepalive),
        )
        self._keepalive = asyncio.create_task(self.keepalive.run(), name=f"relay-{self.relay_id}-keepalive")
        self._port = int(self._server.sockets[0].getsockname()[1])
        if self.web_ports is not None:
            await self.web_ports.start()
        self._consumer = asyncio.create_task(self._consume_commands(), name=f"relay-{self.relay_id}-commands")
        if self._registration is not None:
            await self._registration.start()  # a failed publish is logged; the refresh retries
        log.info("relay %s (%s) listening on %s, published as %s", self.relay_id, self.region, self.url, self.public_url)

    @property
    def port(self) -> int:
        """The bound port (still known after ``close()``)."""
        assert self._port is not None, "start() first"
        return self._port

    @property
    def url(self) -> str:
        """The URL of the bound address."""
        return f"wss://{_url_host(self.host)}:{self.port}{AGENT_PATH}"

    @property
    def public_port(self) -> int:
        return self._public_port or self.port

    @property
    def public_url(self) -> str:
        """What agents are told to connect to (the registry record's ``url``)."""
        return self._public_url or f"wss://{_url_host(self.public_host)}:{self.public_port}{AGENT_PATH}"

    @property
    def draining(self) -> bool:
        return self._closing

    def record(self) -> RelayRecord:
        """This relay's registry record, as of now."""
        return RelayRecord(
            relay_id=self.relay_id,
            region=self.region,
            url=self.public_url,
            host=self.public_host,
            port=self.public_port,
            connections=len(self.agents),
            capacity=self.max_connections,
            draining=self._closing,
            updated_at=self.clock.now().timestamp(),
            ports_url=self.web_ports.url_template if self.web_ports is not None else None,
        )

    async def close(self) -> None:
        """Drain and shut down; see the module docstring for the sequence. Takes at most about
        ``drain_timeout`` + 2 × ``registry_timeout`` seconds.

        Cancelling it skips the rest of the drain, but the background tasks are still
        stopped and the registry record still removed.
        """
        if self._server is None or self._closing:
            return
        self._closing = True
        try:
            if self._registration is not None:  # 1. publish draining (no periodic refresh may overwrite it)
                await self._registration.stop_refreshing()
                await self._registration.publish()
            self._server.close(close_connections=False)  # 2. stop accepting
            if self.web_ports is not None:
                await self.web_ports.close()
            self._tell_everyone_to_move()  # 3. move, then close 1001
            await self._wait_for_handlers(self._server)  # 4. wait for handlers (bounded)
        finally:
            await stop_task(self._consumer)  # 5. stop the command consumer and the keepalive
            await stop_task(self._keepalive)
            if self._registration is not None:  # 6. stop revocation polling, leave the registry
                await self._registration.stop()
            log.info("relay %s closed", self.relay_id)

    def _tell_everyone_to_move(self) -> None:
        move = protocol.encode(
            protocol.Move(body=protocol.MoveBody(reason="relay draining; reconnect to another relay", retry_after=0.0))
        )
        for link in list(self.agents.values()):
            # Only agents in session (they sent their hello) get the move; for a connection that has
            # not started one, close 1001 alone says the same thing.
            if link.received and link.close_request is None:
                link.queue(move, optional=True)  # a full outbox: the close alone must do
            self._request_close(link, protocol.CLOSE_GOING_AWAY, GOING_AWAY_REASON)
        for renter in list(self._renter_connections):
            self._spawn_close(renter, protocol.CLOSE_GOING_AWAY, "relay shutting down; connect again")
        for test in self.speedtests.connections():
            if isinstance(test, ServerConnection):
                self._spawn_close(test, protocol.CLOSE_GOING_AWAY, "relay shutting down")

    async def _wait_for_handlers(self, server: Server) -> None:
        try:
            async with asyncio.timeout(self.drain_timeout):
                await server.wait_closed()
                await asyncio.gather(*self._closers, return_exceptions=True)
            return
        except TimeoutError:
            pass
        # Whatever is left: agents not answering the close, clients stuck in their handshake.
        stuck = list(self._open_connections)
        log.warning("relay %s: %d connection(s) still open after %.1fs of draining; dropping them",
                    self.relay_id, len(stuck), self.drain_timeout)
        for connection in stuck:
            connection.transport.abort()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.close_timeout):
                await server.wait_closed()
                await asyncio.gather(*self._closers, return_exceptions=True)

    # ---- HTTP side: health, routing and the connection rate ---------------------------

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        if request.path == "/health":
            body = json.dumps(
                {
                    "relay_id": self.relay_id,
                    "region": self.region,
                    "url": self.public_url,
                    "status": "draining" if self._closing else "ok",
                    "draining": self._closing,
                    "agents": len(self.agents),
                    "capacity": self.max_connections,
                    "max_connections": self.max_connections,
                    "messages_forwarded": self.messages_forwarded,
                    "commands_delivered": self.commands_delivered,
                    "refused": dict(self.refused),
                    "renter_connections": len(self._renter_connections),
                }
            )
            response = connection.respond(HTTPStatus.OK, body + "\n")
            # Headers is a multidict: assigning adds a second Content-Type after respond()'s text/plain.
            del response.headers["Content-Type"]
            response.headers["Content-Type"] = "application/json"
            return response
        renter = urlsplit(request.path).path == CONNECT_PATH
        if not renter and request.path not in (AGENT_PATH, SPEEDTEST_PATH):
            return connection.respond(HTTPStatus.NOT_FOUND, f"agents connect to {AGENT_PATH}, renters to {CONNECT_PATH}\n")
        address = connection.remote_address
        source = source_key(str(address[0])) if address else "unknown"
        # A service gateway's stream (a master, for every renter of its services) is not held to the per-source limit.
        gateway = renter and self.renters is not None and self.renters.from_gateway(request)
        wait = 0.0 if gateway else (self.renter_sources if renter else self.sources).admit(source, self.clock.monotonic())
        if wait > 0:
            self.refused["source_rate"] += 1
            retry_after = math.ceil(wait)
            log.warning("refused a connection from %s: more than its connection rate; retry in %ds", source, retry_after)
            response = connection.respond(
                HTTPStatus.TOO_MANY_REQUESTS, f"too many new connections from {source}; retry in {retry_after} s\n"
            )
            response.headers["Retry-After"] = str(retry_after)
            return response
        if renter:
            if self.renters is None:
                return connection.respond(HTTPStatus.NOT_FOUND, "this relay takes no renters' connections\n")
            if self._closing:
                return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "relay shutting down; connect again\n")
            refusal = self.renters.admit(connection, request, host_connected=self._in_session)
            if refusal is not None:
                self.refused["renter_" + refusal.status.name.lower()] += 1
                return refusal_response(connection, refusal)
        return None

    def _in_session(self, host_id: str) -> bool:
        link = self.agents.get(host_id)
        return link is not None and link.close_request is None

    def _links_of(self, host_id: str) -> StreamLink | None:
        """The host's renter streams (created on first use), or ``None`` when it is not here."""
        link = self.agents.get(host_id)
        return link.streams if link is not None and link.close_request is None else None

    # ---- one agent ------------------------------------------------------------------

    async def _handle(self, connection: ServerConnection) -> None:
        claims = self.renters.claims_of(connection) if self.renters is not None else None
        if claims is not None:
            assert self.renters is not None
            self._renter_connections.add(connection)
            try:
                link = self.agents.get(claims.host_id)
                await self.renters.serve(connection, claims, link.streams if link is not None else None)
            finally:
                self._renter_connections.discard(connection)
                self.renters.forget(connection)
            return
        try:
            host_id, serial = peer_identity(connection)
        except GpumarketError as exc:
            log.warning("refused a connection from %s: %s", connection.remote_address, exc)
            await connection.close(protocol.CLOSE_IDENTITY_MISMATCH, close_reason(f"no usable client certificate: {exc}"))
            return
        if await self._is_revoked(serial):
            self.refused["revoked"] += 1
            log.warning("refused host %s: certificate %s is revoked", host_id, serial)
            await connection.close(protocol.CLOSE_REVOKED, REVOKED_REASON)
            return
        if self._closing:
            await connection.close(protocol.CLOSE_GOING_AWAY, GOING_AWAY_REASON)
            return
        if connection.request is not None and connection.request.path == SPEEDTEST_PATH:  # speed test, not an agent link
            self._speedtest_serials[connection] = serial
            try:
                await speedtest.handle(connection, host_id=host_id, registry=self.speedtests, max_frame=self.max_frame)
            finally:
                self._speedtest_serials.pop(connection, None)
            return
        if len(self.agents) >= self.max_connections and host_id not in self.agents:
            self.refused["full"] += 1
            log.warning("refused host %s: relay full (%d connections)", host_id, self.max_connections)
            await connection.close(protocol.CLOSE_TOO_MANY_CONNECTIONS, "relay full; try another relay")
            return
        link = AgentLink(
            host_id=host_id,
            serial=serial,
            connection=connection,
            messages=TokenBucket(self.max_messages_per_second, self.message_burst, self.clock.monotonic()),
            max_outbound_queue=self.max_outbound_queue,
            stream_options=self.stream_options,
            on_slow_consumer=self._slow_consumer,
        )
        bound_send_buffer(connection.transport, self.stream_options.link_send_buffer)
        forget_handshake(connection)
        # Welcome queued and link swapped in before any await: a racing reconnect cannot leave one
        # untracked, and a drain starting now finds the link (its move goes after the welcome).
        link.queue(self._welcome(host_id, link.agreed_max_data))
        previous, self.agents[host_id] = self.agents.get(host_id), link
        if previous is not None:
            log.info("host %s reconnected; closing its previous connection", host_id)
            self._request_close(previous, protocol.CLOSE_REPLACED, "replaced by a newer connection of this host")
        log.info("host %s connected from %s", host_id, connection.remote_address)
        connection_id = new_connection_id()
        try:
            await self._announce("open", host_id, connection_id)
            await self._receive(link)
        except ConnectionClosed as exc:
            log.info("host %s disconnected (%s)", host_id, exc)
        finally:
            current = self.agents.get(host_id) is link
            if current:
                del self.agents[host_id]
                # A link replaced by a newer one here says nothing: the newer one's open already did.
                await self._announce("closed", host_id, connection_id, code=connection.close_code)
            await link.finish(self.close_timeout)

    async def _announce(self, event: Literal["open", "closed"], host_id: str, connection_id: str, *, code: int | None = None) -> None:
        """Tell the master (``access.linkevents``) that the host's link here opened or closed; bounded, never raises."""
        await announce(self.bus, event=event, relay_id=self.relay_id, host_id=host_id, connection_id=connection_id,
                       at=self.clock.now(), draining=self._closing, code=code, timeout=self.link_event_timeout)

    def _welcome(self, host_id: str, max_stream_data: int | None) -> str:
        """The welcome frame (built here, so that its model is not held by the handler for the connection's
        life); ``max_stream_data`` only where the agent offered one (older agents refuse a field they lack)."""
        body = protocol.WelcomeBody(
            relay_id=self.relay_id, host_id=host_id, heartbeat_interval=self.heartbeat_interval,
            telemetry_interval=self.telemetry_interval, max_frame=self.max_frame,
            max_messages_per_second=self.max_messages_per_second, message_burst=self.message_burst,
            max_stream_data=max_stream_data,
        )  # fmt: skip
        return protocol.Welcome(body=body).model_dump_json(exclude={"body": {"max_stream_data"}} if max_stream_data is None else None)

    async def _receive(self, link: AgentLink) -> None:
        connection = link.connection
        async for frame in connection:
            if isinstance(frame, bytes):  # a stream frame: bounded by the streams' flow control, not the message rate
                try:
                    link.streams.feed(frame)
                except StreamProtocolError as exc:
                    log.warning("closing host %s: %s", link.host_id, exc)
                    await connection.close(exc.close_code, close_reason(str(exc)))
                    return
                del frame
                continue
            if not link.messages.take(self.clock.monotonic()):
                self.refused["message_rate"] += 1
                log.warning("closing host %s: more than %g messages/s (burst %d)", link.host_id,
                            self.max_messages_per_second, self.message_burst)
                self._request_close(
                    link,
                    protocol.CLOSE_RATE_LIMITED,
                    f"more than {self.max_messages_per_second:g} messages/s (burst {self.message_burst}); slow down",
                )
                return
            try:
                message = decode_agent_frame(frame, max_frame=self.max_frame)
                protocol.check_identity(message, link.host_id)
            except ProtocolError as exc:
                log.warning("closing host %s: %s (%s)", link.host_id, exc.message, exc.code)
                await connection.close(exc.close_code, close_reason(exc.message))
                return
            try:
                await self.bus.publish(
                    protocol.AGENT_EVENTS_STREAM,
                    encode_bus_envelope(self.relay_id, message, self.clock.now(), cert_serial=link.serial),
                )
            except BusError as exc:
                # Not acknowledged: the agent keeps the message and replays it elsewhere.
                log.error("bus unavailable, dropping host %s to another relay: %s", link.host_id, exc)
                await connection.close(protocol.CLOSE_BUS_UNAVAILABLE, "relay cannot reach the master; reconnect elsewhere")
                return
            link.received += 1
            self.messages_forwarded += 1
            ack = encode_ack(message.seq)
            # Not held while the agent is idle until its next frame (a telemetry frame is ~7 KB, its message more).
            del frame, message
            await link.send_own(ack)

    def _slow_consumer(self, link: AgentLink) -> None:
        log.warning("host %s is not reading (%d frames queued); disconnecting it", link.host_id, link.queued)
        self.refused["slow_consumer"] += 1
        link.request_close(protocol.CLOSE_SLOW_CONSUMER, "too slow reading; reconnect")
        self._close_now(link)

    def _request_close(self, link: AgentLink, code: int, reason: str) -> None:
        """Close ``link`` once the frames already queued for it are sent (its writer does the close)."""
        if not link.request_close(code, reason):  # a full outbox will not drain soon: close now
            self._close_now(link)

    def _close_now(self, link: AgentLink) -> None:
        assert link.close_request is not None
        link.stop_writer()
        self._spawn_close(link.connection, link.close_request.code, link.close_request.reason)

    def _spawn_close(self, connection: ServerConnection, code: int, reason: str) -> None:
        task = asyncio.create_task(connection.close(code, close_reason(reason)))
        self._closers.add(task)  # owned: close() awaits whatever is still running
        task.add_done_callback(self._closers.discard)

    # ---- revocation (``access.registration`` polls the registry) -----------------------

    async def _is_revoked(self, serial: str) -> bool:
        return await self._registration.is_revoked(serial) if self._registration is not None else False

    def _close_revoked(self, revoked: frozenset[str]) -> None:
        for link in list(self.agents.values()):
            if link.serial in revoked and link.close_request is None:
                self.refused["revoked"] += 1
                log.warning("closing host %s: its certificate %s was revoked", link.host_id, link.serial)
                self._request_close(link, protocol.CLOSE_REVOKED, REVOKED_REASON)
        for connection, serial in list(self._speedtest_serials.items()):
            if serial in revoked:
                del self._speedtest_serials[connection]
                log.warning("closing a speed test: certificate %s was revoked", serial)
                self._spawn_close(connection, protocol.CLOSE_REVOKED, REVOKED_REASON)

    # ---- the master's commands ---------------------------------------------------------

    async def _consume_commands(self) -> None:
        await consume_commands(self.bus, self.relay_id, self._deliver)

    def _deliver(self, payload: bytes) -> None:
        if deliver(payload, self.agents):
            self.commands_delivered += 1


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host

