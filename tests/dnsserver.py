"""A small authoritative DNS server on loopback, for tests that resolve real names.

``LoopbackDnsServer`` answers over UDP and TCP on the same 127.0.0.1 port (a
resolver pointed at it with one port uses both: UDP first, TCP when the UDP answer
is truncated). Records are plain text keyed by ``(name, type)`` and can be changed
while the server runs::

    async with LoopbackDnsServer({
        ("_gpumarket._tcp.example.test", "SRV"): ["10 5 8443 relay1.example.test."],
        ("relay1.example.test", "A"): ["127.0.0.1"],
    }) as dns_server:
        ...  # resolver=dns_server.host, resolver_port=dns_server.port
        dns_server.set_records("relay1.example.test", "A", ["127.0.0.2"])

How it answers a query for ``(name, type)``, first rule that applies:

1. ``drop_queries`` is set: it does not answer at all (an unresponsive server).
2. ``set_rcode(name, rcode)`` was called for the name: that rcode, no records.
3. Records are set for ``(name, type)``: NOERROR with them (authoritative).
4. The name has records of other types, or an empty list was set for
   ``(name, type)``: NOERROR with no records ("no answer", NODATA).
5. Otherwise: NXDOMAIN.

There is no CNAME chasing, wildcard or delegation; a test that needs one adds it.
Every query received is appended to ``queries``, so a test can assert what was
asked and over which transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Self, cast

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

log = logging.getLogger(__name__)

RecordKey = tuple[str, str]
"""``(name, type)``, for example ``("relay1.example.test", "A")``; names are absolute with or without the trailing dot."""

# A UDP answer without EDNS is limited to 512 bytes (RFC 1035 §4.2.1).
_CLASSIC_UDP_PAYLOAD = 512
_TCP_LENGTH = struct.Struct("!H")


@dataclass(frozen=True, slots=True)
class ReceivedQuery:
    """One question the server was asked."""

    transport: Literal["udp", "tcp"]
    name: str  # absolute, lower case, with the trailing dot
    rdtype: str  # "SRV", "A", ...


def _absolute(name: str | dns.name.Name) -> dns.name.Name:
    if isinstance(name, dns.name.Name):
        return name if name.is_absolute() else name.concatenate(dns.name.root)
    return dns.name.from_text(name, origin=dns.name.root)


class LoopbackDnsServer:
    """An authoritative DNS server for tests on ``host`` (127.0.0.1), one port for UDP and TCP.

    ``ttl`` is the TTL of every answer. ``tcp_idle_timeout`` bounds how long a TCP
    connection may sit without sending a query; ``max_bind_attempts`` bounds the
    search for a port free for both UDP and TCP.
    """

    def __init__(
        self,
        records: Mapping[RecordKey, Iterable[str]] | None = None,
        *,
        host: str = "127.0.0.1",
        ttl: int = 60,
        tcp_idle_timeout: float = 5.0,
        max_bind_attempts: int = 20,
    ) -> None:
        self.host = host
        self.ttl = ttl
        self.tcp_idle_timeout = tcp_idle_timeout
        self.max_bind_attempts = max_bind_attempts
        self.drop_queries = False
        """When true, queries are read and recorded but never answered."""
        self.queries: list[ReceivedQuery] = []
        self._records: dict[tuple[dns.name.Name, dns.rdatatype.RdataType], dns.rrset.RRset | None] = {}
        self._rcodes: dict[dns.name.Name, dns.rcode.Rcode] = {}
        for (name, rdtype), values in (records or {}).items():
            self.set_records(name, rdtype, values)
        self._port: int | None = None
        self._udp_transport: asyncio.DatagramTransport | None = None
        self._tcp_server: asyncio.Server | None = None
        self._tcp_writers: set[asyncio.StreamWriter] = set()

    # ---- records -------------------------------------------------------------------

    def set_records(self, name: str, rdtype: str, values: Iterable[str]) -> None:
        """Serve ``values`` (rdata in zone-file text) for ``(name, rdtype)``, replacing what was there.

        Names inside rdata (an SRV target) are absolute whether or not they end in a
        dot. An empty ``values`` makes the name exist with no records of this type
        (NODATA). Invalid rdata raises here, not when queried.
        """
        owner = _absolute(name)
        rdatatype = dns.rdatatype.from_text(rdtype)
        texts = list(values)
        rrset = (
            dns.rrset.from_text_list(
                owner, self.ttl, dns.rdataclass.IN, rdatatype, texts, origin=dns.name.root, relativize=False
            )
            if texts
            else None
        )
        self._records[(owner, rdatatype)] = rrset

    def remove_records(self, name: str, rdtype: str) -> None:
        """Stop serving ``(name, rdtype)``; the name is NXDOMAIN if nothing else is left for it."""
        self._records.pop((_absolute(name), dns.rdatatype.from_text(rdtype)), None)

    def set_rcode(self, name: str, rcode: dns.rcode.Rcode | None) -> None:
        """Answer every query for ``name`` with ``rcode`` (NXDOMAIN, SERVFAIL, REFUSED...); ``None`` undoes it."""
        owner = _absolute(name)
        if rcode is None:
            self._rcodes.pop(owner, None)
        else:
            self._rcodes[owner] = rcode

    def answer(self, query: dns.message.Message) -> dns.message.Message:
        """The response to ``query`` by the rules in the module docstring (``drop_queries`` aside)."""
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        if len(query.question) != 1:
            response.set_rcode(dns.rcode.FORMERR)
            return response
        question = query.question[0]
        owner, rdtype = question.name, dns.rdatatype.RdataType(question.rdtype)
        forced = self._rcodes.get(owner)
        if forced is not None:
            response.set_rcode(forced)
            return response
        if question.rdclass != dns.rdataclass.IN:
            response.set_rcode(dns.rcode.REFUSED)
            return response
        if (owner, rdtype) in self._records:
            rrset = self._records[(owner, rdtype)]
            if rrset is not None:
                response.answer.append(rrset)
            return response
        if not any(existing == owner for existing, _ in self._records):
            response.set_rcode(dns.rcode.NXDOMAIN)
        return response

    # ---- lifecycle -----------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port, the same for UDP and TCP; only after ``start()``."""
        if self._port is None:
            raise RuntimeError("LoopbackDnsServer.start() has not been called")
        return self._port

    async def start(self) -> None:
        """Bind UDP on a free port and TCP on the same port, retrying if TCP's is taken."""
        loop = asyncio.get_running_loop()
        for _ in range(self.max_bind_attempts):
            udp_transport, _protocol = await loop.create_datagram_endpoint(
                lambda: _UdpProtocol(self), local_addr=(self.host, 0), family=socket.AF_INET
            )
            port: int = udp_transport.get_extra_info("sockname")[1]
            try:
                tcp_server = await asyncio.start_server(
                    self._serve_tcp, self.host, port, family=socket.AF_INET
                )
            except OSError:
                udp_transport.close()
                continue
            self._udp_transport, self._tcp_server, self._port = udp_transport, tcp_server, port
            return
        raise OSError(
            f"no port on {self.host} was free for both UDP and TCP after {self.max_bind_attempts} attempts"
        )

    async def close(self) -> None:
        """Stop answering: close the UDP socket, the TCP listener and every open TCP connection."""
        if self._udp_transport is not None:
            self._udp_transport.close()
            self._udp_transport = None
        if self._tcp_server is not None:
            self._tcp_server.close()
            for writer in list(self._tcp_writers):
                writer.close()
            await self._tcp_server.wait_closed()
            self._tcp_server = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ---- transports ----------------------------------------------------------------

    def _receive(self, wire: bytes, transport: Literal["udp", "tcp"]) -> dns.message.Message | None:
        """Parse and record a query; ``None`` when it is malformed or must be dropped."""
        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException as exc:
            log.warning("loopback DNS server: dropping a malformed %s query: %s", transport, exc)
            return None
        for question in query.question:
            self.queries.append(
                ReceivedQuery(
                    transport, question.name.to_text().lower(), dns.rdatatype.to_text(question.rdtype)
                )
            )
        return None if self.drop_queries else query

    def _answer_or_servfail(self, query: dns.message.Message) -> dns.message.Message:
        """The answer, or SERVFAIL (logged) when building it fails, so a broken test fails fast, not by timeout."""
        try:
            response = self.answer(query)
            response.to_wire()  # rendering is where bad records show up
        except Exception:
            log.exception("loopback DNS server: cannot answer %s", query.question)
            response = dns.message.make_response(query)
            response.set_rcode(dns.rcode.SERVFAIL)
        return response

    def _handle_datagram(
        self, wire: bytes, addr: tuple[str, int], transport: asyncio.DatagramTransport
    ) -> None:
        query = self._receive(wire, "udp")
        if query is None:
            return
        response = self._answer_or_servfail(query)
        max_size = max(query.payload, _CLASSIC_UDP_PAYLOAD) if query.edns >= 0 else _CLASSIC_UDP_PAYLOAD
        try:
            reply = response.to_wire(max_size=max_size)
        except dns.exception.TooBig:
            # Too big for UDP: say so (TC) with no records, and the client retries over TCP.
            response.answer.clear()
            response.flags |= dns.flags.TC
            reply = response.to_wire(max_size=max_size)
        transport.sendto(reply, addr)

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tcp_writers.add(writer)
        try:
            while True:
                try:
                    async with asyncio.timeout(self.tcp_idle_timeout):
                        (length,) = _TCP_LENGTH.unpack(await reader.readexactly(_TCP_LENGTH.size))
                        wire = await reader.readexactly(length)
                except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                    return
                query = self._receive(wire, "tcp")
                if query is None:
                    continue
                reply = self._answer_or_servfail(query).to_wire()
                writer.write(_TCP_LENGTH.pack(len(reply)) + reply)
                await writer.drain()
        finally:
            self._tcp_writers.discard(writer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, server: LoopbackDnsServer) -> None:
        self._server = server
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A datagram endpoint's transport (not a DatagramTransport subclass on Python 3.11).
        self._transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | bytes, int]) -> None:
        if self._transport is not None and isinstance(addr[0], str):
            self._server._handle_datagram(data, (addr[0], addr[1]), self._transport)
