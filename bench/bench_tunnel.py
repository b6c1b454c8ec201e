"""A renter's bytes through the relay and the agent's link, against plain loopback TCP, in one run.

The path measured is the one ``gpumarket`` renters take: a websocket to the relay's
``/v1/connect`` (TLS, a connect token signed by the CA) → a stream on the rental host's agent
link (TLS + client certificate, ``shared.streams``) → the agent's ``TunnelServer`` → a TCP
connection to the rental's port. Every piece is the real one: ``access.relay.Relay`` with the
in-process bus, the real ``agent.runner.Agent`` (an enrolled state, a simulated GPU backend,
its heartbeats, telemetry and spool), and ``websockets`` for the renter. The one stand-in is the
container: ``TunnelServer`` asks the workload manager for the rental's container address, and
here a small object answers ``127.0.0.1``, where this benchmark's own TCP server plays the
rental's program (a sink, a source and an echo, chosen by the first bytes of a connection).

The baseline is the same renter code talking to the same server directly over loopback TCP.

Processes (``--layout``): by default the relay runs in a child process of its own and the agent with
the rental's server in this one, as in production, where the relay and the agent are separate
machines (the rental's program is on the agent's). ``--layout one-process`` puts the relay in this
process and its event loop too (one core for both hops: a lower bound). The renter runs in a child
process either way, and the keystrokes of figure 3 in a second one (an interactive ``ssh`` has a ProxyCommand of its
own beside an ``scp``'s). On a 2-core machine the processes share the two cores.

Figures:

1. Bulk throughput, ``--mb`` MiB uploaded (renter → rental) and downloaded (rental → renter), in
   64 KiB websocket messages (the relay's renter message size), against a direct TCP copy of the
   same bytes in 64 KiB writes. Goals (issue 42): at least 0.3× direct and at least 300 MB/s. Beside each,
   the relay's and the agent's CPU per MB moved (their processes' CPU time over the bytes): on a machine
   other work shares, it says what a cut saved where the throughput swings with the load.
2. Round trip: a 64-byte request echoed by the rental, p50/p99 over ``--round-trips``, against the
   same echo over direct TCP; blocks of 100 interleaved. Goal: p50 added under 1 ms.
3. A keystroke (1 byte, echoed) every 10 ms, from a renter process of its own, while 20 bulk copies (10 each way)
   from the other share the agent link, p50/p99/max; the same with 20 direct TCP copies as baseline. Goal: p99 under
   20 ms.
   Meanwhile the agent's heartbeats (every ``--heartbeat-interval`` s, the relay's welcome sets
   it) are timed from the spool write to the relay's ack, against the same at rest.

The event loop is the one production runs (``shared.eventloop``: uvloop where it imports); ``--loop
asyncio`` measures asyncio's own.

Usage: ``python bench/bench_tunnel.py [--quick] [--mb N] [--round-trips N] [--seconds S] [--loop KIND]
[--layout processes|one-process] [--stream-data BYTES]``

``--stream-data``: the DATA frame size the agent offers its relay (default 256 KiB, ``LARGE_DATA``; 65536 keeps
protocol v1's frames): the agent link's frame size, renters' messages are 64 KiB either way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import ssl
import struct
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from access.relay import Relay
from agent.gpu.sim import SimulatedBackend
from agent.reach.tunnels import TunnelServer
from agent.runner import Agent
from agent.state import AgentState, Identity, atomic_write
from agent.timings import AgentTimings
from shared.bus import InProcessBus
from shared.crypto import (
    CertificateAuthority,
    certificate_public_key,
    generate_private_key,
    make_csr,
    server_ssl_context,
    write_private_key,
)
from shared.crypto.tokens import new_claims
from shared.eventloop import LOOP_KINDS, loop_name
from shared.eventloop import run as run_on_loop
from shared.outbound import FrameStore
from shared.streams import CONNECT_PATH, LARGE_DATA, MAX_DATA

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _children import Child, answer, stdin_lines
from _common import describe_machine, quantile, record

MiB = 1 << 20
MB = 1_000_000
HOST_ID = "bench-tunnel-host"
HEADER = struct.Struct("!cQ")  # what the rental's server does (S sink, D source, E echo) and how many bytes
ENDLESS = 1 << 62
CHUNK = MAX_DATA  # 64 KiB: the renter's websocket messages, the direct copy's writes, the server's reads
ECHO_SIZE = 64
KEYSTROKE_EVERY = 0.010
COPIES = 20
RENTALS = 4  # the bulk copies are spread over rentals: the relay allows 16 connections per rental


# ---- the rental's side (this process) -----------------------------------------------------------


class RentalProgram:
    """The rental's stand-in program, a TCP server: ``S`` reads N bytes and answers ``K``; ``D`` writes
    N bytes; ``E`` echoes until the end. ``close`` drops every connection still open."""

    def __init__(self) -> None:
        self.payload = os.urandom(CHUNK)
        self.writers: set[asyncio.StreamWriter] = set()

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            mode, size = HEADER.unpack(await reader.readexactly(HEADER.size))
            if mode == b"S":
                left = size
                while left > 0 and (data := await reader.read(min(left, 256 * 1024))):
                    left -= len(data)
                writer.write(b"K")
                await writer.drain()
            elif mode == b"D":
                left = size
                while left > 0:
                    writer.write(self.payload[: min(left, CHUNK)])
                    left -= CHUNK
                    await writer.drain()
            elif mode == b"E":
                while data := await reader.read(CHUNK):
                    writer.write(data)
                    await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except RuntimeError:  # uvloop: a write on a transport the tunnel's end closed
            if not writer.is_closing():
                raise
        finally:
            self.writers.discard(writer)
            writer.close()

    def close(self) -> None:
        for writer in list(self.writers):
            writer.transport.abort()


class ContainerStandIn:
    """What ``TunnelServer`` asks the workload manager: whether the rental runs here (it does) and a
    connection to its container's port (this machine's loopback, where ``rental_program`` listens)."""

    def workload(self, rental_id: str) -> object | None:
        return self if rental_id.startswith("bench-rental-") else None

    async def open_container_port(
        self, rental_id: str, port: int, *, timeout: float = 5.0
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        async with asyncio.timeout(timeout):
            return await asyncio.open_connection("127.0.0.1", port)


class LoopLag:
    """How late a 1 ms sleep on this process's event loop wakes up (ms), while ``running``."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _probe(self) -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(0.001)
            self.lags.append((time.perf_counter() - started) * 1e3 - 1.0)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[list[float]]:
        self.lags = []
        self._task = asyncio.create_task(self._probe(), name="bench-loop-lag")
        try:
            yield self.lags
        finally:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


@dataclass
class AckTimes:
    """Wraps the agent's spool (``FrameStore``): when each heartbeat was written, when its ack came."""

    inner: FrameStore
    written: dict[int, float] = field(default_factory=dict)
    delays: list[tuple[float, float]] = field(default_factory=list)  # (written at, seconds to the ack)

    def add(self, seq: int, kind: str, frame: str) -> None:
        if kind == "heartbeat":
            self.written[seq] = time.perf_counter()
        self.inner.add(seq, kind, frame)

    def ack(self, seq: int) -> bool:
        written = self.written.pop(seq, None)
        if written is not None:
            self.delays.append((written, time.perf_counter() - written))
        return self.inner.ack(seq)

    def discard_kind(self, kind: str) -> int:
        return self.inner.discard_kind(kind)

    def pending(self) -> Iterator[tuple[int, str]]:
        return self.inner.pending()

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def evicted(self) -> dict[str, int]:
        return self.inner.evicted

    def between(self, start: float, end: float) -> tuple[list[float], int]:
        """Ack delays (ms) of heartbeats written in [start, end), and how many of those are still unacked."""
        delays = [delay * 1e3 for at, delay in self.delays if start <= at < end]
        return delays, sum(1 for at in self.written.values() if start <= at < end)


def enrolled_state(ca: CertificateAuthority, folder: Path) -> AgentState:
    """An agent data dir as enrollment leaves it: key, certificate from ``ca``, CA, identity."""
    state = AgentState(folder)
    key = generate_private_key()
    write_private_key(state.key_file, key)
    state.cert_file.write_bytes(ca.sign_agent_csr(make_csr(key, HOST_ID), host_id=HOST_ID).cert_pem)
    atomic_write(state.ca_file, ca.cert_pem)
    state.save_identity(Identity(host_id=HOST_ID, master_url="http://unused"))
    return state


def start_relay(directory: Path, heartbeat_interval: float) -> Relay:
    """The relay over ``directory``'s CA and server certificate (``prepare_ca`` wrote them), on the in-process bus."""
    ca = CertificateAuthority.load_or_create(directory / "ca")
    return Relay(
        relay_id="bench-relay", bus=InProcessBus(),
        ssl_context=server_ssl_context(directory / "server.crt", directory / "server.key", ca.cert_path,
                                       require_client_cert=False),  # as `gpumarket up`: renters have none
        heartbeat_interval=heartbeat_interval, telemetry_interval=1.0,
        token_key=certificate_public_key(ca.certificate),
        renter_connection_burst_per_source=1000,  # every renter connection here comes from 127.0.0.1
    )  # fmt: skip


class RelayHere:
    """The relay in this process (``--layout one-process``): its CPU is this process's."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.url, self.port = relay.url, relay.port

    async def cpu_seconds(self) -> float:
        return 0.0

    async def close(self) -> None:
        await self.relay.close()
        await self.relay.bus.close()


class RelayProcess:
    """The relay in a child process (``--layout processes``), as in production, where it runs on
    another machine than the agent: answers its URL, then its CPU time when asked."""

    def __init__(self, child: Child, settings: dict[str, Any]) -> None:
        self.child = child
        self.url, self.port = settings["url"], settings["port"]

    @classmethod
    async def start(cls, directory: Path, args: argparse.Namespace) -> RelayProcess:
        child = await Child.spawn(__file__, "--relay-process", "--loop", args.loop)
        await child.send({"directory": str(directory), "heartbeat_interval": args.heartbeat_interval})
        return cls(child, await child.answer("start"))

    async def cpu_seconds(self) -> float:
        return float(await self.child.ask("cpu"))

    async def close(self) -> None:
        await self.child.stop()


async def relay_main() -> None:
    """The relay's child process: the settings line, then ``cpu`` or ``exit`` commands."""
    commands = await stdin_lines()
    settings = json.loads(await commands.readline())
    relay = start_relay(Path(settings["directory"]), settings["heartbeat_interval"])
    await relay.start()
    try:
        answer({"url": relay.url, "port": relay.port})
        while line := await commands.readline():
            op = json.loads(line)["op"]
            if op == "exit":
                return
            answer(time.process_time())
    finally:
        await relay.close()
        await relay.bus.close()


@contextlib.asynccontextmanager
async def host_side(directory: Path, args: argparse.Namespace) -> AsyncIterator[tuple[dict[str, Any], AckTimes, RelayHere | RelayProcess]]:
    """The relay, the agent connected to it and the rental's program; yields the renter's settings."""
    ca = CertificateAuthority.load_or_create(directory / "ca")
    ca.write_server_certificate(directory, ["127.0.0.1", "localhost"])  # server.key, server.crt
    relay: RelayHere | RelayProcess
    if args.layout == "processes":
        relay = await RelayProcess.start(directory, args)
    else:
        here = start_relay(directory, args.heartbeat_interval)
        await here.start()
        relay = RelayHere(here)
    program = RentalProgram()
    server = await asyncio.start_server(program, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    timings = AgentTimings(network_interval=0, reconnect_base_delay=0.05, reconnect_max_delay=0.5)
    agent = Agent(enrolled_state(ca, directory / "agent"), SimulatedBackend("sim:8xH100", seed=HOST_ID),
                  relay_urls=[relay.url], timings=timings, rng=random.Random(7), stream_data=args.stream_data)  # fmt: skip
    agent.tunnels = TunnelServer(ContainerStandIn())  # type: ignore[arg-type]  # the container's stand-in
    acks = AckTimes(agent.window.store)
    agent.window.store = acks
    running = asyncio.create_task(agent.run(), name="bench-agent")
    try:
        async with asyncio.timeout(30):
            await agent.connected.wait()
        expires = time.time() + 3600
        tokens = {
            f"bench-rental-{i}": ca.sign_connect_token(new_claims(
                account_id="bench-renter", rental_id=f"bench-rental-{i}", host_id=HOST_ID, kind="tcp", port=port,
                expires_at=expires,
            ))
            for i in range(RENTALS + 1)
        }  # fmt: skip
        settings = {
            "port": port, "connect_url": f"wss://127.0.0.1:{relay.port}{CONNECT_PATH}",
            "ca_pem": ca.cert_pem.decode(), "tokens": tokens,
        }  # fmt: skip
        yield settings, acks, relay
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        await agent.close()
        server.close()
        program.close()
        await relay.close()


# ---- the renter's side (a child process) --------------------------------------------------------


class Renter:
    """Connections to the rental's program, direct or through the relay; runs in the child process."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.port: int = settings["port"]
        self.url: str = settings["connect_url"]
        self.tokens: dict[str, str] = settings["tokens"]
        self.context = ssl.create_default_context(cadata=settings["ca_pem"])
        self.payload = os.urandom(CHUNK)

    def tunnel(self, rental: int) -> connect:
        token = self.tokens[f"bench-rental-{rental}"]
        return connect(self.url, ssl=self.context, additional_headers={"Authorization": f"Bearer {token}"},
                       compression=None, max_size=4 * MiB, open_timeout=10, close_timeout=2)  # fmt: skip

    async def direct(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)

    # Each operation has a direct and a tunnel form, with the same writes.

    async def upload_direct(self, size: int, moved: list[int]) -> None:
        reader, writer = await self.direct()
        try:
            writer.write(HEADER.pack(b"S", size))
            left = size
            while left > 0:
                writer.write(self.payload[: min(left, CHUNK)])
                left -= CHUNK
                moved[0] += CHUNK
                await writer.drain()
            if await reader.read(1) != b"K":
                raise RuntimeError("the rental's sink did not confirm")
        finally:
            writer.close()

    async def upload_tunnel(self, size: int, moved: list[int], rental: int = 0) -> None:
        async with self.tunnel(rental) as ws:
            await ws.send(HEADER.pack(b"S", size))
            left = size
            while left > 0:
                await ws.send(self.payload[: min(left, CHUNK)])
                left -= CHUNK
                moved[0] += CHUNK
            if await ws.recv() != b"K":
                raise RuntimeError("the rental's sink did not confirm")

    async def download_direct(self, size: int, moved: list[int]) -> None:
        reader, writer = await self.direct()
        try:
            writer.write(HEADER.pack(b"D", size))
            left = size
            while left > 0:
                data = await reader.read(CHUNK)
                if not data:
                    raise RuntimeError("the rental's source ended early")
                left -= len(data)
                moved[0] += len(data)
        finally:
            writer.close()

    async def download_tunnel(self, size: int, moved: list[int], rental: int = 0) -> None:
        async with self.tunnel(rental) as ws:
            await ws.send(HEADER.pack(b"D", size))
            left = size
            while left > 0:
                data = await ws.recv()
                left -= len(data)
                moved[0] += len(data)

    async def bulk(self, path: str, direction: str, size: int) -> dict[str, Any]:
        moved = [0]
        started, cpu = time.perf_counter(), time.process_time()
        await getattr(self, f"{direction}_{path}")(size, moved)
        return {"seconds": time.perf_counter() - started, "bytes": moved[0], "cpu_s": time.process_time() - cpu}

    async def echo(self, count: int, block: int) -> dict[str, Any]:
        """``count`` round trips of ECHO_SIZE bytes each way, direct and through the tunnel in blocks of ``block``."""
        message = b"e" * ECHO_SIZE
        times: dict[str, list[float]] = {"direct": [], "tunnel": []}
        reader, writer = await self.direct()
        writer.write(HEADER.pack(b"E", 0))
        async with self.tunnel(RENTALS) as ws:
            await ws.send(HEADER.pack(b"E", 0))
            for _ in range(2):  # warm both paths
                await self._tunnel_round_trip(ws, message)
                await self._direct_round_trip(reader, writer, message)
            done = 0
            while done < count:
                n = min(block, count - done)
                for _ in range(n):
                    times["direct"].append(await self._direct_round_trip(reader, writer, message))
                for _ in range(n):
                    times["tunnel"].append(await self._tunnel_round_trip(ws, message))
                done += n
        writer.close()
        return times

    @staticmethod
    async def _direct_round_trip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, message: bytes) -> float:
        started = time.perf_counter()
        writer.write(message)
        await reader.readexactly(len(message))
        return (time.perf_counter() - started) * 1e3

    @staticmethod
    async def _tunnel_round_trip(ws: ClientConnection, message: bytes) -> float:
        started = time.perf_counter()
        await ws.send(message)
        got = 0
        while got < len(message):
            got += len(await ws.recv())
        return (time.perf_counter() - started) * 1e3

    async def start_copies(self, path: str, copies: int) -> None:
        """Start ``copies`` endless bulk copies (half each way), direct or through the relay; ``stop_copies`` ends them."""
        self.moved = [0]
        ops = []
        for i in range(copies):
            direction = "upload" if i % 2 == 0 else "download"
            if path == "direct":
                ops.append(getattr(self, f"{direction}_direct")(ENDLESS, self.moved))
            else:
                ops.append(getattr(self, f"{direction}_tunnel")(ENDLESS, self.moved, i % RENTALS))
        self.copiers = [asyncio.ensure_future(op) for op in ops]
        await asyncio.sleep(0.5)  # every copy under way
        if failed := [c for c in self.copiers if c.done()]:
            failed[0].result()
            raise RuntimeError("a bulk copy ended early")
        self.copies_from = (self.moved[0], time.perf_counter())

    async def stop_copies(self) -> float:
        """End the copies ``start_copies`` began; the bytes per second they moved meanwhile."""
        moved_before, started = self.copies_from
        rate = (self.moved[0] - moved_before) / (time.perf_counter() - started)
        for copier in self.copiers:
            copier.cancel()
        await asyncio.gather(*self.copiers, return_exceptions=True)
        return rate

    async def keystrokes(self, path: str, seconds: float) -> list[float]:
        """A keystroke (1 byte, echoed) every KEYSTROKE_EVERY for ``seconds``: the round trips (ms). Run from a renter
        process of its own beside the one whose copies load the link, as an interactive ``ssh`` has its own
        ProxyCommand beside an ``scp``'s."""
        rtts: list[float] = []
        if path == "direct":
            reader, writer = await self.direct()
            writer.write(HEADER.pack(b"E", 0))
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                rtts.append(await self._direct_round_trip(reader, writer, b"k"))
                await asyncio.sleep(KEYSTROKE_EVERY)
            writer.close()
        else:
            async with self.tunnel(RENTALS) as ws:
                await ws.send(HEADER.pack(b"E", 0))
                deadline = time.perf_counter() + seconds
                while time.perf_counter() < deadline:
                    rtts.append(await self._tunnel_round_trip(ws, b"k"))
                    await asyncio.sleep(KEYSTROKE_EVERY)
        return rtts


async def renter_main() -> None:
    """The child: read the settings, then one JSON command a line; answer each with one JSON line."""
    commands = await stdin_lines()
    renter = Renter(json.loads(await commands.readline()))
    while line := await commands.readline():
        command = json.loads(line)
        op = command.pop("op")
        if op == "exit":
            return
        answer(await getattr(renter, op)(**command))


# ---- the report -----------------------------------------------------------------------------------


def percentiles(values: list[float]) -> str:
    return f"{quantile(values, 0.5):7.2f} {quantile(values, 0.99):7.2f} {max(values):7.2f}"


def verdict(ok: bool) -> str:
    return "OK" if ok else "MISSED"


LAYOUTS = {
    "processes": "the relay in a child process; the agent and the rental's stand-in TCP server in this one",
    "one-process": "relay + agent + the rental's stand-in TCP server in this process, one event loop",
}


async def run(args: argparse.Namespace) -> int:
    print(describe_machine(with_openssl=True))
    print(f"layout: {LAYOUTS[args.layout]} ({loop_name()}; both hops TLS); the renter in a child process, its keystrokes in another; "
          f"the agent offers {args.stream_data // 1024} KiB DATA frames")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="gm-bench-tunnel-") as tmp:
        async with host_side(Path(tmp), args) as (settings, acks, relay):
            child = await Child.spawn(__file__, "--renter", "--loop", args.loop)
            typist = await Child.spawn(__file__, "--renter", "--loop", args.loop)  # the keystrokes' own process
            try:
                await child.send(settings)
                await typist.send(settings)
                return await report(args, child, typist, acks, relay)
            finally:
                await asyncio.gather(child.stop(), typist.stop())


async def contention(child: Child, typist: Child, path: str, seconds: float) -> dict[str, Any]:
    """Keystrokes from ``typist`` while ``child`` runs COPIES bulk copies (half each way), ``path`` direct or tunnel."""
    await child.ask("start_copies", path=path, copies=COPIES)
    try:
        rtts = await typist.ask("keystrokes", path=path, seconds=seconds)
    finally:
        rate = await child.ask("stop_copies")
    return {"rtts": rtts, "bulk_bytes_per_s": rate}


async def report(args: argparse.Namespace, child: Child, typist: Child, acks: AckTimes, relay: RelayHere | RelayProcess) -> int:
    size = args.mb * MiB
    # 1. Bulk.
    print(f"\nbulk: {args.mb} MiB each way in {CHUNK // 1024} KiB messages/writes, one connection")
    print(f"  {'':<34} {'tunnel':>12} {'direct TCP':>12} {'ratio':>7}   goals")
    for direction, label in (("upload", "upload   renter → rental"), ("download", "download rental → renter")):
        direct = await child.ask("bulk", path="direct", direction=direction, size=size)
        cpu = time.process_time() + await relay.cpu_seconds()
        tunnel = await child.ask("bulk", path="tunnel", direction=direction, size=size)
        host_cpu_s = time.process_time() + await relay.cpu_seconds() - cpu
        host_cpu = host_cpu_s / tunnel["seconds"]
        d_rate = direct["bytes"] / direct["seconds"] / MB
        t_rate = tunnel["bytes"] / tunnel["seconds"] / MB
        ratio = t_rate / d_rate
        print(f"  {label:<34} {t_rate:>7,.0f} MB/s {d_rate:>7,.0f} MB/s {ratio:>6.2f}×   "
              f"≥300 MB/s {verdict(t_rate >= 300)}, ≥0.3× {verdict(ratio >= 0.3)}   CPU: relay+agent {host_cpu:.0%} ({host_cpu_s * 1e3 / (tunnel['bytes'] / MB):.1f} ms/MB), renter {tunnel['cpu_s'] / tunnel['seconds']:.0%} of a core")  # fmt: skip
        record("tunnel", f"bulk {label.split()[0]}, {args.mb} MiB in {CHUNK // 1024} KiB messages", t_rate, "MB/s",
               "direct TCP", d_rate, f"goals ≥ 300 MB/s and ≥ 0.3× direct; relay+agent at {host_cpu:.0%} of a core, "
               f"{host_cpu_s * 1e3 / (tunnel['bytes'] / MB):.1f} ms CPU per MB; {loop_name()}, layout {args.layout}, "
               f"{args.stream_data // 1024} KiB DATA frames offered")  # fmt: skip

    # 2. Round trips.
    times = await child.ask("echo", count=args.round_trips, block=100)
    d50, t50 = quantile(times["direct"], 0.5), quantile(times["tunnel"], 0.5)
    print(f"\nround trip: {ECHO_SIZE}-byte echo, {args.round_trips:,} each, blocks of 100 interleaved (ms)")
    print(f"  {'':<34} {'p50':>7} {'p99':>7} {'max':>7}")
    print(f"  {'tunnel':<34} {percentiles(times['tunnel'])}")
    print(f"  {'direct TCP (baseline)':<34} {percentiles(times['direct'])}")
    print(f"  {'added by the tunnel, p50':<34} {t50 - d50:7.2f}   ({t50 / d50:.1f}× direct)   goal < 1 ms: {verdict(t50 - d50 < 1)}")
    record("tunnel", f"{ECHO_SIZE}-byte echo round trip, p50 of {args.round_trips:,}", t50, "ms", "direct TCP echo", d50,
           f"p99 {quantile(times['tunnel'], 0.99):.2f} ms; goal: under 1 ms added at p50")  # fmt: skip

    # 3. Keystrokes and heartbeats beside bulk copies.
    idle_start = time.perf_counter()
    await asyncio.sleep(args.seconds / 2)
    idle_end = time.perf_counter()
    direct = await contention(child, typist, "direct", args.seconds)
    loaded_start = time.perf_counter()
    async with LoopLag().running() as lags:
        tunnel = await contention(child, typist, "tunnel", args.seconds)
    loaded_end = time.perf_counter()
    print(f"\nkeystroke: 1 byte echoed every {KEYSTROKE_EVERY * 1e3:.0f} ms for {args.seconds:g} s beside "
          f"{COPIES} bulk copies ({COPIES // 2} each way) (ms)")  # fmt: skip
    print(f"  {'':<34} {'p50':>7} {'p99':>7} {'max':>7} {'n':>5}  bulk moved meanwhile")
    print(f"  {'through the tunnel, same link':<34} {percentiles(tunnel['rtts'])} {len(tunnel['rtts']):>5}  "
          f"{tunnel['bulk_bytes_per_s'] / MB:,.0f} MB/s")  # fmt: skip
    print(f"  {'direct TCP, 20 direct copies':<34} {percentiles(direct['rtts'])} {len(direct['rtts']):>5}  "
          f"{direct['bulk_bytes_per_s'] / MB:,.0f} MB/s")  # fmt: skip
    print(f"  {'through the tunnel at rest':<34} {percentiles(times['tunnel'])} {len(times['tunnel']):>5}")
    lag_of = "relay+agent" if args.layout == "one-process" else "the agent's"
    print(f"  {'event-loop lag, ' + lag_of + ' process':<34} {percentiles(lags)} {len(lags):>5}")
    p99 = quantile(tunnel["rtts"], 0.99)
    print(f"  tunnel p99 {p99:.1f} ms: {p99 / quantile(times['tunnel'], 0.99):.0f}× at rest, "
          f"{p99 / quantile(direct['rtts'], 0.99):.1f}× direct under load; goal < 20 ms: {verdict(p99 < 20)}")  # fmt: skip
    record("tunnel", f"keystroke echo beside {COPIES} bulk copies on the same link, p99", p99, "ms",
           f"direct TCP beside {COPIES} direct copies", quantile(direct["rtts"], 0.99), "goal: under 20 ms")  # fmt: skip

    idle, idle_missing = acks.between(idle_start, idle_end)
    loaded, loaded_missing = acks.between(loaded_start, loaded_end)
    print(f"\nheartbeat → ack at the agent, a heartbeat every {args.heartbeat_interval:g} s (ms)")
    print(f"  {'':<34} {'p50':>7} {'p99':>7} {'max':>7} {'n':>5}  unacked at the end")
    for label, delays, missing in (
        ("beside 20 tunnel copies", loaded, loaded_missing),
        ("idle (baseline)", idle, idle_missing),
    ):
        if delays:
            print(f"  {label:<34} {percentiles(delays)} {len(delays):>5}  {missing}")
        else:
            print(f"  {label:<34} {'-':>7} {'-':>7} {'-':>7} {0:>5}  {missing}")
    if loaded and idle:
        print(f"  beside copies p99 {quantile(loaded, 0.99) / quantile(idle, 0.99):.1f}× idle; "
              f"max {max(loaded):.0f} ms against a 10 s production interval")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a few seconds: 32 MiB, 300 round trips, 2 s phases")
    parser.add_argument("--mb", type=int, default=None, help="MiB copied each way (default 512)")
    parser.add_argument("--round-trips", type=int, default=None, help="echo round trips each path (default 2000)")
    parser.add_argument("--seconds", type=float, default=None, help="keystroke phase length, each path (default 8)")
    parser.add_argument("--heartbeat-interval", type=float, default=0.1, help="the agent's heartbeat (default 0.1 s)")
    parser.add_argument("--loop", choices=LOOP_KINDS, default="auto",
                        help="the event loop of the relay, the agent and the renter (default: uvloop where it imports)")
    parser.add_argument("--layout", choices=tuple(LAYOUTS), default="processes",
                        help="the relay in its own process as in production (default), or relay and agent in one")
    parser.add_argument("--stream-data", type=int, default=LARGE_DATA,
                        help=f"the DATA frame size the agent offers the relay (default {LARGE_DATA}; {MAX_DATA}: protocol v1's)")
    parser.add_argument("--renter", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--relay-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.renter or args.relay_process:
        run_on_loop(renter_main() if args.renter else relay_main(), kind=args.loop)
        return 0
    args.mb = args.mb or (32 if args.quick else 512)
    args.round_trips = args.round_trips or (300 if args.quick else 2000)
    args.seconds = args.seconds or (2.0 if args.quick else 8.0)
    if args.mb < 1 or args.round_trips < 1 or args.seconds <= 0 or args.heartbeat_interval <= 0:
        parser.error("every figure must be positive")
    return run_on_loop(run(args), kind=args.loop)


if __name__ == "__main__":
    sys.exit(main())
