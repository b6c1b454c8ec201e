"""Chromium in a network namespace of its own, reaching the host's loopback servers through a SOCKS5 proxy.

When an address of its network namespace comes or goes, Chromium fails the requests that wait for a connection with
ERR_NETWORK_CHANGED (and drops its idle connections), and the rest of the suite does that all the time beside the
browser tests (containers' veths on Docker's bridge, process rentals' ``gmp*`` veths, WireGuard devices). So the
browser runs in a namespace where nothing ever changes: ``gmbrw-<pid>-<random>``, with only ``lo`` up.

The test process opens a listening socket on ``127.0.0.1:<port>`` *inside* it (a short-lived thread enters the
namespace with ``setns(2)``, binds, and goes back: the socket keeps the namespace it was made in) and serves SOCKS5
on it from the host's namespace, in a thread of its own: each connection Chromium asks for goes to the host's
loopback (``127.0.0.0/8``, ``::1``, ``localhost`` and ``*.localhost``, which Chromium treats as loopback too), and
the bytes are spliced both ways. Any other address is refused: the browser tests never reach outside the machine.
Chromium starts through a wrapper (``ip netns exec NAME chromium "$@"``) with ``--proxy-server`` pointing at that
socket and ``--proxy-bypass-list=<-loopback>``, so that loopback URLs take the proxy too; the tests keep their
``http://127.0.0.1:PORT/…`` URLs. Needs root (``ip netns``, ``setns``), as the suite has in CI; fails otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import os
import secrets
import shlex
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar

import pytest

CHROMIUM = Path(os.environ.get("GPUMARKET_TEST_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run",
]  # fmt: skip
NETNS_DIR: Final = Path("/var/run/netns")
PREFIX: Final = "gmbrw-"
CLONE_NEWNET: Final = 0x40000000
START_S: Final = 10.0  # the proxy's thread starts its event loop within this, or stops within it

_libc = ctypes.CDLL(None, use_errno=True)
T = TypeVar("T")


@dataclass(frozen=True)
class BrowserNamespace:
    """Where Chromium runs: the namespace, the proxy's port inside it, and the wrapper to launch instead of Chromium."""

    name: str
    proxy_port: int
    executable: Path

    @property
    def args(self) -> list[str]:
        """Chromium's command line: the suite's flags, and every URL (loopback too) through the proxy."""
        return [*CHROMIUM_ARGS, f"--proxy-server=socks5://127.0.0.1:{self.proxy_port}", "--proxy-bypass-list=<-loopback>"]


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"setns: {os.strerror(code)}")


def in_namespace(name: str, make: Callable[[], T]) -> T:
    """What ``make()`` returns, called inside network namespace ``name`` (a socket made there keeps it). A short-lived
    thread of its own enters and leaves (``setns`` changes the calling thread only): if leaving failed, that thread
    ends with the error rather than live on in the wrong namespace."""
    result: list[T] = []
    error: list[BaseException] = []

    def work() -> None:
        with contextlib.ExitStack() as opened:
            try:
                own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                opened.callback(os.close, own)
                target = os.open(NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
                opened.callback(os.close, target)
                _setns(target)
                try:
                    result.append(make())
                finally:
                    _setns(own)
            except BaseException as exc:  # handed to the caller
                error.append(exc)

    thread = threading.Thread(target=work, name=f"netns-{name}", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def _listener() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _remove_stale() -> None:
    """Namespaces of this helper whose test process is gone (killed before its clean-up ran): CI runs on one machine
    again and again."""
    for path in NETNS_DIR.glob(f"{PREFIX}*") if NETNS_DIR.is_dir() else []:
        pid = path.name.removeprefix(PREFIX).split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            subprocess.run(["ip", "netns", "del", path.name], capture_output=True, check=False)


@contextlib.contextmanager
def browser_namespace(chromium: Path = CHROMIUM) -> Iterator[BrowserNamespace]:
    """A network namespace with only ``lo``, a SOCKS5 proxy listening inside it onto the host's loopback, and a
    wrapper that runs ``chromium`` in it; all removed when the block ends. Fails the test (never skips) without root,
    ``ip`` or Chromium."""
    assert chromium.exists(), (
        f"{chromium} is missing: the console's browser tests need Debian's chromium "
        "(make chromium, or apt-get install chromium; or set GPUMARKET_TEST_CHROMIUM)"
    )
    if os.geteuid() != 0:
        pytest.fail("the browser tests need root: Chromium runs in a network namespace of its own (tests/browserns.py)")
    ip = shutil.which("ip")
    if ip is None:
        pytest.fail("`ip` is missing: the browser tests run Chromium in a network namespace (apt-get install iproute2)")
    _remove_stale()
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
    _ip("netns", "add", name)
    try:
        _ip("-n", name, "link", "set", "lo", "up")
        listener = in_namespace(name, _listener)
        with tempfile.TemporaryDirectory(prefix=PREFIX) as folder, _Socks5Proxy(listener):
            wrapper = Path(folder) / "chromium"
            wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(ip)} netns exec {name} {shlex.quote(str(chromium))} "$@"\n')
            wrapper.chmod(0o755)
            yield BrowserNamespace(name=name, proxy_port=listener.getsockname()[1], executable=wrapper)
    finally:
        _ip("netns", "del", name)


class _Socks5Proxy:
    """SOCKS5 (no authentication, CONNECT only) on ``listener``, served by an event loop in a thread of its own: the
    tests' own loop may block (a synchronous call in an async test) while Chromium still loads through it."""

    def __init__(self, listener: socket.socket) -> None:
        self._listener = listener
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: list[BaseException] = []
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._run, name="browserns-socks5", daemon=True)

    def __enter__(self) -> _Socks5Proxy:
        self._thread.start()
        if not self._started.wait(START_S) or self._error:
            raise RuntimeError(f"the browser's SOCKS5 proxy did not start: {self._error or 'no answer'}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(START_S)
        assert not self._thread.is_alive(), "the browser's SOCKS5 proxy did not stop"

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported by __enter__ when it happens on the way up
            self._error.append(exc)
            self._started.set()
        finally:
            self._listener.close()
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._client, sock=self._listener)
        self._started.set()
        await self._stop.wait()
        server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await server.wait_closed()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        try:
            upstream = await self._handshake(reader, writer)
            if upstream is not None:
                up_reader, up_writer = upstream
                self._writers.add(up_writer)
                try:
                    await asyncio.gather(_splice(reader, up_writer, writer), _splice(up_reader, writer, up_writer))
                finally:
                    self._writers.discard(up_writer)
                    up_writer.close()
        except (OSError, asyncio.IncompleteReadError):
            pass  # the browser or the server went away: nothing to tell either
        finally:
            self._writers.discard(writer)
            self._tasks.discard(task)
            writer.close()

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """RFC 1928's greeting and CONNECT request; the connection to the host's loopback, or None after the reply
        that says why not."""
        version, count = await reader.readexactly(2)
        methods = await reader.readexactly(count)
        if version != 5 or 0 not in methods:
            writer.write(b"\x05\xff")  # no acceptable method
            return None
        writer.write(b"\x05\x00")
        version, command, _, kind = await reader.readexactly(4)
        if kind == 1:
            host = str(ipaddress.IPv4Address(await reader.readexactly(4)))
        elif kind == 4:
            host = str(ipaddress.IPv6Address(await reader.readexactly(16)))
        elif kind == 3:
            host = (await reader.readexactly((await reader.readexactly(1))[0])).decode("ascii", "replace")
        else:
            writer.write(b"\x05\x08\x00\x01" + bytes(6))  # address type not supported
            return None
        (port,) = struct.unpack("!H", await reader.readexactly(2))
        if command != 1:
            writer.write(b"\x05\x07\x00\x01" + bytes(6))  # command not supported
            return None
        targets = _loopback(host)
        if not targets:
            writer.write(b"\x05\x02\x00\x01" + bytes(6))  # not allowed: the tests reach the host's loopback only
            return None
        for target in targets:
            try:
                upstream = await asyncio.open_connection(target, port)
            except OSError:
                continue
            writer.write(b"\x05\x00\x00\x01" + bytes(6))
            return upstream
        writer.write(b"\x05\x05\x00\x01" + bytes(6))  # connection refused
        return None


def _loopback(host: str) -> list[str]:
    """The host's loopback addresses to try for ``host`` as Chromium asked for it; none for any other address."""
    name = host.lower().rstrip(".").strip("[]")
    if name == "localhost" or name.endswith(".localhost"):
        return ["127.0.0.1", "::1"]
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return []
    return [str(address)] if address.is_loopback else []


async def _splice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, readers_own: asyncio.StreamWriter) -> None:
    """Bytes from ``reader`` to ``writer`` until the end, which is passed on (a half-close, as HTTP may use). A reset
    on either side aborts both connections (``readers_own`` is the writer of ``reader``'s), which ends the other
    direction too."""
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.transport.abort()
        readers_own.transport.abort()
