"""The geo DNS: real UDP and TCP queries against a GeoDnsServer on 127.0.0.1, port 0.

Relays come from a MemoryRegistry on a fake clock (and from real Redis for
``serve_dns``); client regions come from loopback source addresses (127.0.0.2 is in
us-east, 127.0.0.3 in eu-west) or from an EDNS Client Subnet option.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import secrets
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import dns.asyncquery
import dns.edns
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset
import dns.update
import pytest
from dns.rdtypes.ANY.SOA import SOA
from dns.rdtypes.IN.SRV import SRV

from access.geodns.regions import Location, RegionMap, parse_prefix_regions, parse_region_distance
from access.geodns.server import GeoDnsServer, serve_dns, server_from_settings
from agent.discovery import resolve_relays
from shared.errors import BusError, ConfigError
from shared.registry import MemoryRegistry, RedisRegistry, RelayRecord
from shared.settings import DnsSettings
from tests.factories import MS
from tests.helpers import eventually

ZONE = "relays.example.test"
SRV_NAME = f"_gpumarket._tcp.{ZONE}"
US_CLIENT = "127.0.0.2"  # in us-east through 127.0.0.0/8
EU_CLIENT = "127.0.0.3"  # in eu-west through its own /32
SHORT_TIMEOUT = 200 * MS  # how long a test waits for an answer that must not come
ANSWER_TIMEOUT = 5.0

PREFIX_REGIONS = parse_prefix_regions(
    {
        "127.0.0.0/8": "us-east",
        "127.0.0.3/32": "eu-west",
        "198.51.100.0/24": "eu-west",
        "203.0.113.0/24": "us-west",
        "2001:db8:e0::/48": "eu-west",
    }
)
REGION_DISTANCE = parse_region_distance({"us-east:us-west": 10, "us-east:eu-west": 80, "us-west:eu-west": 90})


class FakeClock:
    """Seconds that move only when a test says so."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def relay(
    relay_id: str,
    region: str,
    host: str,
    *,
    port: int = 8443,
    connections: int = 0,
    capacity: int = 100,
    draining: bool = False,
) -> RelayRecord:
    return RelayRecord(
        relay_id=relay_id,
        region=region,
        url=f"wss://{host}:{port}/v1/agent",
        host=host,
        port=port,
        connections=connections,
        capacity=capacity,
        draining=draining,
        updated_at=0.0,
    )


async def registry_with(relays: Sequence[RelayRecord], *, clock: FakeClock | None = None) -> MemoryRegistry:
    registry = MemoryRegistry(clock=clock or FakeClock())
    for record in relays:
        await registry.put_relay(record, ttl=60)
    return registry


@asynccontextmanager
async def geodns(registry: MemoryRegistry | RedisRegistry, **overrides: Any) -> AsyncIterator[GeoDnsServer]:
    """A started GeoDnsServer on 127.0.0.1 port 0 with the test regions; ``overrides`` replace its options."""
    options: dict[str, Any] = {
        "zone": ZONE,
        "prefix_regions": PREFIX_REGIONS,
        "region_distance": REGION_DISTANCE,
        "default_region": "us-east",
        "ttl": 30,
        "refresh_interval": 3600.0,  # tests that want a refresh shorten it or call refresh()
        **overrides,
    }
    async with GeoDnsServer(registry, **options) as server:
        yield server


def make_query(
    name: str,
    rdtype: str,
    *,
    subnet: str | None = None,
    edns: int | None = None,
) -> dns.message.Message:
    """A query; ``subnet`` ("198.51.100.0/24") adds an EDNS Client Subnet option (and EDNS)."""
    options: list[dns.edns.Option] | None = None
    if subnet is not None:
        address, length = subnet.split("/")
        options = [dns.edns.ECSOption(address, int(length))]
    return dns.message.make_query(name, rdtype, use_edns=edns, options=options)


async def ask_udp(
    server: GeoDnsServer, query: dns.message.Message, *, source: str = US_CLIENT, timeout: float = ANSWER_TIMEOUT
) -> dns.message.Message:
    return await dns.asyncquery.udp(query, "127.0.0.1", port=server.port, source=source, timeout=timeout)


async def ask_tcp(server: GeoDnsServer, query: dns.message.Message, *, source: str = US_CLIENT) -> dns.message.Message:
    return await dns.asyncquery.tcp(query, "127.0.0.1", port=server.port, source=source, timeout=ANSWER_TIMEOUT)


def srv_records(response: dns.message.Message) -> list[SRV]:
    """The SRV answer (an unordered set on the wire) by priority, heaviest weight first, then target."""
    records = [rdata for rrset in response.answer for rdata in rrset if isinstance(rdata, SRV)]
    return sorted(records, key=lambda record: (record.priority, -record.weight, record.target.to_text()))


def targets(response: dns.message.Message) -> list[str]:
    return [record.target.to_text() for record in srv_records(response)]


def addresses(section: Sequence[dns.rrset.RRset]) -> dict[str, set[str]]:
    """``{owner name: {address, ...}}`` of the A and AAAA records in ``section``."""
    found: dict[str, set[str]] = {}
    for rrset in section:
        if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            found.setdefault(rrset.name.to_text(), set()).update(rdata.to_text() for rdata in rrset)
    return found


def soa_of(response: dns.message.Message) -> SOA:
    (rrset,) = [rrset for rrset in response.authority if rrset.rdtype == dns.rdatatype.SOA]
    (record,) = list(rrset)
    assert isinstance(record, SOA)
    return record


def client_subnet(response: dns.message.Message) -> dns.edns.ECSOption:
    (option,) = [option for option in response.options if isinstance(option, dns.edns.ECSOption)]
    return option


# Four relays: two in us-east with different spare capacity, one in us-west published
# under a hostname, one in eu-west.
WORLD = [
    relay("us-1", "us-east", "192.0.2.1", connections=20),  # spare 80
    relay("us-2", "us-east", "192.0.2.2", port=9443, connections=70),  # spare 30
    relay("uw-1", "us-west", "uw1.example.net", connections=50),  # spare 50
    relay("eu-1", "eu-west", "192.0.2.3", connections=10),  # spare 90
]


class TestSrvAnswers:
    async def test_nearest_region_first_weighted_by_spare_capacity(self) -> None:
        """A us-east client gets us-east relays at priority 0 weighted by spare capacity, then us-west, then eu-west."""
        async with geodns(await registry_with(WORLD), ttl=17) as server:
            response = await ask_udp(server, make_query(SRV_NAME, "SRV"))
        assert response.rcode() == dns.rcode.NOERROR
        assert response.flags & dns.flags.AA
        assert not response.flags & dns.flags.RA  # never a resolver
        assert [(r.priority, r.weight, r.port, r.target.to_text()) for r in srv_records(response)] == [
            (0, 80, 8443, f"us-1.{ZONE}."),
            (0, 30, 9443, f"us-2.{ZONE}."),
            (1, 50, 8443, "uw1.example.net."),
            (2, 90, 8443, f"eu-1.{ZONE}."),
        ]
        assert {rrset.ttl for rrset in response.answer + response.additional} == {17}
        # Targets synthesized for IP literals come with their addresses; a hostname target does not.
        assert addresses(response.additional) == {
            f"us-1.{ZONE}.": {"192.0.2.1"},
            f"us-2.{ZONE}.": {"192.0.2.2"},
            f"eu-1.{ZONE}.": {"192.0.2.3"},
        }

    async def test_max_answers_keeps_the_nearest(self) -> None:
        """With max_answers=2 a us-east client hears of the two us-east relays only."""
        async with geodns(await registry_with(WORLD), max_answers=2) as server:
            response = await ask_udp(server, make_query(SRV_NAME, "SRV"))
        assert targets(response) == [f"us-1.{ZONE}.", f"us-2.{ZONE}."]

    async def test_weights_are_scaled_into_sixteen_bits(self) -> None:
        """Spare capacities above 65535 are scaled down proportionally, and never to 0."""
        relays = [
            relay("big", "us-east", "192.0.2.1", capacity=1_000_000),
            relay("small", "us-east", "192.0.2.2", capacity=10),
        ]
        async with geodns(await registry_with(relays)) as server:
            response = await ask_udp(server, make_query(SRV_NAME, "SRV"))
        assert [record.weight for record in srv_records(response)] == [65535, 1]


class TestClientRegion:
    async def test_client_subnet_decides_the_region_and_is_echoed_with_a_scope(self) -> None:
        """A us-east resolver asking for an eu-west subnet gets eu-west first, and the ECS option back with scope 24."""
        async with geodns(await registry_with(WORLD)) as server:
            response = await ask_udp(server, make_query(SRV_NAME, "SRV", subnet="198.51.100.0/24"))
        assert srv_records(response)[0].target.to_text() == f"eu-1.{ZONE}."
        assert srv_records(response)[0].priority == 0
        echoed = client_subnet(response)
        assert (echoed.address, echoed.srclen, echoed.scopelen) == ("198.51.100.0", 24, 24)

    async def test_ipv6_client_subnet(self) -> None:
        """An IPv6 subnet inside an eu-west /48 is answered for eu-west, with scope 48."""
        async with geodns(await registry_with(WORLD)) as server:
            response = await ask_udp(server, make_query(SRV_NAME, "SRV", subnet="2001:db8:e0:1::/56"))
        assert targets(response)[0] == f"eu-1.{ZONE}."
        assert client_subnet(response).scopelen == 48

    async def test_answers_not_tailored_to_the_client_have_scope_zero(self) -> None:
        """The SOA is the same for everyone, so its ECS scope is 0 and resolvers may share it."""
        async with geodns(await registry_with(WORLD)) as server:
            response = await ask_udp(server, make_query(ZONE, "SOA", subnet="198.51.100.0/24"))
        assert client_subnet(response).scopelen == 0

    async def test_source_address_decides_the_region_without_client_subnet(self) -> None:
        """Without ECS, a query from 127.0.0.2 gets us-east first and one from 127.0.0.3 gets eu-west first."""
        async with geodns(await registry_with(WORLD)) as server:
            from_us = await ask_udp(server, make_query(SRV_NAME, "SRV"), source=US_CLIENT)
            from_eu = await ask_udp(server, make_query(SRV_NAME, "SRV"), source=EU_CLIENT)
            from_eu_over_tcp = await ask_tcp(server, make_query(SRV_NAME, "SRV"), source=EU_CLIENT)
        assert targets(from_us)[0] == f"us-1.{ZONE}."
        assert targets(from_eu)[0] == f"eu-1.{ZONE}."
        assert targets(from_eu_over_tcp)[0] == f"eu-1.{ZONE}."
        assert not from_us.options  # no ECS in the query, none in the answer

    def test_scope_excludes_more_specific_prefixes_of_other_regions(self) -> None:
        """10.2.3.4 is in 10.0.0.0/8 (us) but its /14 would include 10.1.0.0/16 (eu), so the scope is 15."""
        regions = RegionMap(
            parse_prefix_regions({"10.0.0.0/8": "us", "10.1.0.0/16": "eu"}), default_region="local"
        )
        assert regions.locate(ipaddress.ip_address("10.2.3.4")) == Location("us", 15)
        assert regions.locate(ipaddress.ip_address("10.1.2.3")) == Location("eu", 16)
        assert regions.locate(ipaddress.ip_address("192.0.2.1")) == Location("local", 1)
        assert regions.locate(ipaddress.ip_address("2001:db8::1")) == Location("local", 0)

    def test_distances_are_symmetric_with_a_default(self) -> None:
        """A listed pair reads both ways, a region is at 0 from itself, an unlisted pair is far."""
        regions = RegionMap(region_distance={("us", "eu"): 80.0}, unknown_distance=5000.0)
        assert (regions.distance("eu", "us"), regions.distance("us", "us"), regions.distance("us", "ap")) == (
            80.0,
            0.0,
            5000.0,
        )


class TestRelayHealth:
    async def test_draining_and_full_relays_are_not_offered_when_others_have_room(self) -> None:
        """us-east has one draining and one full relay, so a us-east client is sent to eu-west."""
        relays = [
            relay("us-drain", "us-east", "192.0.2.1", draining=True),
            relay("us-full", "us-east", "192.0.2.2", connections=100),
            relay("eu-1", "eu-west", "192.0.2.3"),
        ]
        async with geodns(await registry_with(relays)) as server:
            srv = await ask_udp(server, make_query(SRV_NAME, "SRV"))
            apex = await ask_udp(server, make_query(ZONE, "A"))
        assert targets(srv) == [f"eu-1.{ZONE}."]
        assert addresses(apex.answer) == {f"{ZONE}.": {"192.0.2.3"}}

    async def test_full_relays_are_offered_when_none_has_room(self) -> None:
        """When every live relay is full, the non-draining ones are still offered (weight 1), never the draining one."""
        relays = [
            relay("us-drain", "us-east", "192.0.2.1", draining=True),
            relay("us-full", "us-east", "192.0.2.2", connections=100),
            relay("eu-full", "eu-west", "192.0.2.3", connections=120),
        ]
        async with geodns(await registry_with(relays)) as server:
            response = await ask_udp(server, make_query(SRV_NAME, "SRV"))
        assert [(r.target.to_text(), r.priority, r.weight) for r in srv_records(response)] == [
            (f"us-full.{ZONE}.", 0, 1),
            (f"eu-full.{ZONE}.", 1, 1),
        ]

    async def test_no_usable_relay_is_nodata_with_the_soa(self) -> None:
        """With only draining relays the answer is NOERROR with no records and the SOA for negative caching."""
        relays = [relay("us-drain", "us-east", "192.0.2.1", draining=True)]
        async with geodns(await registry_with(relays), ttl=12) as server:
            response = await ask_udp(server, make_query(SRV_NAME, "SRV"))
        assert (response.rcode(), response.answer) == (dns.rcode.NOERROR, [])
        assert response.flags & dns.flags.AA
        assert soa_of(response).minimum == 12

    async def test_expired_relay_leaves_the_answers_after_a_refresh(self) -> None:
        """A relay that stops refreshing its registry record disappears from answers within a refresh interval."""
        wall = FakeClock()
        registry = MemoryRegistry(clock=wall)
        await registry.put_relay(relay("us-1", "us-east", "192.0.2.1"), ttl=10)
        await registry.put_relay(relay("us-2", "us-east", "192.0.2.2"), ttl=100)
        async with geodns(registry, refresh_interval=20 * MS) as server:
            before = await ask_udp(server, make_query(SRV_NAME, "SRV"))
            wall.now += 11  # us-1's record expires

            async def us_1_gone() -> list[str] | None:
                names = targets(await ask_udp(server, make_query(SRV_NAME, "SRV")))
                return names if f"us-1.{ZONE}." not in names else None

            after = await eventually(us_1_gone, what="us-1 to leave the SRV answer")
        assert targets(before) == [f"us-1.{ZONE}.", f"us-2.{ZONE}."]
        assert after == [f"us-2.{ZONE}."]

    async def test_registry_is_read_per_refresh_not_per_query(self) -> None:
        """Twenty queries within one refresh interval read the registry once (at start)."""

        class CountingRegistry(MemoryRegistry):
            reads = 0

            async def relays(self) -> list[RelayRecord]:
                CountingRegistry.reads += 1
                return await super().relays()

        registry = CountingRegistry(clock=FakeClock())
        await registry.put_relay(WORLD[0], ttl=60)
        async with geodns(registry) as server:
            for _ in range(20):
                await ask_udp(server, make_query(SRV_NAME, "SRV"))
        assert CountingRegistry.reads == 1

    async def test_registry_failure_keeps_serving_the_last_relays(self) -> None:
        """When the registry cannot be read, answers keep the last relay list and the failure is counted."""

        class FailingRegistry(MemoryRegistry):
            failing = False

            async def relays(self) -> list[RelayRecord]:
                if self.failing:
                    raise BusError("cannot read relays from Redis: connection refused")
                return await super().relays()

        registry = FailingRegistry(clock=FakeClock())
        await registry.put_relay(WORLD[0], ttl=60)
        async with geodns(registry) as server:
            registry.failing = True
            assert await server.refresh() is False
            response = await ask_udp(server, make_query(SRV_NAME, "SRV"))
        assert targets(response) == [f"us-1.{ZONE}."]
        assert server.stats["refresh_failures"] == 1


class TestAddresses:
    async def test_zone_apex_a_and_aaaa_list_the_nearest_ip_relays(self) -> None:
        """The apex A/AAAA answer holds the nearest relays' IP literals of that family; hostname relays are left out."""
        relays = [*WORLD, relay("eu-6", "eu-west", "2001:db8::6"), relay("us-6", "us-east", "2001:db8::7")]
        async with geodns(await registry_with(relays), max_answers=1) as server:
            us_a = await ask_udp(server, make_query(ZONE, "A"), source=US_CLIENT)
            eu_a = await ask_udp(server, make_query(ZONE, "A"), source=EU_CLIENT)
            eu_aaaa = await ask_udp(server, make_query(ZONE, "AAAA"), source=EU_CLIENT)
        assert addresses(us_a.answer) == {f"{ZONE}.": {"192.0.2.1"}}
        assert addresses(eu_a.answer) == {f"{ZONE}.": {"192.0.2.3"}}
        assert addresses(eu_aaaa.answer) == {f"{ZONE}.": {"2001:db8::6"}}
        assert us_a.flags & dns.flags.AA

    async def test_synthesized_targets_resolve(self) -> None:
        """Every SRV target made for an IP literal answers A (or AAAA); the other family is NODATA."""
        relays = [relay("us-1", "us-east", "192.0.2.1"), relay("EU West/1", "eu-west", "2001:db8::1")]
        async with geodns(await registry_with(relays)) as server:
            srv = await ask_udp(server, make_query(SRV_NAME, "SRV"))
            us_target, eu_target = targets(srv)
            us_a = await ask_udp(server, make_query(us_target, "A"))
            us_aaaa = await ask_udp(server, make_query(us_target, "AAAA"))
            eu_aaaa = await ask_udp(server, make_query(eu_target, "AAAA"))
        assert us_target == f"us-1.{ZONE}."
        assert re.fullmatch(rf"eu-west-1-[0-9a-f]{{8}}\.{re.escape(ZONE)}\.", eu_target)  # a safe label
        assert addresses(us_a.answer) == {us_target: {"192.0.2.1"}}
        assert (us_aaaa.rcode(), us_aaaa.answer) == (dns.rcode.NOERROR, [])
        assert soa_of(us_aaaa).mname.to_text() == f"ns.{ZONE}."
        assert addresses(eu_aaaa.answer) == {eu_target: {"2001:db8::1"}}


class TestZoneAndErrors:
    async def test_soa_and_ns_at_the_apex(self) -> None:
        """The apex has a minimal SOA (negative TTL = answer TTL) and an NS naming this server."""
        async with geodns(await registry_with(WORLD), ttl=25) as server:
            soa = await ask_udp(server, make_query(ZONE, "SOA"))
            ns = await ask_udp(server, make_query(ZONE, "NS"))
        (record,) = list(soa.answer[0])
        assert isinstance(record, SOA)
        assert (record.mname.to_text(), record.rname.to_text(), record.minimum) == (
            f"ns.{ZONE}.",
            f"hostmaster.{ZONE}.",
            25,
        )
        assert [rdata.to_text() for rdata in ns.answer[0]] == [f"ns.{ZONE}."]
        assert soa.flags & dns.flags.AA and ns.flags & dns.flags.AA

    async def test_unknown_name_in_the_zone_is_nxdomain_with_the_soa(self) -> None:
        """A name the zone does not have is NXDOMAIN, authoritative, with the SOA in AUTHORITY."""
        async with geodns(await registry_with(WORLD), ttl=30) as server:
            response = await ask_udp(server, make_query(f"nothing-here.{ZONE}", "A"))
        assert response.rcode() == dns.rcode.NXDOMAIN
        assert response.flags & dns.flags.AA
        assert soa_of(response).minimum == 30
        assert server.stats["nxdomain"] == 1

    async def test_empty_non_terminal_is_nodata(self) -> None:
        """_tcp.ZONE exists because _gpumarket._tcp.ZONE does: NOERROR without records, not NXDOMAIN."""
        async with geodns(await registry_with(WORLD)) as server:
            response = await ask_udp(server, make_query(f"_tcp.{ZONE}", "TXT"))
        assert (response.rcode(), response.answer) == (dns.rcode.NOERROR, [])

    async def test_names_outside_the_zone_are_refused(self) -> None:
        """The server is no resolver: names outside the zone (the parent included) are REFUSED without AA."""
        async with geodns(await registry_with(WORLD)) as server:
            other = await ask_udp(server, make_query("example.com", "A"))
            parent = await ask_udp(server, make_query("example.test", "SOA"))
        for response in (other, parent):
            assert response.rcode() == dns.rcode.REFUSED
            assert not response.flags & dns.flags.AA
            assert response.answer == []
        assert server.stats["refused"] == 2

    async def test_malformed_packets_are_dropped_and_serving_goes_on(self) -> None:
        """Random bytes, a short header, a response and an oversized datagram get no reply; the next query does."""
        async with geodns(await registry_with(WORLD), max_udp_query=512) as server:
            loop = asyncio.get_running_loop()
            received: asyncio.Queue[bytes] = asyncio.Queue(maxsize=8)

            class Collect(asyncio.DatagramProtocol):
                def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
                    received.put_nowait(data)

            transport, _ = await loop.create_datagram_endpoint(
                Collect, local_addr=(US_CLIENT, 0), remote_addr=("127.0.0.1", server.port)
            )
            try:
                response_to_us = dns.message.make_response(make_query(SRV_NAME, "SRV"))
                padded = make_query(SRV_NAME, "SRV", edns=0)
                padded.use_edns(0, options=[dns.edns.GenericOption(dns.edns.OptionType.PADDING, b"\0" * 600)])
                for garbage in (secrets.token_bytes(64), b"\x12\x34\x01", response_to_us.to_wire(), padded.to_wire()):
                    transport.sendto(garbage)
                good = make_query(SRV_NAME, "SRV")
                transport.sendto(good.to_wire())
                async with asyncio.timeout(ANSWER_TIMEOUT):
                    first_reply = dns.message.from_wire(await received.get())
            finally:
                transport.close()
        assert first_reply.id == good.id  # the garbage before it got nothing
        assert targets(first_reply)[0] == f"us-1.{ZONE}."
        assert server.stats["malformed"] == 4

    async def test_two_questions_are_formerr(self) -> None:
        """A query with two questions is answered FORMERR."""
        query = make_query(SRV_NAME, "SRV")
        query.find_rrset(
            query.question, dns.name.from_text(ZONE), dns.rdataclass.IN, dns.rdatatype.A, create=True, force_unique=True
        )
        async with geodns(await registry_with(WORLD)) as server:
            response = await ask_udp(server, query)
        assert response.rcode() == dns.rcode.FORMERR

    async def test_notify_and_update_are_notimp(self) -> None:
        """Only QUERY is implemented: NOTIFY and UPDATE get NOTIMP."""
        notify = make_query(ZONE, "SOA")
        notify.set_opcode(dns.opcode.NOTIFY)
        update = dns.update.UpdateMessage(ZONE)
        update.add("evil", 300, "A", "192.0.2.66")
        async with geodns(await registry_with(WORLD)) as server:
            responses = [await ask_udp(server, notify), await ask_udp(server, update)]
            after = await ask_udp(server, make_query(f"evil.{ZONE}", "A"))
        assert [response.rcode() for response in responses] == [dns.rcode.NOTIMP, dns.rcode.NOTIMP]
        assert after.rcode() == dns.rcode.NXDOMAIN

    async def test_unknown_edns_version_is_badvers(self) -> None:
        """EDNS version 1 is answered BADVERS (RFC 6891)."""
        async with geodns(await registry_with(WORLD)) as server:
            response = await ask_udp(server, make_query(SRV_NAME, "SRV", edns=1))
        assert response.rcode() == dns.rcode.BADVERS

    async def test_zone_transfers_are_refused(self) -> None:
        """AXFR is refused: the zone is computed per client and never transferred."""
        async with geodns(await registry_with(WORLD)) as server:
            response = await ask_tcp(server, make_query(ZONE, "AXFR"))
        assert response.rcode() == dns.rcode.REFUSED


class TestLimits:
    async def test_oversized_udp_answer_is_truncated_and_tcp_has_it_all(self) -> None:
        """24 relays do not fit 512 bytes: UDP without EDNS gets TC and no records, TCP gets all 24."""
        relays = [relay(f"relay-{n:02}", "us-east", f"192.0.2.{n}") for n in range(1, 25)]
        async with geodns(await registry_with(relays), max_answers=24) as server:
            over_udp = await ask_udp(server, make_query(SRV_NAME, "SRV"))
            over_tcp = await ask_tcp(server, make_query(SRV_NAME, "SRV"))
        assert over_udp.flags & dns.flags.TC
        assert over_udp.answer == []
        assert not over_tcp.flags & dns.flags.TC
        assert len(srv_records(over_tcp)) == 24
        assert len(addresses(over_tcp.additional)) == 24
        assert server.stats["truncated"] == 1

    async def test_additional_records_go_first_without_tc(self) -> None:
        """When only the ADDITIONAL addresses do not fit 512 bytes, they are left out and TC stays clear (RFC 2181 §9)."""
        relays = [relay(f"r{n:02}", "us-east", f"192.0.2.{n}") for n in range(1, 9)]
        async with geodns(await registry_with(relays), max_answers=8) as server:
            plain = await ask_udp(server, make_query(SRV_NAME, "SRV"))
            with_edns = await ask_udp(server, make_query(SRV_NAME, "SRV", edns=0))
        assert not plain.flags & dns.flags.TC
        assert (len(srv_records(plain)), plain.additional) == (8, [])
        assert len(addresses(with_edns.additional)) == 8  # 1232 bytes hold it all

    async def test_rate_limit_drops_a_bursting_source_and_answers_the_others(self) -> None:
        """Past its burst of 3, 127.0.0.2 is dropped over UDP and refused over TCP while 127.0.0.3 is answered."""
        monotonic = FakeClock()
        async with geodns(await registry_with(WORLD), rate_limit=1.0, rate_burst=3, clock=monotonic) as server:
            for _ in range(3):
                await ask_udp(server, make_query(SRV_NAME, "SRV"), source=US_CLIENT)
            with pytest.raises(dns.exception.Timeout):
                await ask_udp(server, make_query(SRV_NAME, "SRV"), source=US_CLIENT, timeout=SHORT_TIMEOUT)
            refused = await ask_tcp(server, make_query(SRV_NAME, "SRV"), source=US_CLIENT)
            other = await ask_udp(server, make_query(SRV_NAME, "SRV"), source=EU_CLIENT)
            monotonic.now += 1.0  # one token back
            again = await ask_udp(server, make_query(SRV_NAME, "SRV"), source=US_CLIENT)
        assert refused.rcode() == dns.rcode.REFUSED
        assert targets(other)[0] == f"eu-1.{ZONE}."
        assert targets(again)[0] == f"us-1.{ZONE}."
        assert server.stats["rate_limited"] == 2

    async def test_oversized_tcp_length_prefix_closes_the_connection(self) -> None:
        """A length prefix over max_tcp_message closes the connection without reading the body."""
        async with geodns(await registry_with(WORLD), max_tcp_message=4096) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            try:
                writer.write(b"\xff\xff")  # 65535 bytes announced
                await writer.drain()
                async with asyncio.timeout(ANSWER_TIMEOUT):
                    assert await reader.read() == b""
            finally:
                writer.close()
            assert server.stats["malformed"] == 1

    async def test_idle_tcp_connection_is_closed(self) -> None:
        """A TCP connection that sends nothing is closed after tcp_idle_timeout."""
        async with geodns(await registry_with(WORLD), tcp_idle_timeout=50 * MS) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            try:
                async with asyncio.timeout(ANSWER_TIMEOUT):
                    assert await reader.read() == b""
            finally:
                writer.close()

    async def test_tcp_connections_beyond_the_limit_are_closed(self) -> None:
        """With max_tcp_connections=1 a second connection is closed at once; the first is still served."""
        async with geodns(await registry_with(WORLD), max_tcp_connections=1) as server:
            first_reader, first_writer = await asyncio.open_connection("127.0.0.1", server.port)
            second_reader, second_writer = await asyncio.open_connection("127.0.0.1", server.port)
            try:
                async with asyncio.timeout(ANSWER_TIMEOUT):
                    assert await second_reader.read() == b""
                    query = make_query(SRV_NAME, "SRV").to_wire()
                    first_writer.write(len(query).to_bytes(2, "big") + query)
                    length = int.from_bytes(await first_reader.readexactly(2), "big")
                    response = dns.message.from_wire(await first_reader.readexactly(length))
            finally:
                first_writer.close()
                second_writer.close()
        assert targets(response)[0] == f"us-1.{ZONE}."
        assert server.stats["tcp_rejected"] == 1

    async def test_close_ends_open_tcp_connections(self) -> None:
        """close() returns promptly even with a client connected and silent."""
        server = GeoDnsServer(await registry_with(WORLD), zone=ZONE, tcp_idle_timeout=60.0)
        await server.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:

            async def connected() -> bool:
                return server.tcp_connections == 1

            await eventually(connected, what="the server to see the connection")
            async with asyncio.timeout(ANSWER_TIMEOUT):
                await server.close()
                assert await reader.read() == b""
        finally:
            writer.close()


class TestAgentDiscovery:
    async def test_resolve_relays_puts_the_nearest_relay_first(self) -> None:
        """The agent's own resolver, asking from 127.0.0.1 (us-east), gets the us-east relay first."""
        relays = [
            relay("eu-1", "eu-west", "eu1.example.net", port=443),
            relay("us-1", "us-east", "us1.example.net", port=8443),
            relay("uw-1", "us-west", "uw1.example.net", port=8443),
        ]
        async with geodns(await registry_with(relays)) as server:
            candidates = await resolve_relays(ZONE, resolver="127.0.0.1", resolver_port=server.port, timeout=5)
        assert [(c.host, c.priority) for c in candidates] == [
            ("us1.example.net", 0),
            ("uw1.example.net", 1),
            ("eu1.example.net", 2),
        ]
        assert candidates[0].url == "wss://us1.example.net:8443/v1/agent"


class TestServeDns:
    @pytest.mark.redis
    async def test_serves_the_relays_published_in_redis(
        self, redis_url: str, bus_prefix: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """serve_dns reads relays from the Redis registry, answers for them, and stops when told."""
        publisher = RedisRegistry.from_url(redis_url, prefix=bus_prefix)
        try:
            await publisher.put_relay(relay("eu-1", "eu-west", "192.0.2.3"), ttl=60)
            await publisher.put_relay(relay("us-1", "us-east", "192.0.2.1"), ttl=60)
            settings = DnsSettings.load(
                zone=ZONE,
                host="127.0.0.1",
                port=0,
                redis_url=redis_url,
                bus_prefix=bus_prefix,
                prefix_regions={"127.0.0.0/8": "us-east"},
                region_distance={"us-east:eu-west": 80},
            )
            stop = asyncio.Event()
            serving = asyncio.create_task(serve_dns(settings, stop=stop))
            try:

                async def printed_port() -> int | None:
                    if serving.done():
                        serving.result()  # raise what stopped it
                    match = re.search(r"port (\d+)", capsys.readouterr().out)
                    return int(match.group(1)) if match else None

                port = await eventually(printed_port, what="serve_dns to print its port")
                response = await dns.asyncquery.udp(
                    make_query(SRV_NAME, "SRV"), "127.0.0.1", port=port, source=US_CLIENT, timeout=ANSWER_TIMEOUT
                )
            finally:
                stop.set()
                async with asyncio.timeout(ANSWER_TIMEOUT):
                    await serving
        finally:
            await publisher.close()
        assert [(r.priority, r.target.to_text()) for r in srv_records(response)] == [
            (0, f"us-1.{ZONE}."),
            (1, f"eu-1.{ZONE}."),
        ]

    async def test_needs_a_redis_url(self) -> None:
        """Without GPUMARKET_REDIS_URL there is no relay list to serve: a ConfigError says so."""
        settings = DnsSettings.load(redis_url=None, port=0)
        settings.redis_url = None  # an environment variable must not fill it in
        with pytest.raises(ConfigError, match="GPUMARKET_REDIS_URL"):
            await serve_dns(settings, stop=asyncio.Event())


class TestDnsSettings:
    def test_regions_come_from_json_environment_variables(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """GPUMARKET_PREFIX_REGIONS and GPUMARKET_REGION_DISTANCE are JSON objects, parsed into typed tables."""
        monkeypatch.setenv("GPUMARKET_PREFIX_REGIONS", '{"10.0.0.0/8": "eu", "2001:db8::/32": "us"}')
        monkeypatch.setenv("GPUMARKET_REGION_DISTANCE", '{"eu:us": 80}')
        settings = DnsSettings.load()
        assert parse_prefix_regions(settings.prefix_regions) == [
            (ipaddress.ip_network("10.0.0.0/8"), "eu"),
            (ipaddress.ip_network("2001:db8::/32"), "us"),
        ]
        assert parse_region_distance(settings.region_distance) == {("eu", "us"): 80.0}
        assert (settings.zone, settings.ttl, settings.max_answers) == ("relays.gpumarket.local", 30, 4)

    @pytest.mark.parametrize(
        ("overrides", "message"),
        [
            ({"prefix_regions": {"10.0.0.1/8": "eu"}}, "GPUMARKET_PREFIX_REGIONS"),
            ({"region_distance": {"eu-us": 80}}, "GPUMARKET_REGION_DISTANCE"),
            ({"region_distance": {"eu:us": -1}}, "GPUMARKET_REGION_DISTANCE"),
        ],
    )
    def test_bad_region_settings_are_config_errors(self, overrides: dict[str, Any], message: str) -> None:
        """A prefix with host bits, a distance key without ':' or a negative distance is a ConfigError naming the variable."""
        settings = DnsSettings.load(**overrides)
        with pytest.raises(ConfigError, match=message):
            server_from_settings(settings, MemoryRegistry())

    def test_bad_zone_is_rejected_at_load(self) -> None:
        """A zone that is not a DNS name fails when the settings load."""
        with pytest.raises(ConfigError, match="ZONE"):
            DnsSettings.load(zone="not a zone")
