"""The supervisor: every background loop of a master process, owned, restarted, stopped in reverse.

``master_loops`` lists the loops in start order; ``Supervisor`` runs them. The app enters the
supervisor as its last ``cleanup_ctx`` (``master.app``), so the loops start once the database,
the bus and the HTTP sessions they use are open, and stop before any of those close.

The policy, written down:

* **Start.** In ``master_loops`` order, each loop is one task the supervisor owns, named after
  the loop (``ingest``, ``heartbeat-monitor``, ``billing-rate``…). Nothing else in the master
  starts background tasks.
* **Crash.** Every loop retries its own failing passes (logged, next period), so a loop that
  still raises — or returns — is a bug, or a failure before its first pass (the bus down while
  the consumer group is created). The supervisor logs it, with the traceback, and restarts it
  after a back-off: ``restart_delay`` seconds, doubled after each crash in a row up to
  ``max_restart_delay``, and back to ``restart_delay`` once a run lasted longer than
  ``max_restart_delay``. The master is not brought down: its API and the other loops keep
  serving, and the leases keep a restarted loop one master at a time. A ``CancelledError`` is
  never a crash: it ends the loop.
* **Stop.** In reverse start order, one loop at a time: cancel its task, wait for it up to
  ``stop_timeout`` seconds, log that it stopped. Cancelling each loop is safe (its docstring says
  why); leased loops release their lease on the way out so another master need not wait for the
  TTL. A loop still running after ``stop_timeout`` is logged as abandoned and the next one is
  stopped. Should ``stop`` itself be cancelled, every loop not stopped yet is cancelled at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from types import TracebackType

import aiohttp

from billing.jobs import JOBS
from master.background.alerts import alert_loop
from master.background.autoscaler import autoscaler_loop
from master.background.billing import billing_loop
from master.background.commands import command_resender
from master.background.gateway import gateway_stats_loop
from master.background.heartbeats import heartbeat_monitor
from master.background.ingest import ingest_loop
from master.background.links import link_events_loop
from master.background.power import power_loop
from master.background.rental_queue import queue_loop
from master.background.revocations import revocation_publisher
from master.background.scoring import scoring_loop
from master.background.telemetry import maintenance_loop
from master.background.verification import verification_loop
from master.context import Master

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Loop:
    """One background loop: its task's name, and a coroutine function that runs until cancelled."""

    name: str
    run: Callable[[], Awaitable[None]]


def master_loops(master: Master, *, webhook_http: aiohttp.ClientSession) -> list[Loop]:
    """Every background loop of one master process, in start order (they stop in reverse)."""
    loops = [
        Loop("ingest", functools.partial(ingest_loop, master)),
        Loop("link-events", functools.partial(link_events_loop, master)),
        Loop("heartbeat-monitor", functools.partial(heartbeat_monitor, master)),
        Loop("command-resender", functools.partial(command_resender, master)),
        Loop("revocation-publisher", functools.partial(revocation_publisher, master)),
        Loop("telemetry-maintenance", functools.partial(maintenance_loop, master)),
        Loop("alerts", functools.partial(alert_loop, master, http=webhook_http)),
        Loop("host-scoring", functools.partial(scoring_loop, master)),
        Loop("rental-queue", functools.partial(queue_loop, master)),
        Loop("autoscaler", functools.partial(autoscaler_loop, master)),
        Loop("gateway-stats", functools.partial(gateway_stats_loop, master)),
        Loop("power-policy", functools.partial(power_loop, master)),
        Loop("gpu-verification", functools.partial(verification_loop, master)),
    ]
    if master.settings.billing_in_process:
        loops += [Loop(f"billing-{job.name}", functools.partial(billing_loop, master, job)) for job in JOBS.values()]
    return loops


class Supervisor:
    """Runs ``loops`` as owned tasks under the module's policy; an async context manager (start, stop)."""

    def __init__(
        self,
        loops: Iterable[Loop],
        *,
        restart_delay: float = 1.0,
        max_restart_delay: float = 60.0,
        stop_timeout: float = 10.0,
    ) -> None:
        self.loops = list(loops)
        names = [loop.name for loop in self.loops]
        if len(set(names)) != len(names):
            raise ValueError(f"background loop names must be unique: {names}")
        self.restart_delay = restart_delay
        self.max_restart_delay = max_restart_delay
        self.stop_timeout = stop_timeout
        self.restarts: Counter[str] = Counter()
        """Restarts per loop since ``start`` (each one logged when it happened)."""
        self._tasks: dict[str, asyncio.Task[None]] = {}

    @property
    def running(self) -> list[str]:
        """Names of the loops whose task has not finished, in start order."""
        return [name for name, task in self._tasks.items() if not task.done()]

    def start(self) -> None:
        """Start every loop, in order, each as a task named after it."""
        if self._tasks:
            raise RuntimeError("the supervisor is already running")
        for loop in self.loops:
            self._tasks[loop.name] = asyncio.create_task(self._supervise(loop), name=loop.name)
        log.info("background loops started: %s", ", ".join(self._tasks) or "none")

    async def stop(self) -> None:
        """Stop every loop in reverse start order: cancel, wait up to ``stop_timeout``, log."""
        if self._tasks:
            log.info("stopping background loops: %s", ", ".join(reversed(self._tasks)))
        try:
            while self._tasks:
                name, task = self._tasks.popitem()  # the last started first
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=self.stop_timeout)
                if not done:
                    log.error("background loop %s did not stop within %gs of being cancelled; abandoning it",
                              name, self.stop_timeout)
                elif not task.cancelled() and task.exception() is not None:
                    log.error("background loop %s failed while stopping", name, exc_info=task.exception())
                else:
                    log.debug("background loop %s stopped", name)
        except asyncio.CancelledError:
            for task in self._tasks.values():
                task.cancel()
            self._tasks.clear()
            raise

    async def __aenter__(self) -> Supervisor:
        self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def _supervise(self, loop: Loop) -> None:
        """Run ``loop`` until cancelled, restarting it after a back-off whenever it returns or raises."""
        clock = asyncio.get_running_loop()
        delay = self.restart_delay
        while True:
            started = clock.time()
            error: Exception | None = None
            try:
                await loop.run()
            except Exception as exc:
                error = exc
            if clock.time() - started > self.max_restart_delay:
                delay = self.restart_delay  # it ran a good while: not a crash loop
            if error is not None:
                log.error("background loop %s crashed; restarting it in %gs", loop.name, delay, exc_info=error)
            else:
                log.error("background loop %s returned, which it never should; restarting it in %gs", loop.name, delay)
            self.restarts[loop.name] += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_restart_delay)
