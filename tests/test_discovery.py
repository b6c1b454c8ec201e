"""Relay discovery: SRV/A/AAAA resolution against a real DNS server on loopback,
TCP latency probes against real sockets, and the agent's failover order."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import socket
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

import dns.asyncquery
import dns.message
import dns.rcode
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import pytest
from dns.rdtypes.IN.SRV import SRV

from agent.discovery import (
    Probe,
    RelayCandidate,
    RelayDirectory,
    order_srv,
    probe_latency,
    rank_candidates,
    resolve_relays,
)
from shared.crypto import CertificateAuthority, client_ssl_context, server_ssl_context
from shared.errors import ConfigError
from tests.dnsserver import LoopbackDnsServer, ReceivedQuery
from tests.factories import MS

ZONE = "relays.example.test"
SRV_NAME = f"_gpumarket._tcp.{ZONE}"
SHORT_TIMEOUT = 200 * MS  # how long a test waits for a DNS server that never answers


@pytest.fixture
async def dns_server() -> AsyncIterator[LoopbackDnsServer]:
    async with LoopbackDnsServer() as server:
        yield server


@pytest.fixture
def silent_udp_port() -> Iterator[int]:
    """A UDP port on loopback where a socket is bound but never reads, so queries go unanswered."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture
async def listening_port() -> AsyncIterator[int]:
    """A TCP port on loopback that accepts connections (and closes them)."""

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A TCP port on loopback that refuses connections: bound (so nobody else takes it) but not listening."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def candidate(
    host: str,
    *,
    port: int = 8443,
    priority: int = 0,
    weight: int = 0,
    source: Literal["srv", "a", "static"] = "srv",
) -> RelayCandidate:
    return RelayCandidate(
        url=f"wss://{host}:{port}/v1/agent",
        host=host,
        port=port,
        priority=priority,
        weight=weight,
        source=source,
    )


def latencies(by_host: Mapping[str, float | None]) -> Probe:
    """A probe that reports the given latency per host, without touching the network."""

    async def probe(relay: RelayCandidate) -> float | None:
        return by_host[relay.host]

    return probe


def srv(text: str) -> SRV:
    record = dns.rdata.from_text(dns.rdataclass.IN, dns.rdatatype.SRV, text)
    assert isinstance(record, SRV)
    return record


class FakeClock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def fixed_latency(relay: RelayCandidate) -> float | None:
    return 1 * MS


class TestLoopbackDnsServer:
    async def test_answers_over_tcp_as_well_as_udp(self, dns_server: LoopbackDnsServer) -> None:
        """A query over TCP on the same port gets the same authoritative answer as over UDP."""
        dns_server.set_records("relay1.example.test", "A", ["127.0.0.7"])
        query = dns.message.make_query("relay1.example.test", "A")
        over_udp = await dns.asyncquery.udp(query, "127.0.0.1", port=dns_server.port, timeout=5)
        over_tcp = await dns.asyncquery.tcp(query, "127.0.0.1", port=dns_server.port, timeout=5)
        for response in (over_udp, over_tcp):
            assert [rdata.to_text() for rdata in response.answer[0]] == ["127.0.0.7"]
        assert [q.transport for q in dns_server.queries] == ["udp", "tcp"]

    async def test_distinguishes_nxdomain_from_no_data(self, dns_server: LoopbackDnsServer) -> None:
        """A name with other record types is NOERROR with no answer; an unknown name is NXDOMAIN."""
        dns_server.set_records("relay1.example.test", "A", ["127.0.0.7"])
        no_data = await dns.asyncquery.udp(
            dns.message.make_query("relay1.example.test", "AAAA"),
            "127.0.0.1",
            port=dns_server.port,
            timeout=5,
        )
        unknown = await dns.asyncquery.udp(
            dns.message.make_query("relay2.example.test", "A"), "127.0.0.1", port=dns_server.port, timeout=5
        )
        assert (no_data.rcode(), no_data.answer) == (dns.rcode.NOERROR, [])
        assert unknown.rcode() == dns.rcode.NXDOMAIN


class TestResolveRelays:
    async def test_orders_srv_records_by_priority(self, dns_server: LoopbackDnsServer) -> None:
        """SRV records come back as wss:// URLs, lowest priority first, targets without the trailing dot."""
        dns_server.set_records(
            SRV_NAME,
            "SRV",
            [
                "20 5 9443 relay2.example.test.",
                "10 5 8443 relay1.example.test.",
                "30 5 7443 relay3.example.test.",
            ],
        )
        relays = await resolve_relays(ZONE, resolver="127.0.0.1", resolver_port=dns_server.port, timeout=5)
        assert relays == [
            RelayCandidate(
                "wss://relay1.example.test:8443/v1/agent", "relay1.example.test", 8443, 10, 5, "srv"
            ),
            RelayCandidate(
                "wss://relay2.example.test:9443/v1/agent", "relay2.example.test", 9443, 20, 5, "srv"
            ),
            RelayCandidate(
                "wss://relay3.example.test:7443/v1/agent", "relay3.example.test", 7443, 30, 5, "srv"
            ),
        ]
        assert ReceivedQuery("udp", SRV_NAME + ".", "SRV") in dns_server.queries

    async def test_heavier_weight_comes_first_more_often(self, dns_server: LoopbackDnsServer) -> None:
        """Within one priority, over many seeded draws, the weight-90 relay leads far more often than the weight-10 one."""
        dns_server.set_records(
            SRV_NAME, "SRV", ["10 90 8443 heavy.example.test.", "10 10 8443 light.example.test."]
        )
        rng = random.Random(20240601)
        firsts: Counter[str] = Counter()
        for _ in range(200):
            relays = await resolve_relays(
                ZONE, resolver="127.0.0.1", resolver_port=dns_server.port, timeout=5, rng=rng
            )
            assert {relay.host for relay in relays} == {"heavy.example.test", "light.example.test"}
            firsts[relays[0].host] += 1
        assert firsts["heavy.example.test"] > 2 * firsts["light.example.test"]
        assert firsts["light.example.test"] > 0

    def test_weight_zero_gets_a_small_chance(self) -> None:
        """A weight-0 record next to a weight-100 one is picked first rarely, but not never (RFC 2782)."""
        records = [srv("0 0 8443 zero.example.test."), srv("0 100 8443 full.example.test.")]
        rng = random.Random(7)
        zero_first = sum(order_srv(records, rng)[0].weight == 0 for _ in range(5000))
        assert 0 < zero_first < 500

    async def test_many_records_arrive_over_tcp_and_are_capped(self, dns_server: LoopbackDnsServer) -> None:
        """An SRV answer too big for UDP is fetched again over TCP, and the result is cut to max_candidates."""
        dns_server.set_records(
            SRV_NAME, "SRV", [f"{index} 1 8443 relay{index:02d}.example.test." for index in range(40)]
        )
        relays = await resolve_relays(
            ZONE, resolver="127.0.0.1", resolver_port=dns_server.port, timeout=5, max_candidates=32
        )
        assert [relay.host for relay in relays] == [f"relay{index:02d}.example.test" for index in range(32)]
        assert [query.transport for query in dns_server.queries] == ["udp", "tcp"]

    @pytest.mark.parametrize("srv_state", ["nxdomain", "no-data"])
    async def test_falls_back_to_a_and_aaaa_without_srv(
        self, dns_server: LoopbackDnsServer, srv_state: str
    ) -> None:
        """Without SRV records the zone's own addresses are used on the default port, IPv6 in brackets."""
        dns_server.set_records(ZONE, "A", ["127.0.0.1"])
        dns_server.set_records(ZONE, "AAAA", ["::1"])
        if srv_state == "no-data":
            dns_server.set_records(SRV_NAME, "SRV", [])
        relays = await resolve_relays(
            ZONE, resolver="127.0.0.1", resolver_port=dns_server.port, timeout=5, default_port=9443
        )
        assert relays == [
            RelayCandidate("wss://127.0.0.1:9443/v1/agent", "127.0.0.1", 9443, 0, 0, "a"),
            RelayCandidate("wss://[::1]:9443/v1/agent", "::1", 9443, 0, 0, "a"),
        ]

    async def test_raises_config_error_naming_the_zone_when_nothing_resolves(
        self, dns_server: LoopbackDnsServer
    ) -> None:
        """With no SRV, A or AAAA record the error names the zone, the records tried and what to check."""
        with pytest.raises(ConfigError) as raised:
            await resolve_relays(ZONE, resolver="127.0.0.1", resolver_port=dns_server.port, timeout=5)
        message = str(raised.value)
        assert ZONE in message
        assert SRV_NAME in message
        assert "A or AAAA" in message
        assert "check relay_zone" in message
        assert raised.value.code == "relay_dns_not_found"

    async def test_srv_target_dot_means_no_relays(self, dns_server: LoopbackDnsServer) -> None:
        """An SRV record whose target is '.' says the service is not offered, and that is an error, not a fallback."""
        dns_server.set_records(SRV_NAME, "SRV", ["0 0 0 ."])
        dns_server.set_records(ZONE, "A", ["127.0.0.1"])
        with pytest.raises(ConfigError, match="no relays"):
            await resolve_relays(ZONE, resolver="127.0.0.1", resolver_port=dns_server.port, timeout=5)

    async def test_server_failure_is_a_config_error(self, dns_server: LoopbackDnsServer) -> None:
        """SERVFAIL from the DNS server is reported as ConfigError naming the server, not a dnspython exception."""
        dns_server.set_rcode(SRV_NAME, dns.rcode.SERVFAIL)
        with pytest.raises(ConfigError, match=f"DNS server 127.0.0.1 port {dns_server.port}") as raised:
            await resolve_relays(ZONE, resolver="127.0.0.1", resolver_port=dns_server.port, timeout=5)
        assert raised.value.code == "relay_dns_failed"

    async def test_unresponsive_dns_server_times_out_with_config_error(self, silent_udp_port: int) -> None:
        """A DNS server that never answers gives ConfigError "did not answer" once the timeout has passed."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(ConfigError, match="did not answer") as raised:
            await resolve_relays(
                ZONE, resolver="127.0.0.1", resolver_port=silent_udp_port, timeout=SHORT_TIMEOUT
            )
        assert loop.time() - started < SHORT_TIMEOUT + 500 * MS
        assert ZONE in str(raised.value)
        assert raised.value.code == "relay_dns_timeout"

    async def test_dropped_queries_time_out_too(self, dns_server: LoopbackDnsServer) -> None:
        """The loopback server's drop_queries mode reads as an unresponsive server."""
        dns_server.drop_queries = True
        with pytest.raises(ConfigError, match="did not answer"):
            await resolve_relays(
                ZONE, resolver="127.0.0.1", resolver_port=dns_server.port, timeout=SHORT_TIMEOUT
            )
        assert dns_server.queries  # it was asked, and kept quiet

    async def test_rejects_a_resolver_that_is_not_an_address(self) -> None:
        """A resolver given as a host name is a ConfigError, since dnspython needs an address."""
        with pytest.raises(ConfigError, match="not an IP address"):
            await resolve_relays(ZONE, resolver="dns.example.test", timeout=SHORT_TIMEOUT)


class TestProbeLatency:
    async def test_measures_a_listening_socket(self, listening_port: int) -> None:
        """A TCP connect to a listening socket gives a latency in seconds, well under the timeout."""
        latency = await probe_latency(
            candidate("127.0.0.1", port=listening_port), ssl_context=None, timeout=5
        )
        assert isinstance(latency, float)
        assert 0 <= latency < 5

    async def test_closed_port_is_unreachable(self, closed_port: int) -> None:
        """A refused connection makes the candidate unreachable (None)."""
        assert (
            await probe_latency(candidate("127.0.0.1", port=closed_port), ssl_context=None, timeout=5) is None
        )

    async def test_times_the_tls_handshake_when_given_a_context(self, tmp_path: Path) -> None:
        """With an SSL context the probe completes a TLS handshake, and a certificate it does not trust is unreachable."""
        ca = CertificateAuthority.load_or_create(tmp_path / "ca")
        key_pem, cert_pem = ca.issue_server_certificate(["127.0.0.1"])
        (tmp_path / "relay.key").write_bytes(key_pem)
        (tmp_path / "relay.crt").write_bytes(cert_pem)
        ca_file = ca.cert_path
        server_context = server_ssl_context(
            tmp_path / "relay.crt", tmp_path / "relay.key", ca_file, require_client_cert=False
        )

        async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        server = await asyncio.start_server(hang_up, "127.0.0.1", 0, ssl=server_context)
        async with server:
            port = server.sockets[0].getsockname()[1]
            client_context = client_ssl_context(ca_file)
            by_address = await probe_latency(
                candidate("127.0.0.1", port=port), ssl_context=client_context, timeout=5
            )
            untrusting_context = client_ssl_context(
                CertificateAuthority.load_or_create(tmp_path / "other-ca").cert_path
            )
            by_untrusting_client = await probe_latency(
                candidate("127.0.0.1", port=port), ssl_context=untrusting_context, attempts=1, timeout=5
            )
        assert isinstance(by_address, float)
        assert by_untrusting_client is None


class TestRankCandidates:
    async def test_reachable_before_unreachable(self, listening_port: int, closed_port: int) -> None:
        """With real probes, a relay that accepts connections goes ahead of one that refuses, at equal priority."""
        refusing = candidate("127.0.0.1", port=closed_port)
        accepting = candidate("127.0.0.1", port=listening_port)
        assert await rank_candidates([refusing, accepting]) == [accepting, refusing]

    async def test_priority_before_latency_and_unreachable_last_in_given_order(self) -> None:
        """Order is by priority, then latency; unreachable relays go last, in the order they came."""
        fast_backup = candidate("fast-backup", priority=20)
        slow_primary = candidate("slow-primary", priority=10)
        quick_primary = candidate("quick-primary", priority=10)
        down_a = candidate("down-a", priority=0)
        down_b = candidate("down-b", priority=30)
        probe = latencies(
            {
                "fast-backup": 1 * MS,
                "slow-primary": 90 * MS,
                "quick-primary": 5 * MS,
                "down-a": None,
                "down-b": None,
            }
        )
        ranked = await rank_candidates(
            [down_a, fast_backup, slow_primary, down_b, quick_primary], probe=probe
        )
        assert ranked == [quick_primary, slow_primary, fast_backup, down_a, down_b]

    async def test_probes_at_most_concurrency_at_once(self) -> None:
        """No more than `concurrency` probes run at the same time."""
        running = 0
        most = 0

        async def probe(relay: RelayCandidate) -> float | None:
            nonlocal running, most
            running += 1
            most = max(most, running)
            for _ in range(5):
                await asyncio.sleep(0)
            running -= 1
            return 1 * MS

        relays = [candidate(f"relay{index}") for index in range(7)]
        assert await rank_candidates(relays, probe=probe, concurrency=2) == relays
        assert most == 2


class TestRelayDirectory:
    @pytest.fixture
    def three_relays(self, dns_server: LoopbackDnsServer) -> LoopbackDnsServer:
        dns_server.set_records(
            SRV_NAME,
            "SRV",
            [
                "10 1 8443 relay1.example.test.",
                "20 1 8443 relay2.example.test.",
                "30 1 8443 relay3.example.test.",
            ],
        )
        return dns_server

    @staticmethod
    def directory(
        server: LoopbackDnsServer, clock: FakeClock, *, static_urls: Sequence[str] = ()
    ) -> RelayDirectory:
        return RelayDirectory(
            zone=ZONE,
            static_urls=static_urls,
            resolver="127.0.0.1",
            resolver_port=server.port,
            dns_timeout=5.0,
            refresh_interval=300.0,
            failure_cooldown=30.0,
            probe=fixed_latency,
            clock=clock,
        )

    async def test_next_starts_with_the_best_and_fails_over_after_mark_failed(
        self, three_relays: LoopbackDnsServer
    ) -> None:
        """next() gives the best relay until it is marked failed, then the next one in order."""
        clock = FakeClock()
        directory = self.directory(three_relays, clock)
        await directory.refresh()
        assert directory.next() == directory.next() == "wss://relay1.example.test:8443/v1/agent"
        directory.mark_failed("wss://relay1.example.test:8443/v1/agent")
        assert directory.next() == "wss://relay2.example.test:8443/v1/agent"
        directory.mark_draining("wss://relay2.example.test:8443/v1/agent")
        assert directory.next() == "wss://relay3.example.test:8443/v1/agent"

    async def test_next_cycles_back_when_all_failed(self, three_relays: LoopbackDnsServer) -> None:
        """When every relay failed within the cooldown, next() goes round the list, oldest failure first."""
        clock = FakeClock()
        directory = self.directory(three_relays, clock)
        await directory.refresh()
        seen = []
        for _ in range(5):
            url = directory.next()
            seen.append(url.split("//")[1].split(".")[0])
            directory.mark_failed(url)  # the clock does not move: order comes from the failures' order
        assert seen == ["relay1", "relay2", "relay3", "relay1", "relay2"]

    async def test_next_returns_to_a_better_relay_after_its_cooldown(
        self, three_relays: LoopbackDnsServer
    ) -> None:
        """A failed relay is skipped for failure_cooldown seconds, then preferred again."""
        clock = FakeClock()
        directory = self.directory(three_relays, clock)
        await directory.refresh()
        directory.mark_failed("wss://relay1.example.test:8443/v1/agent")
        clock.now += 29.0
        assert directory.next() == "wss://relay2.example.test:8443/v1/agent"
        clock.now += 1.0
        assert directory.next() == "wss://relay1.example.test:8443/v1/agent"

    async def test_keeps_the_old_list_when_a_refresh_fails(
        self, three_relays: LoopbackDnsServer, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A refresh whose resolution fails logs a warning and leaves the known relays in place."""
        clock = FakeClock()
        directory = self.directory(three_relays, clock)
        await directory.refresh()
        known = directory.candidates
        three_relays.remove_records(SRV_NAME, "SRV")
        clock.now += 300.0
        with caplog.at_level(logging.WARNING, logger="agent.discovery"):
            await directory.refresh()
        assert directory.candidates == known
        assert directory.next() == "wss://relay1.example.test:8443/v1/agent"
        assert "keeping the 3 known relays" in caplog.text
        assert not directory.needs_refresh()  # a failed attempt waits a full interval too

    async def test_re_resolves_after_the_refresh_interval(self, three_relays: LoopbackDnsServer) -> None:
        """needs_refresh() turns true once refresh_interval has passed, and the next refresh sees new records."""
        clock = FakeClock()
        directory = self.directory(three_relays, clock)
        assert directory.needs_refresh()
        await directory.refresh()
        assert not directory.needs_refresh()
        three_relays.set_records(
            SRV_NAME, "SRV", ["5 1 8443 relay9.example.test.", "10 1 8443 relay1.example.test."]
        )
        clock.now += 299.0
        assert not directory.needs_refresh()
        assert directory.next() == "wss://relay1.example.test:8443/v1/agent"
        clock.now += 1.0
        assert directory.needs_refresh()
        await directory.refresh()
        assert directory.next() == "wss://relay9.example.test:8443/v1/agent"
        assert [relay.host for relay in directory.candidates] == [
            "relay9.example.test",
            "relay1.example.test",
        ]

    async def test_asks_again_soon_when_every_known_relay_failed(self, three_relays: LoopbackDnsServer) -> None:
        """A relay that died is replaced by another in the DNS: once all known ones failed, the agent looks
        again after ``failed_refresh_interval``, not a whole ``refresh_interval``."""
        clock = FakeClock()
        directory = self.directory(three_relays, clock)
        await directory.refresh()
        for candidate in directory.candidates[:2]:
            directory.mark_failed(candidate.url)
        clock.now += 10.0
        assert not directory.needs_refresh()  # one relay is still good
        await directory.refresh()
        clock.now += 1.0
        for candidate in directory.candidates:
            directory.mark_failed(candidate.url)
        assert not directory.needs_refresh()  # not before failed_refresh_interval since the last look
        three_relays.set_records(SRV_NAME, "SRV", ["5 1 8443 relay9.example.test."])
        clock.now += 4.0
        assert directory.needs_refresh()
        await directory.refresh()
        assert directory.next() == "wss://relay9.example.test:8443/v1/agent"

    async def test_first_refresh_without_any_relay_raises(self, dns_server: LoopbackDnsServer) -> None:
        """With nothing resolvable and no static URLs, refresh() raises ConfigError and next() has nothing to give."""
        directory = self.directory(dns_server, FakeClock())
        with pytest.raises(ConfigError, match=ZONE):
            await directory.refresh()
        assert directory.needs_refresh()
        with pytest.raises(ConfigError, match="no relay known"):
            directory.next()

    async def test_static_urls_stand_in_until_the_zone_resolves(self, dns_server: LoopbackDnsServer) -> None:
        """With a zone that does not resolve yet, the static URLs are kept as the list."""
        directory = self.directory(
            dns_server, FakeClock(), static_urls=["wss://fallback.example.test/v1/agent"]
        )
        await directory.refresh()
        assert directory.next() == "wss://fallback.example.test/v1/agent"

    async def test_static_urls_without_zone_keep_their_order_unreachable_last(self) -> None:
        """Without a zone, static URLs are ranked in their configured order, unreachable ones moved last."""
        probe = latencies(
            {"one.example.test": None, "two.example.test": 50 * MS, "three.example.test": 1 * MS}
        )
        directory = RelayDirectory(
            zone=None,
            static_urls=[
                "wss://one.example.test/v1/agent",
                "wss://two.example.test:9443/v1/agent",
                "wss://three.example.test/v1/agent",
            ],
            probe=probe,
            clock=FakeClock(),
        )
        await directory.refresh()
        assert [relay.url for relay in directory.candidates] == [
            "wss://two.example.test:9443/v1/agent",
            "wss://three.example.test/v1/agent",
            "wss://one.example.test/v1/agent",
        ]
        assert [relay.port for relay in directory.candidates] == [9443, 443, 443]
        assert {relay.source for relay in directory.candidates} == {"static"}

    def test_needs_a_zone_or_static_urls(self) -> None:
        """A directory with neither a zone nor static URLs is a configuration error."""
        with pytest.raises(ConfigError, match="relay_zone"):
            RelayDirectory(zone=None, static_urls=[])

    def test_rejects_a_static_url_that_is_not_a_websocket_url(self) -> None:
        """A static URL must be ws:// or wss:// with a host."""
        with pytest.raises(ConfigError, match=re.escape("https://relay.example.test")):
            RelayDirectory(zone=None, static_urls=["https://relay.example.test"])
