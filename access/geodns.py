"""The geo DNS: an authoritative DNS server for the relay zone that answers with the nearest healthy relays.

Agents look up ``_gpumarket._tcp.<zone>`` SRV (then ``<zone>`` A/AAAA, see
``agent.discovery``). This server answers each query from the live relay list in the
``Registry`` (refreshed every ``refresh_interval``, never per query), ranked for the
asker: the client's region comes from the EDNS Client Subnet option (RFC 7871) when
the query has one, else from the source address; relays are ordered by region
distance, then by spare capacity.

Two layers, as in the relay protocol:

- ``RegionMap`` and ``GeoZone`` are Sans-I/O: a parsed query and a client address in,
  a response message out. ``GeoZone.update(relays)`` swaps in a new relay list.
- ``GeoDnsServer`` owns the sockets (UDP and TCP on one port), the per-source rate
  limit, the message size limits, the refresh task and the counters in ``stats``.

What it answers (the zone is ``Z``):

- ``_gpumarket._tcp.Z`` SRV: the chosen relays (below). Priority is the rank of the
  relay's distance class (0 for the nearest distance; equal distances share a
  priority), weight is the relay's spare capacity (scaled into 1..65535), port and
  target are the relay's. A relay whose host is an IP literal gets the target
  ``<relay label>.Z`` (SRV targets must be names), and the A/AAAA of such targets go
  in the ADDITIONAL section.
- ``Z`` A/AAAA: the addresses of the chosen relays whose host is an IP literal of that
  family. Relays published under a hostname are left out: resolving other zones'
  names would make every answer depend on other DNS servers.
- ``<relay label>.Z`` A/AAAA: the address of a relay published with an IP literal
  (every live relay, draining or not, so a cached SRV answer stays resolvable).
- ``Z`` SOA and NS: one minimal SOA and one NS (``nameserver``, default ``ns.Z``).
- ANY: one RRset of the name (RFC 8482), not all of them.

A relay's hostname is used as its SRV target as it is; a hostname inside ``Z`` is
not answered here (NXDOMAIN), so relays publish either an IP literal or a name in
another zone.

The chosen relays are the live, non-draining relays with spare capacity; when none has
spare capacity, the non-draining ones; the nearest ``max_answers`` of those. When no
relay qualifies the answer is NOERROR with no records and the SOA in AUTHORITY
(NODATA), not SERVFAIL: a resolver caches it only for the short negative TTL, and an
agent falls back to its other relays at once instead of retrying a failing server.

Everything else: unknown names in the zone → NXDOMAIN with the SOA in AUTHORITY (RFC
2308); names outside the zone → REFUSED (this is never a resolver, it never
recurses); opcodes other than QUERY → NOTIMP; not exactly one question → FORMERR;
EDNS version above 0 → BADVERS; zone transfers → REFUSED. Packets that do not parse,
and responses sent to us, are dropped without an answer and counted.

Imports ``shared`` and dnspython only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import math
import re
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Self, cast

import dns.edns
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from shared.errors import BusError, ConfigError
from shared.ratelimit import SourceRateLimiter, source_key
from shared.registry import Registry, RelayRecord, open_registry
from shared.settings import DnsSettings

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

SRV_SERVICE = "_gpumarket._tcp"
"""The SRV owner name is ``<SRV_SERVICE>.<zone>``, as ``agent.discovery`` asks."""

# A UDP answer to a query without EDNS is limited to 512 bytes (RFC 1035 §4.2.1).
CLASSIC_UDP_PAYLOAD = 512
_TCP_LENGTH = struct.Struct("!H")
_MAX_TCP_RESPONSE = 65_535
_MAX_SRV_WEIGHT = 65_535
_SERIAL_MODULUS = 2**32
_LABEL_UNSAFE = re.compile(r"[^a-z0-9-]+")

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


# ---- configuration parsing ----------------------------------------------------------


def parse_prefix_regions(prefix_regions: Mapping[str, str]) -> list[tuple[IPNetwork, str]]:
    """``{"10.0.0.0/8": "eu"}`` → ``[(IPv4Network("10.0.0.0/8"), "eu")]``; raises ``ConfigError`` naming the bad entry."""
    parsed: list[tuple[IPNetwork, str]] = []
    for prefix, region in prefix_regions.items():
        try:
            network = ipaddress.ip_network(prefix.strip(), strict=True)
        except ValueError as exc:
            raise ConfigError(
                f"GPUMARKET_PREFIX_REGIONS: {prefix!r} is not a CIDR prefix ({exc}); write it like \"10.0.0.0/8\""
            ) from None
        if not region:
            raise ConfigError(f"GPUMARKET_PREFIX_REGIONS: prefix {prefix!r} maps to an empty region name")
        parsed.append((network, region))
    return parsed


def parse_region_distance(region_distance: Mapping[str, float]) -> dict[tuple[str, str], float]:
    """``{"us:eu": 80}`` → ``{("us", "eu"): 80.0}``; raises ``ConfigError`` naming the bad entry."""
    parsed: dict[tuple[str, str], float] = {}
    for key, distance in region_distance.items():
        first, separator, second = key.partition(":")
        if not separator or not first or not second or ":" in second:
            raise ConfigError(
                f"GPUMARKET_REGION_DISTANCE: key {key!r} is not two region names joined by ':' (like \"us:eu\")"
            )
        if not math.isfinite(distance) or distance < 0:
            raise ConfigError(f"GPUMARKET_REGION_DISTANCE: the distance of {key!r} must be a finite number >= 0")
        parsed[(first, second)] = float(distance)
    return parsed


# ---- regions (Sans-I/O) -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Location:
    """Where a client is: its region, and the prefix length that decided it (the ECS scope)."""

    region: str
    scope: int


class RegionMap:
    """Client address → region (longest configured prefix wins), and distances between regions.

    ``region_distance`` is symmetric (``("us", "eu")`` also gives the distance from
    ``"eu"`` to ``"us"``); a region is at distance 0 from itself; a pair that is not
    listed is at ``unknown_distance``. An address no prefix covers is in
    ``default_region``. Lookups take one dictionary probe per distinct prefix length.
    """

    def __init__(
        self,
        prefix_regions: Iterable[tuple[IPNetwork, str]] = (),
        *,
        region_distance: Mapping[tuple[str, str], float] | None = None,
        default_region: str = "local",
        unknown_distance: float = 10_000.0,
    ) -> None:
        if not math.isfinite(unknown_distance) or unknown_distance < 0:
            raise ValueError("unknown_distance must be a finite number >= 0")
        self.default_region = default_region
        self.unknown_distance = unknown_distance
        self._prefixes: dict[int, list[tuple[IPNetwork, str]]] = {4: [], 6: []}
        # Per family: [(prefix length, {network as int >> host bits: region})], longest first.
        self._tables: dict[int, list[tuple[int, dict[int, str]]]] = {4: [], 6: []}
        seen: dict[IPNetwork, str] = {}
        for network, region in prefix_regions:
            if network in seen:
                raise ValueError(f"prefix {network} is given twice (regions {seen[network]!r} and {region!r})")
            seen[network] = region
            self._prefixes[network.version].append((network, region))
        for version, prefixes in self._prefixes.items():
            by_length: dict[int, dict[int, str]] = {}
            for network, region in prefixes:
                host_bits = network.max_prefixlen - network.prefixlen
                by_length.setdefault(network.prefixlen, {})[int(network.network_address) >> host_bits] = region
            self._tables[version] = sorted(by_length.items(), reverse=True)
        self._distances: dict[tuple[str, str], float] = {}
        for (first, second), distance in (region_distance or {}).items():
            if not math.isfinite(distance) or distance < 0:
                raise ValueError(f"distance {first!r}-{second!r} must be a finite number >= 0")
            self._distances[(first, second)] = distance
            self._distances[(second, first)] = distance

    def locate(self, address: IPAddress) -> Location:
        """The region of ``address`` and the scope: how many leading bits of it the answer depends on.

        The scope is the matched prefix length, lengthened where a more specific prefix
        of another region lies inside the matched one, so that every address sharing
        ``scope`` leading bits with ``address`` is in the same region (RFC 7871 §7.2.1).
        """
        bits = address.max_prefixlen
        value = int(address)
        matched_length, region = 0, self.default_region
        for length, table in self._tables[address.version]:
            found = table.get(value >> (bits - length))
            if found is not None:
                matched_length, region = length, found
                break
        scope = matched_length
        for network, other_region in self._prefixes[address.version]:
            if network.prefixlen <= matched_length or other_region == region:
                continue
            # The address is outside ``network`` (a longer match would have won), so the
            # bits they share end before ``network.prefixlen``.
            shared_bits = bits - (value ^ int(network.network_address)).bit_length()
            if shared_bits >= matched_length:
                scope = max(scope, shared_bits + 1)
        return Location(region, scope)

    def distance(self, first: str, second: str) -> float:
        if first == second:
            return 0.0
        return self._distances.get((first, second), self.unknown_distance)


# ---- the zone (Sans-I/O) ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Relay:
    """A live relay as the zone serves it."""

    record: RelayRecord
    target: dns.name.Name  # the SRV target: the relay's hostname, or <label>.<zone> for an IP literal
    address: IPAddress | None  # set when the relay's host is an IP literal


@dataclass(frozen=True, slots=True)
class _Snapshot:
    relays: tuple[_Relay, ...]
    by_target: Mapping[dns.name.Name, _Relay]  # synthesized <label>.<zone> names
    empty_non_terminals: frozenset[dns.name.Name]


def _relay_label(relay_id: str, taken: set[str]) -> str:
    """One DNS label for ``relay_id``: the id itself when it is a plain label, else a safe form plus a hash."""
    lowered = relay_id.lower()
    label = _LABEL_UNSAFE.sub("-", lowered).strip("-")[:50] or "relay"
    if label != lowered or label in taken:
        label = f"{label}-{hashlib.sha256(relay_id.encode()).hexdigest()[:8]}"
    taken.add(label)
    return label


def _ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


class GeoZone:
    """The relay zone's data and how it answers one query; no I/O.

    ``update(relays)`` replaces the relay list (from the registry); ``respond(query,
    source)`` builds the response for a parsed query from ``source``. See the module
    docstring for what is answered.
    """

    def __init__(
        self,
        zone: str,
        *,
        regions: RegionMap,
        ttl: int = 30,
        max_answers: int = 4,
        nameserver: str | None = None,
        nameserver_addresses: Sequence[str] = (),
        edns_payload: int = 1232,
    ) -> None:
        if not 0 <= ttl <= 86_400:
            raise ValueError("ttl must be between 0 and 86400 seconds")
        if not 1 <= max_answers <= 100:
            raise ValueError("max_answers must be between 1 and 100")  # 100 answers always fit a TCP message
        if not CLASSIC_UDP_PAYLOAD <= edns_payload <= 65_535:
            raise ValueError("edns_payload must be between 512 and 65535")
        try:
            self.origin = dns.name.from_text(zone.strip().rstrip("."), origin=dns.name.root)
            self.nameserver = (
                dns.name.from_text(nameserver.strip().rstrip("."), origin=dns.name.root)
                if nameserver
                else dns.name.from_text("ns", origin=self.origin)
            )
        except dns.exception.DNSException as exc:
            raise ConfigError(f"the DNS zone {zone!r} or its nameserver {nameserver!r} is not a valid name: {exc}") from None
        if self.origin == dns.name.root:
            raise ConfigError("the DNS zone must not be the root; set GPUMARKET_ZONE")
        self.regions = regions
        self.ttl = ttl
        self.max_answers = max_answers
        self.edns_payload = edns_payload
        self.srv_name = dns.name.from_text(SRV_SERVICE, origin=self.origin)
        self.serial = 1
        self._nameserver_addresses: dict[int, list[IPAddress]] = {4: [], 6: []}
        for text in nameserver_addresses:
            address = _ip_literal(text)
            if address is None:
                raise ConfigError(f"nameserver address {text!r} is not an IP address")
            self._nameserver_addresses[address.version].append(address)
        self._snapshot = _Snapshot((), {}, frozenset())
        self._rejected: set[tuple[str, str, int]] = set()
        self.update([])

    # ---- data ----------------------------------------------------------------------

    @property
    def relays(self) -> list[RelayRecord]:
        """The relay list in use (every live relay, including draining and full ones)."""
        return [relay.record for relay in self._snapshot.relays]

    def update(self, records: Sequence[RelayRecord]) -> None:
        """Serve ``records`` from now on; relays with an unusable host or port are skipped (logged once)."""
        taken: set[str] = set()  # labels right under the zone; the nameserver's first, so no relay shadows it
        if self._in_zone(self.nameserver) and self.nameserver != self.origin:
            taken.add(self.nameserver.relativize(self.origin).labels[-1].decode().lower())
        relays: list[_Relay] = []
        by_target: dict[dns.name.Name, _Relay] = {}
        rejected: set[tuple[str, str, int]] = set()
        for record in sorted(records, key=lambda r: r.relay_id):
            address = _ip_literal(record.host)
            try:
                if not 1 <= record.port <= 65_535:
                    raise ValueError(f"port {record.port} is not 1..65535")
                if address is not None:
                    target = dns.name.Name([_relay_label(record.relay_id, taken).encode()]).concatenate(self.origin)
                else:
                    target = dns.name.from_text(record.host.rstrip("."), origin=dns.name.root)
            except (ValueError, dns.exception.DNSException) as exc:
                key = (record.relay_id, record.host, record.port)
                rejected.add(key)
                if key not in self._rejected:
                    log.warning("geo DNS: not serving relay %s (host %r): %s", record.relay_id, record.host, exc)
                continue
            relay = _Relay(record, target, address)
            relays.append(relay)
            if address is not None:
                by_target[target] = relay
        self._rejected = rejected
        names = [self.srv_name, *by_target]
        if self._in_zone(self.nameserver):
            names.append(self.nameserver)
        empty_non_terminals = {
            parent
            for name in names
            for parent in (name.split(depth)[1] for depth in range(len(self.origin) + 1, len(name)))
        }
        snapshot = _Snapshot(tuple(relays), by_target, frozenset(empty_non_terminals - set(names)))
        if snapshot.relays != self._snapshot.relays:
            self.serial = self.serial % (_SERIAL_MODULUS - 1) + 1  # 1..2**32-1, skipping 0
        self._snapshot = snapshot

    def _in_zone(self, name: dns.name.Name) -> bool:
        return name.is_subdomain(self.origin)

    # ---- answering -----------------------------------------------------------------

    def respond(self, query: dns.message.Message, source: IPAddress) -> dns.message.Message:
        """The response to ``query`` (which must not have QR set) received from ``source``."""
        response = dns.message.make_response(query, our_payload=self.edns_payload)
        if query.opcode() != dns.opcode.QUERY:
            response.set_rcode(dns.rcode.NOTIMP)
            return response
        if len(query.question) != 1:
            response.set_rcode(dns.rcode.FORMERR)
            return response
        if query.edns > 0:
            response.set_rcode(dns.rcode.BADVERS)
            return response
        subnets = [option for option in query.options if isinstance(option, dns.edns.ECSOption)]
        if len(subnets) > 1:
            response.set_rcode(dns.rcode.FORMERR)
            return response
        question = query.question[0]
        qname, qtype = question.name, dns.rdatatype.RdataType(question.rdtype)
        if question.rdclass != dns.rdataclass.IN or not self._in_zone(qname):
            response.set_rcode(dns.rcode.REFUSED)
            return response
        response.flags |= dns.flags.AA
        if qtype in (dns.rdatatype.AXFR, dns.rdatatype.IXFR):
            response.set_rcode(dns.rcode.REFUSED)
            return response
        client_subnet = subnets[0] if subnets else None
        if client_subnet is not None and client_subnet.srclen > 0:
            location = self.regions.locate(ipaddress.ip_address(client_subnet.address))
        else:
            location = self.regions.locate(_unmapped(source))
        tailored = self._answer(response, qname, qtype, location.region)
        if client_subnet is not None:
            # Echo the option; the scope says how widely a resolver may reuse this answer
            # (0: for every client, when the answer does not depend on where they are).
            scope = location.scope if tailored and client_subnet.srclen > 0 else 0
            echoed = dns.edns.ECSOption(client_subnet.address, client_subnet.srclen, scope)
            response.use_edns(0, 0, self.edns_payload, query.payload, options=[echoed])
        return response

    def _answer(
        self, response: dns.message.Message, qname: dns.name.Name, qtype: dns.rdatatype.RdataType, region: str
    ) -> bool:
        """Fill the sections for ``qname``/``qtype`` (in the zone); true when the answer depends on ``region``."""
        snapshot = self._snapshot
        any_type = qtype == dns.rdatatype.ANY  # RFC 8482: answer with one RRset of the name
        if qname == self.srv_name:
            if qtype == dns.rdatatype.SRV or any_type:
                self._answer_srv(response, qname, region)
            else:
                self._nodata(response)
            return True
        if qname == self.origin:
            if qtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                version = 4 if qtype == dns.rdatatype.A else 6
                chosen = self._choose(
                    [r for r in snapshot.relays if r.address is not None and r.address.version == version], region
                )
                self._add_addresses(response.answer, qname, [r.address for r in chosen if r.address is not None])
                if not response.answer:
                    self._nodata(response)
                return True
            if qtype == dns.rdatatype.SOA or any_type:
                response.answer.append(self._soa_rrset())
            elif qtype == dns.rdatatype.NS:
                response.answer.append(
                    dns.rrset.from_rdata(self.origin, self.ttl, self._rdata(dns.rdatatype.NS, self.nameserver.to_text()))
                )
                if self._in_zone(self.nameserver):
                    for addresses in self._nameserver_addresses.values():
                        self._add_addresses(response.additional, self.nameserver, addresses)
            else:
                self._nodata(response)
            return False
        relay = snapshot.by_target.get(qname)
        if relay is not None and relay.address is not None:
            wanted = dns.rdatatype.A if relay.address.version == 4 else dns.rdatatype.AAAA
            if qtype == wanted or any_type:
                self._add_addresses(response.answer, qname, [relay.address])
            else:
                self._nodata(response)
            return False
        if qname == self.nameserver:
            if qtype in (dns.rdatatype.A, dns.rdatatype.AAAA) or any_type:
                versions = (4, 6) if any_type else (4 if qtype == dns.rdatatype.A else 6,)
                for version in versions:
                    self._add_addresses(response.answer, qname, self._nameserver_addresses[version])
            if not response.answer:
                self._nodata(response)
            return False
        if qname in snapshot.empty_non_terminals:
            self._nodata(response)  # the name exists (names below it do), with no records: NODATA, not NXDOMAIN
            return False
        response.set_rcode(dns.rcode.NXDOMAIN)
        response.authority.append(self._soa_rrset())
        return False

    def _choose(self, relays: Sequence[_Relay], region: str) -> list[_Relay]:
        """The relays to offer, nearest first: those with spare capacity, else any not draining."""
        offered = [r for r in relays if not r.record.draining and r.record.spare > 0] or [
            r for r in relays if not r.record.draining
        ]
        offered.sort(key=lambda r: (self.regions.distance(region, r.record.region), -r.record.spare, r.record.relay_id))
        return offered[: self.max_answers]

    def _answer_srv(self, response: dns.message.Message, qname: dns.name.Name, region: str) -> None:
        chosen = self._choose(self._snapshot.relays, region)
        if not chosen:
            self._nodata(response)
            return
        distances = sorted({self.regions.distance(region, relay.record.region) for relay in chosen})
        priority_of = {distance: rank for rank, distance in enumerate(distances)}
        largest_spare = max(relay.record.spare for relay in chosen)
        scale = min(1.0, _MAX_SRV_WEIGHT / largest_spare) if largest_spare else 1.0
        records = []
        for relay in chosen:
            priority = priority_of[self.regions.distance(region, relay.record.region)]
            weight = max(1, min(_MAX_SRV_WEIGHT, round(relay.record.spare * scale)))
            records.append(
                self._rdata(dns.rdatatype.SRV, f"{priority} {weight} {relay.record.port} {relay.target.to_text()}")
            )
        response.answer.append(dns.rrset.from_rdata_list(qname, self.ttl, records))
        for relay in chosen:
            if relay.address is not None:  # a synthesized <label>.<zone> target: save the client a lookup
                self._add_addresses(response.additional, relay.target, [relay.address])

    def _add_addresses(
        self, section: list[dns.rrset.RRset], owner: dns.name.Name, addresses: Sequence[IPAddress]
    ) -> None:
        for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            rdatas = [self._rdata(rdtype, str(a)) for a in addresses if _address_type(a) == rdtype]
            if rdatas:
                section.append(dns.rrset.from_rdata_list(owner, self.ttl, rdatas))

    def _nodata(self, response: dns.message.Message) -> None:
        """NOERROR with no records; the SOA in AUTHORITY lets resolvers cache that (RFC 2308 §2.2)."""
        response.authority.append(self._soa_rrset())

    def _soa_rrset(self) -> dns.rrset.RRset:
        # MINIMUM (the negative TTL, RFC 2308) is the answer TTL: "no relay" is as short-lived as a relay list.
        hostmaster = dns.name.from_text("hostmaster", origin=self.origin)
        text = f"{self.nameserver.to_text()} {hostmaster.to_text()} {self.serial} 3600 600 86400 {self.ttl}"
        return dns.rrset.from_rdata(self.origin, self.ttl, self._rdata(dns.rdatatype.SOA, text))

    @staticmethod
    def _rdata(rdtype: dns.rdatatype.RdataType, text: str) -> dns.rdata.Rdata:
        return dns.rdata.from_text(dns.rdataclass.IN, rdtype, text, origin=dns.name.root, relativize=False)


def _address_type(address: IPAddress) -> dns.rdatatype.RdataType:
    return dns.rdatatype.A if address.version == 4 else dns.rdatatype.AAAA


def _unmapped(address: IPAddress) -> IPAddress:
    """An IPv4 client seen on a dual-stack socket (``::ffff:a.b.c.d``) as its IPv4 address."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def render_udp(response: dns.message.Message, *, max_size: int) -> tuple[bytes, bool]:
    """``response`` in at most ``max_size`` bytes, and whether it had to be truncated (TC).

    ADDITIONAL records are dropped first without TC (RFC 2181 §9: they are optional);
    when the answer itself does not fit, every record goes and TC tells the client to
    ask again over TCP. When even the echoed question section does not fit (a query of
    many questions, answered FORMERR or NOTIMP), it goes too.
    """
    try:
        return response.to_wire(max_size=max_size), False
    except dns.exception.TooBig:
        pass
    if response.additional:
        response.additional.clear()
        try:
            return response.to_wire(max_size=max_size), False
        except dns.exception.TooBig:
            pass
    response.answer.clear()
    response.authority.clear()
    response.flags |= dns.flags.TC
    try:
        return response.to_wire(max_size=max_size), True
    except dns.exception.TooBig:
        response.question.clear()
        return response.to_wire(max_size=max_size), True


# ---- the server ---------------------------------------------------------------------


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
