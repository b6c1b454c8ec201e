"""A task's stop request that a library lost, raised again.

Python 3.11's ``asyncio.wait_for`` returns its awaitable's result when that finishes in the same pass of the event
loop as a cancel of the task awaiting it: the ``CancelledError`` is swallowed and the task runs on (CPython
gh-86296, fixed in 3.12 by building ``wait_for`` on ``asyncio.timeout``). dnspython's asyncio backend waits on
every DNS answer with ``wait_for``, so an agent stopped while it resolves its relays could miss the stop and
connect, then wait on its relay forever (``gpumarket up`` hung on Ctrl-C that way, about one restart in thirty
under load).

The task still knows it was asked: ``Task.cancelling()`` counts cancel requests not yet handled. ``raise_if_cancelled``
raises ``CancelledError`` again where that count is not zero; call it after an await that may have lost one.
"""

from __future__ import annotations

import asyncio


def raise_if_cancelled() -> None:
    """Raise ``CancelledError`` when the current task has a cancel request that nothing handled (see above)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError("the task was cancelled while a library swallowed it (asyncio.wait_for, Python 3.11)")
