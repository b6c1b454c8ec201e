"""Container starts in flight, for ``agent.runtimes.manager.WorkloadManager``: a start waits on the engine (the
image's check and pull, the container's creation), a second start of the same rental waits for the first, and a
stop cancels a pull still running (the start then fails ``workload_stopped``) and waits for the rest of the start.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from agent.runtimes.containeropts import PreparedImage
from shared.errors import Conflict


class StartsInFlight:
    """A lock per rental whose container is being started, and the task of its image's pull meanwhile."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._pulls: dict[str, asyncio.Task[PreparedImage]] = {}

    def __contains__(self, rental_id: object) -> bool:
        """Whether a start of the rental is in flight (or waiting for one)."""
        return rental_id in self._locks

    @contextlib.asynccontextmanager
    async def one_at_a_time(self, rental_id: str) -> AsyncIterator[None]:
        """Hold the rental's start lock: a second start of it waits here for the first; a stop waits for both."""
        lock = self._locks.setdefault(rental_id, asyncio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and self._locks.get(rental_id) is lock:
                del self._locks[rental_id]

    async def image(self, rental_id: str, pull: asyncio.Task[PreparedImage], *, check_open: Callable[[], None]) -> PreparedImage:
        """The image ``pull`` (the check and pull of the rental's start) prepares. A stop that cancels it fails the start
        with ``Conflict`` (``workload_stopped``), or ``check_open``'s error when the manager is closing. Cancelling the
        caller cancels the pull too."""
        self._pulls[rental_id] = pull
        try:
            return await pull
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if pull.cancelled() and current is not None and not current.cancelling():
                check_open()  # close() cancelled it: the agent is shutting down
                raise Conflict(f"rental {rental_id} was stopped while its image was being pulled", code="workload_stopped") from None
            raise
        finally:
            self._pulls.pop(rental_id, None)

    async def stop(self, rental_id: str) -> None:
        """Cancel the rental's pull still running (its start then fails ``workload_stopped``) and wait until its start
        is over (a container already being made is made; the caller stops it). Returns at once when none is in flight."""
        starting = self._locks.get(rental_id)
        if starting is None:
            return
        pull = self._pulls.get(rental_id)
        if pull is not None:
            pull.cancel()
        async with starting:
            pass
