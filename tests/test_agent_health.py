"""The agent's health check, through the simulated backend and NVML recordings of real GPUs.

Recordings with faults (uncorrected ECC errors, pending row remaps, overheating) are the
shipped ones with one answer changed in the test: those are test data, and say so.
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.gpu import ReplayBackend, SimulatedBackend
from agent.health import MAX_TEMPERATURE_C, check_health
from tests.test_agent_runner import Harness, running

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "nvml"
H100 = FIXTURES / "h100-80gb-hbm3.json"
RTX_4080_SUPER = FIXTURES / "rtx-4080-super.json"
MASKED_UUID = "GPU-00000000-0000-0000-0000-000000000000"  # the capture's collector masked the UUID


def _sim(spec: str = "sim:2xRTX4090") -> SimulatedBackend:
    return SimulatedBackend(spec, seed="health-test")


def _h100_with(function: str, args: str, answer: dict[str, Any]) -> ReplayBackend:
    """The H100 recording with ``function(args)`` answering ``answer`` in every pass (test data).

    Nothing to close: a replayed NVML holds no resources.
    """
    recording = json.loads(H100.read_text(encoding="utf-8"))
    edited = copy.deepcopy(recording)
    for tick in edited["calls"]["ticks"]:
        tick["calls"]["gpu0"][function] = {args: answer}
    return ReplayBackend.from_recording(edited)


@pytest.fixture
def h100() -> Iterator[ReplayBackend]:
    backend = ReplayBackend(H100)
    yield backend
    backend.close()


class TestWithTheSimulatedBackend:
    def test_passes_when_every_expected_gpu_is_there_and_sound(self) -> None:
        """Every expected GPU listed, answering and sound: healthy, with one entry per GPU."""
        backend = _sim()
        uuids = [g.uuid for g in backend.gpus()]
        report = check_health(backend, uuids)
        data = report.to_wire()
        assert data["healthy"] is True and data["summary"] == "2 GPU(s) healthy"
        assert [g["uuid"] for g in data["gpus"]] == uuids
        assert all(g["ok"] and g["listed"] and g["answered"] and g["expected"] for g in data["gpus"])
        assert data["gpus"][0]["readings"]["temperature_c"] is not None

    def test_a_missing_gpu_fails_the_check(self) -> None:
        """A GPU the master expects but the backend does not list makes the host unhealthy."""
        backend = _sim()
        gone = "GPU-11111111-2222-3333-4444-555555555555"
        report = check_health(backend, [*(g.uuid for g in backend.gpus()), gone])
        data = report.to_wire()
        assert data["healthy"] is False
        missing = next(g for g in data["gpus"] if g["uuid"] == gone)
        assert not missing["ok"] and not missing["listed"] and "missing" in missing["problems"][0]
        assert gone in data["summary"]
        assert sum(1 for g in data["gpus"] if g["ok"]) == 2

    def test_gpus_the_master_does_not_know_are_checked_too(self) -> None:
        """A GPU the master did not name is still checked, and marked as not expected."""
        backend = _sim()
        first, second = (g.uuid for g in backend.gpus())
        data = check_health(backend, [first]).to_wire()
        assert data["healthy"] is True
        assert {g["uuid"]: g["expected"] for g in data["gpus"]} == {first: True, second: False}


class TestWithNvmlRecordings:
    def test_a_real_h100_at_rest_is_healthy(self, h100: ReplayBackend) -> None:
        """The recorded H100 (41 °C, no ECC errors, no pending remaps) passes, its readings shown."""
        data = check_health(h100, [MASKED_UUID]).to_wire()
        assert data["healthy"] is True
        readings = data["gpus"][0]["readings"]
        assert readings == {
            "temperature_c": 41.0, "ecc_volatile_uncorrected": 0, "retired_pages_pending": None,
            "remapped_rows_pending": False, "remapped_rows_failure": False,
        }  # fmt: skip

    def test_a_geforce_without_ecc_counters_is_not_faulted_for_them(self) -> None:
        """The RTX 4080 SUPER reports no ECC or remapping: unavailable readings are not faults."""
        backend = ReplayBackend(RTX_4080_SUPER)
        try:
            data = check_health(backend, [MASKED_UUID]).to_wire()
        finally:
            backend.close()
        assert data["healthy"] is True
        assert data["gpus"][0]["readings"]["ecc_volatile_uncorrected"] is None

    def test_a_missing_uuid_fails_against_a_recording(self, h100: ReplayBackend) -> None:
        """A recording that lacks a GPU the master expects fails the check for that GPU."""
        data = check_health(h100, [MASKED_UUID, "GPU-not-on-this-host"]).to_wire()
        assert data["healthy"] is False
        assert [g["ok"] for g in data["gpus"]] == [True, False]

    def test_uncorrected_ecc_errors_fail_the_check(self) -> None:
        """Volatile uncorrected ECC errors (2, test data) make the GPU unhealthy."""
        backend = _h100_with("nvmlDeviceGetTotalEccErrors", "1,0", {"value": 2})
        data = check_health(backend, [MASKED_UUID]).to_wire()
        assert data["healthy"] is False
        assert "2 uncorrected ECC error(s)" in data["gpus"][0]["problems"][0]

    def test_pending_and_failed_row_remapping_fail_the_check(self) -> None:
        """A row remap waiting for a reset, and a failed remap (test data), are both reported."""
        backend = _h100_with("nvmlDeviceGetRemappedRows", "", {"value": [0, 3, 1, 1]})
        problems = check_health(backend, [MASKED_UUID]).to_wire()["gpus"][0]["problems"]
        assert any("wait to be remapped" in p for p in problems)
        assert any("remapping failed" in p for p in problems)

    def test_an_overheating_gpu_fails_the_check(self) -> None:
        """A GPU at or above the temperature limit (97 °C, test data) is unhealthy."""
        backend = _h100_with("nvmlDeviceGetTemperatureV", "0", {"value": 97})
        data = check_health(backend, [MASKED_UUID]).to_wire()
        assert data["healthy"] is False and f"{MAX_TEMPERATURE_C:g} °C" in data["summary"]
        assert check_health(_h100_with("nvmlDeviceGetTemperatureV", "0", {"value": 97}), [MASKED_UUID],
                            max_temperature_c=100).healthy

    def test_a_gpu_that_does_not_answer_fails_the_check(self) -> None:
        """A backend whose sample raises (a spent recording, as a lost GPU would) fails every GPU it lists."""
        backend = ReplayBackend(H100, loop=False)
        backend.sample()
        backend.sample()  # both recorded passes played: the next sample raises
        data = check_health(backend, [MASKED_UUID]).to_wire()
        assert data["healthy"] is False
        assert "did not answer a sample: GpuBackendUnavailable" in data["gpus"][0]["problems"][0]


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    async with Harness(tmp_path) as h:
        yield h


class TestTheCommand:
    async def test_health_check_commands_report_the_verdict_in_their_data(self, harness: Harness) -> None:
        """The agent answers health_check with ok (the check ran) and data.healthy, per GPU findings included."""
        relay = await harness.relay("relay-a")
        backend = SimulatedBackend("sim:2xRTX4090", seed="h-runner-test")
        uuids = [g.uuid for g in backend.gpus()]
        async with running(harness.agent([relay.url], backend)) as agent:
            await agent.connected.wait()
            await harness.command(relay, "cmd-ok", "health_check", {"gpu_uuids": uuids})
            await harness.command(relay, "cmd-gone", "health_check", {"gpu_uuids": [*uuids, "GPU-gone"]})
            await harness.command(relay, "cmd-bad", "health_check", {"gpu_uuids": "GPU-x"})
            passed = await harness.result("cmd-ok")
            failed = await harness.result("cmd-gone")
            refused = await harness.result("cmd-bad")
        assert passed.ok and passed.data["healthy"] is True and len(passed.data["gpus"]) == 2
        assert failed.ok and failed.data["healthy"] is False and "GPU-gone" in failed.data["summary"]
        assert not refused.ok and "gpu_uuids must be a list" in refused.detail
