"""Off-peak power limits on this host's idle GPUs, and the energy they saved (docs/power.md).

The master sends the host's whole policy (``shared.protocol.SetPowerPolicy``): a limit per GPU and
the end of the off-peak window. ``PowerPolicy`` keeps it and, on every ``reconcile`` (at once, then
every few seconds while the agent runs), makes the GPUs match it:

* inside the window an idle GPU with a target is lowered to it (the limit it had is remembered);
* a GPU a workload holds is never lowered, and one found lowered is restored;
* after the window, or with no policy, every lowered GPU is restored to the limit it had.

**Before a workload starts** the start path calls ``ready_for_start``: it reserves the GPUs (no
reconcile lowers them meanwhile) and restores those that are lowered, one NVML call each, all within
``restore_timeout`` (1 s, a reconcile in progress included). If a restore fails or takes longer, the start
fails with ``power_restore_failed``: a renter never runs on a lowered GPU.

**Energy saved**, per GPU, cumulative Wh: while a GPU is lowered and idle, each sampling pass adds
``max(0, baseline − draw) × Δt``, where the baseline is the same GPU's own idle draw measured while it
was not lowered (a moving mean, ``baseline_weight`` per sample) and Δt the time since the previous pass
(a gap longer than ``max_sample_gap`` counts nothing). Idle: no workload of the agent's holds it, no compute
process runs on it and its utilization is at most ``IDLE_UTIL_PCT``. Never ``default − cap``: an idle GPU draws far less
than either limit, so only a measured difference is claimed. A GPU without a baseline yet saves nothing.

What it lowered, its counters and its baselines are kept in ``power.json`` in the agent's data dir, so a
restarted agent still restores what an earlier one lowered. Imports ``agent.gpu``, ``agent.state`` and
``shared`` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agent.gpu.base import GpuBackend, GpuInfo, GpuSample
from agent.state import atomic_write
from shared import protocol
from shared.clock import utcnow
from shared.errors import PowerLimitError

log = logging.getLogger(__name__)


@dataclass
class _Lowered:
    original_w: float | None  # the limit the GPU had before the policy lowered it (None: unknown, restore the default)
    watts: float  # the limit set


@dataclass
class _State:
    targets: dict[str, float] = field(default_factory=dict)
    until: datetime | None = None
    lowered: dict[str, _Lowered] = field(default_factory=dict)
    saved_wh: dict[str, float] = field(default_factory=dict)
    baseline_w: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "targets": self.targets, "until": None if self.until is None else self.until.isoformat(),
            "lowered": {uuid: {"original_w": lowered.original_w, "watts": lowered.watts} for uuid, lowered in self.lowered.items()},
            "saved_wh": self.saved_wh, "baseline_w": self.baseline_w,
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> _State:
        until = data.get("until")
        return cls(
            targets={str(k): float(v) for k, v in data.get("targets", {}).items()},
            until=None if until is None else datetime.fromisoformat(until),
            lowered={str(k): _Lowered(v.get("original_w"), float(v["watts"])) for k, v in data.get("lowered", {}).items()},
            saved_wh={str(k): float(v) for k, v in data.get("saved_wh", {}).items()},
            baseline_w={str(k): float(v) for k, v in data.get("baseline_w", {}).items()},
        )


class PowerPolicy:
    """The host's power policy: lowers idle GPUs off-peak, restores them, counts the energy saved.

    ``in_use`` answers the GPU (or MIG instance) UUIDs workloads hold now (``WorkloadManager.gpus_in_use``).
    Backend calls run in threads; one ``asyncio.Lock`` orders reconciles and starts.
    """

    def __init__(
        self,
        backend: GpuBackend,
        state_file: Path,
        *,
        in_use: Callable[[], Iterable[str]],
        clock: Callable[[], datetime] = utcnow,
        # Timeouts
        restore_timeout: float = 1.0,
        # Measuring
        max_sample_gap: float = 10.0,
        baseline_weight: float = 0.05,
        save_interval: float = 60.0,
    ) -> None:
        if not 0 < restore_timeout <= 10 or not 0 < baseline_weight <= 1 or max_sample_gap <= 0:
            raise ValueError("restore_timeout must be in (0, 10] s, baseline_weight in (0, 1], max_sample_gap above 0")
        self.backend = backend
        self.state_file = state_file
        self.in_use = in_use
        self.clock = clock
        self.restore_timeout = restore_timeout
        self.max_sample_gap = max_sample_gap
        self.baseline_weight = baseline_weight
        self.save_interval = save_interval
        self._state = self._load()
        self._lock = asyncio.Lock()
        self._reserved: Counter[str] = Counter()
        self._last_sample_at: float | None = None
        self._last_saved_at: float | None = None

    # ---- what the master and the start path call ---------------------------------------

    async def apply(self, command: protocol.SetPowerPolicy) -> protocol.PowerPolicyApplied:
        """Take the master's policy (it replaces the one before) and make the GPUs match it now."""
        self._state.targets = {target.gpu_uuid: float(target.watts) for target in command.targets}
        until = command.off_peak_until
        self._state.until = None if until is None else (until if until.tzinfo else until.replace(tzinfo=UTC))
        self._save()
        return await self.reconcile()

    async def reconcile(self) -> protocol.PowerPolicyApplied:
        """Lower the idle GPUs the open window names, restore every other lowered one. Cancelling is safe: a GPU is
        recorded as lowered before its limit is set, so one cancelled half-way is restored later all the same."""
        async with self._lock:
            return await self._reconcile()

    @contextlib.asynccontextmanager
    async def ready_for_start(self, gpu_uuids: Iterable[str]) -> AsyncIterator[None]:
        """Reserve the GPUs of a workload about to start and restore any that is lowered, within
        ``restore_timeout``; the workload starts inside the block. Raises ``PowerLimitError``
        (``power_restore_failed``) when a GPU could not be restored in time: the start must not go on."""
        physical = self._physical(gpu_uuids)
        # Reserved at once: a reconcile that starts from now on leaves them alone; one already running (it may lower
        # them) holds the lock, and the restore below runs after it. The bound covers that wait too.
        self._reserved.update(physical)
        try:
            async with asyncio.timeout(self.restore_timeout), self._lock:
                for uuid in [uuid for uuid in physical if uuid in self._state.lowered]:
                    await self._restore(uuid)
        except (TimeoutError, PowerLimitError) as exc:
            self._release(physical)
            reason = f"took longer than {self.restore_timeout:g} s" if isinstance(exc, TimeoutError) else str(exc)
            raise PowerLimitError(
                f"the workload was not started: a GPU it needs is still power-limited by the off-peak policy and "
                f"restoring it failed ({reason})", code="power_restore_failed",
            ) from exc
        except BaseException:
            self._release(physical)
            raise
        try:
            yield
        finally:
            self._release(physical)

    def observe(self, samples: Iterable[GpuSample], at: float) -> None:
        """Count the energy saved since the previous sampling pass (``at``: a monotonic time in seconds)."""
        gap = None if self._last_sample_at is None else at - self._last_sample_at
        self._last_sample_at = at
        hours = gap / 3600 if gap is not None and 0 < gap <= self.max_sample_gap else 0.0
        busy = self._physical(self.in_use()) | set(self._reserved)
        for sample in samples:
            draw = sample.power_draw_w
            if draw is None or not math.isfinite(draw) or sample.uuid in busy or not _looks_idle(sample):
                continue
            if sample.uuid in self._state.lowered:
                baseline = self._state.baseline_w.get(sample.uuid)
                if baseline is not None and hours:
                    self._state.saved_wh[sample.uuid] = self._state.saved_wh.get(sample.uuid, 0.0) + max(0.0, baseline - draw) * hours
            else:
                baseline = self._state.baseline_w.get(sample.uuid)
                self._state.baseline_w[sample.uuid] = draw if baseline is None else baseline + self.baseline_weight * (draw - baseline)
        if self._last_saved_at is None or at - self._last_saved_at >= self.save_interval:
            self._last_saved_at = at
            self._save()

    def energy_saved_wh(self, gpu_uuid: str) -> float:
        """Energy the policy saved on this GPU so far, Wh (0 where it never saved any)."""
        return round(self._state.saved_wh.get(gpu_uuid, 0.0), 3)

    def lowered(self) -> dict[str, float]:
        """The GPUs lowered now: uuid → the limit set."""
        return {uuid: lowered.watts for uuid, lowered in self._state.lowered.items()}

    async def run(self, *, interval: float = 5.0) -> None:
        """Reconcile every ``interval`` seconds (the window's end, a workload's end) until cancelled; safe to cancel."""
        while True:
            try:
                await self.reconcile()
            except Exception:
                log.exception("power policy: reconciling the GPUs' limits failed; trying again in %g s", interval)
            await asyncio.sleep(interval)

    async def close(self) -> None:
        """Restore every lowered GPU (best effort, each bounded) and save the counters: a stopped agent leaves no
        GPU lowered behind it."""
        async with self._lock:
            for uuid in list(self._state.lowered):
                with contextlib.suppress(PowerLimitError, TimeoutError):
                    async with asyncio.timeout(self.restore_timeout):
                        await self._restore(uuid)
            self._save()

    # ---- inside -------------------------------------------------------------------------

    async def _reconcile(self) -> protocol.PowerPolicyApplied:
        now = self.clock()
        until = self._state.until
        off_peak = until is not None and now < until
        busy = self._physical(self.in_use()) | set(self._reserved)
        infos = {info.uuid: info for info in self.backend.gpus()}
        restored: list[str] = []
        skipped: dict[str, str] = {}
        for uuid in sorted(set(self._state.targets) - set(infos)):
            skipped[uuid] = "not on this host"
        for uuid, info in infos.items():
            target = self._state.targets.get(uuid) if off_peak else None
            lowered = self._state.lowered.get(uuid)
            try:
                if target is None or uuid in busy:
                    if lowered is not None:
                        await self._restore(uuid)
                        restored.append(uuid)
                    if target is not None:
                        skipped[uuid] = "in use: a workload holds it"
                elif lowered is None or lowered.watts != target or info.power_limit_w != target:
                    original = info.power_limit_w if lowered is None else lowered.original_w
                    # Recorded before the call: if it is cancelled half-way (the agent stopping), the GPU may be lowered,
                    # and a record is what gets it restored (restoring one that was not lowered is harmless).
                    self._state.lowered[uuid] = _Lowered(original, target)
                    self._save()
                    try:
                        await asyncio.to_thread(self.backend.set_power_limit, info.index, target)
                    except PowerLimitError:
                        if lowered is None:
                            del self._state.lowered[uuid]  # refused: nothing was changed
                        else:
                            self._state.lowered[uuid] = lowered
                        raise
                    log.info("power policy: GPU %d (%s) lowered to %g W until %s", info.index, uuid, target, until)
            except PowerLimitError as exc:
                skipped[uuid] = exc.message
                log.warning("power policy: GPU %d (%s): %s", info.index, uuid, exc.message)
        self._save()
        return protocol.PowerPolicyApplied(off_peak=off_peak, capped=self.lowered(), restored=restored, skipped=skipped)

    async def _restore(self, uuid: str) -> None:
        """Put a lowered GPU back to the limit it had (its default where that is unknown or no longer allowed)."""
        lowered = self._state.lowered[uuid]
        info = self._info(uuid)
        if info is None:  # the GPU is gone: nothing to restore
            del self._state.lowered[uuid]
            return
        if lowered.original_w is not None and _within(info, lowered.original_w):
            await asyncio.to_thread(self.backend.set_power_limit, info.index, lowered.original_w)
        else:
            await asyncio.to_thread(self.backend.restore_power_limit, info.index)
        del self._state.lowered[uuid]
        self._save()
        log.info("power policy: GPU %d (%s) restored", info.index, uuid)

    def _release(self, physical: set[str]) -> None:
        self._reserved.subtract(physical)
        self._reserved = +self._reserved  # drop the GPUs no start holds any more

    def _info(self, uuid: str) -> GpuInfo | None:
        return next((info for info in self.backend.gpus() if info.uuid == uuid), None)

    def _physical(self, uuids: Iterable[str]) -> set[str]:
        """The physical GPUs behind GPU or MIG instance UUIDs: a MIG instance the backend does not list (its
        layout changed since it opened) counts as every MIG-enabled GPU, so none of them is lowered by mistake."""
        infos = self.backend.gpus()
        parents = {mig.uuid: info.uuid for info in infos for mig in info.mig_instances}
        known = {info.uuid for info in infos}
        physical: set[str] = set()
        for uuid in uuids:
            if uuid in known:
                physical.add(uuid)
            elif uuid in parents:
                physical.add(parents[uuid])
            elif uuid.upper().startswith("MIG-"):
                physical.update(info.uuid for info in infos if info.mig_mode)
        return physical

    def _load(self) -> _State:
        try:
            return _State.from_json(json.loads(self.state_file.read_text()))
        except FileNotFoundError:
            return _State()
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("power policy: %s is unreadable (%s); starting with no policy", self.state_file, exc)
            return _State()

    def _save(self) -> None:
        try:
            atomic_write(self.state_file, json.dumps(self._state.to_json()).encode())
        except OSError as exc:
            log.warning("power policy: cannot write %s: %s", self.state_file, exc)


IDLE_UTIL_PCT = 5.0  # at most this busy, with no compute process, is idle for the baseline and the count


def _looks_idle(sample: GpuSample) -> bool:
    """No compute process and next to no utilization: a GPU the provider uses outside the agent neither inflates the
    baseline nor counts as saving."""
    return not sample.processes and (sample.gpu_util_pct is None or sample.gpu_util_pct <= IDLE_UTIL_PCT)


def _within(info: GpuInfo, watts: float) -> bool:
    low, high = info.power_limit_min_w, info.power_limit_max_w
    return low is not None and high is not None and low <= watts <= high
