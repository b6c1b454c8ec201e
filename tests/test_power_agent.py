"""Off-peak power limits on the agent (docs/power.md): the backends' set and restore, the policy that
lowers idle GPUs and restores them, the energy it counts, and the start path through a real relay.

No GPU here: the simulated backend and NVML recordings of real GPUs stand in for the hardware, and
the NVML set call's refusals are checked against a fake of the one NVML function they need.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent.gpu import ReplayBackend, SimulatedBackend, open_backend
from agent.gpu.base import check_power_limit
from agent.gpu.nvml import set_power_limit
from agent.power import PowerPolicy
from shared import protocol
from shared.errors import PowerLimitError
from tests.helpers import eventually
from tests.test_agent_runner import HOST, Harness, running
from tests.test_gpu_backends import HAS_NVIDIA_DRIVER

H100 = Path(__file__).resolve().parent / "fixtures" / "nvml" / "h100-80gb-hbm3.json"
NOW = datetime(2026, 11, 26, 2, 0, tzinfo=UTC)


def _a100s(count: int = 2) -> SimulatedBackend:
    return SimulatedBackend(f"sim:{count}xA100-80GB", seed="power-test")


class TestSimulatedBackend:
    def test_sets_and_restores_a_limit_within_the_range(self) -> None:
        """A limit inside 100–400 W is applied (identity and samples say so) and a restore puts the default back."""
        sim = _a100s(1)
        assert sim.set_power_limit(0, 250) == 250.0
        assert sim.gpus()[0].power_limit_w == 250.0 and sim.sample()[0].power_limit_w == 250.0
        assert sim.restore_power_limit(0) == 400.0
        assert sim.gpus()[0].power_limit_w == 400.0 and sim.sample()[0].power_limit_w == 400.0

    @pytest.mark.parametrize("watts", [99.0, 401.0, float("nan")])
    def test_a_limit_outside_the_range_is_refused_and_changes_nothing(self, watts: float) -> None:
        """Out of the board's range is power_limit_out_of_range, naming the range; the limit stays as it was."""
        sim = _a100s(1)
        with pytest.raises(PowerLimitError) as refused:
            sim.set_power_limit(0, watts)
        assert refused.value.code == "power_limit_out_of_range" and "100-400 W" in refused.value.message
        assert sim.gpus()[0].power_limit_w == 400.0

    def test_a_busy_gpu_under_a_lower_limit_throttles_on_its_power_cap(self) -> None:
        """A wholly busy GPU lowered to 250 W draws at most 250 W, says sw_power_cap, and clocks lower."""
        sim = _a100s(1)
        uuid = sim.gpus()[0].uuid
        sim.set_busy([uuid], True)
        full = sim.sample()[0]
        sim.set_power_limit(0, 250)
        capped = [sim.sample()[0] for _ in range(20)]
        assert all(s.power_draw_w is not None and s.power_draw_w <= 250.0 for s in capped)
        assert all(s.throttle_reasons is not None and "sw_power_cap" in s.throttle_reasons for s in capped)
        assert full.sm_clock_mhz is not None and max(s.sm_clock_mhz or 0 for s in capped) < full.sm_clock_mhz

    def test_an_idle_gpu_draws_less_under_a_lower_limit(self) -> None:
        """Two identical idle GPUs, one lowered to 250 W: the lowered one's mean draw over many samples is lower."""
        sim = _a100s(2)
        sim.set_power_limit(0, 250)
        draws: list[list[float]] = [[], []]
        for _ in range(200):
            for sample in sim.sample():
                assert sample.power_draw_w is not None
                draws[sample.index].append(sample.power_draw_w)
        assert sum(draws[0]) / 200 < 0.95 * sum(draws[1]) / 200


class TestReplayBackend:
    def test_sets_are_recorded_and_cap_the_recorded_draw(self) -> None:
        """On the H100 recording (idle 69.9 W, then busy 632 W) a 400 W limit leaves the idle pass as recorded,
        holds the busy one at 400 W with sw_power_cap, and every set (the restore too) is recorded."""
        replay = ReplayBackend(H100)
        assert replay.set_power_limit(0, 400) == 400.0
        idle, busy = replay.sample()[0], replay.sample()[0]
        assert idle.power_draw_w == 69.85 and idle.power_limit_w == 400.0
        assert busy.power_draw_w == 400.0 and busy.throttle_reasons is not None and "sw_power_cap" in busy.throttle_reasons
        assert replay.restore_power_limit(0) == 700.0
        assert replay.sample()[0].power_limit_w == 700.0 and replay.sample()[0].power_draw_w == 631.95
        assert replay.power_limit_sets == [("gpu0", 400_000), ("gpu0", 700_000)]

    def test_a_limit_outside_the_recorded_range_is_refused_before_any_call(self) -> None:
        """The recorded range is 200–700 W: 150 W is refused and nothing reaches NVML."""
        replay = ReplayBackend(H100)
        with pytest.raises(PowerLimitError) as refused:
            replay.set_power_limit(0, 150)
        assert refused.value.code == "power_limit_out_of_range" and replay.power_limit_sets == []
        assert replay.gpus()[0].power_limit_w == 700.0


class _RefusingNvml:
    """The one NVML function a set needs, refusing as a driver does for a user without root."""

    def __init__(self, error: type[pynvml.NVMLError]) -> None:
        self.error = error

    def nvmlDeviceSetPowerManagementLimit(self, handle: object, milliwatts: int) -> None:
        raise self.error()


class TestNvmlSet:
    @pytest.mark.parametrize(
        ("error", "code"),
        [(pynvml.NVMLError_NoPermission, "power_limit_no_permission"), (pynvml.NVMLError_NotSupported, "power_limit_unsupported")],
    )
    def test_a_refusal_by_the_driver_is_a_clear_error_not_a_crash(self, error: type[pynvml.NVMLError], code: str) -> None:
        """NVML's no-permission (a non-root agent) or not-supported becomes a PowerLimitError with its own code."""
        info = ReplayBackend(H100).gpus()[0]
        with pytest.raises(PowerLimitError) as refused:
            set_power_limit(object(), info, 400, nvml=_RefusingNvml(error))
        assert refused.value.code == code and "nothing changed" in refused.value.message


class TestOnARealGpu:
    @pytest.mark.skipif(not HAS_NVIDIA_DRIVER, reason="needs an NVIDIA driver and GPU")
    def test_reads_the_allowed_range_and_changes_nothing(self) -> None:
        """On a GPU host: every GPU reports a range around its default, which the policy's check accepts, and values
        just outside it are refused before NVML is asked. Read-only: no limit is ever set here."""
        backend = open_backend("nvml")
        try:
            before = [info.power_limit_w for info in backend.gpus()]
            for info in backend.gpus():
                if info.power_limit_min_w is None or info.power_limit_max_w is None or info.power_limit_default_w is None:
                    continue  # a GPU that lets no limit be set (the policy leaves it out)
                assert info.power_limit_min_w <= info.power_limit_default_w <= info.power_limit_max_w
                assert check_power_limit(info, info.power_limit_default_w) == info.power_limit_default_w
                for outside in (info.power_limit_min_w - 1, info.power_limit_max_w + 1):
                    with pytest.raises(PowerLimitError):
                        check_power_limit(info, outside)
            assert [info.power_limit_w for info in backend.gpus()] == before
        finally:
            backend.close()


class _Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> datetime:
        return self.now


class _FailingRestore(SimulatedBackend):
    """A simulated host whose driver refuses to raise a limit back (test data: a restore that fails)."""

    def set_power_limit(self, index: int, watts: float) -> float:
        if watts > (self.gpus()[index].power_limit_w or 0):
            raise PowerLimitError("the driver refused (test)", code="power_limit_refused")
        return super().set_power_limit(index, watts)


class _StuckRestore(SimulatedBackend):
    """A simulated host whose driver hangs when a limit is raised back, until ``unstick`` (test data: a stuck NVML call)."""

    def __init__(self, spec: str, **kwargs: Any) -> None:
        super().__init__(spec, **kwargs)
        self.unstick = threading.Event()

    def set_power_limit(self, index: int, watts: float) -> float:
        if watts > (self.gpus()[index].power_limit_w or 0):
            self.unstick.wait()
        return super().set_power_limit(index, watts)


def _policy(backend: SimulatedBackend, tmp_path: Path, in_use: set[str], clock: _Clock, **kwargs: Any) -> PowerPolicy:
    return PowerPolicy(backend, tmp_path / "power.json", in_use=lambda: in_use, clock=clock, **kwargs)


def _sample_every_second(policy: PowerPolicy, sim: SimulatedBackend, seconds: int, at: float) -> float:
    """``seconds`` sampling passes a second apart from ``at``, as the agent's sampler makes them; the time after."""
    for _ in range(seconds):
        at += 1.0
        policy.observe(sim.sample(), at)
    return at


def _command(targets: Mapping[str, float], until: datetime | None) -> protocol.SetPowerPolicy:
    return protocol.SetPowerPolicy(
        targets=[protocol.PowerTarget(gpu_uuid=uuid, watts=watts) for uuid, watts in targets.items()], off_peak_until=until
    )


def _limits(backend: SimulatedBackend) -> list[float | None]:
    return [info.power_limit_w for info in backend.gpus()]


class TestPowerPolicy:
    async def test_lowers_an_idle_gpu_and_leaves_a_busy_one(self, tmp_path: Path) -> None:
        """In the window the idle GPU goes to its target; the GPU a workload holds keeps its limit and is named as skipped."""
        sim, clock = _a100s(), _Clock()
        idle, busy = (info.uuid for info in sim.gpus())
        policy = _policy(sim, tmp_path, {busy}, clock)
        applied = await policy.apply(_command({idle: 250, busy: 250}, NOW + timedelta(hours=3)))
        assert applied.off_peak and applied.capped == {idle: 250.0} and "in use" in applied.skipped[busy]
        assert _limits(sim) == [250.0, 400.0]

    async def test_restores_at_the_end_of_the_window(self, tmp_path: Path) -> None:
        """Once the window is over the next reconcile restores the limit the GPU had."""
        sim, clock = _a100s(1), _Clock()
        uuid = sim.gpus()[0].uuid
        policy = _policy(sim, tmp_path, set(), clock)
        await policy.apply(_command({uuid: 250}, NOW + timedelta(hours=1)))
        assert _limits(sim) == [250.0]
        clock.now = NOW + timedelta(hours=1)
        applied = await policy.reconcile()
        assert not applied.off_peak and applied.restored == [uuid] and _limits(sim) == [400.0]

    async def test_a_start_restores_the_gpu_first_and_it_stays_restored_while_held(self, tmp_path: Path) -> None:
        """Inside ready_for_start the GPU has its full limit; while a workload holds it, reconciles leave it there."""
        sim, clock, in_use = _a100s(1), _Clock(), set[str]()
        uuid = sim.gpus()[0].uuid
        policy = _policy(sim, tmp_path, in_use, clock)
        await policy.apply(_command({uuid: 250}, NOW + timedelta(hours=3)))
        async with policy.ready_for_start([uuid]):
            assert _limits(sim) == [400.0]
            await policy.reconcile()  # the reservation holds it (as an image pull would)
            assert _limits(sim) == [400.0]
            in_use.add(uuid)
        await policy.reconcile()
        assert _limits(sim) == [400.0] and policy.lowered() == {}
        in_use.clear()  # the workload ended: back to the window's limit
        await policy.reconcile()
        assert _limits(sim) == [250.0]

    async def test_a_start_fails_when_the_restore_fails(self, tmp_path: Path) -> None:
        """A driver that refuses the restore fails the start with power_restore_failed; nothing runs on a lowered GPU."""
        sim, clock = _FailingRestore("sim:1xA100-80GB", seed="power-test"), _Clock()
        uuid = sim.gpus()[0].uuid
        policy = _policy(sim, tmp_path, set(), clock)
        await policy.apply(_command({uuid: 250}, NOW + timedelta(hours=3)))
        started = False
        with pytest.raises(PowerLimitError) as refused:
            async with policy.ready_for_start([uuid]):
                started = True
        assert refused.value.code == "power_restore_failed" and not started

    async def test_a_start_fails_when_the_restore_hangs_past_its_bound(self, tmp_path: Path) -> None:
        """A restore that does not come back within restore_timeout fails the start (power_restore_failed) instead of
        holding it; the GPU stays recorded as lowered, so the next reconcile deals with it."""
        sim, clock = _StuckRestore("sim:1xA100-80GB", seed="power-test"), _Clock()
        uuid = sim.gpus()[0].uuid
        policy = _policy(sim, tmp_path, set(), clock, restore_timeout=0.05)
        await policy.apply(_command({uuid: 250}, NOW + timedelta(hours=3)))
        try:
            with pytest.raises(PowerLimitError) as refused:
                async with policy.ready_for_start([uuid]):
                    pytest.fail("the workload started on a lowered GPU")
            assert refused.value.code == "power_restore_failed" and "longer than 0.05 s" in refused.value.message
            assert policy.lowered() == {uuid: 250.0}
        finally:
            sim.unstick.set()

    async def test_counts_energy_saved_while_lowered_and_none_without_a_policy(self, tmp_path: Path) -> None:
        """An idle A100 sampled uncapped (the baseline), then an hour lowered to 250 W: it saved energy; its twin,
        never lowered, saved none."""
        sim, clock = _a100s(), _Clock()
        lowered, twin = (info.uuid for info in sim.gpus())
        policy = _policy(sim, tmp_path, set(), clock)
        at = _sample_every_second(policy, sim, 60, 0.0)
        await policy.apply(_command({lowered: 250}, NOW + timedelta(hours=3)))
        _sample_every_second(policy, sim, 3600, at)
        # The model's idle draw at 250/400 of the limit is 60 W x (0.7 + 0.3 x 0.625) = 53.3 W: about 6.7 Wh in the hour.
        assert 4.0 < policy.energy_saved_wh(lowered) < 9.0
        assert policy.energy_saved_wh(twin) == 0.0

    async def test_a_gpu_busy_outside_the_agent_neither_raises_the_baseline_nor_counts(self, tmp_path: Path) -> None:
        """The provider's own job (a process the agent did not start) runs uncapped for ten minutes at ~380 W: it is not
        idle, so it does not become the baseline, and an hour lowered afterwards saves what an idle A100 saves."""
        sim, clock = _a100s(1), _Clock()
        uuid = sim.gpus()[0].uuid
        policy = _policy(sim, tmp_path, set(), clock)
        at = 0.0
        for busy, seconds in ((False, 60), (True, 600), (False, 1)):
            sim.set_busy([uuid], busy)
            at = _sample_every_second(policy, sim, seconds, at)
        await policy.apply(_command({uuid: 250}, NOW + timedelta(hours=3)))
        _sample_every_second(policy, sim, 3600, at)
        assert 4.0 < policy.energy_saved_wh(uuid) < 9.0

    async def test_a_restarted_agent_still_restores_what_an_earlier_one_lowered(self, tmp_path: Path) -> None:
        """What was lowered and the energy counted are kept in power.json: a new PowerPolicy restores after the window."""
        sim, clock = _a100s(1), _Clock()
        uuid = sim.gpus()[0].uuid
        first = _policy(sim, tmp_path, set(), clock)
        await first.apply(_command({uuid: 250}, NOW + timedelta(hours=1)))
        clock.now = NOW + timedelta(hours=2)
        again = _policy(sim, tmp_path, set(), clock)
        assert again.lowered() == {uuid: 250.0}
        await again.reconcile()
        assert _limits(sim) == [400.0] and json.loads((tmp_path / "power.json").read_text())["lowered"] == {}


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    async with Harness(tmp_path) as h:
        yield h


class _WatchedSim(SimulatedBackend):
    """A simulated host that notes each GPU's limit whenever the workload manager shows what runs on it."""

    def __init__(self, spec: str, **kwargs: Any) -> None:
        super().__init__(spec, **kwargs)
        self.limits_when_loaded: list[tuple[list[str], list[float | None]]] = []

    def set_loads(self, loads: Mapping[str, Sequence[float]]) -> None:
        super().set_loads(loads)
        if loads:
            self.limits_when_loaded.append((sorted(loads), [info.power_limit_w for info in self.gpus()]))


class TestThroughTheAgent:
    async def test_the_policy_lowers_idle_gpus_and_a_start_restores_its_gpu_first(self, harness: Harness) -> None:
        """set_power_policy lowers both idle GPUs; start_workload on one restores it before the workload runs; the
        other stays lowered; telemetry reports each GPU's limit and its energy saved."""
        relay = await harness.relay("relay-a")
        backend = _WatchedSim("sim:2xA100-80GB", seed=HOST)
        first, second = (info.uuid for info in backend.gpus())
        until = (datetime.now(UTC) + timedelta(hours=2)).isoformat()
        policy = {"targets": [{"gpu_uuid": first, "watts": 250}, {"gpu_uuid": second, "watts": 250}], "off_peak_until": until}
        start = {"rental_id": "r-power", "gpu_uuids": [first],
                 "workload": {"kind": "process", "argv": [sys.executable, "-c", "import time; time.sleep(30)"]}}  # fmt: skip
        async with running(harness.agent([relay.url], backend, stop_workloads_on_close=True)) as agent:
            await agent.connected.wait()
            await harness.command(relay, "cmd-policy", "set_power_policy", policy)
            applied = await harness.result("cmd-policy")
            assert applied.ok and applied.data["capped"] == {first: 250.0, second: 250.0}, applied
            await harness.command(relay, "cmd-start", "start_workload", start)
            started = await harness.result("cmd-start")
            assert started.ok, started
            assert [info.power_limit_w for info in backend.gpus()] == [400.0, 250.0]

            async def reported() -> list[protocol.GpuSampleModel] | None:
                telemetry = await harness.of_type(protocol.Telemetry)
                latest = telemetry[-1].body.gpus if telemetry else []
                return latest if [g.power_limit_w for g in latest] == [400.0, 250.0] else None

            gpus = await eventually(reported, what="telemetry with the limits in force")
        assert backend.limits_when_loaded and backend.limits_when_loaded[0] == ([first], [400.0, 250.0])
        assert all(g.energy_saved_wh is not None and g.energy_saved_wh >= 0 for g in gpus)
