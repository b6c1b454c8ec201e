"""How many agents one relay process holds: memory per connection, CPU per message at the steady
rate, end-to-end ack latency, connection set-up and drain, against a websockets TLS echo in the same run.

The server runs in a child process (``multiprocessing``, spawn), so its figures are its own:
RSS (``VmRSS``) and CPU (``utime + stime``) are read from ``/proc/<pid>``. The simulated agents
live in ``--workers`` other processes (so that they are not what limits the server), each with
its share: real ``websockets`` clients over TLS 1.3, each with its own client certificate. To keep
set-up short, a worker's certificates share one P-256 key (one CSR, signed once per host id: the
relay only reads the host id and serial); every agent still has its own certificate, serial and
``SSLContext``. Every process raises its open-files limit to the hard limit; where that caps
what one server can hold, the run says so and caps its steps (``RESERVED_FILES`` below it).

Traffic is the production cadence, not scaled: every agent sends one heartbeat and one telemetry
frame (an 8-GPU host: latest samples + window aggregates) every ``--interval`` seconds (10),
evenly spread, with a random phase per agent; the relay acks each after putting it on its bus (an
``InProcessBus`` in the child, trimmed to its last ``BUS_RECORDS`` records as it goes: a Redis
bus would add its client's CPU, and its records are Redis's memory, not the relay's, so the child
keeps only a few of them, not to count them in the relay's memory per agent). The
agents are connected in steps (``--agents 500,2000``); after each step and ``--settle`` seconds,
the child's CPU is sampled over ``--measure`` seconds, its RSS read, and the workers report the
acks they read in that window and each one's latency (frame sent → its ack read).

Servers, one child each:

* ``relay``: ``access.relay.Relay`` as ``gpumarket access`` runs it on asyncio's own loop
  (``GPUMARKET_EVENT_LOOP=asyncio``: TLS, client certificates, 16 KiB TLS reads through one shared
  buffer, decode, bus, acks).
* ``relay-uvloop``: the same on uvloop, ``gpumarket access``'s default loop (``auto``): uvloop's TLS
  protocol has a read buffer of its own per connection (256 KiB, malloc'd: resident as far as reads
  fill it), which ``access.tls`` cannot share.
* ``relay-256k``: the same with CPython's 256 KiB TLS reads (the ``upload MB/s`` column, a
  speed-test upload of ``--bulk-mib`` MiB in 1 MiB frames, shows what the read size costs bulk).
* ``echo-tls``: a plain ``websockets`` server over TLS with client certificates that answers each
  frame with a fixed ack: no decoding, no bus. The baseline the relay's CPU per message is held to.
* ``echo``: the same without TLS: the floor for a Python websockets connection.

Read the ratios, not the absolute figures, on a shared machine: a loaded machine starves the
agents' workers (fewer messages per second than the cadence asks, latency in seconds) and with
them the server's per-message figures, which then carry its fixed costs (keepalive pings) over
fewer messages. Measured figures and conclusions: README "Performance" and docs/operations.md
"Relay capacity".

Usage: ``python bench/bench_relay_capacity.py [--agents 500,2000] [--interval 10] [--measure 10]
[--workers 2] [--servers relay,echo-tls] [--bulk-mib 32]``; 20,000 agents:
``--agents 2000,20000 --bulk-mib 0`` (needs a hard open-files limit above 20,064, and minutes of
set-up: every agent's certificate and handshake).
"""

from __future__ import annotations

import argparse
import asyncio
import asyncio.sslproto
import contextlib
import json
import multiprocessing
import os
import random
import resource
import ssl
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from access.relay import AGENT_PATH, SPEEDTEST_PATH, Relay
from access.service import set_tls_read_buffer
from access.tls import share_read_buffer
from shared import protocol
from shared.outbound import OutboundWindow

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    Progress,
    agent_context,
    busy_backend,
    describe_machine,
    open_agent,
    quantile,
    record,
    telemetry_body,
    write_agent_key,
)

from shared import eventloop
from shared.bus import InProcessBus
from shared.crypto import CertificateAuthority, server_ssl_context
from shared.settings import AccessSettings

GPUS = "sim:8xH100"
SMALL_TLS_READ = 16 << 10
IO_TIMEOUT = 120.0
BUS_RECORDS = 50  # what the child's InProcessBus keeps (a few KB each): Redis's memory in production
RESERVED_FILES = 64  # a process's own files besides its sockets: listener, epoll, pipes, libraries
ECHO_ACK = protocol.encode(protocol.Ack(body=protocol.AckBody(seq=0)))
SERVERS = {
    "relay": "Relay, as `gpumarket access` runs it (asyncio)",
    "relay-uvloop": "Relay on uvloop (`gpumarket access`'s default)",
    "relay-256k": "Relay, 256 KiB TLS reads (CPython's)",
    "echo": "websockets echo, no TLS",
    "echo-tls": "websockets echo, TLS",
}


def raise_open_files_limit() -> int:
    """Raise this process's open-files limit to its hard limit; return the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def proc_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def proc_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


# ---- the server, in a child process -----------------------------------------------------------


@dataclass(frozen=True)
class ServerSpec:
    name: str
    cert_file: str
    key_file: str
    ca_file: str


def serve_child(spec: ServerSpec, control: Connection, results: Connection) -> None:
    """Child process entry point: run the server until the parent says stop, then drain and report."""
    raise_open_files_limit()
    if spec.name == "relay":
        set_tls_read_buffer(AccessSettings().tls_read_buffer_kib)  # as serve_access does
    eventloop.run(_serve(spec, control, results), kind="uvloop" if spec.name == "relay-uvloop" else "asyncio")


async def _echo(connection: ServerConnection) -> None:
    with contextlib.suppress(ConnectionClosed):  # closed by the server's close() mid-send
        await connection.send('{"v":1,"type":"welcome"}')
        async for _frame in connection:
            await connection.send(ECHO_ACK)


async def _serve(spec: ServerSpec, control: Connection, results: Connection) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def wait_for_stop() -> None:
        control.recv()
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=wait_for_stop, daemon=True).start()
    if spec.name.startswith("echo"):
        context = None
        if spec.name == "echo-tls":
            context = server_ssl_context(Path(spec.cert_file), Path(spec.key_file), Path(spec.ca_file))
        server = await serve(_echo, "127.0.0.1", 0, ssl=context, max_queue=16, compression=None, server_header=None)
        scheme = "wss" if context else "ws"
        results.send({"url": f"{scheme}://127.0.0.1:{server.sockets[0].getsockname()[1]}{AGENT_PATH}"})
        await stop.wait()
        started = time.perf_counter()
        server.close()
        await server.wait_closed()
        results.send({"drain_seconds": time.perf_counter() - started, "forwarded": None})
        return
    bus = InProcessBus(max_len=BUS_RECORDS)  # no consumer group: trimmed as it goes
    relay = Relay(
        relay_id="relay-capacity",
        bus=bus,
        ssl_context=server_ssl_context(Path(spec.cert_file), Path(spec.key_file), Path(spec.ca_file)),
        open_timeout=IO_TIMEOUT,
        max_connections=1_000_000,
        # Every simulated agent comes from 127.0.0.1: the per-source limit would refuse them.
        max_connections_per_source_per_minute=1e9,
        connection_burst_per_source=1_000_000,
    )
    await relay.start()
    results.send({"url": relay.url})
    await stop.wait()
    connected = len(relay.agents)
    started = time.perf_counter()
    await relay.close()
    results.send(
        {"drain_seconds": time.perf_counter() - started, "forwarded": relay.messages_forwarded, "drained": connected}
    )
    await bus.close()


# ---- the agents, in worker processes ------------------------------------------------------------


@dataclass
class AgentSetup:
    host_id: str
    context: ssl.SSLContext
    window: OutboundWindow
    telemetry: protocol.TelemetryBody
    sent_at: dict[int, float] = field(default_factory=dict)  # seq -> when it was sent, until acked


@dataclass
class Tally:
    """What a worker's agents saw since the parent last said ``mark``."""

    acked: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    failed: int = 0


def make_agents(ca: CertificateAuthority, directory: Path, first: int, count: int) -> list[AgentSetup]:
    """Agents ``first`` .. ``first + count - 1``: one shared key (see the module docstring), a
    certificate and context each."""
    directory.mkdir(parents=True, exist_ok=True)
    key_file = directory / "shared.key"
    csr = write_agent_key(key_file, "h-capacity")
    telemetry = telemetry_body(busy_backend(GPUS, seed="capacity"), window_s=10.0)
    agents = []
    for number in range(first, first + count):
        host_id = f"h-cap-{number:05d}"
        issued = ca.sign_agent_csr(csr, host_id=host_id)
        context = agent_context(ca.cert_path, key_file, directory / f"{host_id}.crt", issued.cert_pem)
        agents.append(AgentSetup(host_id, context, OutboundWindow(host_id, first_seq=1), telemetry))
    return agents


async def agent_traffic(ws: ClientConnection, agent: AgentSetup, interval: float, rng: random.Random, tally: list[Tally]) -> None:
    """Heartbeat and telemetry, each every ``interval``, evenly spread; count the acks and time them
    (send to ack, end to end through the relay and its bus). ``tally[0]`` is the current tally."""

    async def read() -> None:
        async for frame in ws:
            message = json.loads(frame)
            if message.get("type") == "ack":
                seq = message["body"]["seq"]
                agent.window.ack(seq)
                sent = agent.sent_at.pop(seq, None)
                tally[0].acked += 1
                if sent is not None:
                    tally[0].latencies_ms.append((time.perf_counter() - sent) * 1e3)

    async def write() -> None:
        await asyncio.sleep(rng.uniform(0, interval / 2))
        heartbeat = True
        while True:
            if heartbeat:
                seq, frame = agent.window.heartbeat(protocol.HeartbeatBody(uptime_s=1.0))
            else:
                seq, frame = agent.window.telemetry(agent.telemetry)
            heartbeat = not heartbeat
            agent.sent_at[seq] = time.perf_counter()
            await ws.send(frame)
            await asyncio.sleep(interval / 2)

    with contextlib.suppress(Exception):  # the server goes away at the end of the run
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(read())
            tasks.create_task(write())


async def speedtest_upload(url: str, agent: AgentSetup, mib: int) -> float:
    """Upload ``mib`` MiB through the relay's speed test in 1 MiB frames; the relay's own MB/s."""
    port = url.split(":")[2].split("/")[0]
    async with connect(
        f"wss://127.0.0.1:{port}{SPEEDTEST_PATH}", ssl=agent.context, open_timeout=IO_TIMEOUT, compression=None,
        proxy=None, max_size=protocol.DEFAULT_MAX_FRAME,
    ) as ws:
        hello = json.loads(await ws.recv())
        frame_size = min(int(hello["max_frame"]), 1 << 20)
        total = min(mib << 20, int(hello["max_bytes_per_request"]))
        await ws.send(json.dumps({"op": "upload", "bytes": total}))
        payload = os.urandom(frame_size)
        sent = 0
        while sent < total:
            chunk = payload[: min(frame_size, total - sent)]
            await ws.send(chunk)
            sent += len(chunk)
        done = json.loads(await ws.recv())
        return total / float(done["seconds"]) / 1e6


async def connect_agents(url: str, agents: list[AgentSetup], parallel: int, tally: Tally) -> list[ClientConnection | None]:
    """Connect ``agents``, ``parallel`` handshakes at a time; ``None`` (and counted) for each that failed."""
    slots = asyncio.Semaphore(parallel)

    async def one(agent: AgentSetup) -> ClientConnection | None:
        async with slots:
            try:
                ws = await open_agent(url, agent.host_id, agent.context if url.startswith("wss:") else None,
                                      open_timeout=IO_TIMEOUT)
            except (OSError, TimeoutError, ConnectionClosed, RuntimeError):
                tally.failed += 1
                return None
            share_read_buffer(ws.transport)  # the clients' memory is not measured, only kept small
            return ws

    return await asyncio.gather(*(one(agent) for agent in agents))


@dataclass(frozen=True)
class WorkerSpec:
    ca_dir: str
    directory: str
    first: int
    count: int
    interval: float
    connect_parallel: int
    seed: int


def agent_worker(spec: WorkerSpec, commands: Connection, replies: Connection) -> None:
    """Worker process entry point: hold a share of the agents, driven by the parent's commands."""
    raise_open_files_limit()
    asyncio.sslproto.SSLProtocol.max_size = SMALL_TLS_READ  # this worker's clients only
    asyncio.run(_agent_worker(spec, commands, replies))


async def _agent_worker(spec: WorkerSpec, commands: Connection, replies: Connection) -> None:
    """Commands: ``("connect", url, n)`` (connect the next agents until ``n`` are up, start their
    traffic), ``("mark",)`` (start a new tally), ``("report",)``, ``("upload", url, mib)``,
    ``("close",)`` (drop every connection) and ``("exit",)``."""
    ca = CertificateAuthority.load_or_create(Path(spec.ca_dir))
    agents = make_agents(ca, Path(spec.directory), spec.first, spec.count)
    replies.send(("ready",))
    rng = random.Random(spec.seed)
    tally = [Tally()]
    connections: list[ClientConnection] = []
    traffic: list[asyncio.Task[None]] = []

    async def close_all() -> None:
        for task in traffic:
            task.cancel()
        await asyncio.gather(*traffic, return_exceptions=True)
        for ws in connections:
            ws.transport.abort()
        traffic.clear()
        connections.clear()
        for agent in agents:
            agent.window, agent.sent_at = OutboundWindow(agent.host_id, first_seq=1), {}

    while True:
        command, *arguments = await asyncio.to_thread(commands.recv)
        if command == "connect":
            url, target = arguments
            new = agents[len(connections):target]
            opened = await connect_agents(url, new, spec.connect_parallel, tally[0])
            for ws, agent in zip(opened, new, strict=True):
                if ws is not None:
                    connections.append(ws)
                    traffic.append(asyncio.create_task(agent_traffic(ws, agent, spec.interval, rng, tally)))
            replies.send(("connected", len(connections)))
        elif command == "mark":
            tally[0] = Tally(failed=tally[0].failed)
            replies.send(("marked",))
        elif command == "report":
            replies.send(("report", tally[0].acked, tally[0].latencies_ms, tally[0].failed))
        elif command == "upload":
            url, mib = arguments
            try:
                rates = [await speedtest_upload(url, agents[-1], mib) for _ in range(3)]
            except (OSError, TimeoutError, ConnectionClosed) as exc:
                print(f"  speed-test upload failed: {exc!r}", file=sys.stderr)
                replies.send(("uploaded", None))
            else:
                replies.send(("uploaded", sorted(rates)[1]))
        elif command == "close":
            await close_all()
            replies.send(("closed",))
        else:
            await close_all()
            return


class Workers:
    """The agent worker processes, each with its share of the agents, driven in lockstep."""

    def __init__(self, specs: list[WorkerSpec]) -> None:
        mp = multiprocessing.get_context("spawn")
        self.specs = specs
        self.channels: list[tuple[Connection, Connection]] = []
        self.processes = []
        for spec in specs:
            commands_read, commands_write = mp.Pipe(duplex=False)
            replies_read, replies_write = mp.Pipe(duplex=False)
            process = mp.Process(target=agent_worker, args=(spec, commands_read, replies_write), daemon=True)
            process.start()
            self.processes.append(process)
            self.channels.append((commands_write, replies_read))

    async def ask(self, *commands: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """Send worker i ``commands[i]`` (or ``commands[0]`` to all) and return their replies."""
        for number, (write, _read) in enumerate(self.channels):
            write.send(commands[number] if len(commands) > 1 else commands[0])
        return [await asyncio.to_thread(read.recv) for _write, read in self.channels]

    async def ready(self) -> None:
        """Wait until every worker has made its agents' certificates."""
        for _write, read in self.channels:
            await asyncio.to_thread(read.recv)

    async def ask_one(self, number: int, command: tuple[Any, ...]) -> tuple[Any, ...]:
        write, read = self.channels[number]
        write.send(command)
        reply: tuple[Any, ...] = await asyncio.to_thread(read.recv)
        return reply

    def shares(self, total: int) -> list[int]:
        """How many of ``total`` agents each worker holds."""
        count = len(self.specs)
        return [min(spec.count, total * (n + 1) // count - total * n // count) for n, spec in enumerate(self.specs)]

    def stop(self) -> None:
        for write, _read in self.channels:
            with contextlib.suppress(OSError):
                write.send(("exit",))
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()


@dataclass
class Step:
    agents: int
    connect_rate: float  # connections per second in this step
    connect_cpu_ms: float  # the server's CPU per new connection in this step
    rss_mib: float
    rss_per_agent_kib: float
    cpu_pct: float  # the server's, at the steady rate
    msgs_per_s: float
    cpu_us_per_msg: float
    p50_ms: float
    p99_ms: float


@dataclass
class ServerRun:
    name: str
    base_rss_mib: float = 0.0
    steps: list[Step] = field(default_factory=list)
    drain_seconds: float = 0.0
    upload_mbps: float | None = None
    failed: int = 0


async def measure_server(name: str, paths: tuple[Path, Path, Path], workers: Workers, args: argparse.Namespace) -> ServerRun:
    cert_file, key_file, ca_file = paths
    mp = multiprocessing.get_context("spawn")
    control_read, control_write = mp.Pipe(duplex=False)
    results_read, results_write = mp.Pipe(duplex=False)
    child = mp.Process(
        target=serve_child,
        args=(ServerSpec(name, str(cert_file), str(key_file), str(ca_file)), control_read, results_write),
        daemon=True,
    )
    child.start()
    pid = child.pid or 0
    run = ServerRun(name)
    try:
        async with asyncio.timeout(30):
            url = (await asyncio.to_thread(results_read.recv))["url"]
        await asyncio.sleep(0.5)
        run.base_rss_mib = proc_rss_mib(pid)
        connected = 0
        for target in args.agents:
            cpu_before, started = proc_cpu_seconds(pid), time.perf_counter()
            replies = await workers.ask(*(("connect", url, share) for share in workers.shares(target)))
            connect_seconds, connect_cpu = time.perf_counter() - started, proc_cpu_seconds(pid) - cpu_before
            new, connected = sum(r[1] for r in replies) - connected, sum(r[1] for r in replies)
            print(f"  {name}: {connected:,} agents connected", file=sys.stderr)
            await asyncio.sleep(args.settle)  # handshakes' garbage, first frames
            await workers.ask(("mark",))
            cpu_before, started = proc_cpu_seconds(pid), time.perf_counter()
            await asyncio.sleep(args.measure)
            cpu, seconds = proc_cpu_seconds(pid) - cpu_before, time.perf_counter() - started
            reports = await workers.ask(("report",))
            rss = proc_rss_mib(pid)
            messages = sum(r[1] for r in reports)
            latencies = [ms for r in reports for ms in r[2]]
            run.failed = sum(r[3] for r in reports)
            run.steps.append(
                Step(
                    agents=connected,
                    connect_rate=new / connect_seconds if new else float("nan"),
                    connect_cpu_ms=connect_cpu / new * 1e3 if new else float("nan"),
                    rss_mib=rss,
                    rss_per_agent_kib=(rss - run.base_rss_mib) * 1024 / max(connected, 1),
                    cpu_pct=cpu / seconds * 100,
                    msgs_per_s=messages / seconds,
                    cpu_us_per_msg=cpu / messages * 1e6 if messages else float("nan"),
                    p50_ms=quantile(latencies, 0.5),
                    p99_ms=quantile(latencies, 0.99),
                )
            )
        if name.startswith("relay") and args.bulk_mib > 0:
            _, run.upload_mbps = await workers.ask_one(0, ("upload", url, args.bulk_mib))
        control_write.send("stop")
        async with asyncio.timeout(120):
            report = await asyncio.to_thread(results_read.recv)
        run.drain_seconds = report["drain_seconds"]
    finally:
        with contextlib.suppress(OSError, EOFError):  # a worker that died has said why on stderr
            await workers.ask(("close",))
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
            child.join()
    return run


# ---- report -----------------------------------------------------------------------------------


def print_report(runs: list[ServerRun], interval: float) -> None:
    print(f"\nper server process (child), at {2 / interval:g} msgs/s per agent (heartbeat + telemetry every {interval:g} s)")
    header = (
        f"  {'server':<38} {'agents':>6} {'conn/s':>7} {'ms CPU/conn':>11} {'RSS MiB':>8} {'KiB/agent':>9} "
        f"{'CPU %':>6} {'msgs/s':>7} {'µs CPU/msg':>10} {'p50 ms':>7} {'p99 ms':>7} {'upload MB/s':>11} {'drain s':>7}"
    )
    print(header)
    for run in runs:
        for number, step in enumerate(run.steps):
            last = number == len(run.steps) - 1
            upload = f"{run.upload_mbps:,.0f}" if last and run.upload_mbps is not None else ""
            drain = f"{run.drain_seconds:.2f}" if last else ""
            print(
                f"  {SERVERS[run.name] if number == 0 else '':<38} {step.agents:>6,} {step.connect_rate:>7,.0f} "
                f"{step.connect_cpu_ms:>11.2f} {step.rss_mib:>8,.0f} {step.rss_per_agent_kib:>9,.1f} "
                f"{step.cpu_pct:>6.1f} {step.msgs_per_s:>7,.0f} {step.cpu_us_per_msg:>10,.0f} {step.p50_ms:>7.1f} "
                f"{step.p99_ms:>7.1f} {upload:>11} {drain:>7}"
            )
        if run.failed:
            print(f"  {'':<38} {run.failed:,} connection attempts failed (counted out of the agents above)")
    print(
        "  conn/s: handshakes completed per second, limited by whichever side (agents or server) saturates;\n"
        "  ms CPU/conn: the server's CPU per new connection (TLS handshake + upgrade + welcome; includes the steady load);\n"
        "  KiB/agent: (RSS - RSS before any agent) / agents; CPU %, msgs/s and latency: the steady state after connecting;\n"
        "  p50/p99 ms: an agent's frame sent to its ack read, through the server and the relay's bus (echo servers\n"
        "    answer a fixed ack, so no latency for them);\n"
        "  upload MB/s: a speed-test upload through the relay, median of 3 (bulk cost of the read size);\n"
        "  drain s: Relay.close() with every agent connected (move + close 1001 to each), or the echo server's close."
    )
    steps = {run.name: run.steps[-1] for run in runs if run.steps}
    for relay in ("relay", "relay-uvloop", "relay-256k"):
        if relay in steps and "echo-tls" in steps and steps[relay].agents == steps["echo-tls"].agents:
            ratio = steps[relay].cpu_us_per_msg / steps["echo-tls"].cpu_us_per_msg
            print(f"  {relay} / echo-tls CPU per message at {steps[relay].agents:,} agents: {ratio:.2f}×")
    for relay, what in (("relay", "relay process"), ("relay-uvloop", "relay process on uvloop")):
        if relay not in steps:
            continue
        step, echo = steps[relay], steps.get("echo-tls")
        same = echo is not None and echo.agents == step.agents
        record("relay_capacity", f"{what} with {step.agents:,} agents at the protocol's periods: CPU per message",
               step.cpu_us_per_msg, "µs", "websockets TLS echo" if same else None, echo.cpu_us_per_msg if same and echo else None,
               f"ack p99 {step.p99_ms:.0f} ms", component="relay")  # fmt: skip
        record("relay_capacity", f"{what} with {step.agents:,} agents: memory per agent", step.rss_per_agent_kib,
               "KiB", "websockets TLS echo" if same else None, echo.rss_per_agent_kib if same and echo else None,
               "goal ≤ 40 KiB", component="relay")  # fmt: skip


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--agents", default="500,2000", help="connected agents after each step (default 500,2000)")
    parser.add_argument("--interval", type=float, default=10.0, help="heartbeat and telemetry interval, s (default 10)")
    parser.add_argument("--measure", type=float, default=10.0, help="seconds of steady state measured per step (default 10)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds between connecting and measuring (default 2)")
    parser.add_argument("--connect-parallel", type=int, default=50, help="handshakes in progress at once per worker (default 50)")
    parser.add_argument("--workers", type=int, default=2, help="agent processes (default 2)")
    parser.add_argument("--bulk-mib", type=int, default=32, help="speed-test upload size, MiB (default 32; 0 = skip)")
    parser.add_argument("--servers", default="relay,echo-tls", help=f"servers to measure ({', '.join(SERVERS)})")
    args = parser.parse_args()
    args.agents = sorted({int(n) for n in args.agents.split(",")})
    servers = [s for s in args.servers.split(",") if s]
    if min(args.agents) < 1 or args.interval <= 0 or args.measure <= 0 or args.connect_parallel < 1 or args.workers < 1:
        parser.error("counts and durations must be positive")
    if unknown := [s for s in servers if s not in SERVERS]:
        parser.error(f"unknown server(s) {', '.join(unknown)}; choose from {', '.join(SERVERS)}")
    files = raise_open_files_limit()  # the children raise their own the same way
    print(describe_machine(with_openssl=True))
    most = files - RESERVED_FILES
    if max(args.agents) > most:
        print(
            f"open files: this machine caps a process at {files:,} (hard limit), so a server holds at most {most:,} "
            f"agents here; steps above it run with {most:,} (raise the hard limit, e.g. LimitNOFILE, for more)"
        )
        args.agents = sorted({min(n, most) for n in args.agents})
    print(
        f"agents: {', '.join(f'{n:,}' for n in args.agents)} (cumulative steps) in {args.workers} worker process(es); "
        f"each server in its own child process; TLS 1.3 with client certificates (ECDSA P-256), "
        f"handshakes {args.connect_parallel} at a time per worker; open files per process: {files:,}"
    )
    with tempfile.TemporaryDirectory(prefix="gpumarket-capacity-") as temporary:
        directory = Path(temporary)
        ca = CertificateAuthority.load_or_create(directory / "ca")
        key_file, cert_file = ca.write_server_certificate(directory, ["127.0.0.1", "localhost"])
        started = time.perf_counter()
        total = max(args.agents)
        workers = Workers([
            WorkerSpec(str(directory / "ca"), str(directory / f"worker-{n}"), total * n // args.workers,
                       total * (n + 1) // args.workers - total * n // args.workers, args.interval, args.connect_parallel, n)
            for n in range(args.workers)
        ])
        try:
            progress = Progress("agent certificates (in the workers)", total)
            await workers.ready()
            progress.done()
            window = OutboundWindow("h-cap-00000", first_seq=1)
            heartbeat_bytes = len(window.heartbeat(protocol.HeartbeatBody(uptime_s=1.0))[1])
            telemetry_bytes = len(window.telemetry(telemetry_body(busy_backend(GPUS, seed="capacity"), window_s=10.0))[1])
            print(
                f"set-up: {total:,} agent certificates in {time.perf_counter() - started:.1f} s (one shared key per worker); "
                f"frames: heartbeat {heartbeat_bytes} B, telemetry of 8 GPUs ({GPUS}) {telemetry_bytes:,} B"
            )
            runs = []
            for name in servers:
                runs.append(await measure_server(name, (cert_file, key_file, ca.cert_path), workers, args))
                print(f"  measured {SERVERS[name]}", file=sys.stderr)
        finally:
            workers.stop()
    print_report(runs, args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
