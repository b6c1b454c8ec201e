"""libFuzzer harness (atheris) for the geo DNS responder: ``GeoDnsServer.handle`` in ``access/geodns/server.py``.

Each input is handled as a UDP datagram and as a TCP message. No exception may escape; a
reply must parse as a DNS message with the query's id and the QR flag, and, over UDP to a
query without EDNS, fit 512 bytes; no query may be answered SERVFAIL (which the server
keeps for its own bugs). libFuzzer's
``-timeout`` and ``-rss_limit_mb`` catch hangs and memory blow-ups.

Run from the repository root, with the test extras installed::

    mkdir -p /tmp/corpus-geodns
    .venv/bin/python fuzz/fuzz_geodns.py -max_total_time=600 -timeout=5 -rss_limit_mb=2048 -keep_seed=1 /tmp/corpus-geodns

An empty corpus directory is first seeded with valid queries (SRV, A, AAAA, SOA, NS, ANY,
AXFR, with and without EDNS Client Subnet). ``tests/test_fuzz_geodns.py`` runs this harness
for a bounded number of runs.
"""

from __future__ import annotations

import ipaddress

import atheris
from harness import fuzz  # fuzz/harness.py: this script's folder is first on sys.path

with atheris.instrument_imports(include=["access", "dns"]):
    import dns.edns
    import dns.flags
    import dns.message
    import dns.rcode

    from access.geodns.server import GeoDnsServer
    from access.geodns.zone import CLASSIC_UDP_PAYLOAD
    from shared.registry import MemoryRegistry, RelayRecord

ZONE = "relays.example.test"
SOURCE = ipaddress.ip_address("198.51.100.7")


def _server() -> GeoDnsServer:
    server = GeoDnsServer(MemoryRegistry(), zone=ZONE, rate_limit=1e9, rate_burst=1e9, nameserver_addresses=["192.0.2.53"])
    server.zone.update([
        RelayRecord(relay_id=relay_id, region=region, url=f"wss://{host}:8443/v1/agent", host=host, port=8443,
                    connections=10, capacity=100, draining=False, updated_at=0.0)
        for relay_id, region, host in (("us-1", "us-east", "192.0.2.1"), ("eu-1", "eu-west", "2001:db8::3"),
                                       ("uw-1", "us-west", "uw1.example.net"))
    ])  # fmt: skip
    return server


SERVER = _server()


def seeds() -> list[bytes]:
    """Valid queries for what the zone answers, refuses and does not implement."""
    queries = [
        dns.message.make_query(f"_gpumarket._tcp.{ZONE}", "SRV"),
        dns.message.make_query(f"_gpumarket._tcp.{ZONE}", "SRV", use_edns=0, options=[dns.edns.ECSOption("198.51.100.0", 24)]),
        dns.message.make_query(ZONE, "A"),
        dns.message.make_query(ZONE, "AAAA", use_edns=0, options=[dns.edns.ECSOption("2001:db8:e0::", 48)]),
        dns.message.make_query(ZONE, "SOA"),
        dns.message.make_query(ZONE, "NS"),
        dns.message.make_query(f"us-1.{ZONE}", "ANY"),
        dns.message.make_query(f"ns.{ZONE}", "A"),
        dns.message.make_query(ZONE, "AXFR"),
        dns.message.make_query("example.com", "A", use_edns=1),
    ]
    return [query.to_wire() for query in queries]


def test_one_input(data: bytes) -> None:
    for transport in ("udp", "tcp"):
        reply = SERVER.handle(data, SOURCE, transport)
        if reply is None:
            continue
        response = dns.message.from_wire(reply)
        query = dns.message.from_wire(data)
        if response.id != query.id or not response.flags & dns.flags.QR:
            raise AssertionError(f"reply {response.id} does not answer query {query.id}")
        if transport == "udp" and query.edns < 0 and len(reply) > CLASSIC_UDP_PAYLOAD:
            raise AssertionError(f"a {len(reply)}-byte UDP reply to a query without EDNS")
        if response.rcode() == dns.rcode.SERVFAIL:
            raise AssertionError("SERVFAIL: the server failed to answer (see the logged traceback)")


if __name__ == "__main__":
    fuzz(seeds, test_one_input)
