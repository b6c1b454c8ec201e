"""Helpers every benchmark script shares: the machine line, the results record (``record``), a progress
counter on stderr, quantiles, a fresh database, and the simulated agents' parts (a busy host, its
telemetry, its certificate and its websocket to a relay)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import platform
import secrets
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import asyncpg
from websockets.asyncio.client import ClientConnection, connect

from agent.gpu.sim import SimulatedBackend
from shared import protocol
from shared.crypto import (
    CertificateAuthority,
    client_ssl_context,
    generate_private_key,
    make_csr,
    write_private_key,
)


def describe_machine(*, with_openssl: bool = False) -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    versions = ", ".join(f"{name} {metadata.version(name)}" for name in ("pydantic", "websockets"))
    tls = f"; {ssl.OPENSSL_VERSION}" if with_openssl else ""
    return (
        f"machine: {model}, {cores} cores ({usable} usable); "
        f"{platform.python_implementation()} {platform.python_version()} on {platform.system()} "
        f"{platform.release()}; {versions}{tls}"
    )


RESULTS_ENV = "GPUMARKET_BENCH_RESULTS"
DEFAULT_RESULTS = Path(__file__).resolve().parent / "results.json"
_recorded: set[str] = set()  # benches that recorded a figure in this process (their older figures are gone)


def results_path() -> Path:
    """Where ``record`` writes: ``$GPUMARKET_BENCH_RESULTS``, else ``bench/results.json``."""
    return Path(os.environ.get(RESULTS_ENV) or DEFAULT_RESULTS)


def record(
    bench: str,
    figure: str,
    value: float,
    unit: str,
    baseline: str | None = None,
    baseline_value: float | None = None,
    note: str = "",
    *,
    component: str | None = None,
) -> None:
    """Add one headline figure of ``bench`` (e.g. ``"relay"``) to the results file, beside its baseline from the
    same run (``baseline`` names it: ``"json.loads"``, ``"direct TCP"``; ``baseline_value`` in the same ``unit``).

    ``bench/report.py`` turns the file into docs/performance.md: one table per ``component`` (default: the
    bench's name), the ratio value / baseline, and each bench's date, machine, load and arguments. The first
    figure a bench records in a process drops the figures its earlier runs left, so a file holds each bench's
    latest run. Safe for benches running at once (the file is locked, and replaced whole).
    """
    path = results_path()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    entry = {
        "bench": bench, "component": component or bench, "figure": figure, "value": value, "unit": unit,
        "baseline": baseline, "baseline_value": baseline_value, "note": note,
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "machine": describe_machine(),
        "cores": usable, "load": round(os.getloadavg()[0], 2), "args": " ".join(sys.argv[1:]),
    }  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            figures = json.loads(path.read_text(encoding="utf-8"))["figures"] if path.exists() else []
        except (ValueError, KeyError, TypeError):
            figures = []  # an unreadable file is started again rather than failing the bench at its end
        if bench not in _recorded:
            figures = [f for f in figures if f.get("bench") != bench]
            _recorded.add(bench)
        figures = [f for f in figures if (f.get("bench"), f.get("figure")) != (bench, figure)]
        figures.append(entry)
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps({"figures": figures}, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(temporary, path)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far, from ``/proc``; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def unmount_under(folder: Path) -> list[str]:
    """Unmount (lazily) every filesystem mounted at or under ``folder``, deepest first; returns the mount points.

    A rental's disk (``agent.runtimes.diskquota``) stays mounted until the rental is forgotten, which a bench's
    teardown does not wait for: without this its temporary folder's removal fails with "Device or resource busy"."""
    root = os.path.realpath(folder)
    with open("/proc/self/mounts", encoding="utf-8") as mounts:
        points = [line.split()[1].replace("\\040", " ") for line in mounts if len(line.split()) > 1]
    inside = sorted({p for p in points if p == root or p.startswith(root + os.sep)}, key=len, reverse=True)
    for point in inside:
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)
    return inside


def quantile(values: Iterable[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (``q`` in 0..1) of ``values``: the p99 of 200 values is the
    198th smallest, ``q=1`` the largest; NaN when there are none."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else math.nan


class Progress:
    """A counter line on stderr, shown only once a phase has run for more than ``after`` seconds."""

    def __init__(self, label: str, total: int, *, after: float = 2.0) -> None:
        self.label, self.total, self.after = label, total, after
        self.started = time.monotonic()
        self.last_shown = 0.0
        self.shown = False
        self.tty = sys.stderr.isatty()

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now - self.started < self.after or now - self.last_shown < (0.25 if self.tty else 2.0):
            return
        self.last_shown, self.shown = now, True
        line = f"  {self.label}: {done:,}/{self.total:,} ({now - self.started:.0f}s)"
        print(
            f"\r{line}\033[K" if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True
        )

    def done(self) -> None:
        if self.shown and self.tty:
            print("\r\033[K", end="", file=sys.stderr, flush=True)


@contextlib.asynccontextmanager
async def fresh_database(admin_url: str) -> AsyncIterator[str]:
    """A new, empty database on the server of ``admin_url``; dropped on exit (its connections closed first)."""
    name = f"gm_bench_{secrets.token_hex(6)}"
    admin = await asyncpg.connect(admin_url, timeout=10)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield f"{admin_url.rsplit('/', 1)[0]}/{name}"
        finally:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


def busy_backend(gpus: str, seed: str) -> SimulatedBackend:
    """A simulated host (``gpus``, e.g. ``"sim:8xH100"``) whose every GPU is rented: a process on each."""
    backend = SimulatedBackend(gpus, seed=seed)
    backend.set_busy([gpu.uuid for gpu in backend.gpus()], True)
    return backend


def telemetry_body(backend: SimulatedBackend, window_s: float) -> protocol.TelemetryBody:
    """What ``Agent.report_telemetry`` sends: the latest sample and the window's aggregates."""
    samples = backend.sample()
    return protocol.TelemetryBody(
        sampled_at=datetime.now(UTC),
        gpus=[protocol.GpuSampleModel.model_validate(s.to_wire()) for s in samples],
        window_s=window_s,
        aggregates=[
            protocol.GpuAggregateModel(
                uuid=s.uuid, samples=round(window_s), gpu_util_avg=s.gpu_util_pct, gpu_util_max=s.gpu_util_pct,
                memory_used_max_mib=s.memory_used_mib, temperature_max_c=s.temperature_c,
                power_avg_w=s.power_draw_w, power_max_w=s.power_draw_w,
            )
            for s in samples
        ],
    )


def write_agent_key(key_file: Path, subject: str) -> bytes:
    """A new agent key written to ``key_file``; returns its CSR for ``subject`` (one key may serve many agents)."""
    key = generate_private_key()
    write_private_key(key_file, key)
    return make_csr(key, subject)


def agent_context(ca_cert: Path, key_file: Path, cert_file: Path, cert_pem: bytes) -> ssl.SSLContext:
    """A client context presenting ``cert_pem`` (written to ``cert_file``) with the key in ``key_file``."""
    cert_file.write_bytes(cert_pem)
    return client_ssl_context(ca_cert, cert_file=cert_file, key_file=key_file)


def agent_client_context(ca: CertificateAuthority, directory: Path, host_id: str) -> ssl.SSLContext:
    """A client context for ``host_id``: a new key and a certificate signed by ``ca``, written to ``directory``."""
    key_file = directory / f"{host_id}.key"
    issued = ca.sign_agent_csr(write_agent_key(key_file, host_id), host_id=host_id)
    return agent_context(ca.cert_path, key_file, directory / f"{host_id}.crt", issued.cert_pem)


@dataclass
class Counter:
    """Acks an agent's reader has counted, read by the progress line and the report."""

    acked: int = 0


def agent_connection(url: str, context: ssl.SSLContext | None, *, open_timeout: float) -> connect:
    """An agent's websocket to ``url`` with the agent's options (no compression, no proxy, the protocol's
    frame limit); await it, or enter it as an async context manager."""
    return connect(
        url,
        ssl=context,
        open_timeout=open_timeout,
        close_timeout=2.0,
        compression=None,
        proxy=None,
        max_size=protocol.DEFAULT_MAX_FRAME,
    )


async def open_agent(url: str, host_id: str, context: ssl.SSLContext | None, *, open_timeout: float) -> ClientConnection:
    """An agent's websocket to ``url``, once the relay's welcome has been read."""
    ws = await agent_connection(url, context, open_timeout=open_timeout)
    welcome = json.loads(await ws.recv())
    if welcome.get("type") != "welcome":
        raise RuntimeError(f"{host_id}: expected a welcome, got {welcome!r}")
    return ws


def parse_seeds(text: str) -> list[int]:
    """``42-51`` or ``1,5,9-12`` (a bench's --seeds) as a list of seeds."""
    seeds: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        seeds.extend(range(int(low), int(high or low) + 1))
    return seeds
