"""Shutting down in named steps, each one that runs long reported while it still runs.

A stop that hangs shows nothing by itself: the process prints its last line and waits. ``step`` runs one part of a
shutdown and, when it has not finished after ``warn_after`` seconds, tells ``progress`` its name once and logs a
warning with the stack of every task still alive, so the log says what it waits on. It never cancels the step:
bounding each part is that part's own business (its drain timeout, its ``stop_timeout``).
"""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
WARN_AFTER_S = 5.0


def task_stacks(limit: int = 40) -> str:
    """The stack of every unfinished task of the running loop, the current one included, as text."""
    out = io.StringIO()
    for task in sorted(asyncio.all_tasks(), key=lambda t: t.get_name()):
        if task.done():
            continue
        out.write(f"--- task {task.get_name()}: {task.get_coro()!r}\n")
        task.print_stack(limit=limit, file=out)
    return out.getvalue()


async def step(
    name: str, work: Awaitable[T], *, progress: Callable[[str], None] | None = None, warn_after: float = WARN_AFTER_S
) -> T:
    """Await ``work``; past ``warn_after`` seconds, say ``still stopping: <name>`` once and log every task's stack."""
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=warn_after)
        if not done:
            if progress is not None:
                progress(f"still stopping: {name} (over {warn_after:g} s)")
            log.warning("stopping %s has taken over %g s; the tasks still running:\n%s", name, warn_after, task_stacks())
        return await task
    except asyncio.CancelledError:
        task.cancel()  # our caller was cancelled: so is the step (asyncio.wait would leave it running)
        raise
