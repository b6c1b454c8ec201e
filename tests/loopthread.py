"""An asyncio event loop on a background thread, for synchronous tests that drive a real server.

Hypothesis and schemathesis run synchronous test bodies; the server under test (the geo
DNS, the master's aiohttp app) runs on this thread's own loop and is reached through real
sockets on 127.0.0.1, exactly as a client would.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, Self, TypeVar

T = TypeVar("T")


class LoopThread:
    """``run(coro)`` runs a coroutine on the thread's loop and returns its result (or raises its error)."""

    def __init__(self, *, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=self.timeout)
        self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=self.timeout)
