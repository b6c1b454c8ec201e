"""A browser's HTTP through the relay's web ports (``access/webports.py``) against the same app served directly.

The path measured: a TLS connection to ``WebPorts`` (a session cookie, as a browser holds after the
sign-in redirect) → a stream on a host's agent link (``shared.streams``, the two multiplexers fed to
each other in memory, as ``tests/test_stream_link.py`` does) → a small HTTP/1.1 app on the agent's
side of the stream. The baseline is the same app and the same client over a direct TLS connection on
loopback. Everything shares this process and its event loop, so the figures are a lower bound.

Figures:

1. Download: one ``GET`` whose answer is ``--mb`` MiB (``Content-Length``, written in 64 KiB pieces),
   ``--rounds`` times on one keep-alive connection, median MB/s.
2. Keep-alive requests: ``--requests`` small ``GET`` (2-byte answers) one after the other on one
   connection, requests per second.

Usage: ``python bench/bench_webports.py [--mb N] [--requests N] [--rounds R] [--quick]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import describe_machine, record

from access.webports import WebPorts
from shared.clock import SystemClock
from shared.crypto import CertificateAuthority, certificate_public_key, web_ssl_context
from shared.crypto.tokens import new_claims
from shared.streams import Multiplexer
from shared.streams.aio import Channel, StreamLink

MB = 1 << 20
PIECE = 64 * 1024
RENTAL, HOST, DOMAIN = "r-0123456789abcdef", "h-1", "ports.bench"
LABEL = f"{RENTAL}-8000.{DOMAIN}"

Read = Callable[[int], Awaitable[bytes]]
Write = Callable[[bytes], Awaitable[None]]


async def serve_app(read: Read, write: Write, big: int) -> None:
    """A keep-alive HTTP/1.1 app: ``/big`` answers ``big`` bytes, anything else two. GETs only (no request bodies)."""
    buffer = b""
    body = os.urandom(PIECE)
    while True:
        while b"\r\n\r\n" not in buffer:
            data = await read(PIECE)
            if not data:
                return
            buffer += data
        head, _, buffer = buffer.partition(b"\r\n\r\n")
        if head.split(b" ", 2)[1] == b"/big":
            await write(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n" % big)
            for offset in range(0, big, PIECE):
                await write(body[: min(PIECE, big - offset)])
        else:
            await write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nSet-Cookie: a=1; Path=/\r\nContent-Length: 2\r\n\r\nok")


async def fetch(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str, cookie: str) -> int:
    """One GET on an open connection; the body's length (read and dropped)."""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {LABEL}\r\nCookie: theme=dark; {cookie}\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    left = length
    while left:
        left -= len(await reader.read(min(left, 1 << 20)))
    return length


async def measure(port: int, client: ssl.SSLContext, cookie: str, *, big: int, requests: int, rounds: int) -> tuple[float, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname=LABEL, limit=1 << 20)
    try:
        seconds = []
        for _ in range(rounds):
            started = time.perf_counter()
            assert await fetch(reader, writer, "/big", cookie) == big
            seconds.append(time.perf_counter() - started)
        started = time.perf_counter()
        for _ in range(requests):
            await fetch(reader, writer, "/small", cookie)
        per_second = requests / (time.perf_counter() - started)
    finally:
        writer.close()
    return big / MB / statistics.median(seconds), per_second


async def run(args: argparse.Namespace) -> None:
    big = args.mb * MB
    with tempfile.TemporaryDirectory() as tmp:
        ca = CertificateAuthority.load_or_create(Path(tmp) / "ca")
        key_file, cert_file = ca.write_server_certificate(Path(tmp) / "relay", ["localhost", f"*.{DOMAIN}"])
        server_context = web_ssl_context(cert_file, key_file)
        client = ssl.create_default_context(cafile=str(ca.cert_path))
        tasks: set[asyncio.Task[None]] = set()

        def on_open(channel: Channel) -> None:
            task = asyncio.create_task(serve_app(channel.read, channel.write, big))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        agent: StreamLink
        relay: StreamLink

        async def to_relay(frame: bytes) -> None:
            relay.feed(frame)

        async def to_agent(frame: bytes) -> None:
            agent.feed(frame)

        agent = StreamLink(Multiplexer(initiator=True), to_relay, on_open=on_open)
        relay = StreamLink(Multiplexer(initiator=False), to_agent)
        links = [asyncio.create_task(agent.run()), asyncio.create_task(relay.run())]
        web = WebPorts(token_key=certificate_public_key(ca.certificate), ssl_context=server_context, domain=DOMAIN,
                       links={HOST: relay}.get, clock=SystemClock())  # fmt: skip
        await web.start()

        async def direct(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            async def write(data: bytes) -> None:
                writer.write(data)
                await writer.drain()

            try:
                await serve_app(reader.read, write, big)
            except ConnectionError:
                pass
            finally:
                writer.close()

        baseline = await asyncio.start_server(direct, "127.0.0.1", 0, ssl=server_context)
        try:
            claims = new_claims(account_id="acct-1", rental_id=RENTAL, host_id=HOST, kind="tcp", port=8000,
                                expires_at=time.time() + 600)  # fmt: skip
            token = ca.sign_connect_token(claims)
            reader, writer = await asyncio.open_connection("127.0.0.1", web.port, ssl=client, server_hostname=LABEL)
            writer.write(f"GET /?gm_token={token} HTTP/1.1\r\nHost: {LABEL}\r\n\r\n".encode())
            answer = await reader.read()
            writer.close()
            cookie = next(line for line in answer.decode().split("\r\n") if line.startswith("Set-Cookie: "))
            cookie = cookie.removeprefix("Set-Cookie: ").split(";")[0]
            direct_port = int(baseline.sockets[0].getsockname()[1])
            through = await measure(web.port, client, cookie, big=big, requests=args.requests, rounds=args.rounds)
            plain = await measure(direct_port, client, cookie, big=big, requests=args.requests, rounds=args.rounds)
        finally:
            baseline.close()
            await web.close()
            for task in [*links, *tasks]:
                task.cancel()
            await asyncio.gather(*links, *tasks, return_exceptions=True)
    print(f"download: {args.mb} MiB answers, {args.rounds} rounds, median")
    print(f"  {'direct TLS (baseline)':<34} {plain[0]:>9,.0f} MB/s")
    print(f"  {'through the web port':<34} {through[0]:>9,.0f} MB/s  {through[0] / plain[0]:.2f}× direct")
    print(f"keep-alive: {args.requests:,} small GETs on one connection")
    print(f"  {'direct TLS (baseline)':<34} {plain[1]:>9,.0f} requests/s")
    print(f"  {'through the web port':<34} {through[1]:>9,.0f} requests/s  {through[1] / plain[1]:.2f}× direct")
    record("webports", f"{args.mb} MiB answer through a web port", through[0], "MB/s", "direct TLS", plain[0])
    record("webports", "small GETs on one keep-alive connection through a web port", through[1], "requests/s",
           "direct TLS", plain[1])  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mb", type=int, default=64, help="MiB per download (default 64)")
    parser.add_argument("--requests", type=int, default=2000, help="small requests on one connection (default 2000)")
    parser.add_argument("--rounds", type=int, default=5, help="downloads measured (default 5)")
    parser.add_argument("--quick", action="store_true", help="8 MiB × 2 rounds, 200 requests (for make bench QUICK=1)")
    args = parser.parse_args()
    if args.quick:
        args.mb, args.rounds, args.requests = 8, 2, 200
    if min(args.mb, args.requests, args.rounds) < 1:
        parser.error("every argument must be at least 1")
    print(describe_machine())
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
