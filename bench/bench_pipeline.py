"""Telemetry latency end to end, agent send → relay ack → master stored, at the protocol's rates.

p50/p99 from an agent's send to the master having stored the sample, for many simulated agents on
one relay at the protocol's heartbeat and telemetry rates, with a relay-only baseline in the same run.

Everything runs in this one process, on one event loop, assembled as ``gpumarket up`` does it
(``gpumarket/up.py::start_marketplace``) less HTTP: ``master.app.open_master`` with an
``InProcessBus`` and a ``MemoryRegistry``; the master's background loops (``Ingestor.run``, the
heartbeat monitor, the command resender and the revocation publisher); and an
``access.relay.Relay`` on 127.0.0.1, port 0, with a server certificate from the master's CA and
generous rate limits (every simulated agent comes from 127.0.0.1). The database is SQLite in a
temporary directory, then PostgreSQL when its server answers: a fresh database created on it
with asyncpg and dropped at the end (the PostgreSQL server is the only other process).

``--agents`` hosts (200) are enrolled directly through ``master.services.hosts.enrollment``
(``create_token`` + ``enroll`` with a CSR; one P-256 key serves every CSR, to keep set-up
short: each host still gets its own host id, certificate, serial and ``SSLContext``). Each is a
lightweight ``websockets`` client over TLS 1.3 presenting its certificate, not a full
``agent.runner.Agent``: its frames come from ``shared.outbound.OutboundWindow`` with a
``MemoryStore``, and its telemetry body (the latest sample and the window aggregates of 8
simulated H100s, ``SimulatedBackend("sim:8xH100", seed=host_id)``, busy) is built once. Each agent
sends its hello, then from a random phase a telemetry frame every 10 s (the protocol's rate)
with a heartbeat half-way between; ``--rate-scale`` divides that interval to compress time.

Measured per telemetry frame, keyed by (host, seq), on the monotonic clock:

* send → ack: until the relay's ack (sent once the message is on the bus) reaches the agent;
* send → committed: until the ingestor's transaction that inserted the frame's ``telemetry`` row
  has committed, dated by SQLAlchemy session events (``after_flush`` notes the rows, ``after_commit``
  dates them; the master's code is untouched);
* send → seen by a poll: until the row is visible to an outside reader. A poller runs
  ``SELECT id, host_id, seq FROM telemetry WHERE id > :last ORDER BY id`` every ``--poll``
  seconds (10 ms) on its own autocommit connection and dates each new row when the first poll
  that returns it has returned: late by up to one poll period plus one query, never early. It
  costs this process some CPU (reported); ``--poll 0`` leaves it out;
* ack → committed, per frame: what the master's ingestion adds (waiting on the bus, decoding, the
  transaction and its commit).

Also: committed rows per second, the ingestion backlog at the moment the agents stop sending
(messages the relay put on the bus that the ingestor has not applied yet, and the bus group's
pending count), the time to drain it, and this process's CPU. The baseline, in the same run and
with the same agents, frames and schedule: a relay on a bus nobody consumes (no master in the
loop), send → ack. At the end of each database run every telemetry (host, seq) sent must have
been acknowledged, committed, seen by the poller and stored exactly once, with nothing else stored.

Findings (2-core Xeon VM, CPython 3.11, SQLite and PostgreSQL 15 on the same VM; several runs).
At the protocol's rate, 200 agents (40 msgs/s), a sample is committed about 6.5-8.5 ms after the
agent sent it at p50, on either database; the relay's ack takes about 2 ms (1.1-1.5 ms with no
master in the process), so the master's ingestion adds about 4-5.5 ms at p50. p99 is 15-35 ms and
varies from run to run on about 300 frames (SQLite showed single outliers of 110-180 ms). The
ingestor applies one bus message per transaction, one at a time: it kept up at 80 msgs/s
(``--rate-scale 2``, as 400 agents at the protocol's rate; p99 60-85 ms) and saturated at about
80-105 msgs/s with this process at 100 % of a core (``--rate-scale 10``: 400 msgs/s offered, the
backlog grows by about 300 messages/s and samples are stored 15-35 s late). Then the heartbeat
monitor marks hosts offline and their next heartbeat brings them back, thousands of times in a
10 s run: ``last_seen_at`` is the relay's receive time, so a master lagging by more than three
heartbeat intervals (30 s at the protocol's rate) sees its hosts as silent. Absolute figures are
a floor: the agents' TLS clients, the relay and the master share one event loop.

Usage: ``python bench/bench_pipeline.py [--agents N] [--rate-scale S] [--duration D] [--poll P]
[--databases sqlite,postgresql] [--database-url URL] [--quick]``; the default run takes about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import resource
import secrets
import ssl
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy import bindparam, event, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session
from websockets.asyncio.client import ClientConnection

from access.relay import Relay
from agent.hostfacts import collect_host_facts
from master.app import close_master, open_master
from master.background.commands import command_resender
from master.background.heartbeats import heartbeat_monitor
from master.background.revocations import revocation_publisher
from master.context import Master
from master.models import Host as HostRow
from master.models import HostEvent, TelemetrySample
from master.services.accounts.core import create_account
from master.services.hosts import enrollment
from master.telemetry import batch as batches
from master.telemetry.ingest import Ingestor
from shared import protocol
from shared.bus import InProcessBus
from shared.crypto import server_ssl_context
from shared.outbound import MemoryStore, OutboundWindow
from shared.protocol import INGEST_GROUP
from shared.registry import MemoryRegistry
from shared.settings import MasterSettings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    Progress,
    agent_context,
    busy_backend,
    describe_machine,
    fresh_database,
    open_agent,
    quantile,
    record,
    telemetry_body,
    write_agent_key,
)

GPUS = "sim:8xH100"
PROTOCOL_INTERVAL = 10.0  # heartbeat and telemetry, seconds (MasterSettings / AgentTimings defaults)
WARMUP_FRAMES = 5  # telemetry frames of one agent, one at a time and untimed, before each timed phase
IO_TIMEOUT = 30.0
DRAIN_TIMEOUT = 120.0
BUS_MAX_LEN = 1_000_000
POSTGRES_DEFAULT = os.environ.get("GPUMARKET_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
AGENT_VERSION = "bench"

Key = tuple[str, int]  # (host id, seq)


def raise_open_files_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# ---- hosts: enrollment, certificates, frames ----------------------------------------------------


@dataclass
class BenchHost:
    host_id: str
    context: ssl.SSLContext
    window: OutboundWindow
    hello: protocol.HelloBody
    telemetry: protocol.TelemetryBody


async def enroll_hosts(master: Master, directory: Path, count: int, interval: float, label: str) -> list[BenchHost]:
    """``count`` hosts enrolled with one-time tokens, as a provider's agents would be."""
    async with master.db.session() as session:
        account, _api_key = await create_account(session, f"bench-provider-{secrets.token_hex(4)}", "provider")
    key_file = directory / "agents.key"
    csr = write_agent_key(key_file, "bench-host").decode()
    facts = collect_host_facts(workload_dir=directory, agent_version=AGENT_VERSION).to_wire()
    hosts = []
    progress = Progress(f"{label}: enrolling hosts", count)
    for number in range(count):
        token, _expires = await enrollment.create_token(master, account.id)
        result = await enrollment.enroll(master, token, csr, hostname=f"bench-host-{number:05d}")
        cert_file = directory / f"{result.host_id}.crt"
        context = agent_context(master.ca.cert_path, key_file, cert_file, result.certificate_pem.encode())
        backend = busy_backend(GPUS, seed=result.host_id)  # rented: a process on every GPU
        hello = protocol.HelloBody(
            agent_version=AGENT_VERSION,
            gpu_backend="sim",
            region="local",
            host={**facts, "hostname": f"bench-host-{number:05d}"},
            gpus=[protocol.GpuInfoModel.model_validate(g.to_wire()) for g in backend.gpus()],
        )
        window = OutboundWindow(result.host_id, first_seq=1, store=MemoryStore())
        hosts.append(BenchHost(result.host_id, context, window, hello, telemetry_body(backend, interval)))
        progress.update(number + 1)
    progress.done()
    return hosts


def frame_sizes(host: BenchHost) -> dict[str, int]:
    """Bytes of each kind of frame this host sends (built on a throwaway window)."""
    window = OutboundWindow(host.host_id, first_seq=1)
    heartbeat = protocol.HeartbeatBody(uptime_s=12.345, spool=protocol.SpoolStats(pending=1, evicted={}))
    return {
        "hello": len(window.hello(host.hello)[1]),
        "heartbeat": len(window.heartbeat(heartbeat)[1]),
        "telemetry": len(window.telemetry(host.telemetry)[1]),
    }


# ---- one timed phase: connect, hello, warm up, traffic at the protocol's rate, drain --------------


@dataclass
class Observed:
    """What one phase saw, per telemetry (host, seq); times from ``time.monotonic()``."""

    name: str
    sent: dict[Key, float] = field(default_factory=dict)  # telemetry only (warm-up included)
    warmup: set[Key] = field(default_factory=set)
    acked: dict[Key, float] = field(default_factory=dict)
    committed: dict[Key, float] = field(default_factory=dict)  # the ingestor's transaction had committed
    stored: dict[Key, float] = field(default_factory=dict)  # the first poll that saw the row had returned
    duplicates_seen: int = 0  # rows the poller saw twice (must stay 0)
    heartbeats_sent: int = 0
    messages_acked: int = 0  # every kind
    polls: int = 0
    poll_seconds: float = 0.0  # wall time the polls spanned
    poll_busy: float = 0.0  # wall time inside the polls' queries
    started: float = 0.0
    ended: float = 0.0  # when the last agent stopped sending
    cpu_seconds: float = 0.0
    applied: int = 0  # bus messages (every kind) the ingestor applied during the timed phase
    backlog_at_end: int = 0  # forwarded by the relay, not yet applied by the ingestor
    pending_at_end: int = 0  # delivered to the ingestor, not yet acked on the bus
    drain_seconds: float = 0.0
    connect_seconds: float = 0.0

    def timed(self) -> list[Key]:
        return [key for key in self.sent if key not in self.warmup]


@dataclass
class Pipeline:
    """The master side of a phase, when there is one: its relay's counters and its ingestor."""

    master: Master
    relay: Relay
    ingestor: Ingestor

    def backlog(self) -> int:
        return self.relay.messages_forwarded - self.ingestor.processed - self.ingestor.dead_lettered


async def poll_stored(master: Master, observed: Observed, poll: float) -> None:
    """Date every new telemetry row when the first poll that sees it returns (until cancelled).

    One connection of the master's engine in autocommit mode, so every SELECT sees what was committed
    before it ran: the row was committed before that poll returned, and after the previous one started.
    """
    query = (
        select(TelemetrySample.id, TelemetrySample.host_id, TelemetrySample.seq)
        .where(TelemetrySample.id > bindparam("last_id"))
        .order_by(TelemetrySample.id)
    )
    async with master.db.engine.connect() as connection:
        connection = await connection.execution_options(isolation_level="AUTOCOMMIT")
        last_id = await connection.scalar(select(func.max(TelemetrySample.id))) or 0
        first = time.monotonic()
        while True:
            started = time.monotonic()
            rows = (await connection.execute(query, {"last_id": last_id})).all()
            returned = time.monotonic()
            for row_id, host_id, seq in rows:
                if (host_id, seq) in observed.stored:
                    observed.duplicates_seen += 1
                observed.stored[(host_id, seq)] = returned
                last_id = row_id
            observed.polls += 1
            observed.poll_seconds = started - first
            observed.poll_busy += returned - started
            await asyncio.sleep(max(0.0, poll - (time.monotonic() - started)))


@contextlib.contextmanager
def commit_clock(master: Master, observed: Observed) -> Iterator[None]:
    """Date each telemetry row at the commit of the transaction that inserted it.

    SQLAlchemy session events (``after_commit`` dates the rows once their transaction committed), and the
    rows each session inserted: the telemetry of the batches ``master.telemetry.batch.apply_batch`` applied
    (it writes with one statement, not through ORM objects: the function is wrapped while the clock runs,
    its behaviour untouched) and, for messages applied one by one, the ``TelemetrySample`` rows ``after_flush``
    sees. Only sessions on this master's engine count.
    """
    engine = master.db.engine.sync_engine
    apply_batch = batches.apply_batch

    async def noted_batch(session: AsyncSession, reports: Any, **kwargs: Any) -> batches.BatchOutcome:
        outcome = await apply_batch(session, reports, **kwargs)
        rows = [(r.message.host_id, r.message.seq) for r in reports if r.message.type == "telemetry"]
        if rows and session.sync_session.bind is engine:
            session.sync_session.info.setdefault("bench_rows", []).extend(rows)
        return outcome

    def after_flush(session: Session, _context: object) -> None:
        if session.bind is engine:
            rows = [(row.host_id, row.seq) for row in session.new if isinstance(row, TelemetrySample)]
            if rows:
                session.info.setdefault("bench_rows", []).extend(rows)

    def after_commit(session: Session) -> None:
        rows = session.info.pop("bench_rows", None)
        if rows:
            now = time.monotonic()
            for key in rows:
                observed.committed[key] = now

    def after_rollback(session: Session) -> None:
        session.info.pop("bench_rows", None)

    hooks: list[tuple[str, Callable[..., None]]] = [
        ("after_flush", after_flush), ("after_commit", after_commit), ("after_rollback", after_rollback)
    ]
    for name, hook in hooks:
        event.listen(Session, name, hook)
    batches.apply_batch = noted_batch
    try:
        yield
    finally:
        batches.apply_batch = apply_batch
        for name, hook in hooks:
            event.remove(Session, name, hook)


async def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` every 5 ms: it reads counters of the relay, the ingestor and the poller, which have no events."""
    try:
        async with asyncio.timeout(timeout):
            while not condition():  # noqa: ASYNC110
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}") from None


async def read_acks(ws: ClientConnection, host: BenchHost, observed: Observed) -> None:
    async for frame in ws:
        now = time.monotonic()
        message = json.loads(frame)
        if message.get("type") != "ack":
            continue
        seq = int(message["body"]["seq"])
        host.window.ack(seq)
        observed.messages_acked += 1
        key = (host.host_id, seq)
        if key in observed.sent:
            observed.acked[key] = now


async def send_traffic(
    ws: ClientConnection, host: BenchHost, observed: Observed, *, start: float, end: float, offset: float, interval: float
) -> None:
    """Telemetry at ``start + offset`` and every ``interval`` around it, a heartbeat half-way between, until ``end``.

    The first frame goes within half an interval of ``start`` (a heartbeat when ``offset`` is in the second
    half), so both kinds are spread evenly over the phase.
    """
    half = interval / 2
    began = time.monotonic()
    step = 0 if offset < half else 1  # even steps are telemetry
    first = start + offset % half
    while (at := first + (step - (0 if offset < half else 1)) * half) < end:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        if step % 2 == 0:
            seq, frame = host.window.telemetry(host.telemetry)
            observed.sent[(host.host_id, seq)] = time.monotonic()
        else:
            seq, frame = host.window.heartbeat(
                protocol.HeartbeatBody(
                    uptime_s=round(time.monotonic() - began, 3),
                    spool=protocol.SpoolStats(pending=len(host.window), evicted=host.window.store.evicted),
                )
            )
            observed.heartbeats_sent += 1
        await ws.send(frame)
        step += 1


def offsets(hosts: list[BenchHost], interval: float, seed: str) -> list[float]:
    """Each agent's random phase in [0, interval): where its telemetry falls in each interval."""
    rng = random.Random(seed)
    return [rng.uniform(0.0, interval) for _ in hosts]


def expected_telemetry(phases: list[float], interval: float, duration: float) -> int:
    return sum(math.ceil((duration - phase) / interval) for phase in phases if phase < duration)


async def run_phase(
    name: str,
    url: str,
    hosts: list[BenchHost],
    args: argparse.Namespace,
    pipeline: Pipeline | None,
) -> Observed:
    observed = Observed(name)
    connections: list[ClientConnection] = []
    readers: list[asyncio.Task[None]] = []
    hooks = contextlib.ExitStack()
    if pipeline is not None:
        hooks.enter_context(commit_clock(pipeline.master, observed))
    polling = pipeline is not None and args.poll > 0
    poller = (
        asyncio.create_task(poll_stored(pipeline.master, observed, args.poll), name="bench-poller")
        if pipeline is not None and polling
        else None
    )

    def all_stored(keys: list[Key]) -> Callable[[], bool]:
        if pipeline is None:
            return lambda: all(key in observed.acked for key in keys)
        return lambda: all(
            key in observed.acked and key in observed.committed and (key in observed.stored or not polling)
            for key in keys
        )

    try:
        # Connect every agent, handshakes --connect-parallel at a time.
        slots = asyncio.Semaphore(args.connect_parallel)
        progress = Progress(f"{name}: connecting", len(hosts))

        async def one(host: BenchHost) -> ClientConnection:
            async with slots:
                ws = await open_agent(url, host.host_id, host.context, open_timeout=IO_TIMEOUT)
            progress.update(len(connections) + 1)
            connections.append(ws)
            return ws

        started = time.monotonic()
        opened = await asyncio.gather(*(one(host) for host in hosts))
        observed.connect_seconds = time.monotonic() - started
        progress.done()
        readers = [
            asyncio.create_task(read_acks(ws, host, observed)) for ws, host in zip(opened, hosts, strict=True)
        ]

        # Hello first, as an agent does on every connection; then wait until the master applied them.
        for ws, host in zip(opened, hosts, strict=True):
            _seq, frame = host.window.hello(host.hello)
            await ws.send(frame)
        await wait_until(lambda: observed.messages_acked >= len(hosts), IO_TIMEOUT, "the hellos' acks")
        if pipeline is not None:
            await wait_until(lambda: pipeline.backlog() == 0, IO_TIMEOUT * 4, "the master to apply the hellos")

        # Warm-up, untimed: one agent, one telemetry frame at a time.
        for _ in range(WARMUP_FRAMES):
            seq, frame = hosts[0].window.telemetry(hosts[0].telemetry)
            key = (hosts[0].host_id, seq)
            observed.warmup.add(key)
            observed.sent[key] = time.monotonic()
            await opened[0].send(frame)
            await wait_until(all_stored([key]), IO_TIMEOUT, "a warm-up frame")

        # The timed phase: every agent at the protocol's cadence, from its random phase.
        phases = offsets(hosts, args.interval, "phases")  # the same schedule in every phase
        total = expected_telemetry(phases, args.interval, args.duration)
        progress = Progress(f"{name}: telemetry sent ({args.duration:g} s)", total)
        cpu_before = time.process_time()
        applied_before = pipeline.ingestor.processed if pipeline is not None else 0
        observed.started = time.monotonic() + 0.05
        end = observed.started + args.duration
        writers = [
            asyncio.create_task(
                send_traffic(
                    ws, host, observed, start=observed.started, end=end, offset=phase, interval=args.interval
                )
            )
            for ws, host, phase in zip(opened, hosts, phases, strict=True)
        ]
        while not all(writer.done() for writer in writers):
            await asyncio.sleep(0.25)
            progress.update(len(observed.sent) - len(observed.warmup))
        progress.done()
        await asyncio.gather(*writers)
        observed.ended = time.monotonic()
        observed.cpu_seconds = time.process_time() - cpu_before
        if pipeline is not None:
            observed.applied = pipeline.ingestor.processed - applied_before
            observed.backlog_at_end = pipeline.backlog()
            observed.pending_at_end = await pipeline.master.bus.pending_count(
                protocol.AGENT_EVENTS_STREAM, INGEST_GROUP
            )
        keys = list(observed.sent)
        drain_timeout = max(DRAIN_TIMEOUT, observed.backlog_at_end / 20)  # the ingestor applies 100+ msgs/s
        await wait_until(all_stored(keys), drain_timeout, "every telemetry frame to be acked and stored")
        if pipeline is not None:
            await wait_until(lambda: pipeline.backlog() == 0, drain_timeout, "the ingestion backlog to drain")
        observed.drain_seconds = time.monotonic() - observed.ended
    finally:
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        hooks.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10.0):
                await asyncio.gather(*(ws.close() for ws in connections), return_exceptions=True)
        for ws in connections:
            ws.transport.abort()
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    return observed


# ---- one database: the master, its relay, a baseline relay, the phases -------------------------


@dataclass
class DatabaseRun:
    label: str
    enroll_seconds: float
    frame_bytes: dict[str, int]
    baseline: Observed | None
    pipeline: Observed
    checks: list[str]
    problems: list[str]


def relay_kwargs() -> dict[str, Any]:
    """Generous limits: every agent comes from 127.0.0.1, and --rate-scale raises per-agent rates."""
    return {
        "host": "127.0.0.1",
        "port": 0,
        "open_timeout": IO_TIMEOUT,
        "max_connections": 1_000_000,
        "max_messages_per_second": 1_000.0,
        "message_burst": 1_000,
        "max_connections_per_source_per_minute": 1e9,
        "connection_burst_per_source": 1_000_000,
    }


def background(*factories: Callable[[], Coroutine[Any, Any, None]]) -> list[asyncio.Task[None]]:
    return [asyncio.create_task(factory()) for factory in factories]


async def stop(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def run_database(
    label: str, database_url: str | None, args: argparse.Namespace, *, with_baseline: bool
) -> DatabaseRun:
    with tempfile.TemporaryDirectory(prefix="gpumarket-pipeline-") as temporary:
        directory = Path(temporary)
        settings = MasterSettings.load(
            data_dir=directory / "master",
            database_url=database_url or f"sqlite:///{directory / 'master' / 'gpumarket.db'}",
            heartbeat_interval=args.interval,
            telemetry_interval=args.interval,
            instance_id="master-bench",
        )
        master = await open_master(settings, bus=InProcessBus(max_len=BUS_MAX_LEN), registry=MemoryRegistry())
        tasks: list[asyncio.Task[None]] = []
        relay: Relay | None = None
        try:
            (directory / "agents").mkdir()
            started = time.monotonic()
            hosts = await enroll_hosts(master, directory / "agents", args.agents, args.interval, label)
            enroll_seconds = time.monotonic() - started
            frame_bytes = frame_sizes(hosts[0])
            key_file, cert_file = master.ca.write_server_certificate(
                directory / "relay", ["localhost", "127.0.0.1", "::1"], basename="server"
            )
            server_context = server_ssl_context(cert_file, key_file, master.ca.cert_path)

            baseline = None
            if with_baseline:
                # The same agents and frames against a relay whose bus nobody consumes (trimmed as it goes).
                bus = InProcessBus(max_len=20_000)
                lone = Relay(relay_id="relay-baseline", bus=bus, ssl_context=server_context, **relay_kwargs())
                await lone.start()
                try:
                    baseline = await run_phase("baseline: relay only", lone.url, hosts, args, None)
                finally:
                    await lone.close()
                    await bus.close()

            ingestor = Ingestor(master)
            tasks = background(
                ingestor.run,
                lambda: heartbeat_monitor(master),
                lambda: command_resender(master),
                lambda: revocation_publisher(master),
            )
            relay = Relay(
                relay_id="relay-bench",
                bus=master.bus,
                ssl_context=server_context,
                registry=master.registry,
                heartbeat_interval=args.interval,
                telemetry_interval=args.interval,
                public_host="localhost",
                **relay_kwargs(),
            )
            await relay.start()
            settings.relay_urls = [relay.url]
            observed = await run_phase(f"{label}: pipeline", relay.url, hosts, args, Pipeline(master, relay, ingestor))
            checks, problems = await check_database(master, hosts, observed, ingestor)
            return DatabaseRun(label, enroll_seconds, frame_bytes, baseline, observed, checks, problems)
        finally:
            if relay is not None:
                await relay.close()
            await stop(tasks)
            await close_master(master)


async def check_database(
    master: Master, hosts: list[BenchHost], observed: Observed, ingestor: Ingestor
) -> tuple[list[str], list[str]]:
    """Every telemetry (host, seq) sent was acked and stored exactly once; nothing else was stored."""
    host_ids = [host.host_id for host in hosts]
    async with master.db.session() as session:
        rows = (
            await session.execute(
                select(TelemetrySample.host_id, TelemetrySample.seq, func.count())
                .where(TelemetrySample.host_id.in_(host_ids))
                .group_by(TelemetrySample.host_id, TelemetrySample.seq)
            )
        ).all()
        online = await session.scalar(
            select(func.count()).select_from(HostRow).where(HostRow.id.in_(host_ids), HostRow.state == "online")
        ) or 0
        greeted = await session.scalar(
            select(func.count(func.distinct(HostEvent.host_id))).where(
                HostEvent.host_id.in_(host_ids), HostEvent.from_state == "enrolling", HostEvent.to_state == "online"
            )
        ) or 0
        silenced = await session.scalar(
            select(func.count()).select_from(HostEvent).where(
                HostEvent.host_id.in_(host_ids), HostEvent.actor == "monitor", HostEvent.to_state == "offline"
            )
        ) or 0
    counts = {(host_id, seq): count for host_id, seq, count in rows}
    sent = set(observed.sent)
    problems = []
    if missing_acks := len(sent - set(observed.acked)):
        problems.append(f"{missing_acks:,} sent telemetry frames never acked")
    if missing := len(sent - set(counts)):
        problems.append(f"{missing:,} sent telemetry frames not stored")
    if unexpected := len(set(counts) - sent):
        problems.append(f"{unexpected:,} stored rows nobody sent")
    if twice := sum(1 for count in counts.values() if count != 1):
        problems.append(f"{twice:,} (host, seq) stored more than once")
    if observed.duplicates_seen:
        problems.append(f"the poller saw {observed.duplicates_seen:,} rows twice")
    if observed.polls and (unseen := len(set(counts) - set(observed.stored))):
        problems.append(f"{unseen:,} stored rows the poller never saw (its id order missed them)")
    if uncommitted := len(set(counts) - set(observed.committed)):
        problems.append(f"{uncommitted:,} stored rows whose commit the session events did not see")
    if ingestor.failed or ingestor.dead_lettered:
        problems.append(f"ingestion: {ingestor.failed} failed, {ingestor.dead_lettered} dead-lettered")
    if greeted != len(hosts):
        problems.append(f"only {greeted}/{len(hosts)} hosts came online on their hello")
    checks = [
        f"{len(sent):,} telemetry frames sent ({len(observed.warmup)} warm-up), {len(set(observed.acked) & sent):,} acked, "
        f"{sum(counts.values()):,} rows stored, {sum(1 for count in counts.values() if count == 1):,} (host, seq) "
        f"exactly once, {len(set(counts) - sent)} unexpected; commits dated {len(observed.committed):,}, "
        + (f"the poller saw {len(observed.stored):,}" if observed.polls else "no poller"),
        f"ingestor: {ingestor.processed:,} bus messages applied, {ingestor.failed} failed, "
        f"{ingestor.dead_lettered} dead-lettered; {greeted}/{len(hosts)} hosts came online on their hello; at the end "
        f"{online} online ({silenced} times the heartbeat monitor marked one offline: silent for 3 intervals)",
    ]
    return checks, problems


async def postgres_version(admin_url: str) -> str | None:
    """The server's version, or None when it does not answer."""
    try:
        admin = await asyncpg.connect(admin_url, timeout=3)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return None
    try:
        version: str = await admin.fetchval("SHOW server_version")
        return version.split()[0]
    finally:
        await admin.close()


# ---- report ---------------------------------------------------------------------------------------



def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def latencies(observed: Observed, until: str, since: str = "sent") -> list[float]:
    begin, finish = getattr(observed, since), getattr(observed, until)
    return [finish[key] - begin[key] for key in observed.timed() if key in finish and key in begin]


def print_report(runs: list[DatabaseRun], args: argparse.Namespace) -> None:
    baseline = next((run.baseline for run in runs if run.baseline is not None), None)
    base_p50 = quantile(latencies(baseline, "acked"), 0.5) if baseline else float("nan")

    print(f"\nlatency per telemetry frame, ms (timed frames only; {WARMUP_FRAMES} warm-up frames excluded per phase)")
    print(
        f"  {'path':<54} {'frames':>7} {'p50':>7} {'p95':>7} {'p99':>7} {'max':>7} {'p50 / baseline':>15}"
    )

    def row(label: str, values: list[float], ratio: str | None = None) -> None:
        p50 = quantile(values, 0.5)
        if ratio is None:
            ratio = f"{p50 / base_p50:.2f}x" if base_p50 == base_p50 else ""
        print(
            f"  {label:<54} {len(values):>7,} {ms(p50):>7} {ms(quantile(values, 0.95)):>7} "
            f"{ms(quantile(values, 0.99)):>7} {ms(max(values, default=float('nan'))):>7} {ratio:>15}"
        )

    if baseline is not None:
        row("baseline, relay only (no master): send → ack", latencies(baseline, "acked"), "(baseline)")
    for run in runs:
        observed = run.pipeline
        row(f"{run.label}: send → ack", latencies(observed, "acked"))
        row(f"{run.label}: send → committed", latencies(observed, "committed"))
        if observed.polls:
            row(f"{run.label}: send → seen by a poll", latencies(observed, "stored"))
        row(f"{run.label}: ack → committed (the master's part)", latencies(observed, "committed", "acked"), "")
    print("  committed: the ingestor's transaction that inserted the row had committed (SQLAlchemy after_commit)")
    if any(run.pipeline.polls for run in runs):
        print(
            "  seen by a poll: the first SELECT that returned the row had returned (up to one poll period plus one"
            " query after the commit);\n  "
            + "; ".join(
                f"{run.label}: a poll every {run.pipeline.poll_seconds / max(1, run.pipeline.polls - 1) * 1e3:.1f} ms,"
                f" {run.pipeline.poll_busy / max(1, run.pipeline.polls) * 1e3:.2f} ms per query"
                for run in runs
                if run.pipeline.polls
            )
        )
    for run in runs:
        to_store = latencies(run.pipeline, "committed")
        to_ack = latencies(run.pipeline, "acked")
        base_ack = latencies(baseline, "acked") if baseline is not None else []
        added = [
            f"p{round(q * 100)} +{ms(quantile(to_store, q) - quantile(to_ack, q))} ms"
            + (f" (+{ms(quantile(to_store, q) - quantile(base_ack, q))} over the baseline)" if base_ack else "")
            for q in (0.5, 0.99)
        ]
        print(f"  {run.label}: storing adds, send → committed over this run's send → ack, {', '.join(added)}")
        for q in (0.5, 0.99):
            record("pipeline", f"{run.label}, {args.agents:,} agents at the protocol's rates ×{args.rate_scale:g}: "
                   f"send → committed, p{round(q * 100)}", quantile(to_store, q) * 1e3, "ms",
                   "relay only (no master): send → ack" if base_ack else None,
                   quantile(base_ack, q) * 1e3 if base_ack else None)  # fmt: skip

    print("\nthroughput and ingestion lag, per timed phase")
    print(
        f"  {'phase':<33} {'telemetry':>9} {'heartbeats':>10} {'offered msg/s':>13} {'applied msg/s':>13} {'stored/s':>8} "
        f"{'backlog at end':>14} {'pending':>7} {'drain s':>7} {'CPU %':>6}"
    )
    phases = ([("baseline, relay only", baseline)] if baseline is not None else []) + [
        (run.label, run.pipeline) for run in runs
    ]
    for label, observed in phases:
        seconds = observed.ended - observed.started
        telemetry = len(observed.timed())
        stored = sum(1 for key in observed.timed() if observed.committed.get(key, float("inf")) <= observed.ended)
        is_baseline = observed is baseline
        print(
            f"  {label:<33} {telemetry:>9,} {observed.heartbeats_sent:>10,} "
            f"{(telemetry + observed.heartbeats_sent) / seconds:>13,.1f} "
            f"{'' if is_baseline else f'{observed.applied / seconds:,.1f}':>13} {'' if is_baseline else f'{stored / seconds:,.1f}':>8} "
            f"{'' if is_baseline else f'{observed.backlog_at_end:,}':>14} {'' if is_baseline else f'{observed.pending_at_end:,}':>7} "
            f"{observed.drain_seconds:>7.2f} {observed.cpu_seconds / seconds * 100:>6.1f}"
        )
    print(
        "  offered: telemetry + heartbeats sent per second; applied: bus messages (every kind) the ingestor applied per"
        " second;\n  stored/s: timed telemetry rows committed by the time the agents stopped; backlog at end: messages"
        " on the bus\n  the ingestor had not applied yet when the agents stopped (pending: of those, delivered to it and"
        " not acked yet);\n  drain s: from then until every frame was acked, committed and seen by a poll; CPU %: this"
        " whole process (agents,\n  relay, master, SQLite's threads) over the phase, of one core; the PostgreSQL"
        " server's own is not included"
    )

    print("\ncorrectness")
    for run in runs:
        verdict = "OK" if not run.problems else "FAILED: " + "; ".join(run.problems)
        print(f"  {run.label}: {run.checks[0]}")
        print(f"  {' ' * len(run.label)}  {run.checks[1]} → {verdict}")


# ---- main -------------------------------------------------------------------------------------------


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--agents", type=int, default=200, help="simulated agents on the relay (default 200)")
    parser.add_argument(
        "--rate-scale", type=float, default=1.0,
        help=f"divide the protocol's {PROTOCOL_INTERVAL:g} s heartbeat and telemetry interval by this (default 1)",
    )
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of traffic per timed phase (default 15)")
    parser.add_argument(
        "--poll", type=float, default=0.01,
        help="seconds between polls of the telemetry table (default 0.01; 0: no poller, commit times only)",
    )
    parser.add_argument("--connect-parallel", type=int, default=20, help="handshakes in progress at once (default 20)")
    parser.add_argument(
        "--databases", default="sqlite,postgresql",
        help="databases to run, in order (default sqlite,postgresql; PostgreSQL is skipped with a note when its server "
        "does not answer, unless --database-url was given)",
    )
    parser.add_argument(
        "--database-url", default=None,
        help="PostgreSQL server to use: the bench connects to this URL with asyncpg, CREATEs a fresh database "
        f"gm_bench_<random> beside it, runs there and DROPs it (default {POSTGRES_DEFAULT}; "
        "the default comes from GPUMARKET_TEST_POSTGRES_URL when set)",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the relay-only baseline phase")
    parser.add_argument("--quick", action="store_true", help="50 agents, 10 s phases (for make bench QUICK=1)")
    args = parser.parse_args()
    if args.quick:
        args.agents, args.duration = 50, 10.0
    databases = [name.strip().lower() for name in args.databases.split(",") if name.strip()]
    if unknown := [name for name in databases if name not in ("sqlite", "postgresql")]:
        parser.error(f"unknown database(s) {', '.join(unknown)}; choose from sqlite, postgresql")
    if not databases:
        parser.error("--databases names none")
    if args.agents < 1 or args.connect_parallel < 1 or min(args.rate_scale, args.duration) <= 0 or args.poll < 0:
        parser.error("counts, durations and the rate scale must be positive")
    if args.database_url is not None and "postgresql" not in databases:
        databases.append("postgresql")
    args.interval = PROTOCOL_INTERVAL / args.rate_scale
    raise_open_files_limit()

    postgres_url = args.database_url or POSTGRES_DEFAULT
    postgres = await postgres_version(postgres_url) if "postgresql" in databases else None
    if args.database_url is not None and postgres is None:
        parser.error(f"PostgreSQL does not answer at {args.database_url}")
    print(describe_machine(with_openssl=True))
    print(
        "one process, one event loop: the simulated agents (websockets clients), the relay, its in-process bus and "
        "the master's ingestion (Ingestor, heartbeat monitor, command resender, revocation publisher; no HTTP) "
        "share it; SQLite runs in aiosqlite's threads of this process, PostgreSQL in its own server"
    )
    fleet_msgs = 2 * args.agents / args.interval
    print(
        f"{args.agents:,} agents, TLS 1.3 with client certificates (ECDSA P-256; one key, a certificate each), each "
        f"sending a telemetry frame ({GPUS}) every {args.interval:g} s and a heartbeat half-way between "
        f"(rate scale {args.rate_scale:g}x of the protocol's {PROTOCOL_INTERVAL:g} s): {fleet_msgs:,.1f} msgs/s for "
        f"the fleet, {args.agents / args.interval:,.1f} of them telemetry; {args.duration:g} s timed per phase"
    )
    if "postgresql" in databases and postgres is None:
        print(f"PostgreSQL: not reachable at {postgres_url}; skipped (start it, or pass --database-url)")
        databases.remove("postgresql")
    if not databases:
        return 2

    runs: list[DatabaseRun] = []
    for number, name in enumerate(databases):
        first = number == 0 and not args.no_baseline
        if name == "sqlite":
            runs.append(await run_database("SQLite", None, args, with_baseline=first))
        else:
            async with fresh_database(postgres_url) as url:
                runs.append(await run_database(f"PostgreSQL {postgres}", url, args, with_baseline=first))
        run = runs[-1]
        print(
            f"set-up ({run.label}): {args.agents:,} hosts enrolled (create_token + enroll with a CSR) in "
            f"{run.enroll_seconds:.1f} s; agents connected in {run.pipeline.connect_seconds:.1f} s; frames: "
            + ", ".join(f"{kind} {size:,} B" for kind, size in run.frame_bytes.items())
        )
        print(f"  measured {run.label}", file=sys.stderr)
    print_report(runs, args)
    return 0 if all(not run.problems for run in runs) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
