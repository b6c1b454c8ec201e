"""Measuring between cluster members through their tunnel (``agent.clusternet``): each member answers a responder
on its private address (``MEASURE_PORT``), and the others measure against it — ``echo``: the median of a few
one-byte round trips; ``sink``: the throughput of sending a number of bytes until the responder says it has them;
``loss``: the share of ``LOSS_PROBES`` datagrams the UDP echo (``UdpEcho``, on the same port) did not send back."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import time
from typing import Final, cast

MEASURE_PORT: Final = 29499  # the responder's TCP port on the member's private address
PINGS: Final = 5
# The stages the responder answers: "E" echoes bytes one by one (round trip), "S" + 8-byte length sinks that many and says "K".
MAX_SINK_BYTES: Final = 256 << 20
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

