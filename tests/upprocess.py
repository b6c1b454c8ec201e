"""`gpumarket up` as a real process on free ports, for tests that drive it from outside (browser, installer)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# SIGINT to exit. A loop cancelled while its SQLite statement waits for the write lock finishes only when the lock
# frees or busy_timeout (30 s) passes, so a loaded machine may take past 20 s (once in CI: billing-rate, 2026-11-26).
STOP_S = 45.0


def log_tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]


@contextmanager
def gpumarket_up(data_dir: Path, log: Path, env: dict[str, str], *, agents: int, strict_stop: bool) -> Iterator[subprocess.Popen[bytes]]:
    """Start `gpumarket up --agents N` (output to ``log``); on exit SIGINT it and wait ``STOP_S``.

    Past that it is killed, and with ``strict_stop`` that fails the test, as does an exit status other than 0.
    """
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gpumarket.cli", "up", "--data-dir", str(data_dir), "--http-port", "0",
             "--relay-port", "0", "--agents", str(agents), "--log-level", "WARNING"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        yield process
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            if strict_stop:
                raise AssertionError(f"gpumarket up did not stop within {STOP_S:g} s of SIGINT:\n{log_tail(log)}") from None
    if strict_stop:
        assert process.returncode == 0, f"gpumarket up stopped with {process.returncode}:\n{log_tail(log)}"


def check_alive(process: subprocess.Popen[bytes], log: Path, deadline: float, start_s: float) -> None:
    """Fail at once when `gpumarket up` exited or was not ready by ``deadline`` (monotonic)."""
    if process.poll() is not None:
        raise AssertionError(f"gpumarket up exited with {process.returncode}:\n{log_tail(log)}")
    if time.monotonic() > deadline:
        raise AssertionError(f"gpumarket up was not ready within {start_s:g} s:\n{log_tail(log)}")


def wait_for_credentials(process: subprocess.Popen[bytes], data_dir: Path, log: Path, *, role: str, deadline: float,
                         start_s: float) -> dict[str, Any]:  # fmt: skip
    """`credentials.json` once it names ``role`` (written atomically, but read until it is whole)."""
    creds: dict[str, Any] = {}
    while role not in creds:
        check_alive(process, log, deadline, start_s)
        try:
            creds = json.loads((data_dir / "credentials.json").read_text())
        except (OSError, ValueError):
            time.sleep(0.2)
    return creds
