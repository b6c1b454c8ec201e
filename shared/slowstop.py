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


def await_chain(awaitable: object, limit: int = 40) -> list[str]:
    """Where a suspended coroutine waits, outermost first: one ``file:line in function`` per coroutine it awaits.

    A task's own stack shows only its outermost frame; following ``cr_await`` shows the line that really waits."""
    lines: list[str] = []
    current: object = awaitable
    while current is not None and len(lines) < limit:
        frame = getattr(current, "cr_frame", None) or getattr(current, "gi_frame", None) or getattr(current, "ag_frame", None)
        if frame is None:
            lines.append(f"awaiting {current!r}")
            break
        lines.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        current = getattr(current, "cr_await", None) or getattr(current, "gi_yieldfrom", None) or getattr(current, "ag_await", None)
    return lines


def task_stacks(limit: int = 40) -> str:
    """Where every unfinished task of the running loop waits, the current one included, as text."""
    out = io.StringIO()
    for task in sorted(asyncio.all_tasks(), key=lambda t: t.get_name()):
        if task.done():
            continue
        state = " (cancelling)" if task.cancelling() else ""
        out.write(f"--- task {task.get_name()}{state}\n")
        out.writelines(f"    {line}\n" for line in await_chain(task.get_coro(), limit))
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
