"""Throwaway PostgreSQL and Redis servers for the fault suite, which kills and restarts them.

The machine's own servers (PostgreSQL on 5432, Redis on 6379) are shared and are never
stopped: each fault-suite run starts its own from the same binaries, in a temporary folder,
on free loopback ports.

* PostgreSQL: ``initdb -A trust``, then ``pg_ctl start``; ``crash()`` is ``pg_ctl stop -m
  immediate`` (the postmaster and every backend quit without a checkpoint; the next start
  recovers from the WAL, as after a crash). Run as the ``postgres`` user when the suite runs as
  root, since PostgreSQL refuses to run as root.
* Redis: the bus is Redis Streams, and a Redis without persistence loses every stream, pending
  list and consumer group when it restarts. Production runs it with ``appendonly yes``
  (``deploy/compose.yaml``), so this one runs with ``appendonly yes`` and ``appendfsync always``:
  a write Redis acknowledged is on disk, so ``crash()`` (SIGKILL) loses nothing acknowledged and
  the scenario tests the services' reconnection, not Redis's durability settings.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PG_BIN = Path(os.environ.get("GPUMARKET_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
REDIS_SERVER = os.environ.get("GPUMARKET_TEST_REDIS_SERVER") or shutil.which("redis-server") or "/usr/bin/redis-server"


class ServerError(RuntimeError):
    """A throwaway server would not start or stop; the message says what it printed."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_port(port: int, *, up: bool, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                if up:
                    return
        except OSError:
            if not up:
                return
        time.sleep(0.05)
    raise ServerError(f"{what} did not {'open' if up else 'close'} port {port} within {timeout:g} s")


class PostgresServer:
    """One PostgreSQL cluster in ``<tmp>/data``, listening on 127.0.0.1 only."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="gm-faults-pg-"))
        self.port = free_port()
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            shutil.chown(self.root, user="postgres")

    def _run(self, *args: str, timeout: float = 60) -> str:
        prefix = ["runuser", "-u", "postgres", "--"] if self._as_postgres else []
        done = subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            log = (self.root / "postgres.log")
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise ServerError(f"`{' '.join(args)}` exited {done.returncode}: {done.stdout}{done.stderr}\n{tail}")
        return done.stdout

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        data = self.root / "data"
        if not (PG_BIN / "initdb").exists():
            raise ServerError(f"no PostgreSQL server binaries in {PG_BIN}: install postgresql, or point GPUMARKET_TEST_PG_BIN "
                              "at the folder with initdb and pg_ctl")  # fmt: skip
        if not data.exists():
            self._run(str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c max_connections=200"
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(self.root / "postgres.log"), "-o", options, "-w", "start")

    def crash(self) -> None:
        """``pg_ctl stop -m immediate``: no checkpoint; the next start replays the WAL."""
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.root / "data"), "-m", "immediate", "-w", "stop")

    def destroy(self) -> None:
        if (self.root / "data" / "postmaster.pid").exists():
            try:
                self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.root / "data"), "-m", "immediate", "-w", "stop")
            except (ServerError, subprocess.TimeoutExpired):
                pass
        shutil.rmtree(self.root, ignore_errors=True)


class RedisServer:
    """One redis-server with ``appendonly yes``, ``appendfsync always``, no RDB snapshots."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="gm-faults-redis-"))
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        with open(self.root / "redis.log", "ab") as out:
            self.process = subprocess.Popen(
                [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.root),
                 "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        _wait_port(self.port, up=True, timeout=30, what="redis-server")
        self._wait_loaded(timeout=30)

    def _wait_loaded(self, *, timeout: float) -> None:
        """Until PING answers PONG: the port opens before the append-only file is loaded (``-LOADING`` till then)."""
        deadline = time.monotonic() + timeout
        answer = b""
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    answer = conn.recv(256)
                    if answer.startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise ServerError(f"redis-server on port {self.port} did not answer PING within {timeout:g} s (last: {answer!r})")

    def crash(self) -> None:
        """SIGKILL: what Redis acknowledged is in the append-only file already."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        _wait_port(self.port, up=False, timeout=10, what="redis-server")

    def destroy(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.root, ignore_errors=True)
