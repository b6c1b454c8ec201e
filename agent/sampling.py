"""The agent's GPU sampling: a pass over every GPU each ``sample_interval`` (1 s), each GPU's aggregates over the
telemetry window, and one telemetry message each ``telemetry_interval`` (10 s) with the latest sample and the
window's aggregates. XID and ECC events found on any pass are written at once as ``gpu_events``. Each pass also
tells the power policy what the GPUs draw (``agent.power``: the energy it saved).

``Sampler`` writes through the agent's outbound window (``shared.outbound``) and its ``emit``; ``agent.runner``
runs its loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from agent.gpu.base import GpuBackend, GpuSample
from agent.power import PowerPolicy
from shared import protocol
from shared.outbound import OutboundWindow

log = logging.getLogger(__name__)


@dataclass
class _Window:
    """Aggregates of one GPU over the current telemetry window."""

    samples: int = 0
    util_sum: float = 0.0
    util_n: int = 0
    util_max: float | None = None
    mem_max: int | None = None
    temp_max: float | None = None
    power_sum: float = 0.0
    power_n: int = 0
    power_max: float | None = None

    def add(self, s: GpuSample) -> None:
        self.samples += 1
        if s.gpu_util_pct is not None:
            self.util_sum += s.gpu_util_pct
            self.util_n += 1
            self.util_max = max(self.util_max or 0.0, s.gpu_util_pct)
        if s.memory_used_mib is not None:
            self.mem_max = max(self.mem_max or 0, s.memory_used_mib)
        if s.temperature_c is not None:
            self.temp_max = s.temperature_c if self.temp_max is None else max(self.temp_max, s.temperature_c)
        if s.power_draw_w is not None:
            self.power_sum += s.power_draw_w
            self.power_n += 1
            self.power_max = s.power_draw_w if self.power_max is None else max(self.power_max, s.power_draw_w)

    def model(self, uuid: str) -> protocol.GpuAggregateModel:
        return protocol.GpuAggregateModel(
            uuid=uuid,
            samples=self.samples,
            gpu_util_avg=round(self.util_sum / self.util_n, 2) if self.util_n else None,
            gpu_util_max=self.util_max,
            memory_used_max_mib=self.mem_max,
            temperature_max_c=self.temp_max,
            power_avg_w=round(self.power_sum / self.power_n, 2) if self.power_n else None,
            power_max_w=self.power_max,
        )


class Sampler:
    """Reads the GPUs, keeps each one's window of aggregates, and writes telemetry and GPU events."""

    def __init__(
        self, host_id: str, backend: GpuBackend, power: PowerPolicy, window: OutboundWindow,
        emit: Callable[[int, str], Awaitable[None]],
    ) -> None:  # fmt: skip
        self.host_id = host_id
        self.backend = backend
        self.power = power
        self.window = window
        self._emit = emit
        self._windows: dict[str, _Window] = {}
        self._window_started = time.monotonic()
        self._latest: list[GpuSample] = []
        self.taken = 0

    async def sample_once(self) -> None:
        """One sampling pass: read the GPUs, update the window, push any GPU events at once."""
        samples = await asyncio.to_thread(self.backend.sample)
        self.taken += 1
        self._latest = samples
        self.power.observe(samples, time.monotonic())
        for s in samples:
            self._windows.setdefault(s.uuid, _Window()).add(s)
        poll = getattr(self.backend, "poll_events", None)
        events = await asyncio.to_thread(poll) if callable(poll) else []
        if events:
            body = protocol.GpuEventsBody(
                events=[protocol.GpuEventModel(uuid=e.uuid, kind=e.kind, code=e.code, at=e.at) for e in events]
            )
            await self._emit(*self.window.gpu_events(body))

    async def report_telemetry(self) -> None:
        """Write one telemetry message: the latest sample and the window's aggregates."""
        if not self._latest:
            return
        now = time.monotonic()
        body = protocol.TelemetryBody(
            sampled_at=datetime.now(UTC),
            gpus=[protocol.GpuSampleModel.model_validate({**s.to_wire(), "energy_saved_wh": self.power.energy_saved_wh(s.uuid)})
                  for s in self._latest],
            window_s=round(now - self._window_started, 3),
            aggregates=[w.model(uuid) for uuid, w in self._windows.items()],
        )
        self._windows = {}
        self._window_started = now
        await self._emit(*self.window.telemetry(body))

    async def run(self, sample_interval: Callable[[], float], telemetry_interval: Callable[[], float]) -> None:
        """Sample and report until cancelled. The intervals are read each pass: the relay's welcome may change them."""
        loop = asyncio.get_running_loop()
        last_report: float | None = None  # report right after the first sample, then every interval
        while True:
            try:
                await self.sample_once()
                if last_report is None or loop.time() - last_report >= telemetry_interval():
                    last_report = loop.time()
                    await self.report_telemetry()
            except Exception:
                # A GPU that fails to answer must not stop the agent; log and try next time.
                log.exception("host %s: sampling failed", self.host_id)
            await asyncio.sleep(sample_interval())
