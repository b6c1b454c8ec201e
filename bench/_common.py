"""Helpers every benchmark script shares: the machine line, a progress counter on stderr, quantiles
and a fresh database."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import secrets
import ssl
import sys
import time
from collections.abc import AsyncIterator, Iterable
from importlib import metadata

import asyncpg


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
