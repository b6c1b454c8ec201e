"""Fuzzing the geo DNS: hostile datagrams and streams get an answer for their id, or nothing; never a crash.

``GeoDnsServer.handle`` (request bytes → response bytes or ``None``) is driven directly with
arbitrary bytes and with valid queries built by dnspython, then mutated (flipped, truncated,
extended bytes, hostile header counts, compression-pointer loops). A few properties run over
real UDP and TCP sockets against a server on its own loop thread, including TCP
length-prefix abuse (short reads, a zero or huge length, prefixes split across writes).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import struct
import tracemalloc
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import dns.edns
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from access.geodns.regions import IPAddress
from access.geodns.server import GeoDnsServer
from shared.registry import MemoryRegistry, RelayRecord
from tests.fuzzing import run_atheris_harness
from tests.loopthread import LoopThread

ZONE = "relays.example.test"
SOURCES = [ipaddress.ip_address(a) for a in ("127.0.0.2", "198.51.100.7", "2001:db8:e0::1", "::ffff:203.0.113.9")]
MAX_TCP_MESSAGE = 4096
# Generous: one message is parsed and answered in well under a millisecond; this catches hangs, not slowness.
DEADLINE = timedelta(seconds=2)
FUZZ = settings(max_examples=1000, deadline=DEADLINE, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
SOCKET_FUZZ = settings(max_examples=100, deadline=DEADLINE, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
SOCKET_TIMEOUT = 5.0


def _relay(relay_id: str, region: str, host: str, *, connections: int = 0) -> RelayRecord:
    return RelayRecord(
        relay_id=relay_id, region=region, url=f"wss://{host}:8443/v1/agent", host=host, port=8443,
        connections=connections, capacity=100, draining=False, updated_at=0.0,
    )  # fmt: skip


WORLD = [
    _relay("us-1", "us-east", "192.0.2.1", connections=20),
    _relay("uw-1", "us-west", "uw1.example.net", connections=50),
    _relay("eu-1", "eu-west", "2001:db8::3", connections=10),
]


def _server(**overrides: object) -> GeoDnsServer:
    options: dict[str, object] = {
        "zone": ZONE,
        "nameserver_addresses": ["192.0.2.53"],
        # No rate limit in the way: every fuzzed message reaches the parser.
        "rate_limit": 1e6,
        "rate_burst": 1e6,
        "max_tcp_message": MAX_TCP_MESSAGE,
        **overrides,
    }
    server = GeoDnsServer(MemoryRegistry(), **options)  # type: ignore[arg-type]
    server.zone.update(WORLD)
    return server


@pytest.fixture(scope="module")
def server() -> GeoDnsServer:
    """A server that is never started: ``handle`` is called directly."""
    return _server()


@pytest.fixture(autouse=True, scope="module")
def _quiet_geodns() -> Iterator[None]:
    # Every dropped packet is logged at DEBUG; thousands of them only slow the run down.
    logger = logging.getLogger("access.geodns")
    level = logger.level
    logger.setLevel(logging.INFO)
    yield
    logger.setLevel(level)


# ---- strategies ---------------------------------------------------------------------

NAMES = [
    ZONE, f"_gpumarket._tcp.{ZONE}", f"us-1.{ZONE}", f"eu-1.{ZONE}", f"ns.{ZONE}", f"_tcp.{ZONE}", f"nope.{ZONE}",
    "example.com", "example.test", ".", f"{'a' * 63}.{'b' * 63}.{'c' * 63}.{ZONE}",
]
RDTYPES = [
    dns.rdatatype.A, dns.rdatatype.AAAA, dns.rdatatype.SRV, dns.rdatatype.SOA, dns.rdatatype.NS, dns.rdatatype.ANY,
    dns.rdatatype.AXFR, dns.rdatatype.IXFR, dns.rdatatype.TXT, dns.rdatatype.OPT, dns.rdatatype.TSIG,
    dns.rdatatype.RdataType.make(65280), dns.rdatatype.RdataType.make(65535),
]


def _subnet(draw: st.DrawFn) -> dns.edns.Option:
    if draw(st.booleans()):
        address = str(ipaddress.IPv4Address(draw(st.integers(0, 2**32 - 1))))
        srclen = draw(st.integers(0, 32))
    else:
        address = str(ipaddress.IPv6Address(draw(st.integers(0, 2**128 - 1))))
        srclen = draw(st.integers(0, 128))
    return dns.edns.ECSOption(address, srclen, draw(st.integers(0, srclen)))


@st.composite
def queries(draw: st.DrawFn) -> dns.message.Message:
    """Valid queries: names in and out of the zone, every type we answer and some we refuse, EDNS and ECS."""
    name = draw(st.sampled_from(NAMES) | st.from_regex(r"\A[a-z0-9-]{1,20}\Z").map(lambda label: f"{label}.{ZONE}"))
    rdclass = draw(st.sampled_from([dns.rdataclass.IN, dns.rdataclass.IN, dns.rdataclass.CH, dns.rdataclass.ANY]))
    edns = draw(st.sampled_from([None, None, 0, 0, 0, 1, 255]))
    options: list[dns.edns.Option] = []
    if edns is not None:
        for _ in range(draw(st.integers(0, 2))):
            options.append(_subnet(draw))
        if draw(st.booleans()):
            options.append(dns.edns.GenericOption(dns.edns.OptionType.COOKIE, draw(st.sampled_from([8, 16, 40, 12])) * b"c"))
    query = dns.message.make_query(
        name, draw(st.sampled_from(RDTYPES)), rdclass=rdclass, use_edns=edns, options=options or None,
        payload=draw(st.sampled_from([0, 511, 512, 1232, 4096, 65535])),
    )  # fmt: skip
    query.set_opcode(draw(st.sampled_from([dns.opcode.QUERY] * 6 + [dns.opcode.NOTIFY, dns.opcode.UPDATE, dns.opcode.IQUERY])))
    query.flags |= draw(st.sampled_from([0, dns.flags.RD, dns.flags.AD | dns.flags.CD, dns.flags.TC]))
    for extra in range(draw(st.integers(0, 40)) if draw(st.integers(0, 4)) == 0 else 0):  # several questions: FORMERR
        query.find_rrset(
            query.question, dns.name.from_text(f"q{extra}-{'x' * 20}.example.com"), dns.rdataclass.IN, dns.rdatatype.A,
            create=True, force_unique=True,
        )  # fmt: skip
    return query


@st.composite
def mutated(draw: st.DrawFn, wire: bytes) -> bytes:
    """``wire`` with a few byte-level mutations: flips, truncation, insertion, extension, hostile header fields."""
    data = bytearray(wire)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "extend", "count", "pointer", "label"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif kind == "truncate":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "extend":
            data += draw(st.binary(min_size=1, max_size=64)) * draw(st.integers(1, 8))
        elif kind == "count" and len(data) >= 12:  # QDCOUNT/ANCOUNT/NSCOUNT/ARCOUNT
            field = 4 + 2 * draw(st.integers(0, 3))
            data[field : field + 2] = struct.pack("!H", draw(st.sampled_from([0, 2, 255, 0x7FFF, 0xFFFF])))
        elif kind == "pointer":  # a compression pointer to itself, to the header, or past the end
            data[at:at] = struct.pack("!H", 0xC000 | draw(st.sampled_from([at, 0, 12, 0x3FFF])))
        elif kind == "label":  # a label length running past the end, or a reserved 0x40/0x80 label type
            data[at:at] = bytes([draw(st.sampled_from([63, 64, 0x41, 0x80, 0xFF]))])
    return bytes(data)


@st.composite
def hostile_messages(draw: st.DrawFn) -> bytes:
    """Arbitrary bytes, valid queries, and valid queries mutated."""
    choice = draw(st.integers(0, 4))
    if choice == 0:
        return draw(st.binary(max_size=1500))
    wire = draw(queries()).to_wire(max_size=65_535)
    return wire if choice <= 2 else draw(mutated(wire))


# ---- properties ---------------------------------------------------------------------


def _query_id(wire: bytes) -> int:
    return int.from_bytes(wire[:2], "big")


def check_reply(server: GeoDnsServer, wire: bytes, source: IPAddress, transport: str) -> dns.message.Message | None:
    """Handle ``wire``; a reply must parse, answer the query's id, carry QR and fit the transport."""
    reply = server.handle(wire, source, "udp" if transport == "udp" else "tcp")
    if reply is None:
        return None
    parsed = dns.message.from_wire(reply)
    query = dns.message.from_wire(wire)  # only a query that parsed is answered
    assert parsed.id == query.id == _query_id(wire)
    assert parsed.flags & dns.flags.QR
    assert parsed.question in ([], query.question)
    if transport == "udp":
        limit = min(max(query.payload, 512), server.max_udp_response) if query.edns >= 0 else 512
        assert len(reply) <= limit
    else:
        assert len(reply) <= 65_535
    return parsed


class TestHandleDirectly:
    @FUZZ
    @given(wire=hostile_messages(), source=st.sampled_from(SOURCES), transport=st.sampled_from(["udp", "tcp"]))
    def test_any_message_gets_a_well_formed_reply_for_its_id_or_none(
        self, server: GeoDnsServer, wire: bytes, source: IPAddress, transport: str
    ) -> None:
        """No exception escapes ``handle``; a reply parses as DNS with the query's id; nothing is a SERVFAIL (a bug)."""
        check_reply(server, wire, source, transport)
        assert server.stats["servfail"] == 0

    @FUZZ
    @given(wire=st.binary(max_size=2048))
    def test_arbitrary_bytes_never_escape(self, server: GeoDnsServer, wire: bytes) -> None:
        """Random bytes are dropped or answered, over either transport."""
        for transport in ("udp", "tcp"):
            check_reply(server, wire, SOURCES[0], transport)

    @settings(max_examples=100, deadline=DEADLINE, derandomize=True)
    @given(wire=hostile_messages())
    def test_memory_per_message_is_bounded(self, server: GeoDnsServer, wire: bytes) -> None:
        """Answering one message of at most a few KiB allocates well under 1 MiB at its peak."""
        tracemalloc.start()
        try:
            server.handle(wire, SOURCES[0], "tcp")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < (1 << 20)

    def test_many_questions_that_do_not_fit_512_bytes_get_a_truncated_answer(self) -> None:
        """Regression: a 978-byte query with 31 questions made ``handle`` raise TooBig (its FORMERR echoed them all).

        Neither the answer nor the SERVFAIL fallback fit 512 bytes, so the exception escaped
        into the UDP protocol callback and the client got nothing.
        """
        server = _server()
        query = dns.message.make_query(ZONE, "A")
        for n in range(30):
            query.find_rrset(
                query.question, dns.name.from_text(f"n{n:03}-abcdefghijklmnopqrs.example.com"), dns.rdataclass.IN,
                dns.rdatatype.A, create=True, force_unique=True,
            )  # fmt: skip
        wire = query.to_wire()
        assert len(wire) == 978
        reply = check_reply(server, wire, SOURCES[0], "udp")
        assert reply is not None
        assert reply.rcode() == dns.rcode.FORMERR
        assert reply.flags & dns.flags.TC
        assert server.stats["servfail"] == 0


# ---- over real sockets ----------------------------------------------------------------


@pytest.fixture(scope="module")
def live() -> Iterator[GeoDnsServer]:
    """A started server on 127.0.0.1 (its own loop thread); short TCP idle timeout."""
    with LoopThread() as thread:
        server = _server(tcp_idle_timeout=0.5)
        thread.run(server.start())
        try:
            yield server
        finally:
            thread.run(server.close())


def _probe() -> dns.message.Message:
    return dns.message.make_query(f"_gpumarket._tcp.{ZONE}", "SRV")


def _ask_tcp(server: GeoDnsServer, query: dns.message.Message) -> dns.message.Message:
    with socket.create_connection(("127.0.0.1", server.port), timeout=SOCKET_TIMEOUT) as conn:
        wire = query.to_wire()
        conn.sendall(struct.pack("!H", len(wire)) + wire)
        return dns.message.from_wire(_read_message(conn))


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError(f"connection closed after {len(data)} of {size} bytes")
        data += chunk
    return data


def _read_message(conn: socket.socket) -> bytes:
    (length,) = struct.unpack("!H", _read_exactly(conn, 2))
    return _read_exactly(conn, length)


def _read_to_eof(conn: socket.socket) -> bytes:
    data = b""
    while chunk := conn.recv(65_536):
        data += chunk
    return data


def _split_replies(stream: bytes) -> list[bytes]:
    replies = []
    while stream:
        (length,) = struct.unpack("!H", stream[:2])
        assert len(stream) >= 2 + length, "a reply was cut short"
        replies.append(stream[2 : 2 + length])
        stream = stream[2 + length :]
    return replies


class TestOverSockets:
    @SOCKET_FUZZ
    @given(wire=hostile_messages())
    def test_udp_datagram_then_the_server_still_answers(self, live: GeoDnsServer, wire: bytes) -> None:
        """Whatever datagram arrives, anything sent back answers its id, and the next query is answered."""
        probe = _probe()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as conn:
            conn.settimeout(SOCKET_TIMEOUT)
            conn.connect(("127.0.0.1", live.port))
            conn.send(wire)
            conn.send(probe.to_wire())
            while True:
                reply = dns.message.from_wire(conn.recv(65_535))
                if reply.id == probe.id and reply.question == probe.question:
                    break
                assert reply.id == _query_id(wire)
        assert reply.rcode() == dns.rcode.NOERROR
        assert live.stats["servfail"] == 0

    @SOCKET_FUZZ
    @given(
        chunks=st.lists(
            st.one_of(
                hostile_messages().map(lambda wire: struct.pack("!H", len(wire)) + wire),  # framed
                queries().map(lambda query: query.to_wire(max_size=65_535)).map(lambda wire: struct.pack("!H", len(wire)) + wire),
                st.binary(max_size=64),  # raw garbage, a lone prefix byte, a short body
                st.sampled_from([b"\x00\x00", b"\xff\xff", struct.pack("!H", MAX_TCP_MESSAGE + 1), b"\x00"]),
            ),
            min_size=1,
            max_size=4,
        )
    )
    def test_tcp_stream_is_answered_in_order_or_closed(self, live: GeoDnsServer, chunks: list[bytes]) -> None:
        """A TCP stream of framed, unframed and mis-framed messages gets in-order replies, then EOF; never a hang."""
        stream = b"".join(chunks)
        received = b""
        with socket.create_connection(("127.0.0.1", live.port), timeout=SOCKET_TIMEOUT) as conn:
            # The server may close (or reset) the connection at the first thing it refuses, before
            # the rest is written or its replies are read: what did arrive must still be in order.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                for chunk in chunks:  # one write per chunk: prefixes and bodies split across segments
                    conn.sendall(chunk)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_WR)  # a short read then ends at once, not after the idle timeout
            with contextlib.suppress(ConnectionResetError):
                received = _read_to_eof(conn)
        sent_ids = _framed_ids(stream)
        replies = _split_replies(received)
        assert len(replies) <= len(sent_ids)
        for reply, query_id in zip(replies, sent_ids, strict=False):
            assert dns.message.from_wire(reply).id == query_id
        assert _ask_tcp(live, _probe()).rcode() == dns.rcode.NOERROR
        assert live.stats["servfail"] == 0

    @pytest.mark.parametrize(
        "prefix",
        [b"\x00", b"\x00\x00", b"\xff\xff", struct.pack("!H", MAX_TCP_MESSAGE + 1), struct.pack("!H", 100) + b"short"],
        ids=["half-prefix", "zero-length", "huge-length", "over-the-limit", "short-body"],
    )
    def test_length_prefix_abuse_closes_the_connection_without_a_reply(self, live: GeoDnsServer, prefix: bytes) -> None:
        """A half prefix, a zero or over-limit length, or a body shorter than announced: closed, nothing sent back."""
        with socket.create_connection(("127.0.0.1", live.port), timeout=SOCKET_TIMEOUT) as conn:
            conn.sendall(prefix)
            conn.shutdown(socket.SHUT_WR)
            assert _read_to_eof(conn) == b""
        assert _ask_tcp(live, _probe()).rcode() == dns.rcode.NOERROR

    def test_prefix_split_across_writes_and_pipelined_queries_are_answered(self, live: GeoDnsServer) -> None:
        """A length prefix sent one byte at a time, then two queries in one write: three answers, in order."""
        first, second, third = _probe(), _probe(), dns.message.make_query(ZONE, "SOA")
        with socket.create_connection(("127.0.0.1", live.port), timeout=SOCKET_TIMEOUT) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wire = first.to_wire()
            framed = struct.pack("!H", len(wire)) + wire
            for byte in framed[:3]:
                conn.sendall(bytes([byte]))
            conn.sendall(framed[3:])
            conn.sendall(b"".join(struct.pack("!H", len(w)) + w for w in (second.to_wire(), third.to_wire())))
            ids = [dns.message.from_wire(_read_message(conn)).id for _ in range(3)]
        assert ids == [first.id, second.id, third.id]


def _framed_ids(stream: bytes) -> list[int]:
    """The ids of the messages the server reads from ``stream`` before it would stop (as ``_serve_tcp`` frames it)."""
    ids = []
    while len(stream) >= 2:
        (length,) = struct.unpack("!H", stream[:2])
        if length == 0 or length > MAX_TCP_MESSAGE or len(stream) < 2 + length:
            break
        body = stream[2 : 2 + length]
        try:
            query = dns.message.from_wire(body)
        except Exception:
            break  # garbage on a stream: the server closes the connection
        if query.flags & dns.flags.QR:
            break
        ids.append(query.id)
        stream = stream[2 + length :]
    return ids


class TestAtherisHarness:
    def test_fuzz_geodns_runs_clean(self, tmp_path: Path) -> None:
        """fuzz/fuzz_geodns.py handles 20 000 libFuzzer inputs grown from valid queries without a failure."""
        run_atheris_harness("fuzz_geodns.py", tmp_path, runs=20_000, options=("-max_len=4096",))
