"""The master's background supervisor: loops start in order, crash and restart, stop in reverse; the app runs it.

Loops here are small coroutines that record what happens to them; the app test runs the real
master's loops over SQLite and PostgreSQL with an in-process bus.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from master.app import SUPERVISOR, close_master, create_app, open_master
from master.background.supervisor import Loop, Supervisor
from master.context import Master
from shared.bus import InProcessBus
from shared.errors import ConfigError
from tests.factories import MS, master_settings
from tests.helpers import eventually


def recording(name: str, events: list[str]) -> Callable[[], Awaitable[None]]:
    """A loop that records its start and its cancellation, and otherwise waits."""

    async def run() -> None:
        events.append(f"start {name}")
        try:
            await asyncio.Event().wait()
        finally:
            events.append(f"stop {name}")

    return run


class TestSupervisor:
    async def test_starts_loops_in_order_as_named_tasks_and_stops_them_in_reverse(self) -> None:
        """Each loop runs as a task named after it; stop cancels and awaits them last-started first."""
        events: list[str] = []
        supervisor = Supervisor([Loop(name, recording(name, events)) for name in ("a", "b", "c")])
        async with supervisor:
            await eventually(lambda: _true(len(events) == 3), what="every loop started")
            assert events == ["start a", "start b", "start c"]
            assert supervisor.running == ["a", "b", "c"]
            names = {task.get_name() for task in asyncio.all_tasks()}
            assert {"a", "b", "c"} <= names
        assert events[3:] == ["stop c", "stop b", "stop a"]
        assert supervisor.running == []

    async def test_a_crashing_loop_is_logged_and_restarted_after_a_back_off(self, caplog: pytest.LogCaptureFixture) -> None:
        """A loop that raises is logged with its traceback and started again; the others keep running."""
        runs = 0

        async def flaky() -> None:
            nonlocal runs
            runs += 1
            if runs <= 2:
                raise RuntimeError("the bus was down before the first pass")
            await asyncio.Event().wait()

        events: list[str] = []
        supervisor = Supervisor([Loop("steady", recording("steady", events)), Loop("flaky", flaky)], restart_delay=5 * MS)
        with caplog.at_level(logging.ERROR, logger="master.background.supervisor"):
            async with supervisor:
                await eventually(lambda: _true(runs == 3), what="the third run")
                assert supervisor.restarts == {"flaky": 2}
                assert supervisor.running == ["steady", "flaky"]
        crashes = [r for r in caplog.records if "crashed" in r.getMessage()]
        assert len(crashes) == 2 and crashes[0].exc_info is not None
        assert events == ["start steady", "stop steady"]

    async def test_a_loop_that_returns_is_restarted_too(self) -> None:
        """Returning is never a loop's normal end: the supervisor starts it again."""
        runs = 0

        async def returns() -> None:
            nonlocal runs
            runs += 1

        async with Supervisor([Loop("returns", returns)], restart_delay=MS, max_restart_delay=2 * MS) as supervisor:
            await eventually(lambda: _true(runs >= 3), what="three runs")
            assert supervisor.restarts["returns"] >= 2

    async def test_a_loop_that_ignores_cancellation_is_abandoned_after_the_stop_timeout(self) -> None:
        """Stopping does not hang on one stuck loop: it is logged after ``stop_timeout`` and the rest stop."""
        events: list[str] = []

        async def stubborn() -> None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                events.append("ignored a cancel")
            await asyncio.Event().wait()  # a second cancel ends it

        supervisor = Supervisor([Loop("first", recording("first", events)), Loop("stubborn", stubborn)], stop_timeout=20 * MS)
        async with supervisor:
            await eventually(lambda: _true(events == ["start first"]), what="the first loop")
        assert events == ["start first", "ignored a cancel", "stop first"]
        abandoned = next(task for task in asyncio.all_tasks() if task.get_name() == "stubborn")
        abandoned.cancel()  # so the test leaves nothing running
        with pytest.raises(asyncio.CancelledError):
            await abandoned

    def test_loop_names_are_unique(self) -> None:
        """Two loops under one name would be one task the supervisor cannot tell apart."""
        with pytest.raises(ValueError, match="unique"):
            Supervisor([Loop("a", recording("a", [])), Loop("a", recording("a", []))])


class TestApp:
    async def test_the_app_runs_every_loop_of_the_master_and_stops_them_at_cleanup(self, master: Master) -> None:
        """create_app's supervisor runs the master's loops while the app runs, billing's included."""
        app = create_app(master)
        client: TestClient[Any, Any] = TestClient(TestServer(app))
        await client.start_server()
        try:
            supervisor = app[SUPERVISOR]
            assert supervisor.running == [
                "ingest", "link-events", "heartbeat-monitor", "command-resender", "revocation-publisher", "telemetry-maintenance",
                "alerts", "host-scoring", "rental-queue", "autoscaler", "gateway-stats", "power-policy", "gpu-verification", "billing-rate", "billing-enforce", "billing-payouts",
            ]  # fmt: skip
        finally:
            await client.close()
        assert supervisor.running == []

    async def test_open_master_closes_what_it_opened_when_a_later_step_fails(self, tmp_path: Path) -> None:
        """A standalone master with no bus fails after its database opened, and says what to set."""
        settings = master_settings(tmp_path, redis_url=None)
        with pytest.raises(ConfigError, match="needs the bus"):
            await open_master(settings)
        master = await open_master(settings, bus=InProcessBus())  # the same database opens again
        await close_master(master)


async def _true(value: bool) -> bool:
    return value
