"""GPU backends (simulated and NVML) and host facts.

The NVML collection code is exercised through ``FakeNvml``, a stand-in offering the
``pynvml`` functions the backend calls and raising ``pynvml.NVMLError`` as NVML does;
the real library is only touched to show that this driverless machine says so.
Recordings of real GPUs replayed through the same code are in ``test_nvml_replay``.
"""

from __future__ import annotations

import ctypes
import json
import platform
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from agent.gpu import (
    SIM_MODELS,
    GpuEvent,
    GpuEventSource,
    GpuInfo,
    GpuMigInstance,
    GpuSample,
    NvmlBackend,
    ReplayBackend,
    SimulatedBackend,
    open_backend,
    parse_sim_spec,
    poll_events,
)
from agent.gpu.base import MIB, GpuBackend, GpuProcess
from agent.gpu.nvml import decode_throttle_reasons, format_cuda_version
from agent.gpu.sim import MAX_SIM_GPUS
from agent.hostfacts import HostFacts, collect_host_facts, parse_cpu_model, parse_os_release
from shared.errors import ConfigError, GpuBackendUnavailable, NotFound

UUID_RE = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
REQUIRED_MODELS = {
    "RTX3060", "RTX3090", "RTX4090", "RTX5090", "RTXA4000", "RTX6000ADA", "L4", "L40S",
    "T4", "A10", "A100-40GB", "A100-80GB", "H100", "H200",
}  # fmt: skip
GPU_INFO_KEYS = {
    "index", "uuid", "name", "pci_bus_id", "serial", "memory_total_mib", "compute_capability",
    "driver_version", "cuda_driver_version", "power_limit_w", "power_limit_default_w", "power_limit_min_w",
    "power_limit_max_w", "max_sm_clock_mhz", "max_mem_clock_mhz", "pcie_gen_max", "pcie_width_max",
    "mig_mode", "mig_instances",
}  # fmt: skip
GPU_SAMPLE_KEYS = {
    "index", "uuid", "gpu_util_pct", "mem_util_pct", "memory_used_mib", "memory_free_mib",
    "temperature_c", "power_draw_w", "sm_clock_mhz", "mem_clock_mhz", "fan_pct", "pcie_gen_current",
    "pcie_width_current", "pcie_tx_kbps", "pcie_rx_kbps", "throttle_reasons", "ecc_volatile_uncorrected",
    "ecc_aggregate_uncorrected", "retired_pages_single_bit", "retired_pages_double_bit",
    "retired_pages_pending", "remapped_rows_correctable", "remapped_rows_uncorrectable",
    "remapped_rows_pending", "remapped_rows_failure", "processes", "power_limit_w",
}  # fmt: skip
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "nvml"


def _nvidia_driver_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


HAS_NVIDIA_DRIVER = _nvidia_driver_present()


@pytest.fixture
def sim() -> Iterator[SimulatedBackend]:
    backend = SimulatedBackend("sim:2xRTX4090,1xH100", seed="host-test", rng=random.Random(7))
    yield backend
    backend.close()


# --- the simulated backend ---------------------------------------------------------------


class TestParseSimSpec:
    @pytest.mark.parametrize(
        ("spec", "expected"),
        [
            ("sim:4xRTX4090", [("RTX4090", 4)]),
            ("sim:2xA100-80GB,1xH100", [("A100-80GB", 2), ("H100", 1)]),
            ("sim:RTX3060", [("RTX3060", 1)]),
            ("SIM: 2X rtx-4090 , l40s", [("RTX4090", 2), ("L40S", 1)]),
            ("sim:rtx_6000_ada,a10040gb", [("RTX6000ADA", 1), ("A100-40GB", 1)]),
            (f"sim:{MAX_SIM_GPUS}xT4", [("T4", MAX_SIM_GPUS)]),
        ],
    )
    def test_parses_counts_and_case_insensitive_model_keys(
        self, spec: str, expected: list[tuple[str, int]]
    ) -> None:
        """A spec yields canonical model keys with their counts, in order."""
        assert parse_sim_spec(spec) == expected

    @pytest.mark.parametrize(
        "spec",
        [
            "",
            "sim:",
            "sim:   ",
            "4xRTX4090",
            "sim:4xRTX9999",
            "sim:0xH100",
            "sim:-1xH100",
            "sim:4x",
            "sim:H100,,H100",
            "sim:H100,",
            f"sim:{MAX_SIM_GPUS + 1}xT4",
            "sim:9xH100,8xH200",
            "sim:" + "9" * 5000 + "xH100",
        ],
    )
    def test_rejects_bad_specs_naming_the_valid_models(self, spec: str) -> None:
        """Every malformed spec raises ConfigError whose message lists all valid model keys."""
        with pytest.raises(ConfigError) as caught:
            parse_sim_spec(spec)
        for key in SIM_MODELS:
            assert key in caught.value.message
        assert caught.value.details["valid_models"] == list(SIM_MODELS)

    def test_unknown_model_is_named_in_the_error(self) -> None:
        """The error says which model was not understood."""
        with pytest.raises(ConfigError, match="RTX9999"):
            parse_sim_spec("sim:2xRTX9999")


class TestSimModels:
    def test_covers_the_required_models(self) -> None:
        """The table holds at least the models demos are expected to use."""
        assert set(SIM_MODELS) >= REQUIRED_MODELS

    @pytest.mark.parametrize(
        ("key", "name", "memory_mib", "capability"),
        [
            ("RTX4090", "NVIDIA GeForce RTX 4090", 24564, "8.9"),
            ("A100-80GB", "NVIDIA A100-SXM4-80GB", 81920, "8.0"),
            ("H100", "NVIDIA H100 80GB HBM3", 81559, "9.0"),
            ("T4", "Tesla T4", 15360, "7.5"),
        ],
    )
    def test_identity_matches_the_table(self, key: str, name: str, memory_mib: int, capability: str) -> None:
        """A simulated GPU reports its model's real NVML name, VRAM and compute capability."""
        (info,) = SimulatedBackend(f"sim:{key}", seed="s").gpus()
        assert (info.name, info.memory_total_mib, info.compute_capability) == (name, memory_mib, capability)
        model = SIM_MODELS[key]
        assert info.power_limit_w == model.power_limit_w
        assert info.max_sm_clock_mhz == model.max_sm_clock_mhz
        assert info.pcie_gen_max == model.pcie_gen_max
        assert info.pcie_width_max == 16

    def test_features_a_card_lacks_are_none(self) -> None:
        """A GeForce card has no serial, ECC or MIG; a passive data-centre card has no fan."""
        backend = SimulatedBackend("sim:RTX4090,H100", seed="s")
        geforce, hopper = backend.gpus()
        assert geforce.serial is None and geforce.mig_mode is None
        assert hopper.serial is not None and hopper.mig_mode is False
        geforce_sample, hopper_sample = backend.sample()
        assert geforce_sample.ecc_volatile_uncorrected is None and geforce_sample.fan_pct is not None
        assert hopper_sample.ecc_volatile_uncorrected == 0 and hopper_sample.fan_pct is None


class TestSimulatedBackend:
    def test_is_a_gpu_backend(self, sim: SimulatedBackend) -> None:
        """The simulated backend fits the GpuBackend seam and names itself "sim"."""
        backend: GpuBackend = sim
        assert backend.name == "sim"

    def test_uuids_are_stable_for_a_seed_and_differ_across_seeds(self) -> None:
        """A restarted demo agent reports the same GPUs; another host reports other ones."""
        first = [gpu.uuid for gpu in SimulatedBackend("sim:4xRTX4090", seed="host-a").gpus()]
        again = [gpu.uuid for gpu in SimulatedBackend("sim:4xRTX4090", seed="host-a").gpus()]
        other = [gpu.uuid for gpu in SimulatedBackend("sim:4xRTX4090", seed="host-b").gpus()]
        assert first == again
        assert len(set(first)) == 4
        assert not set(first) & set(other)
        assert all(UUID_RE.match(gpu_uuid) for gpu_uuid in first + other)

    def test_indexes_and_bus_ids_are_distinct(self) -> None:
        """GPUs are numbered from 0 in spec order, each on its own PCI bus."""
        gpus = SimulatedBackend("sim:2xA100-80GB,1xH100", seed="s").gpus()
        assert [gpu.index for gpu in gpus] == [0, 1, 2]
        assert [gpu.name for gpu in gpus] == ["NVIDIA A100-SXM4-80GB"] * 2 + ["NVIDIA H100 80GB HBM3"]
        assert len({gpu.pci_bus_id for gpu in gpus}) == 3
        assert {gpu.driver_version for gpu in gpus} == {"570.124.06"}
        assert {gpu.cuda_driver_version for gpu in gpus} == {"12.8"}

    def test_requires_a_seed(self) -> None:
        """An empty seed would give every demo host the same UUIDs, so it is refused."""
        with pytest.raises(ConfigError, match="seed"):
            SimulatedBackend("sim:T4", seed="")

    @pytest.mark.parametrize("key", sorted(SIM_MODELS))
    def test_samples_stay_within_physical_bounds(self, key: str) -> None:
        """Idle and busy readings of every model stay within what the hardware can report."""
        backend = SimulatedBackend(f"sim:{key}", seed="s", rng=random.Random(key))
        (info,) = backend.gpus()
        model = SIM_MODELS[key]
        for busy in (False, True):
            backend.set_busy([info.uuid], busy)
            for _ in range(50):
                (sample,) = backend.sample()
                _assert_physically_plausible(sample, info)
                assert (sample.fan_pct is None) == (not model.has_fan)

    def test_set_busy_raises_load_and_idle_drops_it_back(self, sim: SimulatedBackend) -> None:
        """A busy GPU works hard near its power limit with one process; set idle, it calms down."""
        target, bystander, _ = sim.gpus()
        sim.set_busy([target.uuid], True)
        busy, idle, _ = sim.sample()
        assert target.power_limit_w is not None
        assert busy.gpu_util_pct is not None and busy.gpu_util_pct >= 90
        assert busy.power_draw_w is not None and busy.power_draw_w >= 0.8 * target.power_limit_w
        assert busy.temperature_c is not None and busy.temperature_c >= 60
        assert busy.memory_used_mib is not None and busy.memory_used_mib >= 0.6 * target.memory_total_mib
        (process,) = busy.processes
        assert process.used_memory_mib is not None and 0 < process.used_memory_mib <= busy.memory_used_mib
        assert idle.uuid == bystander.uuid
        assert idle.gpu_util_pct is not None and idle.gpu_util_pct <= 5
        assert idle.processes == ()

        sim.set_busy([target.uuid], False)
        calm = sim.sample()[0]
        assert calm.gpu_util_pct is not None and calm.gpu_util_pct <= 5
        assert calm.power_draw_w is not None and calm.power_draw_w <= 0.2 * target.power_limit_w
        assert calm.temperature_c is not None and calm.temperature_c <= 40
        assert calm.processes == ()

    def test_busy_gpu_keeps_its_process_id(self, sim: SimulatedBackend) -> None:
        """The fake workload's pid does not change from one sample to the next."""
        target = sim.gpus()[0]
        sim.set_busy([target.uuid], True)
        sim.set_busy([target.uuid], True)
        pids = {sample.processes[0].pid for sample in (sim.sample()[0] for _ in range(5))}
        assert len(pids) == 1

    def test_set_busy_with_an_unknown_uuid_changes_nothing(self, sim: SimulatedBackend) -> None:
        """One unknown UUID fails the whole call before any GPU changes."""
        known = sim.gpus()[0].uuid
        with pytest.raises(NotFound):
            sim.set_busy([known, "GPU-00000000-0000-0000-0000-000000000000"], True)
        assert sim.sample()[0].processes == ()

    def test_same_rng_seed_repeats_the_readings(self) -> None:
        """Two backends with equally seeded rngs produce identical samples."""
        first = SimulatedBackend("sim:2xL4", seed="s", rng=random.Random(1))
        second = SimulatedBackend("sim:2xL4", seed="s", rng=random.Random(1))
        assert first.sample() == second.sample()

    def test_idle_gpus_say_they_idle_and_train_their_link_down(self, sim: SimulatedBackend) -> None:
        """An idle GDDR card reports gpu_idle and a Gen1 link; busy, it runs at its full link and no idle reason."""
        geforce = sim.gpus()[0]
        idle = sim.sample()[0]
        assert idle.throttle_reasons == ("gpu_idle",)
        assert (idle.pcie_gen_current, idle.pcie_width_current) == (1, 16)
        sim.set_busy([geforce.uuid], True)
        busy = sim.sample()[0]
        assert busy.throttle_reasons is not None and "gpu_idle" not in busy.throttle_reasons
        assert busy.pcie_gen_current == geforce.pcie_gen_max

    def test_memory_error_counters_follow_the_architecture(self) -> None:
        """Ampere-and-later ECC GPUs remap rows, a T4 retires pages, a GeForce card does neither."""
        hopper, turing, geforce = SimulatedBackend("sim:H100,T4,RTX4090", seed="s").sample()
        assert (hopper.remapped_rows_correctable, hopper.remapped_rows_failure) == (0, False)
        assert hopper.retired_pages_single_bit is None
        assert (turing.retired_pages_single_bit, turing.retired_pages_pending) == (0, False)
        assert turing.remapped_rows_uncorrectable is None
        assert geforce.retired_pages_double_bit is None and geforce.remapped_rows_pending is None

    def test_power_limit_range_is_the_reference_boards(self) -> None:
        """The default limit is the model's; the adjustable range is the reference board's (the power policy is
        checked against it: docs/power.md)."""
        (info,) = SimulatedBackend("sim:RTX4090", seed="s").gpus()
        assert info.power_limit_default_w == info.power_limit_w == 450.0
        assert (info.power_limit_min_w, info.power_limit_max_w) == (150.0, 600.0)
        assert info.mig_instances == ()


class TestSimulatedEvents:
    def test_injected_xid_is_polled_once(self, sim: SimulatedBackend) -> None:
        """inject_xid queues one XID event for that GPU; the next poll reports it, the one after nothing."""
        at = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
        backend = SimulatedBackend("sim:2xH100", seed="s", clock=lambda: at)
        target = backend.gpus()[1].uuid
        assert backend.poll_events() == []
        backend.inject_xid(target, 79)
        assert backend.poll_events() == [GpuEvent(uuid=target, kind="xid", code=79, at=at)]
        assert backend.poll_events() == []

    def test_is_an_event_source(self, sim: SimulatedBackend) -> None:
        """The simulated backend offers poll_events, so the agent's poll_events helper reaches it."""
        assert isinstance(sim, GpuEventSource)
        sim.inject_xid(sim.gpus()[0].uuid, 48)
        assert [(event.kind, event.code) for event in poll_events(sim)] == [("xid", 48)]

    def test_injecting_for_an_unknown_gpu_is_refused(self, sim: SimulatedBackend) -> None:
        """An XID for a UUID the backend does not have raises NotFound and queues nothing."""
        with pytest.raises(NotFound):
            sim.inject_xid("GPU-00000000-0000-0000-0000-000000000000", 79)
        assert sim.poll_events() == []

    def test_pending_events_are_bounded(self) -> None:
        """A demo injecting more than max_pending_events keeps only the newest ones."""
        backend = SimulatedBackend("sim:T4", seed="s", max_pending_events=3)
        uuid = backend.gpus()[0].uuid
        for code in range(5):
            backend.inject_xid(uuid, code)
        assert [event.code for event in backend.poll_events()] == [2, 3, 4]

    def test_backends_without_events_poll_empty(self) -> None:
        """poll_events(backend) answers [] for a GpuBackend that offers no poll_events."""

        class Plain:
            name = "plain"

        assert poll_events(Plain()) == []


def _assert_physically_plausible(sample: GpuSample, info: GpuInfo) -> None:
    assert sample.index == info.index and sample.uuid == info.uuid
    assert sample.gpu_util_pct is not None and 0 <= sample.gpu_util_pct <= 100
    assert sample.mem_util_pct is not None and 0 <= sample.mem_util_pct <= 100
    assert sample.memory_used_mib is not None and sample.memory_free_mib is not None
    assert 0 < sample.memory_used_mib <= info.memory_total_mib
    assert sample.memory_used_mib + sample.memory_free_mib == info.memory_total_mib
    assert sample.temperature_c is not None and 20 <= sample.temperature_c <= 90
    assert info.power_limit_w is not None
    assert sample.power_draw_w is not None and 0 < sample.power_draw_w <= info.power_limit_w
    assert info.max_sm_clock_mhz is not None and info.max_mem_clock_mhz is not None
    assert sample.sm_clock_mhz is not None and 0 < sample.sm_clock_mhz <= info.max_sm_clock_mhz
    assert sample.mem_clock_mhz is not None and 0 < sample.mem_clock_mhz <= info.max_mem_clock_mhz
    assert sample.fan_pct is None or 0 <= sample.fan_pct <= 100
    assert sample.pcie_tx_kbps is not None and sample.pcie_tx_kbps >= 0
    assert sample.pcie_rx_kbps is not None and sample.pcie_rx_kbps >= 0


class TestWireFormat:
    def test_gpu_info_to_wire_has_exactly_its_fields(self, sim: SimulatedBackend) -> None:
        """GpuInfo.to_wire is JSON-ready with exactly the documented keys."""
        for info in sim.gpus():
            wire = info.to_wire()
            assert set(wire) == GPU_INFO_KEYS
            assert json.loads(json.dumps(wire)) == wire

    def test_gpu_sample_to_wire_has_exactly_its_fields(self, sim: SimulatedBackend) -> None:
        """GpuSample.to_wire is JSON-ready, processes included as a list of objects."""
        sim.set_busy([sim.gpus()[0].uuid], True)
        wires = [sample.to_wire() for sample in sim.sample()]
        for wire in wires:
            assert set(wire) == GPU_SAMPLE_KEYS
            assert json.loads(json.dumps(wire)) == wire
        assert set(wires[0]["processes"][0]) == {"pid", "used_memory_mib"}
        assert wires[1]["processes"] == []


# --- choosing a backend ------------------------------------------------------------------


class TestOpenBackend:
    def test_sim_spec_opens_the_simulated_backend(self) -> None:
        """Only a spec starting with "sim:" gives simulated GPUs."""
        backend = open_backend("sim:2xH100", seed="host-1")
        assert isinstance(backend, SimulatedBackend)
        assert backend.name == "sim"
        assert [gpu.name for gpu in backend.gpus()] == ["NVIDIA H100 80GB HBM3"] * 2

    @pytest.mark.parametrize(
        "spec", ["", "cuda", "simulated", "sim", "nvml:0", "auto", "4xRTX4090", "replay"]
    )
    def test_rejects_unknown_specs(self, spec: str) -> None:
        """Anything but "nvml", "replay:..." or "sim:..." is a ConfigError naming the accepted forms."""
        with pytest.raises(ConfigError) as caught:
            open_backend(spec, seed="host-1")
        assert "nvml" in caught.value.message and "sim:" in caught.value.message
        assert "replay:" in caught.value.message

    def test_replay_spec_opens_a_recording(self) -> None:
        """A "replay:PATH" spec replays that NVML recording through the NVML code, as backend "replay"."""
        backend = open_backend(f"replay:{FIXTURES / 'h100-80gb-hbm3.json'}", seed="ignored")
        try:
            assert isinstance(backend, ReplayBackend)
            assert backend.name == "replay"
            assert [gpu.name for gpu in backend.gpus()] == ["NVIDIA H100 80GB HBM3"]
        finally:
            backend.close()

    @pytest.mark.parametrize("spec", ["replay:", "replay:  ", "replay:/nonexistent/recording.json"])
    def test_replay_without_a_usable_recording_is_a_config_error(self, spec: str) -> None:
        """A replay spec naming no file, or a missing one, says what to give instead."""
        with pytest.raises(ConfigError, match="recording"):
            open_backend(spec)

    @pytest.mark.skipif(HAS_NVIDIA_DRIVER, reason="this host has an NVIDIA driver")
    def test_nvml_without_a_driver_says_so_and_never_simulates(self) -> None:
        """On a driverless host "nvml" fails loudly, pointing at the driver and at sim: for demos."""
        with pytest.raises(GpuBackendUnavailable) as caught:
            open_backend("nvml", seed="host-1")
        message = caught.value.message
        assert "driver" in message.lower()
        assert "sim:" in message
        assert caught.value.code == "gpu_backend_unavailable"

    @pytest.mark.skipif(not HAS_NVIDIA_DRIVER, reason="needs an NVIDIA driver and GPU")
    def test_nvml_reads_real_gpus(self) -> None:
        """On a GPU host, NVML reports every GPU with a real UUID and plausible readings."""
        backend = open_backend("nvml")
        try:
            gpus = backend.gpus()
            assert backend.name == "nvml"
            assert gpus, "the driver is present but NVML lists no GPU"
            for info, sample in zip(gpus, backend.sample(), strict=True):
                assert UUID_RE.match(info.uuid) or info.uuid.startswith("MIG-")
                assert info.memory_total_mib > 0 and info.driver_version
                assert sample.uuid == info.uuid
                assert sample.memory_used_mib is None or sample.memory_used_mib <= info.memory_total_mib
                json.dumps([info.to_wire(), sample.to_wire()])
        finally:
            backend.close()
            backend.close()


class TestPynvmlPackage:
    def test_importing_pynvml_warns_nothing(self) -> None:
        """pynvml comes from nvidia-ml-py, not the deprecated "pynvml" shim that warns on import."""
        result = subprocess.run(
            [sys.executable, "-W", "error::DeprecationWarning", "-W", "error::FutureWarning",
             "-c", "import pynvml, agent.gpu"],
            capture_output=True,
            text=True,
            check=False,
            cwd=Path(__file__).resolve().parents[1],
        )  # fmt: skip
        assert result.returncode == 0, result.stderr


# --- the NVML backend, driven by a stand-in for the NVML library --------------------------


class _Fail:
    """A reading that NVML answers with an error code."""

    def __init__(self, code: int) -> None:
        self.code = code


NOT_SUPPORTED = _Fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
FUNCTION_NOT_FOUND = _Fail(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
NO_INSTANCE = 0xFFFFFFFF
XID = pynvml.nvmlEventTypeXidCriticalError
DOUBLE_BIT = pynvml.nvmlEventTypeDoubleBitEccError
SINGLE_BIT = pynvml.nvmlEventTypeSingleBitEccError


def _h100_readings() -> dict[str, Any]:
    # Values as pynvml returns them on an H100 SXM: bytes from a pre-11.5 pynvml where
    # the old API gave bytes, milliwatts, bytes of memory.
    return {
        "uuid": b"GPU-1b2c3d4e-0000-1111-2222-333344445555",
        "name": "NVIDIA H100 80GB HBM3",
        "pci": SimpleNamespace(busId=b"00000000:18:00.0"),
        "serial": b"1654923001234",
        "memory": SimpleNamespace(total=81559 * MIB, used=20480 * MIB, free=61079 * MIB),
        "capability": (9, 0),
        "power_limit": 700_000,  # enforced
        "power_management_limit": 700_000,
        "power_default": 700_000,
        "power_constraints": [200_000, 700_000],
        "max_clock": {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 2619},
        "pcie_gen": 5,
        "pcie_width": 16,
        "pcie_gen_current": 5,
        "pcie_width_current": 16,
        "mig": [pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_DISABLE],
        "mig_count": 7,
        "mig_devices": {},
        "utilization": SimpleNamespace(gpu=97, memory=61),
        "temperature_v": 71,
        "temperature": 71,
        "power": 612_345,
        "clock": {pynvml.NVML_CLOCK_SM: 1755, pynvml.NVML_CLOCK_MEM: 2619},
        "fan": NOT_SUPPORTED,
        "pcie": {pynvml.NVML_PCIE_UTIL_TX_BYTES: 1200, pynvml.NVML_PCIE_UTIL_RX_BYTES: 845000},
        "throttle": 0x4,  # sw_power_cap
        "ecc": {pynvml.NVML_VOLATILE_ECC: 0, pynvml.NVML_AGGREGATE_ECC: 2},
        # Hopper remaps rows and retires no pages.
        "retired": NOT_SUPPORTED,
        "retired_pending": NOT_SUPPORTED,
        "remapped": (3, 0, 0, 0),
        "processes": [
            SimpleNamespace(pid=4242, usedGpuMemory=20000 * MIB),
            SimpleNamespace(pid=4343, usedGpuMemory=None),
        ],
        "supported_events": XID | DOUBLE_BIT | SINGLE_BIT,
        "register_events": None,
    }


def _mig_device(slot: int, *, gpu_instance: int, profile: str, memory_mib: int, sms: int) -> dict[str, Any]:
    return {
        "uuid": f"MIG-5a1b2c3d-0000-1111-2222-00000000000{slot}",
        "name": f"NVIDIA H100 80GB HBM3 MIG {profile}",
        "memory": SimpleNamespace(total=memory_mib * MIB, used=0, free=memory_mib * MIB),
        "gpu_instance_id": gpu_instance,
        "compute_instance_id": 0,
        "attributes": SimpleNamespace(multiprocessorCount=sms, memorySizeMB=memory_mib),
    }


def _h100_mig_readings() -> dict[str, Any]:
    """An H100 in MIG mode with a 3g.40gb and a 1g.10gb instance; the other slots are empty."""
    readings = _h100_readings()
    readings["mig"] = [pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE]
    readings["mig_devices"] = {
        0: _mig_device(0, gpu_instance=2, profile="3g.40gb", memory_mib=40192, sms=60),
        3: _mig_device(3, gpu_instance=9, profile="1g.10gb", memory_mib=9856, sms=16),
    }
    return readings


def _event(device: Any, event_type: int, data: int, *, gpu_instance: int = NO_INSTANCE) -> SimpleNamespace:
    # nvmlEventData_t as pynvml returns it.
    return SimpleNamespace(
        device=device,
        eventType=event_type,
        eventData=data,
        gpuInstanceId=gpu_instance,
        computeInstanceId=NO_INSTANCE,
    )


class FakeNvml:
    """The slice of the ``pynvml`` API the NVML backend uses, answering from fixed readings.

    Device handles are GPU indexes; a MIG device's handle is ``(gpu index, slot)``. Events
    put in ``pending_events`` come out of ``nvmlEventSetWait`` one per call. Constants
    come from ``pynvml`` itself, as in the backend.
    """

    EVENT_SET = "fake-event-set"

    def __init__(
        self,
        gpus: list[dict[str, Any]],
        *,
        init_error: int | None = None,
        driver_version: Any = b"550.54.15",
        cuda_version: Any = 12040,
        event_set: Any = None,
    ) -> None:
        self.readings = gpus
        self.init_error = init_error
        self.driver_version = driver_version
        self.cuda_version = cuda_version
        self.event_set = event_set
        self.inits = 0
        self.shutdowns = 0
        self.registered: list[tuple[int, int]] = []
        self.event_sets_freed = 0
        self.pending_events: list[SimpleNamespace] = []

    def _answer(self, value: Any) -> Any:
        if isinstance(value, _Fail):
            raise pynvml.NVMLError(value.code)
        return value

    def _device(self, handle: Any) -> dict[str, Any]:
        if isinstance(handle, tuple):
            gpu, slot = handle
            devices: dict[int, dict[str, Any]] = self.readings[gpu]["mig_devices"]
            return devices[slot]
        device: dict[str, Any] = self.readings[handle]
        return device

    def _read(self, handle: Any, key: str, *choice: int) -> Any:
        value = self._answer(self._device(handle)[key])
        for selector in choice:
            value = self._answer(value[selector])
        return value

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> Any:
        return self._answer(self.driver_version)

    def nvmlSystemGetCudaDriverVersion(self) -> Any:
        return self._answer(self.cuda_version)

    def nvmlDeviceGetCount(self) -> int:
        return len(self.readings)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: Any) -> Any:
        return self._read(handle, "uuid")

    def nvmlDeviceGetName(self, handle: Any) -> Any:
        return self._read(handle, "name")

    def nvmlDeviceGetPciInfo(self, handle: int) -> Any:
        return self._read(handle, "pci")

    def nvmlDeviceGetSerial(self, handle: int) -> Any:
        return self._read(handle, "serial")

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        return self._read(handle, "memory")

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> Any:
        return self._read(handle, "capability")

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> Any:
        return self._read(handle, "power_limit")

    def nvmlDeviceGetPowerManagementLimit(self, handle: int) -> Any:
        return self._read(handle, "power_management_limit")

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: int) -> Any:
        return self._read(handle, "power_default")

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: int) -> Any:
        return self._read(handle, "power_constraints")

    def nvmlDeviceGetMaxClockInfo(self, handle: int, clock: int) -> Any:
        return self._read(handle, "max_clock", clock)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: int) -> Any:
        return self._read(handle, "pcie_gen")

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: int) -> Any:
        return self._read(handle, "pcie_width")

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: int) -> Any:
        return self._read(handle, "pcie_gen_current")

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: int) -> Any:
        return self._read(handle, "pcie_width_current")

    def nvmlDeviceGetMigMode(self, handle: int) -> Any:
        return self._read(handle, "mig")

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: int) -> Any:
        return self._read(handle, "mig_count")

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: int, slot: int) -> Any:
        if slot not in self.readings[handle]["mig_devices"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return (handle, slot)

    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> Any:
        return self._read(handle, "gpu_instance_id")

    def nvmlDeviceGetComputeInstanceId(self, handle: Any) -> Any:
        return self._read(handle, "compute_instance_id")

    def nvmlDeviceGetAttributes(self, handle: Any) -> Any:
        return self._read(handle, "attributes")

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return self._read(handle, "utilization")

    def nvmlDeviceGetTemperatureV(self, handle: int, sensor: int) -> Any:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._read(handle, "temperature_v")

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> Any:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._read(handle, "temperature")

    def nvmlDeviceGetPowerUsage(self, handle: int) -> Any:
        return self._read(handle, "power")

    def nvmlDeviceGetClockInfo(self, handle: int, clock: int) -> Any:
        return self._read(handle, "clock", clock)

    def nvmlDeviceGetFanSpeed(self, handle: int) -> Any:
        return self._read(handle, "fan")

    def nvmlDeviceGetPcieThroughput(self, handle: int, counter: int) -> Any:
        return self._read(handle, "pcie", counter)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> Any:
        return self._read(handle, "throttle")

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter: int) -> Any:
        assert error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        return self._read(handle, "ecc", counter)

    def nvmlDeviceGetRetiredPages(self, handle: int, cause: int) -> Any:
        return self._read(handle, "retired", cause)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: int) -> Any:
        return self._read(handle, "retired_pending")

    def nvmlDeviceGetRemappedRows(self, handle: int) -> Any:
        return self._read(handle, "remapped")

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: int) -> Any:
        return self._read(handle, "processes")

    def nvmlEventSetCreate(self) -> Any:
        if isinstance(self.event_set, _Fail):
            self._answer(self.event_set)
        return self.EVENT_SET

    def nvmlDeviceGetSupportedEventTypes(self, handle: int) -> Any:
        return self._read(handle, "supported_events")

    def nvmlDeviceRegisterEvents(self, handle: int, event_types: int, event_set: Any) -> None:
        assert event_set == self.EVENT_SET
        answer = self.readings[handle]["register_events"]
        if isinstance(answer, _Fail) or (
            isinstance(answer, dict) and isinstance(answer.get(event_types), _Fail)
        ):
            self._answer(answer if isinstance(answer, _Fail) else answer[event_types])
        self.registered.append((handle, event_types))

    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> Any:
        assert event_set == self.EVENT_SET and timeout_ms == 0, "the agent must never block on events"
        if not self.pending_events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return self.pending_events.pop(0)

    def nvmlEventSetFree(self, event_set: Any) -> None:
        assert event_set == self.EVENT_SET
        self.event_sets_freed += 1


H100_INFO = GpuInfo(
    index=0,
    uuid="GPU-1b2c3d4e-0000-1111-2222-333344445555",
    name="NVIDIA H100 80GB HBM3",
    pci_bus_id="00000000:18:00.0",
    serial="1654923001234",
    memory_total_mib=81559,
    compute_capability="9.0",
    driver_version="550.54.15",
    cuda_driver_version="12.4",
    power_limit_w=700.0,
    power_limit_default_w=700.0,
    power_limit_min_w=200.0,
    power_limit_max_w=700.0,
    max_sm_clock_mhz=1980,
    max_mem_clock_mhz=2619,
    pcie_gen_max=5,
    pcie_width_max=16,
    mig_mode=False,
    mig_instances=(),
)


class TestNvmlBackend:
    def test_reads_every_identity_field(self) -> None:
        """Identity comes from the NVML calls, bytes decoded and milliwatts turned into watts."""
        backend = NvmlBackend(nvml=FakeNvml([_h100_readings()]))
        assert backend.name == "nvml"
        assert backend.gpus() == [H100_INFO]

    def test_reads_every_live_field(self) -> None:
        """Live state comes from the NVML calls; an unsupported fan or page retirement is None, not 0."""
        backend = NvmlBackend(nvml=FakeNvml([_h100_readings()]))
        assert backend.sample() == [
            GpuSample(
                index=0,
                uuid="GPU-1b2c3d4e-0000-1111-2222-333344445555",
                gpu_util_pct=97.0,
                mem_util_pct=61.0,
                memory_used_mib=20480,
                memory_free_mib=61079,
                temperature_c=71.0,
                power_draw_w=612.345,
                sm_clock_mhz=1755,
                mem_clock_mhz=2619,
                fan_pct=None,
                pcie_gen_current=5,
                pcie_width_current=16,
                pcie_tx_kbps=1200,
                pcie_rx_kbps=845000,
                throttle_reasons=("sw_power_cap",),
                ecc_volatile_uncorrected=0,
                ecc_aggregate_uncorrected=2,
                retired_pages_single_bit=None,
                retired_pages_double_bit=None,
                retired_pages_pending=None,
                remapped_rows_correctable=3,
                remapped_rows_uncorrectable=0,
                remapped_rows_pending=False,
                remapped_rows_failure=False,
                processes=(
                    GpuProcess(pid=4242, used_memory_mib=20000),
                    GpuProcess(pid=4343, used_memory_mib=None),
                ),
                power_limit_w=700.0,  # the enforced limit read at start-up (no policy set another)
            )
        ]

    def test_counts_retired_pages_by_cause(self) -> None:
        """A pre-Ampere GPU reports how many pages it retired for each cause, and a pending retirement."""
        readings = _h100_readings()
        readings["retired"] = {
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: [0x1000, 0x2000],
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: [0x3000],
        }
        readings["retired_pending"] = pynvml.NVML_FEATURE_ENABLED
        readings["remapped"] = NOT_SUPPORTED
        (sample,) = NvmlBackend(nvml=FakeNvml([readings])).sample()
        assert (sample.retired_pages_single_bit, sample.retired_pages_double_bit) == (2, 1)
        assert sample.retired_pages_pending is True
        assert sample.remapped_rows_correctable is None and sample.remapped_rows_failure is None

    def test_unsupported_fields_are_none(self) -> None:
        """A consumer card without serial, MIG, ECC, PCIe counters or limits reports None for each."""
        readings = _h100_readings()
        for key in (
            "serial", "mig", "ecc", "pcie", "power_limit", "power_management_limit", "power_default",
            "power_constraints", "capability", "pci", "utilization", "pcie_gen_current", "throttle", "remapped",
        ):  # fmt: skip
            readings[key] = NOT_SUPPORTED
        readings["max_clock"] = {
            pynvml.NVML_CLOCK_SM: 2520,
            pynvml.NVML_CLOCK_MEM: _Fail(pynvml.NVML_ERROR_NO_PERMISSION),
        }
        backend = NvmlBackend(nvml=FakeNvml([readings], cuda_version=NOT_SUPPORTED))
        (info,) = backend.gpus()
        assert (info.serial, info.mig_mode, info.power_limit_w) == (None, None, None)
        assert (info.power_limit_default_w, info.power_limit_min_w, info.power_limit_max_w) == (
            None,
            None,
            None,
        )
        assert (info.compute_capability, info.pci_bus_id) == (None, None)
        assert (info.cuda_driver_version, info.max_mem_clock_mhz) == (None, None)
        assert info.max_sm_clock_mhz == 2520
        assert info.mig_instances == ()
        (sample,) = backend.sample()
        assert (sample.ecc_volatile_uncorrected, sample.ecc_aggregate_uncorrected) == (None, None)
        assert (sample.pcie_tx_kbps, sample.pcie_rx_kbps, sample.pcie_gen_current) == (None, None, None)
        assert (sample.gpu_util_pct, sample.mem_util_pct) == (None, None)
        assert sample.throttle_reasons is None
        assert (sample.remapped_rows_correctable, sample.remapped_rows_pending) == (None, None)

    def test_a_pynvml_without_the_newer_calls_reports_none_for_them(self) -> None:
        """An older nvidia-ml-py lacking a function (here the limit range) is "not available", not a crash."""
        nvml = FakeNvml([_h100_readings()])
        (info,) = NvmlBackend(nvml=_Without(nvml, "nvmlDeviceGetPowerManagementLimitConstraints")).gpus()
        assert (info.power_limit_min_w, info.power_limit_max_w) == (None, None)
        assert info.power_limit_default_w == 700.0

    def test_power_limit_falls_back_to_the_management_limit(self) -> None:
        """A driver without nvmlDeviceGetEnforcedPowerLimit reports the management limit as the limit."""
        readings = _h100_readings()
        readings["power_limit"] = FUNCTION_NOT_FOUND
        readings["power_management_limit"] = 650_000
        (info,) = NvmlBackend(nvml=FakeNvml([readings])).gpus()
        assert info.power_limit_w == 650.0

    def test_mig_mode_enabled_reads_true(self) -> None:
        """A GPU whose current MIG mode is enabled reports mig_mode True."""
        (info,) = NvmlBackend(nvml=FakeNvml([_h100_mig_readings()])).gpus()
        assert info.mig_mode is True

    def test_lists_the_mig_instances_of_a_mig_enabled_gpu(self) -> None:
        """Each configured MIG device is reported with its ids, memory, profile and SMs; empty slots are skipped."""
        (info,) = NvmlBackend(nvml=FakeNvml([_h100_mig_readings()])).gpus()
        assert info.mig_instances == (
            GpuMigInstance(
                uuid="MIG-5a1b2c3d-0000-1111-2222-000000000000",
                gpu_instance_id=2,
                compute_instance_id=0,
                memory_total_mib=40192,
                name="NVIDIA H100 80GB HBM3 MIG 3g.40gb",
                profile="3g.40gb",
                multiprocessor_count=60,
            ),
            GpuMigInstance(
                uuid="MIG-5a1b2c3d-0000-1111-2222-000000000003",
                gpu_instance_id=9,
                compute_instance_id=0,
                memory_total_mib=9856,
                name="NVIDIA H100 80GB HBM3 MIG 1g.10gb",
                profile="1g.10gb",
                multiprocessor_count=16,
            ),
        )
        wire = info.to_wire()
        assert wire["mig_instances"][1]["profile"] == "1g.10gb"
        assert json.loads(json.dumps(wire)) == wire

    def test_mig_instances_are_not_read_while_mig_is_disabled(self) -> None:
        """With MIG disabled the GPU lists no instances, even where MIG devices would answer."""
        readings = _h100_mig_readings()
        readings["mig"] = [pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE]
        (info,) = NvmlBackend(nvml=FakeNvml([readings])).gpus()
        assert (info.mig_mode, info.mig_instances) == (False, ())

    def test_falls_back_to_the_older_temperature_call(self) -> None:
        """A driver without nvmlDeviceGetTemperatureV still reports the temperature."""
        readings = _h100_readings()
        readings["temperature_v"] = FUNCTION_NOT_FOUND
        readings["temperature"] = 64
        (sample,) = NvmlBackend(nvml=FakeNvml([readings])).sample()
        assert sample.temperature_c == 64.0

    def test_other_nvml_errors_propagate(self) -> None:
        """A lost GPU is not "unsupported": the error reaches the caller instead of a None."""
        readings = _h100_readings()
        readings["power"] = _Fail(pynvml.NVML_ERROR_GPU_IS_LOST)
        backend = NvmlBackend(nvml=FakeNvml([readings]))
        with pytest.raises(pynvml.NVMLError) as caught:
            backend.sample()
        assert caught.value.value == pynvml.NVML_ERROR_GPU_IS_LOST

    @pytest.mark.parametrize(
        "code", [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED]
    )
    def test_missing_driver_raises_unavailable(self, code: int) -> None:
        """No library or no loaded driver: GpuBackendUnavailable mentioning the driver and sim:."""
        with pytest.raises(GpuBackendUnavailable) as caught:
            NvmlBackend(nvml=FakeNvml([], init_error=code))
        assert "driver" in caught.value.message.lower()
        assert "sim:4xRTX4090" in caught.value.message

    def test_failure_while_reading_gpus_shuts_nvml_down(self) -> None:
        """If identity cannot be read, NVML is shut down and the error says what happened."""
        readings = _h100_readings()
        readings["uuid"] = _Fail(pynvml.NVML_ERROR_GPU_IS_LOST)
        nvml = FakeNvml([readings])
        with pytest.raises(GpuBackendUnavailable, match="could not read"):
            NvmlBackend(nvml=nvml)
        assert nvml.shutdowns == 1

    def test_close_shuts_down_once(self) -> None:
        """close() may be called twice; NVML is shut down once, the event set freed once, and sampling stops."""
        nvml = FakeNvml([_h100_readings(), _h100_readings()])
        backend = NvmlBackend(nvml=nvml)
        assert [gpu.index for gpu in backend.gpus()] == [0, 1]
        backend.close()
        backend.close()
        assert (nvml.inits, nvml.shutdowns, nvml.event_sets_freed) == (1, 1, 1)
        with pytest.raises(GpuBackendUnavailable):
            backend.sample()
        assert backend.poll_events() == []

    @pytest.mark.parametrize(
        ("raw", "text"), [(12040, "12.4"), (12080, "12.8"), (11020, "11.2"), (13000, "13.0")]
    )
    def test_formats_cuda_versions(self, raw: int, text: str) -> None:
        """NVML's integer CUDA version becomes "major.minor"."""
        assert format_cuda_version(raw) == text


class _Without:
    """``nvml`` as a ``pynvml`` that lacks the function ``missing`` (an older nvidia-ml-py)."""

    def __init__(self, nvml: FakeNvml, missing: str) -> None:
        self._nvml, self._missing = nvml, missing

    def __getattr__(self, name: str) -> Any:
        if name == self._missing:
            raise AttributeError(name)
        return getattr(self._nvml, name)


class TestThrottleReasons:
    @pytest.mark.parametrize(
        ("mask", "names"),
        [
            (0x0, ()),
            (0x1, ("gpu_idle",)),
            (0x4 | 0x20, ("sw_power_cap", "sw_thermal")),
            (0x8 | 0x40 | 0x80, ("hw_slowdown", "hw_thermal", "hw_power_brake")),
            (0x2 | 0x10 | 0x100, ("applications_clocks", "sync_boost", "display_clocks")),
            (0x1 | 0x1000, ("gpu_idle", "unknown_0x1000")),
        ],
    )
    def test_decodes_the_bitmask_into_names(self, mask: int, names: tuple[str, ...]) -> None:
        """Each set bit becomes its name, in bit order; a bit this agent does not know is kept as unknown_0x..."""
        assert decode_throttle_reasons(mask) == names

    def test_falls_back_to_the_throttle_reasons_call_of_older_drivers(self) -> None:
        """A driver before 535 answers only nvmlDeviceGetCurrentClocksThrottleReasons; it is read instead."""
        nvml = FakeNvml([_h100_readings()])
        older = _Without(nvml, "nvmlDeviceGetCurrentClocksEventReasons")
        older.nvmlDeviceGetCurrentClocksThrottleReasons = lambda handle: 0x40  # type: ignore[attr-defined]
        (sample,) = NvmlBackend(nvml=older).sample()
        assert sample.throttle_reasons == ("hw_thermal",)


class TestNvmlEvents:
    def test_registers_each_gpu_for_the_events_it_supports(self) -> None:
        """Every GPU is registered for XID, double- and single-bit ECC events, masked by what it supports."""
        geforce = _h100_readings()
        geforce["supported_events"] = XID  # no ECC on GeForce
        nvml = FakeNvml([_h100_readings(), geforce])
        NvmlBackend(nvml=nvml)
        assert nvml.registered == [(0, XID | DOUBLE_BIT | SINGLE_BIT), (1, XID)]

    def test_a_gpu_refusing_events_is_left_out(self) -> None:
        """NotSupported from one GPU's registration leaves that GPU unwatched; the others still report."""
        refusing = _h100_readings()
        refusing["register_events"] = NOT_SUPPORTED
        nvml = FakeNvml([refusing, _h100_readings()])
        backend = NvmlBackend(nvml=nvml)
        assert nvml.registered == [(1, XID | DOUBLE_BIT | SINGLE_BIT)]
        nvml.pending_events = [_event(1, XID, 79)]
        assert [event.code for event in backend.poll_events()] == [79]

    def test_unknown_support_registers_event_types_one_by_one(self) -> None:
        """Where NVML cannot list the supported types and the whole mask is refused, each type is tried alone."""
        readings = _h100_readings()
        readings["supported_events"] = NOT_SUPPORTED
        readings["register_events"] = {
            XID | DOUBLE_BIT | SINGLE_BIT: NOT_SUPPORTED,
            DOUBLE_BIT: NOT_SUPPORTED,
        }
        nvml = FakeNvml([readings])
        NvmlBackend(nvml=nvml)
        assert sorted(types for _, types in nvml.registered) == [SINGLE_BIT, XID]

    def test_no_event_support_means_no_events_and_nothing_allocated(self) -> None:
        """A driver without events at all gives an empty poll, and the unused event set is freed."""
        readings = _h100_readings()
        readings["register_events"] = NOT_SUPPORTED
        nvml = FakeNvml([readings])
        backend = NvmlBackend(nvml=nvml)
        assert backend.poll_events() == []
        assert nvml.event_sets_freed == 1
        unsupported = FakeNvml([_h100_readings()], event_set=NOT_SUPPORTED)
        assert NvmlBackend(nvml=unsupported).poll_events() == []

    def test_polls_xid_and_ecc_events_once_each(self) -> None:
        """poll_events reports every queued event with its GPU's UUID, kind and XID code, then nothing."""
        at = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
        second = _h100_readings()
        second["uuid"] = "GPU-22222222-0000-1111-2222-333344445555"
        nvml = FakeNvml([_h100_readings(), second])
        backend = NvmlBackend(nvml=nvml, clock=lambda: at)
        nvml.pending_events = [
            _event(1, XID, 79),
            _event(0, DOUBLE_BIT, 0),
            _event(0, XID, 48, gpu_instance=3),
        ]
        assert backend.poll_events() == [
            GpuEvent(uuid="GPU-22222222-0000-1111-2222-333344445555", kind="xid", code=79, at=at),
            GpuEvent(uuid=H100_INFO.uuid, kind="double_bit_ecc", code=None, at=at),
            GpuEvent(uuid=H100_INFO.uuid, kind="xid", code=48, at=at, gpu_instance_id=3),
        ]
        assert backend.poll_events() == []
        assert poll_events(backend) == []

    def test_one_poll_hands_over_at_most_its_limit(self) -> None:
        """Events past max_events_per_poll stay queued for the next poll instead of stalling this one."""
        nvml = FakeNvml([_h100_readings()])
        backend = NvmlBackend(nvml=nvml, max_events_per_poll=2)
        nvml.pending_events = [_event(0, XID, code) for code in (13, 31, 43)]
        assert [event.code for event in backend.poll_events()] == [13, 31]
        assert [event.code for event in backend.poll_events()] == [43]

    def test_event_to_wire_is_json_ready(self) -> None:
        """GpuEvent.to_wire carries every field, the time in ISO 8601 with its offset."""
        event = GpuEvent(uuid="GPU-x", kind="xid", code=79, at=datetime(2024, 5, 1, 12, 0, tzinfo=UTC))
        wire = event.to_wire()
        assert wire == {
            "uuid": "GPU-x", "kind": "xid", "code": 79, "at": "2024-05-01T12:00:00+00:00",
            "gpu_instance_id": None, "compute_instance_id": None,
        }  # fmt: skip
        assert json.loads(json.dumps(wire)) == wire


# --- host facts --------------------------------------------------------------------------


class TestHostFacts:
    def test_collects_sane_facts(self, tmp_path: Path) -> None:
        """Host facts describe this machine with positive sizes and the given agent version."""
        facts = collect_host_facts(workload_dir=tmp_path, agent_version="0.1.0")
        assert facts.hostname
        assert facts.os_name == platform.system()
        assert facts.kernel == platform.release()
        assert facts.arch == platform.machine()
        assert facts.cpu_count >= 1
        assert facts.ram_total_mib > 0
        assert 0 <= facts.disk_free_gib <= facts.disk_total_gib and facts.disk_total_gib > 0
        assert facts.python_version == platform.python_version()
        assert facts.agent_version == "0.1.0"

    def test_to_wire_has_exactly_its_fields(self, tmp_path: Path) -> None:
        """HostFacts.to_wire is JSON-ready with one key per field."""
        wire = collect_host_facts(workload_dir=tmp_path, agent_version="0.1.0").to_wire()
        assert set(wire) == set(HostFacts.__dataclass_fields__)
        assert json.loads(json.dumps(wire)) == wire

    def test_measures_the_disk_of_a_workload_dir_not_yet_created(self, tmp_path: Path) -> None:
        """A fresh install's missing workload directory is measured on the filesystem it will live on."""
        facts = collect_host_facts(workload_dir=tmp_path / "not" / "yet", agent_version="0.1.0")
        assert facts.disk_total_gib > 0

    def test_reads_the_pretty_name_from_os_release(self, tmp_path: Path) -> None:
        """PRETTY_NAME from the first os-release file present names the OS; none present gives None."""
        os_release = tmp_path / "os-release"
        os_release.write_text(
            'NAME="Ubuntu"\nVERSION="22.04.4 LTS (Jammy Jellyfish)"\nPRETTY_NAME="Ubuntu 22.04.4 LTS"\n'
        )
        facts = collect_host_facts(
            workload_dir=tmp_path, agent_version="0.1.0", os_release_paths=(tmp_path / "missing", os_release)
        )
        assert facts.os_release == "Ubuntu 22.04.4 LTS"
        facts = collect_host_facts(workload_dir=tmp_path, agent_version="0.1.0", os_release_paths=())
        assert facts.os_release is None

    def test_parses_os_release_quoting(self) -> None:
        """os-release values may be double-, single- or unquoted; comments are skipped."""
        fields = parse_os_release(
            "# comment\nID=debian\nNAME='Debian GNU/Linux'\nPRETTY_NAME=\"Debian 12\"\n\nBAD\n"
        )
        assert fields == {"ID": "debian", "NAME": "Debian GNU/Linux", "PRETTY_NAME": "Debian 12"}

    def test_parses_the_cpu_model(self) -> None:
        """The CPU model comes from /proc/cpuinfo's "model name" line."""
        cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7763 64-Core Processor\n"
        assert parse_cpu_model(cpuinfo) == "AMD EPYC 7763 64-Core Processor"
        assert parse_cpu_model("processor\t: 0\n") is None
