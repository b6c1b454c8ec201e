"""How many agents one relay process holds: memory per connection, CPU at the steady message rate,
connection setup rate, and drain time, with a plain websockets baseline in the same run.

The server runs in a child process (``multiprocessing``, spawn), so its figures are its own:
RSS (``VmRSS``) and CPU (``utime + stime``) are read from ``/proc/<pid>``. This process holds the
simulated agents, all on one event loop: real ``websockets`` clients over TLS 1.3, each with its
own client certificate. To keep set-up short, the certificates share one P-256 key (one CSR,
signed once per host id: the relay only reads the host id and serial, so this changes nothing
it does); every agent still has its own certificate, serial and ``SSLContext``.

Traffic is the production cadence, not scaled: every agent sends one heartbeat and one telemetry
frame (an 8-GPU host: latest samples + window aggregates) every ``--interval`` seconds (10),
evenly spread, with a random phase per agent; the relay acks each after putting it on its bus (an
``InProcessBus`` in the child, trimmed as it goes: a Redis bus would add its client's CPU). The
agents are connected in steps (``--agents 500,2000``); after each step, and a settling second,
the child's CPU is sampled over ``--measure`` seconds and its RSS read.

Servers, one child each:

* ``relay``: ``access.relay.Relay`` as deployed (TLS, client certificates, decode, bus, acks).
* ``relay-16k``: the same, with ``asyncio.sslproto.SSLProtocol.max_size`` lowered from 256 KiB to
  16 KiB in the child. CPython's asyncio allocates (and zero-fills, so it is resident) one read
  buffer of ``max_size`` per TLS connection; 16 KiB is one TLS record, so small frames cost the
  same, and a large transfer needs more, smaller reads. The ``upload MB/s`` column (speed-test
  uploads of ``--bulk-mib`` MiB in 1 MiB frames through the relay, median of 3) shows what that costs.
* ``echo``: a plain ``websockets`` server without TLS that answers each frame with a fixed ack,
  no decoding, no bus: the floor for a Python websockets connection.
* ``echo-tls`` (only when asked for): the same echo over TLS with client certificates, which
  separates the cost of TLS from the relay's own.

This process's clients use 16 KiB TLS read buffers too (it does not touch the child), only so
that 2,000 clients fit comfortably; it does not change what the server measures.

Conclusion (2-core Xeon VM, CPython 3.11, OpenSSL 3.0; two default runs agreed within ~15 %).
A relay process's memory is dominated by TLS: with CPython's default 256 KiB read buffer each
agent costs about 330 KiB resident (a TLS echo server costs about 310 KiB, a plain websockets
connection under 20 KiB), so 10,000 agents need about 3.2 GiB. With 16 KiB read buffers it is
about 93 KiB per agent (0.9 GiB for 10,000) and no measurable loss on small frames or on a bulk
speed-test upload (120-420 MB/s across runs with either buffer: noise, no consistent penalty,
and far above what a speed test needs): worth adopting, with the
caveat that ``SSLProtocol.max_size`` is an asyncio internal, set process-wide. CPU at the
production cadence (2 messages per agent per 10 s) is about 13 % of one core for 2,000 agents,
about 0.3 ms per message including keepalive pings, so roughly 65 % of a core for 10,000 agents;
each new TLS 1.3 connection with a client certificate costs the relay 2-3 ms of CPU, i.e. about
350-450 handshakes per second per core, so 10,000 agents reconnecting after a relay loss is
25-30 s of a whole core on top of the steady load. Plan for about 5,000 agents per relay process
(one process per core, each published in the registry), with ``max_connections`` 10,000 as the
hard ceiling. Beyond that, the alternative is to terminate TLS in front of the relays (HAProxy,
nginx or Envoy, in C: typically tens of KiB of TLS state per connection and handshakes without
Python's per-connection overhead; not measured here); the relay then needs the client certificate (or its host id and serial) forwarded by the
proxy, for example in a header it sets and the relay trusts only from the proxy, and its
per-source connection limit raised or keyed on the forwarded client address, since every
connection then comes from the proxy.

Usage: ``python bench/bench_relay_capacity.py [--agents 500,2000] [--interval 10] [--measure 4]
[--servers relay,relay-16k,echo]``; the default run takes about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
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

from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from access.relay import AGENT_PATH, SPEEDTEST_PATH, Relay
from shared import protocol
from shared.outbound import OutboundWindow

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    Counter,
    Progress,
    agent_context,
    busy_backend,
    describe_machine,
    open_agent,
    telemetry_body,
    write_agent_key,
)

from shared.bus import InProcessBus
from shared.crypto import CertificateAuthority, server_ssl_context

GPUS = "sim:8xH100"
SMALL_TLS_READ = 16 << 10
IO_TIMEOUT = 60.0
ECHO_ACK = protocol.encode(protocol.Ack(body=protocol.AckBody(seq=0)))
SERVERS = {
    "relay": "Relay, TLS (256 KiB read buffer)",
    "relay-16k": "Relay, TLS (16 KiB read buffer)",
    "echo": "websockets echo, no TLS",
    "echo-tls": "websockets echo, TLS (256 KiB)",  # not run by default: splits TLS from the relay's own cost
}


def raise_open_files_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


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
    if spec.name == "relay-16k":
        asyncio.sslproto.SSLProtocol.max_size = SMALL_TLS_READ  # type: ignore[attr-defined]
    asyncio.run(_serve(spec, control, results))


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
    bus = InProcessBus(max_len=20_000)  # no consumer group: trimmed as it goes
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


# ---- the agents ---------------------------------------------------------------------------------


@dataclass
class AgentSetup:
    host_id: str
    context: ssl.SSLContext
    window: OutboundWindow
    telemetry: protocol.TelemetryBody


def make_agents(ca: CertificateAuthority, directory: Path, count: int) -> list[AgentSetup]:
    """``count`` agents: one shared key (see the module docstring), a certificate and context each."""
    key_file = directory / "shared.key"
    csr = write_agent_key(key_file, "h-capacity")
    telemetry = telemetry_body(busy_backend(GPUS, seed="capacity"), window_s=10.0)
    agents = []
    progress = Progress("agent certificates", count)
    for number in range(count):
        host_id = f"h-cap-{number:05d}"
        issued = ca.sign_agent_csr(csr, host_id=host_id)
        context = agent_context(ca.cert_path, key_file, directory / f"{host_id}.crt", issued.cert_pem)
        agents.append(AgentSetup(host_id, context, OutboundWindow(host_id, first_seq=1), telemetry))
        progress.update(number + 1)
    progress.done()
    return agents


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


@dataclass
class ServerRun:
    name: str
    base_rss_mib: float = 0.0
    steps: list[Step] = field(default_factory=list)
    drain_seconds: float = 0.0
    upload_mbps: float | None = None


async def agent_traffic(ws: ClientConnection, agent: AgentSetup, interval: float, rng: random.Random, counter: Counter) -> None:
    """Heartbeat and telemetry, each every ``interval``, evenly spread; count the acks."""

    async def read() -> None:
        async for frame in ws:
            message = json.loads(frame)
            if message.get("type") == "ack":
                agent.window.ack(message["body"]["seq"])
                counter.acked += 1

    async def write() -> None:
        await asyncio.sleep(rng.uniform(0, interval / 2))
        heartbeat = True
        while True:
            if heartbeat:
                _seq, frame = agent.window.heartbeat(protocol.HeartbeatBody(uptime_s=1.0))
            else:
                _seq, frame = agent.window.telemetry(agent.telemetry)
            heartbeat = not heartbeat
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


async def measure_server(name: str, paths: tuple[Path, Path, Path], agents: list[AgentSetup], args: argparse.Namespace) -> ServerRun:
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
    run = ServerRun(name)
    connections: list[ClientConnection] = []
    traffic: list[asyncio.Task[None]] = []
    counter = Counter()
    rng = random.Random(1)
    try:
        async with asyncio.timeout(30):
            url = (await asyncio.to_thread(results_read.recv))["url"]
        await asyncio.sleep(0.5)
        run.base_rss_mib = proc_rss_mib(child.pid or 0)
        slots = asyncio.Semaphore(args.connect_parallel)

        async def one(agent: AgentSetup) -> ClientConnection:
            async with slots:
                return await open_agent(
                    url, agent.host_id, agent.context if url.startswith("wss:") else None, open_timeout=IO_TIMEOUT
                )

        for target in args.agents:
            new = agents[len(connections) : target]
            cpu_before, started = proc_cpu_seconds(child.pid or 0), time.perf_counter()
            progress = Progress(f"{name}: connecting", len(new))
            fresh = []
            for batch_start in range(0, len(new), 250):
                fresh += await asyncio.gather(*(one(agent) for agent in new[batch_start : batch_start + 250]))
                progress.update(len(fresh))
            progress.done()
            connect_seconds, connect_cpu = time.perf_counter() - started, proc_cpu_seconds(child.pid or 0) - cpu_before
            for ws, agent in zip(fresh, new, strict=True):
                traffic.append(asyncio.create_task(agent_traffic(ws, agent, args.interval, rng, counter)))
            connections += fresh
            await asyncio.sleep(1.0)  # settle: handshakes' garbage, first frames
            cpu_before, acked_before, started = proc_cpu_seconds(child.pid or 0), counter.acked, time.perf_counter()
            await asyncio.sleep(args.measure)
            seconds = time.perf_counter() - started
            cpu = proc_cpu_seconds(child.pid or 0) - cpu_before
            messages = counter.acked - acked_before
            rss = proc_rss_mib(child.pid or 0)
            run.steps.append(
                Step(
                    agents=len(connections),
                    connect_rate=len(new) / connect_seconds,
                    connect_cpu_ms=connect_cpu / len(new) * 1e3,
                    rss_mib=rss,
                    rss_per_agent_kib=(rss - run.base_rss_mib) * 1024 / len(connections),
                    cpu_pct=cpu / seconds * 100,
                    msgs_per_s=messages / seconds,
                    cpu_us_per_msg=cpu / messages * 1e6 if messages else float("nan"),
                )
            )
        if name.startswith("relay") and args.bulk_mib > 0:
            rates = [await speedtest_upload(url, agents[-1], args.bulk_mib) for _ in range(3)]
            run.upload_mbps = sorted(rates)[1]
        control_write.send("stop")
        async with asyncio.timeout(60):
            report = await asyncio.to_thread(results_read.recv)
        run.drain_seconds = report["drain_seconds"]
    finally:
        for task in traffic:
            task.cancel()
        await asyncio.gather(*traffic, return_exceptions=True)
        for ws in connections:
            ws.transport.abort()
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
            child.join()
    return run


# ---- report -----------------------------------------------------------------------------------


def print_report(runs: list[ServerRun], interval: float) -> None:
    print(f"\nper server process (child), at {2 / interval:g} msgs/s per agent (heartbeat + telemetry every {interval:g} s)")
    header = (
        f"  {'server':<33} {'agents':>6} {'conn/s':>7} {'ms CPU/conn':>11} {'RSS MiB':>8} {'KiB/agent':>9} "
        f"{'CPU %':>6} {'msgs/s':>7} {'µs CPU/msg':>10} {'upload MB/s':>11} {'drain s':>7}"
    )
    print(header)
    for run in runs:
        for number, step in enumerate(run.steps):
            last = number == len(run.steps) - 1
            upload = f"{run.upload_mbps:,.0f}" if last and run.upload_mbps is not None else ""
            drain = f"{run.drain_seconds:.2f}" if last else ""
            print(
                f"  {SERVERS[run.name] if number == 0 else '':<33} {step.agents:>6,} {step.connect_rate:>7,.0f} "
                f"{step.connect_cpu_ms:>11.2f} {step.rss_mib:>8,.0f} {step.rss_per_agent_kib:>9,.1f} "
                f"{step.cpu_pct:>6.1f} {step.msgs_per_s:>7,.0f} {step.cpu_us_per_msg:>10,.0f} {upload:>11} {drain:>7}"
            )
    print(
        "  conn/s: handshakes completed per second, limited by whichever side (this process or the server) saturates;\n"
        "  ms CPU/conn: the server's CPU per new connection (TLS handshake + upgrade + welcome; includes the steady load);\n"
        "  KiB/agent: (RSS - RSS before any agent) / agents; CPU % and msgs/s: the steady state after connecting;\n"
        "  upload MB/s: a speed-test upload through the relay, median of 3 (bulk cost of the read buffer);\n"
        "  drain s: Relay.close() with every agent connected (move + close 1001 to each), or the echo server's close."
    )
    tls = {run.name: run.steps[-1] for run in runs if run.steps}
    if "relay" in tls and "relay-16k" in tls:
        saved = tls["relay"].rss_per_agent_kib - tls["relay-16k"].rss_per_agent_kib
        print(f"  16 KiB TLS read buffers save {saved:,.0f} KiB per connection ({saved * 10_000 / 2**20:,.1f} GiB per 10,000 agents)")


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--agents", default="500,2000", help="connected agents after each step (default 500,2000)")
    parser.add_argument("--interval", type=float, default=10.0, help="heartbeat and telemetry interval, s (default 10)")
    parser.add_argument("--measure", type=float, default=4.0, help="seconds of steady state measured per step (default 4)")
    parser.add_argument("--connect-parallel", type=int, default=50, help="handshakes in progress at once (default 50)")
    parser.add_argument("--bulk-mib", type=int, default=32, help="speed-test upload size, MiB (default 32; 0 = skip)")
    parser.add_argument("--servers", default="relay,relay-16k,echo", help=f"servers to measure ({', '.join(SERVERS)})")
    args = parser.parse_args()
    args.agents = sorted({int(n) for n in args.agents.split(",")})
    servers = [s for s in args.servers.split(",") if s]
    if min(args.agents) < 1 or args.interval <= 0 or args.measure <= 0 or args.connect_parallel < 1:
        parser.error("counts and durations must be positive")
    if unknown := [s for s in servers if s not in SERVERS]:
        parser.error(f"unknown server(s) {', '.join(unknown)}; choose from {', '.join(SERVERS)}")
    raise_open_files_limit()
    asyncio.sslproto.SSLProtocol.max_size = SMALL_TLS_READ  # type: ignore[attr-defined]  # this process's clients only

    print(describe_machine(with_openssl=True))
    print(
        f"agents: {', '.join(f'{n:,}' for n in args.agents)} (cumulative steps) in this process, one event loop; "
        f"each server in its own child process; TLS 1.3 with client certificates (ECDSA P-256), "
        f"handshakes {args.connect_parallel} at a time"
    )
    with tempfile.TemporaryDirectory(prefix="gpumarket-capacity-") as temporary:
        directory = Path(temporary)
        ca = CertificateAuthority.load_or_create(directory / "ca")
        key_file, cert_file = ca.write_server_certificate(directory, ["127.0.0.1", "localhost"])
        started = time.perf_counter()
        agents = make_agents(ca, directory, max(args.agents))
        heartbeat_bytes = len(agents[0].window.heartbeat(protocol.HeartbeatBody(uptime_s=1.0))[1])
        telemetry_bytes = len(agents[0].window.telemetry(agents[0].telemetry)[1])
        agents[0].window = OutboundWindow(agents[0].host_id, first_seq=1)
        print(
            f"set-up: {len(agents):,} agent certificates in {time.perf_counter() - started:.1f} s (one shared key); "
            f"frames: heartbeat {heartbeat_bytes} B, telemetry of 8 GPUs ({GPUS}) {telemetry_bytes:,} B"
        )
        runs = []
        for name in servers:
            runs.append(await measure_server(name, (cert_file, key_file, ca.cert_path), agents, args))
            print(f"  measured {SERVERS[name]}", file=sys.stderr)
    print_report(runs, args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
