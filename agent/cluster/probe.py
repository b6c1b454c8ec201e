"""Measuring between cluster members through their tunnel (``agent.cluster.net``): each member answers a responder
on its private address (``MEASURE_PORT``), and the others measure against it — ``echo``: the median of a few
one-byte round trips; ``sink``: the throughput of sending a number of bytes until the responder says it has them;
``loss``: the share of ``LOSS_PROBES`` datagrams the UDP echo (``UdpEcho``, on the same port) did not send back.

A throughput is two ``sink`` runs: ``PROBE_BYTES`` first, then as many bytes as that rate carries in
``RUN_BUDGET_S`` (``run_size``), so that a slow link (a loaded relay: a few Mbit/s) yields its figure in seconds
instead of timing out on a fixed size; the responder's protocol is unchanged. ``attempt`` (tried again until a deadline),
``through`` and ``loss_to`` run them from inside a member's network namespace, so over the member's path to the peer."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Final, cast

from agent.runtimes.netns import socket_in_namespace

Run = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[float]]
"""One measurement over a fresh connection to a responder (``echo``, or ``sink`` with its size)."""

MEASURE_PORT: Final = 29499  # the responder's TCP port on the member's private address
PINGS: Final = 5
# The stages the responder answers: "E" echoes bytes one by one (round trip), "S" + 8-byte length sinks that many and says "K".
MAX_SINK_BYTES: Final = 256 << 20
PROBE_BYTES: Final = 256 << 10  # the first run: long enough for a rate, short on any link that answers at all
RUN_BUDGET_S: Final = 2.0  # how long the second run is sized to last at the first run's rate
LOSS_PROBES: Final = 100
LOSS_SPACING_S: Final = 0.002  # between two probes: 100 probes take 0.2 s
LOSS_WAIT_S: Final = 1.0  # after the last probe, for late answers


async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        async with asyncio.timeout(60):
            stage = await reader.readexactly(1)
            if stage == b"E":
                for _ in range(PINGS):
                    writer.write(await reader.readexactly(1))
                    await writer.drain()
            elif stage == b"S":
                left = min(int.from_bytes(await reader.readexactly(8), "big"), MAX_SINK_BYTES)
                while left > 0:
                    chunk = await reader.read(min(left, 1 << 16))
                    if not chunk:
                        return
                    left -= len(chunk)
                writer.write(b"K")
                await writer.drain()
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> float:
    """The median of ``PINGS`` one-byte round trips, ms."""
    rtts: list[float] = []
    writer.write(b"E")
    for _ in range(PINGS):
        started = time.perf_counter()
        writer.write(b"p")
        await writer.drain()
        await reader.readexactly(1)
        rtts.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(rtts), 3)


async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, size: int) -> float:
    """Mbit/s of sending ``size`` bytes until the responder says it has them all."""
    chunk = bytes(1 << 16)
    started = time.perf_counter()
    writer.write(b"S" + size.to_bytes(8, "big"))
    sent = 0
    while sent < size:
        part = chunk[: min(len(chunk), size - sent)]
        writer.write(part)
        await writer.drain()
        sent += len(part)
    await reader.readexactly(1)
    return round(size * 8 / (time.perf_counter() - started) / 1e6, 1)


def run_size(probe_mbit_s: float, limit: int) -> int:
    """Bytes for the second throughput run: what ``probe_mbit_s`` carries in ``RUN_BUDGET_S``, between
    ``PROBE_BYTES`` and ``limit``."""
    return max(PROBE_BYTES, min(limit, int(probe_mbit_s * 1e6 / 8 * RUN_BUDGET_S)))


async def throughput(attempt: Callable[[Run], Awaitable[tuple[float | None, str | None]]], limit: int) -> tuple[float | None, str | None]:
    """Mbit/s (or why not) of a ``PROBE_BYTES`` run, then of one sized by ``run_size`` to its rate (at most ``limit``
    bytes), each run made by ``attempt`` (which tries until its deadline). A fixed 8 MiB took past the 15 s deadline
    at 6 Mbit/s (a relay path on a loaded host) and left the pair without a figure. Where the second run fails, the
    first's figure stands."""
    probe = min(PROBE_BYTES, limit)
    first, failed = await attempt(lambda r, w: sink(r, w, probe))
    if first is None or probe == limit:
        return first, failed
    size = run_size(first, limit)
    second, _ = await attempt(lambda r, w: sink(r, w, size))
    return (second if second is not None else first), None


class UdpEcho(asyncio.DatagramProtocol):
    """Sends every datagram back where it came from (at most 64 bytes of it): the loss probes' answer."""

    transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)  # the selector loop's is not a DatagramTransport subclass

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.transport is not None:
            self.transport.sendto(data[:64], addr)


async def loss(sock: socket.socket, *, probes: int = LOSS_PROBES) -> float:
    """Percent of ``probes`` numbered datagrams sent on ``sock`` (non-blocking, connected to a peer's ``UdpEcho``) that
    did not come back within ``LOSS_WAIT_S`` of the last."""
    loop = asyncio.get_running_loop()
    answered: set[int] = set()
    all_back = asyncio.Event()

    async def receive() -> None:
        while True:
            data = await loop.sock_recv(sock, 64)
            number = int.from_bytes(data, "big") if len(data) == 4 else probes
            if number < probes:
                answered.add(number)
                if len(answered) == probes:
                    all_back.set()

    receiving = asyncio.create_task(receive())
    try:
        for number in range(probes):
            await loop.sock_sendall(sock, number.to_bytes(4, "big"))
            await asyncio.sleep(LOSS_SPACING_S)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LOSS_WAIT_S):  # not wait_for: it can lose a cancel (shared/cancelling.py)
                await all_back.wait()
    finally:
        receiving.cancel()
        await asyncio.gather(receiving, return_exceptions=True)
    return round(100.0 * (probes - len(answered)) / probes, 1)



async def loss_to(pid: int, target: str) -> float | None:
    """Loss to ``target``'s UDP echo from inside ``pid``'s namespace, so through the member's path (``None``: could
    not be probed)."""
    try:
        sock = await socket_in_namespace(pid, lambda: _connected_udp(target), name="cluster-loss")
    except OSError:
        return None
    try:
        return await loss(sock)
    except OSError:
        return None
    finally:
        sock.close()


async def attempt(pid: int, target: str, run: Run, *, timeout: float) -> tuple[float | None, str | None]:
    """``run`` against ``target``'s responder, tried again until it works or ``timeout`` passed (the peer may set its
    own peers a moment later than this one): its figure, or why not (each distinct error, how often)."""
    deadline = time.monotonic() + timeout
    errors: dict[str, int] = {}
    while time.monotonic() < deadline:
        try:
            async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                return await through(pid, target, run), None
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            why = str(exc) or type(exc).__name__
            errors[why] = errors.get(why, 0) + 1
            await asyncio.sleep(0.2)
    return None, ", ".join(f"{why} ×{n}" if n > 1 else why for why, n in errors.items()) or "no answer"


async def through(pid: int, target: str, run: Run) -> float:
    """``run`` over a connection to ``target``'s responder made inside the member's namespace (so through its path)."""
    sock = await socket_in_namespace(pid, lambda: socket.create_connection((target, MEASURE_PORT), timeout=2.0), name="cluster-measure")
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        return await run(reader, writer)
    finally:
        writer.close()


def _connected_udp(target: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.connect((target, MEASURE_PORT))
    return sock
