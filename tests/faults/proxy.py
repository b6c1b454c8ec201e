"""A TCP proxy that breaks the link it carries on purpose: latency, stalls, a black hole, cut connections.

``tc netem`` is what one would use for this, but its kernel module is missing where the suite
runs ("Specified qdisc kind is unknown"), so the fault suite puts this proxy on the link
instead: between an agent and its relay (the agent's ``GPUMARKET_RELAY_URL`` points at the
proxy; TLS passes through untouched, the relay's certificate covers 127.0.0.1), or between a
relay and Redis (the relay's ``GPUMARKET_REDIS_URL``), which is the relay's whole path to the
masters.

What it can do, each from the controlling thread at any time:

* ``shape(latency=, stall_probability=, stall_s=)``: every chunk is delayed by ``latency``
  seconds, and with ``stall_probability`` a chunk is held ``stall_s`` longer, as TCP holds a
  stream behind a lost segment until it is retransmitted (loss, as the application sees it).
  Order is kept: a chunk never overtakes the one before it.
* ``black_hole()`` / ``heal()``: nothing is read or forwarded in either direction (a connection's end included), open
  connections stay open and new ones are accepted but not connected onward: a partition.
  On ``heal`` what was held goes through, as a TCP stream does once a short partition ends.
* ``cut()``: every open connection is reset (RST) at once, as a long outage ends once
  keepalives or pings have given up on both sides.

The proxy runs its own event loop in a daemon thread, so it keeps forwarding while the test's
own loop is busy or between tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

CHUNK = 65536


@dataclass
class ProxyStats:
    connections: int = 0
    cut: int = 0
    bytes_up: int = 0  # client → target
    bytes_down: int = 0  # target → client
    stalls: int = 0


@dataclass
class _Shape:
    latency: float = 0.0
    stall_probability: float = 0.0
    stall_s: float = 0.0


@dataclass(eq=False)
class _Link:
    client: asyncio.StreamWriter
    target: asyncio.StreamWriter | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


class FaultProxy:
    """``127.0.0.1:port`` → ``target_host:target_port``; see the module docstring."""

    def __init__(self, target_host: str, target_port: int, *, name: str, seed: int = 0) -> None:
        self.target = (target_host, target_port)
        self.name = name
        self.port = 0
        self.stats = ProxyStats()
        self._shape = _Shape()
        self._rng = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"fault-proxy-{name}", daemon=True)
        self._open: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()

    # ---- control (from any thread) -----------------------------------------------------

    def start(self) -> int:
        """Listen on a free loopback port; returns it."""
        self._thread.start()
        self.port = self._call(self._start)
        return self.port

    @property
    def url_host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def shape(self, *, latency: float = 0.0, stall_probability: float = 0.0, stall_s: float = 0.0) -> None:
        self._shape = _Shape(latency, stall_probability, stall_s)

    def black_hole(self) -> None:
        self._call(self._set_open, False)

    def heal(self) -> None:
        """End a black hole and any shaping."""
        self._shape = _Shape()
        self._call(self._set_open, True)

    def cut(self) -> int:
        """Reset every open connection; returns how many there were."""
        return self._call(self._cut)

    def close(self) -> None:
        if not self._thread.is_alive():
            self._loop.close()
            return
        with contextlib.suppress(Exception):
            self._call(self._close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    def _call(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(fn(*args), self._loop)
        return future.result(timeout=10)

    # ---- inside the proxy's loop ------------------------------------------------------

    async def _start(self) -> int:
        self._open = asyncio.Event()
        self._open.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def _set_open(self, value: bool) -> None:
        assert self._open is not None
        if value:
            self._open.set()
        else:
            self._open.clear()

    async def _cut(self) -> int:
        links = list(self._links)
        for link in links:
            for writer in (link.client, link.target):
                if writer is not None:
                    _reset(writer)
            for task in link.tasks:
                task.cancel()
        self._links.clear()
        self.stats.cut += len(links)
        return len(links)

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._cut()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        assert self._open is not None
        link = _Link(client_writer)
        self._links.add(link)
        self.stats.connections += 1
        try:
            await self._open.wait()  # partitioned: the connection is accepted, nothing goes onward
            target_reader, target_writer = await asyncio.open_connection(*self.target)
        except OSError:
            self._links.discard(link)
            _reset(client_writer)
            return
        link.target = target_writer
        if link not in self._links:  # cut while connecting
            _reset(target_writer)
            return
        up = asyncio.create_task(self._pump(client_reader, target_writer, up=True))
        down = asyncio.create_task(self._pump(target_reader, client_writer, up=False))
        link.tasks |= {up, down}
        await asyncio.wait(link.tasks)
        self._links.discard(link)
        for writer in (client_writer, target_writer):
            writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, up: bool) -> None:
        """Forward one direction, chunk by chunk, with the shaping of the moment; ends at EOF or an error."""
        assert self._open is not None
        due = 0.0
        try:
            while True:
                await self._open.wait()
                data = await reader.read(CHUNK)
                if not data:
                    # A black hole holds the end of the connection too: a dead network carries no FIN.
                    await self._open.wait()
                    with contextlib.suppress(OSError):
                        if writer.can_write_eof():
                            writer.write_eof()
                    return
                shape = self._shape
                delay = shape.latency
                if shape.stall_probability and self._rng.random() < shape.stall_probability:
                    delay += shape.stall_s
                    self.stats.stalls += 1
                due = max(due, time.monotonic() + delay)  # never overtake the chunk before
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._open.wait()
                writer.write(data)
                await writer.drain()
                if up:
                    self.stats.bytes_up += len(data)
                else:
                    self.stats.bytes_down += len(data)
        except (OSError, ConnectionError):
            _reset(writer)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), as a dead network path ends a connection."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
