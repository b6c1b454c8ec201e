"""The browser tests' network namespace (``tests/browserns.py``): its proxy reaches the host's loopback and nothing
else, and Chromium in it keeps its requests while the host's addresses come and go, as they do when other tests of
the suite start containers; Chromium in the host's namespace, beside it, loses them (which shows the change happened)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import socket
import socketserver
import struct
import subprocess
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
from aiohttp import web
from playwright.async_api import Page, async_playwright

from tests.browserns import CHROMIUM, CHROMIUM_ARGS, BrowserNamespace, browser_namespace, in_namespace
from tests.helpers import eventually

WAIT_MS = 20_000
HELD = 7  # one more than Chromium's 6 connections per server: the last waits for a connection


class _Echo(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        self.wfile.write(b"host: " + self.rfile.readline())


@pytest.fixture
def echo_port() -> Iterator[int]:
    """A server on the host's loopback answering one line with ``host: <line>``."""
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield server.server_address[1]
        server.shutdown()


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, f"the proxy closed after {data!r}"
        data += chunk
    return data


def _socks_connect(namespace: BrowserNamespace, address: bytes, port: int) -> tuple[int, socket.socket]:
    """From inside the namespace, as Chromium does: the proxy's reply code to CONNECT ``address`` (type and bytes as
    RFC 1928 puts them), and the connection."""
    sock = in_namespace(namespace.name, lambda: socket.create_connection(("127.0.0.1", namespace.proxy_port), timeout=10))
    sock.sendall(b"\x05\x01\x00")
    assert _recv_exactly(sock, 2) == b"\x05\x00"
    sock.sendall(b"\x05\x01\x00" + address + struct.pack("!H", port))
    reply = _recv_exactly(sock, 10)
    return reply[1], sock


def test_the_proxy_reaches_the_hosts_loopback_and_nothing_else(echo_port: int) -> None:
    """Inside the namespace the host's server is not listening (its loopback is its own); through the proxy it
    answers, by address and by a ``*.localhost`` name; an address outside the machine is refused. The namespace and
    its wrapper are gone when the block ends."""
    with browser_namespace() as namespace:
        with pytest.raises(ConnectionRefusedError):
            in_namespace(namespace.name, lambda: socket.create_connection(("127.0.0.1", echo_port), timeout=10))
        name = b"rental-8000.ports.localhost"
        for address in (b"\x01" + socket.inet_aton("127.0.0.1"), b"\x03" + bytes([len(name)]) + name):
            code, sock = _socks_connect(namespace, address, echo_port)
            with sock:
                assert code == 0
                sock.sendall(b"ping\n")
                assert sock.makefile("rb").readline() == b"host: ping\n"
        code, sock = _socks_connect(namespace, b"\x01" + socket.inet_aton("198.18.0.1"), echo_port)
        sock.close()
        assert code == 2  # not allowed
        assert namespace.executable.exists()
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert namespace.name not in netns
    assert not namespace.executable.exists()


@pytest.fixture
async def held_server() -> AsyncIterator[tuple[str, dict[str, int], asyncio.Event]]:
    """A page, and ``/held/<tag>/<n>`` requests that it counts per tag and answers once released."""
    arrived: dict[str, int] = {}
    release = asyncio.Event()

    async def page(request: web.Request) -> web.Response:
        return web.Response(text="<!doctype html><title>held</title>", content_type="text/html")

    async def held(request: web.Request) -> web.Response:
        tag = request.match_info["tag"]
        arrived[tag] = arrived.get(tag, 0) + 1
        await release.wait()
        return web.Response(text=f"answered {request.match_info['n']}")

    app = web.Application()
    app.router.add_get("/", page)
    app.router.add_get("/held/{tag}/{n}", held)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", arrived, release
    finally:
        release.set()
        await runner.cleanup()


async def _hold(page: Page, base: str, tag: str) -> None:
    """``HELD`` fetches from the page, their outcomes in ``window.results``."""
    await page.goto(base + "/")
    await page.evaluate(
        """([tag, count]) => {
            window.results = [];
            for (let n = 0; n < count; n++) {
                fetch(`/held/${tag}/${n}`).then(r => r.text()).then(t => results.push(t), e => results.push(`failed: ${e}`));
            }
        }""",
        [tag, HELD],
    )


async def _churn(stop: asyncio.Event) -> None:
    """A veth with an address comes and goes in the host's namespace until ``stop``, as other tests' containers do."""
    name = f"gmbt{secrets.token_hex(3)}"
    try:
        for n in itertools.count():
            if stop.is_set():
                return
            for command in (f"link add {name} type veth peer name {name}p", f"addr add 198.18.{n % 256}.1/24 dev {name}",
                            f"link set {name} up", f"link set {name}p up", f"link del {name}"):  # fmt: skip
                process = await asyncio.create_subprocess_exec("ip", *command.split(), stderr=subprocess.PIPE)
                _, err = await process.communicate()
                assert process.returncode == 0, f"ip {command}: {err.decode()}"
    finally:
        process = await asyncio.create_subprocess_exec("ip", "link", "del", name, stderr=subprocess.DEVNULL)
        await process.wait()  # when a command above failed midway; refused when none is left


@pytest.mark.slow
async def test_chromium_in_the_namespace_keeps_its_requests_while_the_hosts_addresses_change(
    held_server: tuple[str, dict[str, int], asyncio.Event],
) -> None:
    """Two Chromiums, one in the namespace and one in the host's, each with 6 requests held by the server and a 7th
    waiting for a connection. Addresses come and go on the host until the host's Chromium fails its waiting request
    with ERR_NETWORK_CHANGED; then the server answers, and every request of the namespace's Chromium succeeds."""
    base, arrived, release = held_server
    failures: list[str] = []
    with browser_namespace() as namespace:
        async with async_playwright() as playwright, contextlib.AsyncExitStack() as stack:
            inside = await playwright.chromium.launch(executable_path=str(namespace.executable), args=namespace.args)
            stack.push_async_callback(inside.close)
            outside = await playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            stack.push_async_callback(outside.close)
            inside_page, outside_page = await inside.new_page(), await outside.new_page()
            inside_page.on("requestfailed", lambda request: failures.append(f"{request.url}: {request.failure}"))
            outside_failures: list[str | None] = []
            outside_page.on("requestfailed", lambda request: outside_failures.append(request.failure))
            await _hold(inside_page, base, "inside")
            await _hold(outside_page, base, "outside")

            async def all_but_one_arrived() -> bool:
                return arrived.get("inside", 0) == arrived.get("outside", 0) == HELD - 1

            await eventually(all_but_one_arrived, timeout=WAIT_MS / 1000, what="6 held requests of each browser")
            stop = asyncio.Event()
            churn = asyncio.create_task(_churn(stop))
            outside_failed = asyncio.create_task(
                outside_page.wait_for_function("() => results.some(r => r.startsWith('failed'))", timeout=WAIT_MS, polling=100)
            )
            await asyncio.wait([churn, outside_failed], return_when=asyncio.FIRST_COMPLETED)
            stop.set()
            await churn  # raises what went wrong with `ip`, if anything did
            await outside_failed  # raises when the host's Chromium never noticed: the test would prove nothing
            assert "net::ERR_NETWORK_CHANGED" in outside_failures, outside_failures
            release.set()
            await inside_page.wait_for_function(f"() => results.length === {HELD}", timeout=WAIT_MS, polling=100)
            assert sorted(await inside_page.evaluate("results")) == sorted(f"answered {n}" for n in range(HELD))
            assert arrived["inside"] == HELD
    assert not failures, failures
