"""How often and how fast the agent talks to its relay: ``AgentTimings`` (its intervals and timeouts) and
``Pacer`` (its messages kept under the relay's budget). Imports nothing of the agent's."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


class Pacer:
    """Keeps this agent under the relay's message budget (a token bucket at a safety margin).

    Cancelling ``take`` is safe: nothing was sent and no token is lost.
    """

    def __init__(self, *, margin: float = 0.8) -> None:
        self.margin = margin
        self.rate: float | None = None
        self.burst = 1.0
        self.tokens = 0.0
        self.updated = time.monotonic()
        self._lock = asyncio.Lock()

    def configure(self, rate: float | None, burst: int | None) -> None:
        if rate is None:
            self.rate = None
            return
        self.rate = rate * self.margin
        self.burst = max(1.0, (burst or 1) * self.margin)
        self.tokens, self.updated = self.burst, time.monotonic()

    async def take(self) -> None:
        if self.rate is None:
            return
        async with self._lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
            self.updated = now
            if self.tokens < 1.0:
                wait = (1.0 - self.tokens) / self.rate
                await asyncio.sleep(wait)
                self.tokens, self.updated = 1.0, time.monotonic()
            self.tokens -= 1.0


@dataclass
class AgentTimings:
    """Intervals and timeouts of one agent (seconds); every one bounded and explicit."""

    sample_interval: float = 1.0
    telemetry_interval: float = 10.0
    heartbeat_interval: float = 10.0
    network_interval: float = 3600.0  # 0 disables periodic measurement
    log_ship_interval: float = 2.0
    open_timeout: float = 10.0
    welcome_timeout: float = 10.0
    reconnect_base_delay: float = 0.5
    reconnect_max_delay: float = 30.0
    stable_after: float = 10.0  # a connection up this long resets the back-off
    renew_at_fraction: float = 0.7  # renew the certificate when this much of its lifetime has passed
    renewal_retry: float = 300.0  # ask again if no certificate came back within this
