"""The geo DNS server: sockets, limits, the relay-list refresh, and ``gpumarket dns``.

``GeoDnsServer`` serves ``access.geodns.zone.GeoZone`` over UDP and TCP on one port, with
a per-source rate limit, message size limits, a refresh task that reloads the relay list
from the ``Registry`` every ``refresh_interval`` (never per query), and counters in
``stats``. ``server_from_settings`` and ``serve_dns`` build and run it from ``DnsSettings``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Literal, Self, cast

import dns.flags
import dns.message
import dns.rcode

from access.geodns.regions import (
    IPAddress,
    IPNetwork,
    RegionMap,
    parse_prefix_regions,
    parse_region_distance,
)
from access.geodns.zone import CLASSIC_UDP_PAYLOAD, GeoZone, render_udp
from shared.cancelling import raise_if_cancelled
from shared.errors import BusError, ConfigError
from shared.ratelimit import SourceRateLimiter, source_key
from shared.registry import Registry, open_registry
from shared.settings import DnsSettings

log = logging.getLogger(__name__)

_TCP_LENGTH = struct.Struct("!H")
_MAX_TCP_RESPONSE = 65_535

STAT_NAMES = (
    "queries",  # every message received, over UDP or TCP, before any check
    "answered",  # NOERROR responses sent (with records, or NODATA)
    "nxdomain",
    "refused",  # names outside the zone, zone transfers, classes other than IN
    "formerr",
    "notimp",
    "badvers",
    "servfail",  # a bug while answering; logged with its traceback
    "malformed",  # not parseable, too large, or not a query: dropped
    "rate_limited",  # over the per-source budget: dropped (UDP) or REFUSED (TCP)
    "truncated",  # UDP answers sent with TC because the answer did not fit
    "tcp_rejected",  # TCP connections closed at once because max_tcp_connections were open
    "refresh_failures",  # registry reads that failed; the last relay list stays in use
)


class GeoDnsServer:
    """The geo DNS on ``host``:``port``, UDP and TCP; ``port`` 0 picks a port free for both.

    Zone: ``zone``, ``ttl``, ``max_answers``, ``nameserver`` (+ ``nameserver_addresses``
    when it lies inside the zone). Geography: ``prefix_regions`` (longest prefix wins),
    ``region_distance`` (symmetric), ``default_region``, ``unknown_distance``.

    Timing: the relay list is reloaded from ``registry`` every ``refresh_interval``
    seconds (each read bounded by ``registry_timeout``; a failed read keeps the last
    list); a TCP connection is closed after ``tcp_idle_timeout`` seconds without a
    complete query, or a reply it does not read.

    Limits: UDP datagrams over ``max_udp_query`` bytes are dropped (that size is also
    the EDNS payload we advertise); UDP answers are at most ``max_udp_response`` bytes
    (and the client's advertised size); a TCP length prefix over ``max_tcp_message``
    closes the connection; ``max_tcp_connections`` are served at once (more are closed
    on accept); each source may send ``rate_limit`` queries per second with bursts of
    ``rate_burst`` (``shared.ratelimit.SourceRateLimiter``, IPv6 per /64, at most
    ``max_rate_sources`` tracked) —
    over it, UDP queries are dropped (no reflection) and TCP queries get REFUSED.

    ``clock`` (monotonic seconds) drives the rate limit. The registry is not owned:
    ``close()`` leaves it open.
    """

    def __init__(
        self,
        registry: Registry,
        *,
        zone: str,
        prefix_regions: Iterable[tuple[IPNetwork, str]] = (),
        region_distance: Mapping[tuple[str, str], float] | None = None,
        default_region: str = "local",
        unknown_distance: float = 10_000.0,
        host: str = "127.0.0.1",
        port: int = 0,
        ttl: int = 30,
        max_answers: int = 4,
        nameserver: str | None = None,
        nameserver_addresses: Sequence[str] = (),
        # Timing
        refresh_interval: float = 2.0,
        registry_timeout: float = 5.0,
        tcp_idle_timeout: float = 10.0,
        # Limits
        max_udp_query: int = 1232,
        max_udp_response: int = 1232,
        max_tcp_message: int = 4096,
        max_tcp_connections: int = 256,
        rate_limit: float = 100.0,
        rate_burst: float = 200.0,
        max_rate_sources: int = 65_536,
        max_bind_attempts: int = 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= port <= 65_535:
            raise ValueError("port must be between 0 and 65535")
        if refresh_interval <= 0 or registry_timeout <= 0 or tcp_idle_timeout <= 0:
            raise ValueError("refresh_interval, registry_timeout and tcp_idle_timeout must be > 0")
        if not CLASSIC_UDP_PAYLOAD <= max_udp_query <= 65_535 or not CLASSIC_UDP_PAYLOAD <= max_udp_response <= 65_535:
            raise ValueError("max_udp_query and max_udp_response must be between 512 and 65535")
        if not 12 <= max_tcp_message <= 65_535 or max_tcp_connections < 1 or max_bind_attempts < 1:
            raise ValueError("max_tcp_message must be 12..65535, max_tcp_connections and max_bind_attempts >= 1")
        self.host = host
        self.refresh_interval = refresh_interval
        self.registry_timeout = registry_timeout
        self.tcp_idle_timeout = tcp_idle_timeout
        self.max_udp_query = max_udp_query
        self.max_udp_response = max_udp_response
        self.max_tcp_message = max_tcp_message
        self.max_tcp_connections = max_tcp_connections
        self.max_bind_attempts = max_bind_attempts
        self.zone = GeoZone(
            zone,
            regions=RegionMap(
                prefix_regions,
                region_distance=region_distance,
                default_region=default_region,
                unknown_distance=unknown_distance,
            ),
            ttl=ttl,
            max_answers=max_answers,
            nameserver=nameserver,
            nameserver_addresses=nameserver_addresses,
            edns_payload=max_udp_query,
        )
        # Keyed per address, IPv6 per /64 (one host usually owns a whole /64).
        self.rate_limiter = SourceRateLimiter(rate=rate_limit, burst=rate_burst, max_sources=max_rate_sources)
        self._clock = clock
        self.stats: dict[str, int] = dict.fromkeys(STAT_NAMES, 0)
        self._registry = registry
        self._requested_port = port
        self._port: int | None = None
        self._udp_transport: asyncio.DatagramTransport | None = None
        self._tcp_server: asyncio.Server | None = None
        self._tcp_handlers: set[asyncio.Task[None]] = set()
        self._refresher: asyncio.Task[None] | None = None
        self._registry_failing = False
        self._closing = False

    # ---- lifecycle -----------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port, the same for UDP and TCP; only after ``start()``."""
        if self._port is None:
            raise RuntimeError("GeoDnsServer.start() has not been called")
        return self._port

    @property
    def tcp_connections(self) -> int:
        """DNS-over-TCP connections open now."""
        return len(self._tcp_handlers)

    async def start(self) -> None:
        """Load the relay list once, bind UDP and TCP, and start refreshing.

        A registry that fails here is logged and retried by the refresh task; until it
        answers, queries get NODATA. Raises ``OSError`` when the port cannot be bound.
        Cancelling is safe: nothing is left bound.
        """
        await self.refresh()
        loop = asyncio.get_running_loop()
        attempts = self.max_bind_attempts if self._requested_port == 0 else 1
        for attempt in range(attempts):
            udp_transport, _protocol = await loop.create_datagram_endpoint(
                lambda: _UdpProtocol(self), local_addr=(self.host, self._requested_port)
            )
            port: int = udp_transport.get_extra_info("sockname")[1]
            try:
                tcp_server = await asyncio.start_server(self._serve_tcp, self.host, port)
            except BaseException as exc:  # cancelled too: never leave the UDP socket behind
                udp_transport.close()
                if not isinstance(exc, OSError) or attempt + 1 == attempts:
                    raise
                continue  # port 0 gave a UDP port whose TCP twin is taken: try another
            self._udp_transport = udp_transport
            self._tcp_server, self._port = tcp_server, port
            break
        self._refresher = asyncio.create_task(self._refresh_forever(), name="geodns-refresh")

    async def close(self) -> None:
        """Stop: close both listeners, then the open TCP connections, then the refresh task.

        Queries in flight over TCP get no answer. Idempotent; the registry stays open.
        """
        self._closing = True
        if self._udp_transport is not None:
            self._udp_transport.close()
            self._udp_transport = None
        if self._tcp_server is not None:
            self._tcp_server.close()
        for handler in list(self._tcp_handlers):
            handler.cancel()
        if self._tcp_handlers:
            await asyncio.gather(*self._tcp_handlers, return_exceptions=True)
        if self._tcp_server is not None:
            await self._tcp_server.wait_closed()
            self._tcp_server = None
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
            self._refresher = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ---- relay list ----------------------------------------------------------------

    async def refresh(self) -> bool:
        """Reload the relay list from the registry now; false (logged) when the read failed.

        A failed read keeps serving the last list: relays expire from the registry, so
        the last list known is the best guess while it cannot be read. Cancelling is
        safe: the list in use changes only after a complete read.
        """
        try:
            async with asyncio.timeout(self.registry_timeout):
                records = await self._registry.relays()
        except (BusError, TimeoutError, OSError) as exc:
            self._refresh_failed(f"{exc or type(exc).__name__}")
            return False
        except Exception:
            log.exception("geo DNS: reading the relay registry failed unexpectedly")
            self._refresh_failed("unexpected error (logged above)")
            return False
        self.zone.update(records)
        if self._registry_failing:
            log.info("geo DNS: the relay registry answers again (%d relays)", len(records))
            self._registry_failing = False
        return True

    def _refresh_failed(self, reason: str) -> None:
        self.stats["refresh_failures"] += 1
        if not self._registry_failing:
            log.warning(
                "geo DNS: cannot read the relay registry (%s); serving the last %d relays known until it answers",
                reason,
                len(self.zone.relays),
            )
        self._registry_failing = True

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval)
            await self.refresh()
            # redis-py sends with asyncio.wait_for, which can lose a cancel (shared.cancelling): close() then waited on
            # this loop forever, and `gpumarket dns` ignored SIGTERM (tests/test_cluster.py, under load).
            raise_if_cancelled()

    # ---- messages ------------------------------------------------------------------

    def handle(self, wire: bytes, source: IPAddress, transport: Literal["udp", "tcp"]) -> bytes | None:
        """The reply to one received message, or ``None`` when it is dropped; updates ``stats``."""
        self.stats["queries"] += 1
        allowed = self.rate_limiter.admit(source_key(str(source)), self._clock()) == 0.0
        if not allowed:
            self.stats["rate_limited"] += 1
            if transport == "udp":
                return None
        if transport == "udp" and len(wire) > self.max_udp_query:
            self.stats["malformed"] += 1
            return None
        try:
            query = dns.message.from_wire(wire)
        except Exception as exc:  # any parser failure on untrusted bytes is the sender's problem
            self.stats["malformed"] += 1
            log.debug("geo DNS: dropping an unparseable %s message from %s: %s", transport, source, exc)
            return None
        if query.flags & dns.flags.QR:
            self.stats["malformed"] += 1  # a response sent to a server: never answer it (no loops, no reflection)
            return None
        if not allowed:
            response = dns.message.make_response(query)
            response.set_rcode(dns.rcode.REFUSED)
            return self._render(query, response, transport)
        try:
            response = self.zone.respond(query, source)
            reply = self._render(query, response, transport)
        except Exception:  # a bug: answer SERVFAIL at once rather than let the client time out
            log.exception("geo DNS: cannot answer %s from %s", query.question, source)
            response = dns.message.make_response(query)
            response.set_rcode(dns.rcode.SERVFAIL)
            reply = self._render(query, response, transport)
        self._count(response.rcode())
        return reply

    def _render(
        self, query: dns.message.Message, response: dns.message.Message, transport: Literal["udp", "tcp"]
    ) -> bytes:
        if transport == "tcp":
            return response.to_wire(max_size=_MAX_TCP_RESPONSE)
        if query.edns >= 0:
            max_size = min(max(query.payload, CLASSIC_UDP_PAYLOAD), self.max_udp_response)
        else:
            max_size = CLASSIC_UDP_PAYLOAD
        reply, truncated = render_udp(response, max_size=max_size)
        if truncated:
            self.stats["truncated"] += 1
        return reply

    def _count(self, rcode: dns.rcode.Rcode) -> None:
        name = "answered" if rcode == dns.rcode.NOERROR else dns.rcode.to_text(rcode).lower()
        self.stats[name] = self.stats.get(name, 0) + 1

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is None or self._closing or len(self._tcp_handlers) >= self.max_tcp_connections:
            self.stats["tcp_rejected"] += 1
            writer.transport.abort()
            return
        self._tcp_handlers.add(task)
        # Closed gracefully (FIN after what was written) unless the client stopped reading,
        # or we are shutting down: then aborted, so no socket waits on a dead peer.
        graceful = False
        try:
            source = _peer_address(writer.get_extra_info("peername"))
            while source is not None:
                try:
                    async with asyncio.timeout(self.tcp_idle_timeout):
                        (length,) = _TCP_LENGTH.unpack(await reader.readexactly(_TCP_LENGTH.size))
                        if length > self.max_tcp_message or length == 0:
                            self.stats["malformed"] += 1
                            graceful = True
                            return  # never read what we would not accept
                        wire = await reader.readexactly(length)
                except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                    graceful = True
                    return
                reply = self.handle(wire, source, "tcp")
                if reply is None:
                    graceful = True
                    return  # garbage on a stream: this is not a DNS client
                writer.write(_TCP_LENGTH.pack(len(reply)) + reply)
                try:
                    async with asyncio.timeout(self.tcp_idle_timeout):
                        await writer.drain()
                except (TimeoutError, ConnectionError):
                    return
        finally:
            self._tcp_handlers.discard(task)
            if graceful:
                writer.close()
            else:
                writer.transport.abort()


def _peer_address(peer: object) -> IPAddress | None:
    if isinstance(peer, tuple) and peer and isinstance(peer[0], str):
        try:
            return ipaddress.ip_address(peer[0])
        except ValueError:
            return None
    return None


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, server: GeoDnsServer) -> None:
        self._server = server
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | bytes, int]) -> None:
        source = _peer_address(addr)
        if self._transport is None or source is None:
            return
        reply = self._server.handle(data, source, "udp")
        if reply is not None:
            self._transport.sendto(reply, addr)

    def error_received(self, exc: Exception) -> None:
        # ICMP errors for earlier replies (a client that went away); nothing to do.
        log.debug("geo DNS: UDP error: %s", exc)


# ---- service ------------------------------------------------------------------------


def server_from_settings(settings: DnsSettings, registry: Registry) -> GeoDnsServer:
    """A ``GeoDnsServer`` configured by ``settings``; raises ``ConfigError`` for bad region settings."""
    try:
        return GeoDnsServer(
            registry,
            zone=settings.zone,
            prefix_regions=parse_prefix_regions(settings.prefix_regions),
            region_distance=parse_region_distance(settings.region_distance),
            default_region=settings.default_region,
            unknown_distance=settings.unknown_distance,
            host=settings.host,
            port=settings.port,
            ttl=settings.ttl,
            max_answers=settings.max_answers,
            nameserver=settings.nameserver,
            nameserver_addresses=settings.nameserver_addresses,
            refresh_interval=settings.refresh_interval,
            tcp_idle_timeout=settings.tcp_idle_timeout,
            max_tcp_connections=settings.max_tcp_connections,
            rate_limit=settings.rate_limit,
            rate_burst=settings.rate_burst,
        )
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"invalid dns settings: {exc}") from None


async def serve_dns(settings: DnsSettings, *, stop: asyncio.Event, registry: Registry | None = None) -> None:
    """``gpumarket dns``: answer for the relay zone until ``stop`` is set.

    Opens the relay registry at ``settings.redis_url`` (or uses ``registry``, which it
    then does not close: the embedded mode shares one), starts the server, waits, and
    closes in reverse order. Raises ``ConfigError`` for bad settings or a port that
    cannot be bound. Cancelling is safe: the server and the registry are closed.
    """
    owns_registry = registry is None
    if registry is None:
        if settings.redis_url is None:
            raise ConfigError("the geo DNS reads the live relays from Redis: set GPUMARKET_REDIS_URL")
        registry = await open_registry(settings.redis_url, prefix=settings.bus_prefix)
    try:
        server = server_from_settings(settings, registry)
        try:
            await server.start()
        except OSError as exc:
            raise ConfigError(
                f"the geo DNS cannot listen on {settings.host} port {settings.port} (UDP and TCP): {exc}; "
                "set GPUMARKET_HOST / GPUMARKET_PORT"
            ) from None
        print(f"geo DNS for {settings.zone} listening on {settings.host} port {server.port} (UDP and TCP)", flush=True)
        try:
            await stop.wait()
        finally:
            await server.close()
    finally:
        if owns_registry:
            await registry.close()


__all__ = ["STAT_NAMES", "GeoDnsServer", "serve_dns", "server_from_settings"]
