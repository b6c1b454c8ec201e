"""End-to-end throughput of a real relay over TLS against a plain websockets TLS echo server, in one run.

Starts an ``access.relay.Relay`` over TLS 1.3 on 127.0.0.1 with an ``InProcessBus`` (CA,
server and agent certificates in a temporary directory), connects ``--agents`` agents as real
``websockets`` clients, each presenting its own client certificate, and has each send
``--messages`` telemetry frames of an 8-GPU host (built with ``OutboundWindow``), pipelined
with at most ``--in-flight`` unacknowledged frames per agent. Measures:

* connections established per second: TCP + TLS 1.3 handshake with client certificates +
  websocket upgrade + the relay's welcome, ``--connect-parallel`` at a time;
* acknowledged messages per second end to end (agent → relay → bus → ack), the ack latency
  under that load (p50/p99), and once more with one agent and one frame in flight (latency at rest);
* the process's resident memory (``VmRSS``) before the relay starts, once the agents are
  connected, and once every message is on the bus.

The baseline, in the same run: a plain ``websockets`` server on another port with the same
TLS context, taking the same frames from the same clients and answering each with a small
fixed ack, without decoding and without a bus. Then the bus is checked: its stream holds
exactly one record per acknowledged message, each (host, seq) once.

Everything (relay, bus, the agents' clients, the echo server) runs in this one process, on one
event loop, so one core does both ends' work: absolute rates are a floor for the relay alone,
and the ratio to the baseline is the figure to compare across machines.

Usage: ``python bench/bench_relay.py [--agents K] [--messages M] [--in-flight W] [--rounds R]``
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import os
import ssl
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import Server, ServerConnection, serve

from access.relay import AGENT_PATH, Relay
from shared import protocol
from shared.outbound import MemoryStore, OutboundWindow

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    Counter,
    Progress,
    agent_client_context,
    agent_connection,
    busy_backend,
    describe_machine,
    quantile,
    record,
)

from shared.bus import InProcessBus
from shared.crypto import CertificateAuthority, server_ssl_context

RELAY_ID = "relay-bench"
MASTER_GROUP = "bench-master"  # an idle consumer group, so the bus keeps every record for the check
GPUS = "sim:8xH100"
DISTINCT_SAMPLES = 16  # telemetry bodies per agent, cycled (values differ from frame to frame)
AT_REST_MESSAGES = 300
WARMUP_MESSAGES = 100  # sent by one extra agent before each target is timed
IO_TIMEOUT = 10.0
ECHO_ACK = protocol.encode(protocol.Ack(body=protocol.AckBody(seq=0)))




async def show_progress(progress: Progress, counter: Counter) -> None:
    """Update ``progress`` from ``counter`` until cancelled."""
    try:
        while True:
            await asyncio.sleep(0.25)
            progress.update(counter.acked)
    finally:
        progress.done()


def rss_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB, from /proc/self/status; NaN where unavailable."""
    values = {"VmRSS": float("nan"), "VmHWM": float("nan")}
    with contextlib.suppress(OSError), open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in values:
                values[key] = int(rest.split()[0]) / 1024  # kB
    return values["VmRSS"], values["VmHWM"]


# ---- set-up: certificates and frames --------------------------------------------------------


@dataclass
class AgentSetup:
    host_id: str
    context: ssl.SSLContext
    window: OutboundWindow
    frames: list[tuple[int, str]]
    rest_frames: list[tuple[int, str]]  # for the latency at rest; only the first agent has any


def make_agents(ca: CertificateAuthority, directory: Path, count: int, messages: int) -> list[AgentSetup]:
    """``count`` agents of ``messages`` frames each, then one more: the warm-up agent."""
    agents = []
    progress = Progress("agents set up (certificate + frames)", count + 1)
    for number in range(count + 1):
        host_id = f"h-bench-{number:04d}" if number < count else "h-bench-warmup"
        if number == count:
            messages = WARMUP_MESSAGES
        context = agent_client_context(ca, directory, host_id)

        backend = busy_backend(GPUS, seed=host_id)  # rented: processes on every GPU
        bodies = [
            protocol.TelemetryBody(
                sampled_at=datetime.now(UTC),
                gpus=[protocol.GpuSampleModel.model_validate(s.to_wire()) for s in backend.sample()],
            )
            for _ in range(min(DISTINCT_SAMPLES, messages))
        ]
        rest = AT_REST_MESSAGES if number == 0 else 0
        window = OutboundWindow(host_id, first_seq=1, store=MemoryStore(max_messages=messages + rest))
        frames = [window.telemetry(bodies[i % len(bodies)]) for i in range(messages + rest)]
        agents.append(AgentSetup(host_id, context, window, frames[:messages], frames[messages:]))
        progress.update(number + 1)
    progress.done()
    return agents


# ---- the agents' side -----------------------------------------------------------------------


@dataclass
class Run:
    """What one target (relay or echo) measured."""

    name: str
    connect_seconds: float = 0.0
    connect_latencies: list[float] = field(default_factory=list)
    messages: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    rest_messages: int = 0
    rest_latencies: list[float] = field(default_factory=list)

    @property
    def connect_rate(self) -> float:
        return len(self.connect_latencies) / self.connect_seconds

    @property
    def rate(self) -> float:
        return self.messages / self.seconds


def open_agent(url: str, agent: AgentSetup) -> connect:
    return agent_connection(url, agent.context, open_timeout=IO_TIMEOUT)


async def connect_agents(
    stack: contextlib.AsyncExitStack, url: str, agents: list[AgentSetup], parallel: int, run: Run
) -> list[ClientConnection]:
    """Connect every agent and read its welcome, ``parallel`` at a time."""
    slots = asyncio.Semaphore(parallel)

    async def one(agent: AgentSetup) -> ClientConnection:
        async with slots:
            started = time.perf_counter()
            ws = await stack.enter_async_context(open_agent(url, agent))
            welcome = json.loads(await ws.recv())
            run.connect_latencies.append(time.perf_counter() - started)
        if welcome.get("type") != "welcome":
            raise RuntimeError(f"{agent.host_id}: expected a welcome, got {welcome!r}")
        return ws

    started = time.perf_counter()
    connections = await asyncio.gather(*(one(agent) for agent in agents))
    run.connect_seconds = time.perf_counter() - started
    return list(connections)


async def pump(
    ws: ClientConnection,
    agent: AgentSetup,
    frames: list[tuple[int, str]],
    in_flight: int,
    *,
    check_seq: bool,
    latencies: list[float],
    counter: Counter,
) -> None:
    """Send ``frames`` with at most ``in_flight`` unacknowledged; wait for every ack."""
    slots = asyncio.Semaphore(in_flight)
    sent: collections.deque[tuple[int, float]] = collections.deque()

    async def send() -> None:
        for seq, frame in frames:
            await slots.acquire()
            sent.append((seq, time.perf_counter()))
            await ws.send(frame)

    async def receive() -> None:
        for _ in range(len(frames)):
            reply = await ws.recv()
            now = time.perf_counter()
            seq, sent_at = sent.popleft()
            ack = json.loads(reply)  # the same client work for both targets
            if check_seq and (ack.get("type") != "ack" or ack["body"]["seq"] != seq):
                raise RuntimeError(f"{agent.host_id}: expected the ack of seq {seq}, got {reply!r}")
            agent.window.ack(seq)
            latencies.append(now - sent_at)
            counter.acked += 1
            slots.release()

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(send())
        tasks.create_task(receive())


async def warm_up(name: str, url: str, warmup: AgentSetup, in_flight: int) -> None:
    """One connection and a few frames, untimed: lazily built validators, caches, first-use costs."""
    async with asyncio.timeout(30.0), open_agent(url, warmup) as ws:
        await ws.recv()  # the welcome
        await pump(
            ws, warmup, warmup.frames, in_flight, check_seq=name == "relay", latencies=[], counter=Counter()
        )


async def measure(
    name: str,
    url: str,
    agents: list[AgentSetup],
    warmup: AgentSetup,
    args: argparse.Namespace,
    snapshots: list[tuple[str, float]],
) -> Run:
    """Warm up; connect the agents to ``url``, pump every frame, measure; then latency at rest with one agent."""
    await warm_up(name, url, warmup, args.in_flight)
    run = Run(name)
    total = sum(len(agent.frames) for agent in agents)
    async with contextlib.AsyncExitStack() as stack:
        connections = await connect_agents(stack, url, agents, args.connect_parallel, run)
        snapshots.append(("agents connected", rss_mib()[0]))
        gc.collect()
        counter = Counter()
        ticker = asyncio.create_task(show_progress(Progress(f"{name} acked", total), counter))
        started = time.perf_counter()
        try:
            async with asyncio.timeout(max(60.0, total / 200)), asyncio.TaskGroup() as tasks:
                for ws, agent in zip(connections, agents, strict=True):
                    tasks.create_task(
                        pump(
                            ws,
                            agent,
                            agent.frames,
                            args.in_flight,
                            check_seq=name == "relay",
                            latencies=run.latencies,
                            counter=counter,
                        )
                    )
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
        run.seconds = time.perf_counter() - started
        run.messages = counter.acked
        snapshots.append(("all messages acked", rss_mib()[0]))
        # Latency at rest: the first agent alone, one frame at a time.
        first, rest = agents[0], Counter()
        async with asyncio.timeout(max(30.0, AT_REST_MESSAGES / 20)):
            await pump(
                connections[0],
                first,
                first.rest_frames,
                1,
                check_seq=name == "relay",
                latencies=run.rest_latencies,
                counter=rest,
            )
        run.rest_messages = rest.acked
    return run


# ---- the baseline: a websockets TLS server that answers every frame with a fixed ack ----------


async def echo_handler(connection: ServerConnection) -> None:
    await connection.send('{"v":1,"type":"welcome"}')
    async for _frame in connection:
        await connection.send(ECHO_ACK)


async def start_echo(context: ssl.SSLContext) -> Server:
    # The relay's websocket settings, less its routing, decoding and bus.
    return await serve(
        echo_handler,
        "127.0.0.1",
        0,
        ssl=context,
        ssl_handshake_timeout=IO_TIMEOUT,
        open_timeout=IO_TIMEOUT,
        close_timeout=2.0,
        max_size=protocol.DEFAULT_MAX_FRAME,
        max_queue=16,
        compression=None,
        server_header=None,
    )


# ---- correctness ----------------------------------------------------------------------------


async def check_bus(bus: InProcessBus, relay: Relay, agents: list[AgentSetup], acked: int) -> tuple[int, int]:
    """Read back every record; return (stream length, payload bytes). Raises if anything is off."""
    length = await bus.stream_length(protocol.AGENT_EVENTS_STREAM)
    seen: list[tuple[str, int]] = []
    payload_bytes = 0
    while True:
        batch = await bus.read(protocol.AGENT_EVENTS_STREAM, MASTER_GROUP, "bench", count=1_000, block=None)
        if not batch:
            break
        for entry in batch:
            payload_bytes += len(entry.payload)
            message = json.loads(entry.payload)["message"]
            seen.append((message["host_id"], message["seq"]))
        await bus.ack(protocol.AGENT_EVENTS_STREAM, MASTER_GROUP, [entry.id for entry in batch])
    expected = {(agent.host_id, seq) for agent in agents for seq, _frame in agent.frames + agent.rest_frames}
    problems = []
    if length != acked:
        problems.append(f"the bus stream holds {length:,} records but {acked:,} messages were acked")
    if relay.messages_forwarded != acked:
        problems.append(f"the relay forwarded {relay.messages_forwarded:,} messages but {acked:,} were acked")
    if len(seen) != length:
        problems.append(f"read back {len(seen):,} records of {length:,}")
    if len(set(seen)) != len(seen):
        problems.append(f"{len(seen) - len(set(seen)):,} (host, seq) on the bus more than once")
    if set(seen) != expected:
        missing, unexpected = len(expected - set(seen)), len(set(seen) - expected)
        problems.append(f"{missing:,} (host, seq) missing on the bus, {unexpected:,} unexpected")
    if problems:
        raise RuntimeError("; ".join(problems))
    return length, payload_bytes


# ---- report ---------------------------------------------------------------------------------



def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def print_report(relay_runs: list[Run], echo_runs: list[Run]) -> None:
    def median_run(runs: list[Run], key: str) -> Run:
        return sorted(runs, key=lambda r: getattr(r, key))[len(runs) // 2]

    relay_msgs, echo_msgs = median_run(relay_runs, "rate"), median_run(echo_runs, "rate")
    relay_conn, echo_conn = median_run(relay_runs, "connect_rate"), median_run(echo_runs, "connect_rate")
    rounds = f" (median of {len(relay_runs)} rounds)" if len(relay_runs) > 1 else ""

    print(f"\nconnections{rounds}")
    print(f"  {'target':<34} {'conn/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'ours/baseline':>14}")
    for run, ratio in [
        (relay_conn, f"{relay_conn.connect_rate / echo_conn.connect_rate:.2f}x"),
        (echo_conn, "(baseline)"),
    ]:
        print(
            f"  {label(run):<34} {run.connect_rate:>9,.0f} {ms(quantile(run.connect_latencies, 0.5)):>8} "
            f"{ms(quantile(run.connect_latencies, 0.99)):>8} {ratio:>14}"
        )

    print(f"\nmessages, end to end{rounds}")
    print(
        f"  {'target':<34} {'acked':>7} {'msgs/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'rest p50':>9} {'rest p99':>9} {'ours/baseline':>14}"
    )
    for run, ratio in [(relay_msgs, f"{relay_msgs.rate / echo_msgs.rate:.2f}x"), (echo_msgs, "(baseline)")]:
        print(
            f"  {label(run):<34} {run.messages:>7,} {run.rate:>9,.0f} {ms(quantile(run.latencies, 0.5)):>8} "
            f"{ms(quantile(run.latencies, 0.99)):>8} {ms(quantile(run.rest_latencies, 0.5)):>9} "
            f"{ms(quantile(run.rest_latencies, 0.99)):>9} {ratio:>14}"
        )
    record("relay", f"{relay_msgs.messages:,} telemetry frames from agents over TLS, acked after the bus took them",
           relay_msgs.rate, "msgs/s", "websockets TLS echo", echo_msgs.rate, f"p99 {ms(quantile(relay_msgs.latencies, 0.99))} ms")  # fmt: skip
    record("relay", "TLS connections with client certificates", relay_conn.connect_rate, "conn/s", "websockets TLS echo",
           echo_conn.connect_rate)  # fmt: skip
    if len(relay_runs) > 1:
        print(
            "  msgs/s per round: relay "
            + ", ".join(f"{r.rate:,.0f}" for r in relay_runs)
            + "; echo "
            + ", ".join(f"{r.rate:,.0f}" for r in echo_runs)
        )
    per_message = 1 / relay_msgs.rate - 1 / echo_msgs.rate
    print(
        f"  per message, the relay path takes {per_message * 1e6:,.0f} µs more of the event loop than the echo"
    )
    print(
        "  p50/p99: ack latency under that load (about frames in flight / msgs/s); "
        f"rest: one agent, one frame in flight, {AT_REST_MESSAGES} frames"
    )


def label(run: Run) -> str:
    return "Relay (decode + bus + ack)" if run.name == "relay" else "websockets TLS echo (baseline)"


# ---- main -----------------------------------------------------------------------------------


async def one_round(
    number: int,
    agents: list[AgentSetup],
    warmup: AgentSetup,
    server_context: ssl.SSLContext,
    args: argparse.Namespace,
    total: int,
) -> tuple[Run, Run, list[tuple[str, float]], tuple[int, int]]:
    # The relay first, so that the echo's garbage cannot hide in its memory figures.
    snapshots: list[tuple[str, float]] = []
    gc.collect()
    snapshots.append(("before the relay (frames prebuilt)", rss_mib()[0]))
    bus = InProcessBus(max_len=max(100_000, 2 * total))
    await bus.ensure_group(protocol.AGENT_EVENTS_STREAM, MASTER_GROUP)
    relay = Relay(
        relay_id=RELAY_ID,
        bus=bus,
        ssl_context=server_context,
        host="127.0.0.1",
        port=0,
        open_timeout=IO_TIMEOUT,
        close_timeout=2.0,
        # This bench measures throughput: lift the per-agent and per-source rate limits.
        max_messages_per_second=1_000_000.0,
        message_burst=1_000_000,
        max_connections_per_source_per_minute=1_000_000.0,
        connection_burst_per_source=100_000,
    )
    await relay.start()
    try:
        relay_run = await measure("relay", relay.url, agents, warmup, args, snapshots)
        checked = await check_bus(
            bus, relay, [*agents, warmup], relay_run.messages + relay_run.rest_messages + len(warmup.frames)
        )
    finally:
        await relay.close()
        await bus.close()

    echo = await start_echo(server_context)
    try:
        port = echo.sockets[0].getsockname()[1]
        echo_run = await measure("echo", f"wss://127.0.0.1:{port}{AGENT_PATH}", agents, warmup, args, [])
    finally:
        echo.close()
        await echo.wait_closed()
    if args.rounds > 1:
        print(
            f"  round {number}/{args.rounds}: relay {relay_run.rate:,.0f} msgs/s, echo {echo_run.rate:,.0f} msgs/s",
            file=sys.stderr,
        )
    return relay_run, echo_run, snapshots, checked


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--agents", type=int, default=50, help="connected agents (default 50)")
    parser.add_argument(
        "--messages", type=int, default=400, help="telemetry frames per agent (default 400: 20,000 in all)"
    )
    parser.add_argument(
        "--in-flight", type=int, default=64, help="unacknowledged frames per agent at most (default 64)"
    )
    parser.add_argument(
        "--connect-parallel", type=int, default=10, help="handshakes in progress at once (default 10)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="relay and echo measurements (default 1)")
    args = parser.parse_args()
    if min(args.agents, args.messages, args.in_flight, args.connect_parallel, args.rounds) < 1:
        parser.error("every count must be at least 1")
    total = args.agents * args.messages

    print(describe_machine(with_openssl=True))
    print(
        "one process, one event loop: the relay, its in-process bus, the agents' websocket clients and "
        "the echo server share it; RSS is this whole process's"
    )
    print(
        f"{args.agents} agents x {args.messages:,} telemetry frames = {total:,} messages, "
        f"at most {args.in_flight} unacked per agent; {args.rounds} round(s) of relay then echo; TLS 1.3 "
        f"with client certificates (ECDSA P-256), handshakes {args.connect_parallel} at a time"
    )

    with tempfile.TemporaryDirectory(prefix="gpumarket-bench-") as temporary:
        directory = Path(temporary)
        ca = CertificateAuthority.load_or_create(directory / "ca")
        key_file, cert_file = ca.write_server_certificate(directory, ["127.0.0.1", "localhost"])
        server_context = server_ssl_context(cert_file, key_file, ca.cert_path)
        *agents, warmup = make_agents(ca, directory, args.agents, args.messages)
        frame_bytes = statistics.mean(len(frame.encode()) for agent in agents for _seq, frame in agent.frames)
        print(f"frames: telemetry of 8 busy GPUs ({GPUS}), {frame_bytes:,.0f} bytes on average")

        relay_runs: list[Run] = []
        echo_runs: list[Run] = []
        first_snapshots: list[tuple[str, float]] = []
        first_check = (0, 0)
        for number in range(1, args.rounds + 1):
            relay_run, echo_run, snapshots, checked = await one_round(
                number, agents, warmup, server_context, args, total
            )
            relay_runs.append(relay_run)
            echo_runs.append(echo_run)
            if number == 1:
                first_snapshots, first_check = snapshots, checked

    print_report(relay_runs, echo_runs)

    print("\nmemory of this process (VmRSS, round 1, relay)")
    base = first_snapshots[0][1]
    for what, value in first_snapshots:
        delta = "" if what == first_snapshots[0][0] else f"  ({value - base:+,.1f} MiB)"
        print(f"  {what:<34} {value:>8,.1f} MiB{delta}")
    print(f"  {'peak (VmHWM, whole run)':<34} {rss_mib()[1]:>8,.1f} MiB")
    length, payload_bytes = first_check
    print(
        f"  the bus holds {length:,} unconsumed records, {payload_bytes / 2**20:,.1f} MiB of payload, "
        "for the check below"
    )

    print("\ncorrectness (round 1)")
    relay_first = relay_runs[0]
    print(
        f"  acked {relay_first.messages:,} in the main phase + {relay_first.rest_messages:,} at rest "
        f"+ {WARMUP_MESSAGES} warm-up = {relay_first.messages + relay_first.rest_messages + WARMUP_MESSAGES:,}; "
        f"bus stream length {length:,}; "
        "every (host, seq) sent is on the bus exactly once; every ack named the seq it answered: OK"
    )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
