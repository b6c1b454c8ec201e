"""The relay zone (Sans-I/O): the live relay records and the answer to one parsed query.

``GeoZone.update(relays)`` swaps in a new relay list (from the ``Registry``);
``GeoZone.respond(query, source)`` builds the response for the asker, whose region comes
from the EDNS Client Subnet option (RFC 7871) when the query has one, else from the source
address, through ``access.geodns.regions``. ``render_udp`` fits a response into a
UDP message.

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

import hashlib
import ipaddress
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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

from access.geodns.regions import IPAddress, RegionMap
from shared.errors import ConfigError
from shared.registry import RelayRecord

log = logging.getLogger(__name__)

SRV_SERVICE = "_gpumarket._tcp"
"""The SRV owner name is ``<SRV_SERVICE>.<zone>``, as ``agent.discovery`` asks."""

# A UDP answer to a query without EDNS is limited to 512 bytes (RFC 1035 §4.2.1).
CLASSIC_UDP_PAYLOAD = 512
_MAX_SRV_WEIGHT = 65_535
_SERIAL_MODULUS = 2**32
_LABEL_UNSAFE = re.compile(r"[^a-z0-9-]+")


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


__all__ = ["CLASSIC_UDP_PAYLOAD", "SRV_SERVICE", "GeoZone", "render_udp"]
