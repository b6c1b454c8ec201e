"""What the workload tests share (processes, per-rental users, containers): the ``on_exit``
recorder, a simulated GPU host and a cgroup slice of the test's own.

``tests/conftest.py`` loads them as a plugin, so every test module has them by name; a module
may override one (the container tests use a larger host).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from agent.gpu.sim import SimulatedBackend
from agent.runtimes.cgroups import CgroupLimiter, cgroup_limiter, detect_cgroup_support
from agent.runtimes.containeropts import ContainerOptions
from agent.runtimes.manager import WorkloadManager
from tests import dockerengine


class Exits:
    """Records ``on_exit`` calls (the order kept in ``calls``); ``wait_for`` awaits the one of a rental."""

    def __init__(self, *, wait: float = 10.0) -> None:
        self.calls: list[tuple[str, int | None]] = []
        self.wait = wait
        self._changed = asyncio.Event()

    async def __call__(self, rental_id: str, exit_code: int | None) -> None:
        self.calls.append((rental_id, exit_code))
        self._changed.set()

    def of(self, rental_id: str) -> list[int | None]:
        return [code for called, code in self.calls if called == rental_id]

    async def wait_for(self, rental_id: str) -> int | None:
        """The exit code of the rental's first reported exit, once there is one (``wait`` seconds at most)."""
        async with asyncio.timeout(self.wait):
            while not self.of(rental_id):
                self._changed.clear()
                await self._changed.wait()
        return self.of(rental_id)[0]


@contextlib.asynccontextmanager
async def container_manager(work: Path, *, seed: str) -> AsyncIterator[WorkloadManager]:
    """A workload manager of a simulated 2 × RTX 4090 host running containers under an owner of its own, with short
    stop and kill timeouts; at the end it is closed and everything its owner made in the engine removed."""
    owner = f"test-{secrets.token_hex(4)}"
    made = WorkloadManager(
        work, SimulatedBackend("sim:2xRTX4090", seed=seed), container=ContainerOptions(owner=owner),
        stop_timeout=2.0, kill_timeout=5.0, check_interval=0.05,
    )  # fmt: skip
    try:
        yield made
    finally:
        with contextlib.suppress(Exception):
            await made.close(stop_workloads=True)
        dockerengine.remove_owned(owner)


@pytest.fixture
def exits() -> Exits:
    return Exits()


@pytest.fixture
def backend() -> SimulatedBackend:
    return SimulatedBackend("sim:2xRTX4090", seed="t")


@pytest.fixture
def gpus(backend: SimulatedBackend) -> list[str]:
    return [g.uuid for g in backend.gpus()]


@pytest.fixture
def cgroups() -> Iterator[CgroupLimiter]:
    """This host's real cgroup support, in a slice of this test's own that is removed afterwards."""
    support = detect_cgroup_support(slice_name=f"gpumarket-test-{secrets.token_hex(4)}.slice")
    limiter = cgroup_limiter(support)
    yield limiter
    limiter.close()
    for slice_dir in support.slices:
        for group in slice_dir.glob("rental-*"):
            with contextlib.suppress(OSError):
                group.rmdir()
        with contextlib.suppress(OSError):
            slice_dir.rmdir()
