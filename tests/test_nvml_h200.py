"""The live NVML recording of a real NVIDIA H200, replayed through the agent's own collection code.

``tests/fixtures/nvml/h200.json`` was recorded through NVML itself by ``gpumarket agent
record-nvml`` on an H200 (see ``tests/fixtures/nvml/README.md``): 12 passes a second apart,
idle (passes 0-3), under a bf16 matrix-product load (4-9) and after it (10-11). The values
asserted here are what that GPU answered; the nvidia-smi output captured in the same run
(``sources/linux-x86_64__nvidia-h200__580.159.04.*``) is checked against them.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from agent.gpu import ReplayBackend
from agent.gpu.replay import ReplayNvml, iter_calls
from agent.record import record_nvml
from master.services.market.tiers import Tier, classify

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "nvml"
H200 = FIXTURES / "h200.json"
CAPTURE = FIXTURES / "sources" / "linux-x86_64__nvidia-h200__580.159.04.capture.txt"
AT = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
IDLE, LOAD, AFTER = range(0, 4), range(4, 10), range(10, 12)
LOAD_PID = 599


def _recording() -> dict[str, Any]:
    return json.loads(H200.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _query_gpu(state: str) -> dict[str, str]:
    """The capture's ``--query-gpu`` CSV row for ``state`` (idle, load, after), by header."""
    section = CAPTURE.read_text(encoding="utf-8").split(f"# {state} :: query-gpu (csv)\n", 1)[1]
    lines = [line for line in section.split("\n#####", 2)[1].splitlines()[1:] if line.strip()]
    header, row = list(csv.reader(lines, skipinitialspace=True))[:2]
    return dict(zip(header, row, strict=True))


@pytest.fixture
def h200() -> Iterator[ReplayBackend]:
    backend = ReplayBackend(H200, clock=lambda: AT)
    yield backend
    backend.close()


class TestH200Recording:
    def test_provenance_says_recorded_through_nvml(self) -> None:
        """Unlike the converted recordings, this one was recorded live: 12 passes, serials redacted."""
        source = _recording()["source"]
        assert source["how"].startswith("recorded through NVML")
        assert "converted" not in source["how"] and "origin" not in source
        assert (source["ticks"], source["interval_s"], source["redacted"]) == (
            12,
            1.0,
            ["nvmlDeviceGetSerial"],
        )
        assert source["gpus"] == ["NVIDIA H200"]
        assert (source["driver_version"], source["cuda_driver_version"]) == ("580.159.04", "13.0")

    def test_identity(self, h200: ReplayBackend) -> None:
        """One H200: 143771 MiB, compute capability 9.0, 700 W, Gen5 x16, MIG off, serial redacted."""
        (info,) = h200.gpus()
        assert info.name == "NVIDIA H200"
        assert UUID.match(info.uuid)
        assert info.serial == "REDACTED"
        assert (info.memory_total_mib, info.compute_capability, info.pci_bus_id) == (
            143771,
            "9.0",
            "00000000:00:06.0",
        )
        assert (info.driver_version, info.cuda_driver_version) == ("580.159.04", "13.0")
        assert (info.power_limit_w, info.power_limit_default_w) == (700.0, 700.0)
        assert (info.power_limit_min_w, info.power_limit_max_w) == (200.0, 700.0)
        assert (info.max_sm_clock_mhz, info.max_mem_clock_mhz) == (1980, 3201)
        assert (info.pcie_gen_max, info.pcie_width_max) == (5, 16)
        assert (info.mig_mode, info.mig_instances) == (False, ())

    def test_one_uuid_throughout(self, h200: ReplayBackend) -> None:
        """Every pass reports the one GPU, under the UUID the open phase read."""
        (info,) = h200.gpus()
        uuids = {sample.uuid for _ in range(h200.tick_count) for sample in h200.sample()}
        assert uuids == {info.uuid}

    def test_samples_follow_idle_then_load_then_idle(self, h200: ReplayBackend) -> None:
        """Idle at 345 MHz and ~78 W; under load 99-100 % busy, power-capped near 700 W, one process."""
        samples = [h200.sample()[0] for _ in range(h200.tick_count)]
        for tick in IDLE:
            idle = samples[tick]
            assert (idle.gpu_util_pct, idle.sm_clock_mhz, idle.processes) == (0.0, 345, ())
            assert idle.throttle_reasons == ("gpu_idle",)
            assert 75.0 < (idle.power_draw_w or 0) < 85.0
        for tick in LOAD:
            load = samples[tick]
            assert (load.gpu_util_pct or 0) >= 99.0
            assert load.throttle_reasons == ("sw_power_cap",)
            assert 1400 <= (load.sm_clock_mhz or 0) < 1980
            assert [(process.pid, process.used_memory_mib) for process in load.processes] == [
                (LOAD_PID, 9322)
            ]
        assert all(680.0 < (samples[tick].power_draw_w or 0) <= 700.0 for tick in LOAD[1:])
        assert samples[AFTER[0]].gpu_util_pct == 0.0 and samples[AFTER[0]].processes != ()
        assert (samples[AFTER[-1]].gpu_util_pct, samples[AFTER[-1]].processes) == (0.0, ())

    def test_used_memory_includes_the_drivers_reservation(self, h200: ReplayBackend) -> None:
        """NVML's (v1) used memory counts the 616 MiB the driver reserves; nvidia-smi's memory.used does not."""
        idle = h200.sample()[0]
        smi = _query_gpu("idle")
        assert (smi["memory.used [MiB]"], smi["memory.reserved [MiB]"]) == ("0 MiB", "616 MiB")
        assert (idle.memory_used_mib, idle.memory_free_mib) == (615, 143155)

    def test_what_the_h200_does_not_support_is_none(self, h200: ReplayBackend) -> None:
        """No fan reading and no page retirement (Hopper remaps rows instead); ECC and PCIe throughput are read."""
        sample = h200.sample()[0]
        assert sample.fan_pct is None
        assert (sample.retired_pages_single_bit, sample.retired_pages_double_bit) == (None, None)
        assert sample.retired_pages_pending is None
        assert (sample.remapped_rows_correctable, sample.remapped_rows_uncorrectable) == (0, 0)
        assert (sample.remapped_rows_pending, sample.remapped_rows_failure) == (False, False)
        assert (sample.ecc_volatile_uncorrected, sample.ecc_aggregate_uncorrected) == (0, 0)
        assert sample.pcie_tx_kbps is not None and sample.pcie_rx_kbps is not None
        assert (sample.pcie_gen_current, sample.pcie_width_current) == (5, 16)

    def test_events_were_watched_and_none_arrived(self, h200: ReplayBackend) -> None:
        """The agent registered for XID and ECC events on the H200; every pass's wait timed out."""
        assert _recording()["calls"]["open"]["gpu0"]["nvmlDeviceRegisterEvents"] == {
            "11,event_set": {"value": None}
        }
        for _ in range(h200.tick_count):
            h200.sample()
            assert h200.poll_events() == []

    def test_nvidia_smi_agrees_with_nvml(self, h200: ReplayBackend) -> None:
        """The nvidia-smi CSV captured in the same run names the same GPU, limits and load process."""
        (info,) = h200.gpus()
        smi = _query_gpu("idle")
        assert (smi["name"], smi["uuid"], smi["pci.bus_id"]) == (info.name, info.uuid, info.pci_bus_id)
        assert (smi["driver_version"], smi["compute_cap"]) == (info.driver_version, info.compute_capability)
        assert smi["memory.total [MiB]"] == f"{info.memory_total_mib} MiB"
        assert (smi["power.min_limit [W]"], smi["power.max_limit [W]"]) == ("200.00 W", "700.00 W")
        assert (smi["clocks.max.sm [MHz]"], smi["clocks.max.memory [MHz]"]) == ("1980 MHz", "3201 MHz")
        assert (smi["mig.mode.current"], smi["serial"]) == ("Disabled", "REDACTED")
        load = _query_gpu("load")
        assert load["clocks_event_reasons.active"] == "0x0000000000000004"  # SW power cap, as NVML said
        text = CAPTURE.read_text(encoding="utf-8")
        assert f", {LOAD_PID}, python3, 9322 MiB" in text

    def test_the_master_lists_it_as_flagship(self, h200: ReplayBackend) -> None:
        """Classified from what the agent reports (as the master does), the H200 is the known h200, flagship."""
        (info,) = h200.gpus()
        result = classify(
            info.name,
            info.memory_total_mib,
            max_sm_clock_mhz=info.max_sm_clock_mhz,
            pcie_gen=info.pcie_gen_max,
            pcie_width=info.pcie_width_max,
        )
        assert (result.model_key, result.tier, result.needs_review) == ("h200", Tier.FLAGSHIP, False)
        assert result.score == 124.4  # above the H100 SXM's 100: more and faster memory

    def test_recording_the_replay_replays_the_same(self, tmp_path: Path) -> None:
        """Recording the replay again gives the same GPUs, samples and calls: the file holds every call made."""
        recording = _recording()
        nvml = ReplayNvml(recording)
        nvml.start_tick(0)
        ticks = nvml.tick_count
        moves = iter(range(1, ticks))
        out = tmp_path / "again.json"
        record_nvml(
            out, seconds=ticks, interval=1.0, nvml=nvml,
            sleep=lambda _: nvml.start_tick(next(moves)), clock=lambda: AT,
        )  # fmt: skip
        original, again = ReplayBackend(H200), ReplayBackend(out)
        try:
            assert again.gpus() == original.gpus()
            for _ in range(ticks):
                assert again.sample() == original.sample()
        finally:
            original.close()
            again.close()
        keys = {call[:4] for call in iter_calls(recording)}
        assert {call[:4] for call in iter_calls(json.loads(out.read_text(encoding="utf-8")))} == keys
