"""NVML recordings: the agent's NVML collection code driven by readings of real GPUs, and the recorder.

The shipped recordings (``tests/fixtures/nvml/*.json``) are converted from public
nvidia-smi captures of a real H100 80GB HBM3 and a real GeForce RTX 4080 SUPER (see
``tests/fixtures/nvml/README.md``); the values asserted here are the captures' own.
Recordings with GPU events are the shipped ones with event answers added in the test,
because nvidia-smi output holds no events: those are test data, and say so.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import importlib.util
import json
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pynvml
import pytest

from agent.gpu import GpuEvent, GpuEventSource, ReplayBackend
from agent.gpu.nvml import handle_key
from agent.gpu.nvmlbackend import NvmlBackend
from agent.gpu.replay import ReplayNvml, iter_calls, load_recording
from agent.record import main as record_main
from agent.record import record_nvml
from shared.errors import ConfigError, GpuBackendUnavailable
from tests.test_gpu_backends import (
    DOUBLE_BIT,
    HAS_NVIDIA_DRIVER,
    XID,
    FakeNvml,
    _event,
    _h100_mig_readings,
    _h100_readings,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "nvml"
H100 = FIXTURES / "h100-80gb-hbm3.json"
RTX_4080_SUPER = FIXTURES / "rtx-4080-super.json"
RECORDINGS = [H100, RTX_4080_SUPER]
AT = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
MASKED_UUID = "GPU-00000000-0000-0000-0000-000000000000"  # the capture's collector masked the UUID


def _recording(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


@pytest.fixture
def h100() -> Iterator[ReplayBackend]:
    backend = ReplayBackend(H100, clock=lambda: AT)
    yield backend
    backend.close()


@pytest.fixture
def rtx() -> Iterator[ReplayBackend]:
    backend = ReplayBackend(RTX_4080_SUPER, clock=lambda: AT)
    yield backend
    backend.close()


def _with_xid(recording: dict[str, Any], *, tick: int, code: int) -> dict[str, Any]:
    """``recording`` made to watch GPU 0 for events, with XID ``code`` arriving in pass ``tick`` (test data)."""
    edited = copy.deepcopy(recording)
    calls = edited["calls"]
    calls["open"]["system"]["nvmlEventSetCreate"] = {"": {"value": {"$opaque": "event_set"}}}
    gpu0 = calls["open"]["gpu0"]
    gpu0["nvmlDeviceGetSupportedEventTypes"] = {"": {"value": XID | DOUBLE_BIT}}
    gpu0["nvmlDeviceRegisterEvents"] = {f"{XID | DOUBLE_BIT},event_set": {"value": None}}
    event = {
        "device": {"$handle": "gpu0"}, "eventType": XID, "eventData": code,
        "gpuInstanceId": 0xFFFFFFFF, "computeInstanceId": 0xFFFFFFFF,
    }  # fmt: skip
    for index, entry in enumerate(calls["ticks"]):
        answers: list[dict[str, Any]] = [{"value": event}] if index == tick else []
        answers.append({"error": "NVMLError_Timeout"})
        entry["calls"].setdefault("system", {})["nvmlEventSetWait"] = {"event_set,0": answers}
    return edited


class _CtypesNvml:
    """``FakeNvml`` answering in pynvml's own ctypes types, as on hardware.

    Handles are ``c_nvmlDevice_t`` pointers, a new Python object on every call (NVML hands
    out addresses); PCI info is an ``nvmlPciInfo_t`` (whose ``device`` is a PCI number, not a
    handle); the event set is a ``c_nvmlEventSet_t``; events are ``c_nvmlEventData_t`` whose
    ``device`` is yet another pointer object to the GPU.
    """

    def __init__(self, nvml: FakeNvml) -> None:
        self._nvml = nvml
        self._devices = [pynvml.struct_c_nvmlDevice_t() for _ in nvml.readings]
        self._event_set = pynvml.struct_c_nvmlEventSet_t()

    def _pointer(self, index: int) -> Any:
        return ctypes.cast(ctypes.addressof(self._devices[index]), pynvml.c_nvmlDevice_t)

    def _index(self, handle: Any) -> int:
        address = ctypes.cast(handle, ctypes.c_void_p).value
        assert address is not None, "a NULL device handle"
        return [ctypes.addressof(device) for device in self._devices].index(address)

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._nvml, name)
        if not name.startswith("nvmlDevice") or name.startswith(
            ("nvmlDeviceGetCount", "nvmlDeviceGetHandleBy")
        ):
            return target
        return lambda handle, *args: target(self._index(handle), *args)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return self._pointer(index)

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        info = pynvml.nvmlPciInfo_t()
        info.busId = self._nvml.nvmlDeviceGetPciInfo(self._index(handle)).busId
        info.bus, info.device = 0x18, 3
        return info

    def nvmlEventSetCreate(self) -> Any:
        return ctypes.pointer(self._event_set)

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None:
        assert isinstance(event_set, pynvml.c_nvmlEventSet_t)
        self._nvml.registered.append((self._index(handle), event_types))

    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> Any:
        event = self._nvml.nvmlEventSetWait(FakeNvml.EVENT_SET, timeout_ms)
        data = pynvml.c_nvmlEventData_t()
        data.device = self._pointer(event.device)
        data.eventType, data.eventData = event.eventType, event.eventData
        data.gpuInstanceId, data.computeInstanceId = event.gpuInstanceId, event.computeInstanceId
        return data

    def nvmlEventSetFree(self, event_set: Any) -> None:
        pass


def _two_gpus_with_an_xid() -> _CtypesNvml:
    second = _h100_readings()
    second["uuid"] = "GPU-22222222-0000-1111-2222-333344445555"
    second["pci"] = SimpleNamespace(busId=b"00000000:19:00.0")
    nvml = FakeNvml([_h100_readings(), second])
    nvml.pending_events = [_event(1, XID, 79)]
    return _CtypesNvml(nvml)


def _call_keys(recording: dict[str, Any]) -> set[tuple[str, str, str, str]]:
    """(phase, scope, function, args) of every recorded answer."""
    return {call[:4] for call in iter_calls(recording)}


def _load_converter() -> ModuleType:
    spec = importlib.util.spec_from_file_location("convert_nvidia_smi", FIXTURES / "convert_nvidia_smi.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class TestShippedRecordings:
    @pytest.mark.parametrize("path", RECORDINGS, ids=lambda path: path.stem)
    def test_identity_matches_the_recordings_source(self, path: Path) -> None:
        """Name, driver and CUDA version read through the NVML code are what the recording's source states."""
        backend = ReplayBackend(path)
        try:
            source = backend.source
            assert [gpu.name for gpu in backend.gpus()] == source["gpus"]
            (info,) = backend.gpus()
            assert (info.driver_version, info.cuda_driver_version) == (
                source["driver_version"],
                source["cuda_driver_version"],
            )
            assert info.uuid == MASKED_UUID
        finally:
            backend.close()

    @pytest.mark.parametrize("path", RECORDINGS, ids=lambda path: path.stem)
    def test_provenance_says_converted_from_nvidia_smi(self, path: Path) -> None:
        """Each recording names its public origin and says it was converted, not recorded through NVML."""
        source = _recording(path)["source"]
        assert "converted from nvidia-smi output" in source["how"]
        assert "NOT recorded through NVML" in source["how"]
        origin = source["origin"]
        assert origin["repository"] == "https://github.com/utkuozdemir/nvidia_gpu_exporter"
        assert len(origin["commit"]) == 40 and origin["path"].startswith("internal/captures/")
        assert (FIXTURES.parents[2] / origin["excerpt"]).is_file()

    def test_h100_identity_is_the_captures(self, h100: ReplayBackend) -> None:
        """The H100's limits, clocks, link and compute capability are those nvidia-smi printed."""
        (info,) = h100.gpus()
        assert info.name == "NVIDIA H100 80GB HBM3"
        assert (info.pci_bus_id, info.memory_total_mib, info.compute_capability) == (
            "00000000:00:09.0",
            81559,
            "9.0",
        )
        assert (info.power_limit_w, info.power_limit_default_w) == (700.0, 700.0)
        assert (info.power_limit_min_w, info.power_limit_max_w) == (200.0, 700.0)
        assert (info.max_sm_clock_mhz, info.max_mem_clock_mhz) == (1980, 2619)
        assert (info.pcie_gen_max, info.pcie_width_max, info.mig_mode) == (5, 16, False)

    def test_serial_numbers_are_redacted(self, h100: ReplayBackend) -> None:
        """A recording never holds a serial number: the H100's reads "REDACTED"."""
        assert h100.gpus()[0].serial == "REDACTED"
        text = H100.read_text(encoding="utf-8")
        assert '"REDACTED"' in text and "0000000000000" not in text

    def test_consumer_card_features_it_lacks_are_none(self, rtx: ReplayBackend) -> None:
        """The GeForce capture's "[N/A]" fields (serial, MIG, ECC, page retirement, row remapping) replay as None."""
        (info,) = rtx.gpus()
        assert (info.serial, info.mig_mode, info.mig_instances) == (None, None, ())
        assert (info.power_limit_min_w, info.power_limit_max_w) == (150.0, 400.0)
        sample = rtx.sample()[0]
        assert (sample.ecc_volatile_uncorrected, sample.ecc_aggregate_uncorrected) == (None, None)
        assert (sample.retired_pages_single_bit, sample.retired_pages_pending) == (None, None)
        assert (sample.remapped_rows_correctable, sample.remapped_rows_failure) == (None, None)
        assert sample.fan_pct == 0.0  # a stopped fan is a reading, not "not supported"

    def test_fields_the_capture_lacks_are_none(self, h100: ReplayBackend) -> None:
        """PCIe throughput, absent from the converted sections, and the H100's fan and page retirement are None."""
        sample = h100.sample()[0]
        assert (sample.pcie_tx_kbps, sample.pcie_rx_kbps) == (None, None)
        assert sample.fan_pct is None
        assert (sample.retired_pages_single_bit, sample.retired_pages_double_bit) == (None, None)
        assert (sample.remapped_rows_correctable, sample.remapped_rows_pending) == (0, False)

    def test_h100_samples_follow_idle_then_load(self, h100: ReplayBackend) -> None:
        """The first pass is the idle capture, the second the gpu-burn load, with its three processes."""
        idle, load = h100.sample()[0], h100.sample()[0]
        assert (idle.gpu_util_pct, idle.memory_used_mib, idle.temperature_c, idle.power_draw_w) == (
            0.0,
            0,
            41.0,
            69.85,
        )
        assert (idle.sm_clock_mhz, idle.processes) == (345, ())
        assert (load.gpu_util_pct, load.mem_util_pct, load.memory_used_mib) == (100.0, 11.0, 19818)
        assert (load.temperature_c, load.power_draw_w, load.sm_clock_mhz) == (59.0, 631.95, 1980)
        assert [(process.pid, process.used_memory_mib) for process in load.processes] == [
            (11327, 2566),
            (11328, 1542),
            (11345, 15690),
        ]

    def test_throttle_reasons_decode(self, h100: ReplayBackend, rtx: ReplayBackend) -> None:
        """clocks_event_reasons.active 0x1 at idle reads ("gpu_idle",); 0x0 under load reads ()."""
        assert [h100.sample()[0].throttle_reasons for _ in range(2)] == [("gpu_idle",), ()]
        assert [rtx.sample()[0].throttle_reasons for _ in range(2)] == [("gpu_idle",), ()]

    def test_consumer_link_trains_down_at_idle(self, rtx: ReplayBackend) -> None:
        """The RTX 4080 SUPER's link ran at Gen1 idle and Gen4 under load; its maximum is Gen4."""
        assert [rtx.sample()[0].pcie_gen_current for _ in range(2)] == [1, 4]
        assert rtx.gpus()[0].pcie_gen_max == 4

    def test_replay_loops(self, h100: ReplayBackend) -> None:
        """After the last pass the recording starts over, so pass three equals pass one."""
        passes = [h100.sample() for _ in range(5)]
        assert h100.tick_count == 2
        assert passes[0] == passes[2] == passes[4] and passes[1] == passes[3]
        assert passes[0] != passes[1]

    def test_replay_without_loop_ends(self) -> None:
        """With loop=False the recording is played once; one more sample says it is spent."""
        backend = ReplayBackend(H100, loop=False)
        backend.sample()
        backend.sample()
        with pytest.raises(GpuBackendUnavailable, match="no more samples"):
            backend.sample()

    def test_shipped_recordings_have_no_events(self, h100: ReplayBackend) -> None:
        """nvidia-smi output holds no events, so the converted recordings watch none and report none."""
        assert isinstance(h100, GpuEventSource)
        for _ in range(3):
            h100.sample()
            assert h100.poll_events() == []

    @pytest.mark.parametrize("path", RECORDINGS, ids=lambda path: path.stem)
    def test_converter_reproduces_the_shipped_recording(self, path: Path, tmp_path: Path) -> None:
        """Running convert_nvidia_smi.py on the kept excerpt gives the shipped recording exactly."""
        converter = _load_converter()
        (shipped,) = [item for item in converter.SHIPPED if item.out == path.name]
        out = tmp_path / path.name
        converter.convert(
            FIXTURES / shipped.excerpt,
            out,
            origin_path=shipped.origin_path,
            origin_commit=shipped.origin_commit,
        )
        assert _recording(out) == _recording(path)


class TestReplayedEvents:
    def test_xid_in_a_recording_is_reported_by_poll_events(self) -> None:
        """An XID recorded in pass two is reported, with the GPU's UUID and code, after pass two only."""
        backend = ReplayBackend.from_recording(_with_xid(_recording(H100), tick=1, code=79), clock=lambda: AT)
        backend.sample()
        assert backend.poll_events() == []
        backend.sample()
        assert backend.poll_events() == [GpuEvent(uuid=MASKED_UUID, kind="xid", code=79, at=AT)]
        assert backend.poll_events() == []

    def test_events_replay_again_when_the_recording_loops(self) -> None:
        """Looping replays the whole recording, its events included."""
        backend = ReplayBackend.from_recording(_with_xid(_recording(H100), tick=0, code=48))
        codes = []
        for _ in range(4):
            backend.sample()
            codes.append([event.code for event in backend.poll_events()])
        assert codes == [[48], [], [48], []]

    def test_poll_before_the_first_sample_reports_nothing(self) -> None:
        """Events belong to a sampling pass; before the first one there are none."""
        backend = ReplayBackend.from_recording(_with_xid(_recording(H100), tick=0, code=48))
        assert backend.poll_events() == []


class TestReplayNvml:
    def test_unrecorded_call_falls_back_like_an_older_driver(self) -> None:
        """A call the recording lacks answers FunctionNotFound, so the collector falls back to the older call."""
        recording = _recording(H100)
        for tick in recording["calls"]["ticks"]:
            gpu0 = tick["calls"]["gpu0"]
            gpu0["nvmlDeviceGetTemperature"] = gpu0.pop("nvmlDeviceGetTemperatureV")
        nvml = ReplayNvml(recording)
        nvml.start_tick(0)
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            nvml.nvmlDeviceGetTemperatureV(nvml.nvmlDeviceGetHandleByIndex(0), pynvml.NVML_TEMPERATURE_GPU)
        backend = ReplayBackend.from_recording(recording)
        assert backend.sample()[0].temperature_c == 41.0

    def test_raises_pynvmls_own_exception_classes(self) -> None:
        """A recorded NVMLError_NotSupported is raised as pynvml.NVMLError_NotSupported, whose value is the code."""
        nvml = ReplayNvml(_recording(RTX_4080_SUPER))
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(pynvml.NVMLError_NotSupported) as caught:
            nvml.nvmlDeviceGetSerial(handle)
        assert caught.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED

    def test_constants_are_pynvmls(self) -> None:
        """Anything that is not an NVML function is pynvml's own attribute."""
        nvml = ReplayNvml(_recording(H100))
        assert nvml.NVML_CLOCK_SM == pynvml.NVML_CLOCK_SM
        assert nvml.nvmlEventTypeXidCriticalError == pynvml.nvmlEventTypeXidCriticalError

    @pytest.mark.parametrize(
        ("document", "problem"),
        [
            ({"format": "something-else"}, "not an NVML recording"),
            ({"format": "gpumarket-nvml-recording", "version": 99}, "version"),
            ({"format": "gpumarket-nvml-recording", "version": 1, "calls": {"open": {}, "ticks": []}}, "ticks"),
            (
                {"format": "gpumarket-nvml-recording", "version": 1,
                 "calls": {"open": {"system": {"nvmlDeviceGetCount": {"": {"error": "NotAClass"}}}}, "ticks": [{}]}},
                "NVMLError",
            ),
            (
                {"format": "gpumarket-nvml-recording", "version": 1,
                 "calls": {"open": {"system": {"nvmlDeviceGetCount": {"": {"valu": 1}}}}, "ticks": [{}]}},
                "must be",
            ),
        ],
    )  # fmt: skip
    def test_rejects_what_is_not_a_usable_recording(self, document: dict[str, Any], problem: str) -> None:
        """A wrong format, version or answer is a ConfigError saying what is wrong."""
        with pytest.raises(ConfigError, match=problem):
            ReplayBackend.from_recording(document)

    def test_rejects_a_file_that_is_not_json(self, tmp_path: Path) -> None:
        """A file that is not JSON is a ConfigError naming the file."""
        path = tmp_path / "broken.json"
        path.write_text("{not json", encoding="utf-8")
        with pytest.raises(ConfigError, match=r"broken\.json"):
            load_recording(path)


class TestRecordNvml:
    @pytest.mark.parametrize("path", RECORDINGS, ids=lambda path: path.stem)
    def test_recording_a_replay_replays_the_same(self, path: Path, tmp_path: Path) -> None:
        """Recording the replay's fake NVML and replaying that file gives equal GPUs and samples.

        The recorder runs the collector itself, so a call it failed to write down would come back
        as FunctionNotFound (None) in the second replay and the samples would differ.
        """
        recording = _recording(path)
        source_nvml = ReplayNvml(recording)
        source_nvml.start_tick(0)
        ticks = source_nvml.tick_count
        moves = iter(range(1, ticks))
        out = tmp_path / "again.json"
        record_nvml(
            out, seconds=ticks, interval=1.0, nvml=source_nvml,
            sleep=lambda _: source_nvml.start_tick(next(moves)), clock=lambda: AT,
        )  # fmt: skip
        original, again = ReplayBackend(path), ReplayBackend(out)
        assert again.gpus() == original.gpus()
        for _ in range(2 * ticks):
            assert again.sample() == original.sample()
        # Every pass of the new recording holds the very calls of the original's.
        assert _call_keys(_recording(out)) == _call_keys(recording)

    def test_round_trip_keeps_mig_instances_and_events(self, tmp_path: Path) -> None:
        """MIG devices (their own handles) and an XID event survive record → replay through the same code."""
        nvml = FakeNvml([_h100_mig_readings(), _h100_readings()])
        nvml.pending_events = [_event(0, XID, 79, gpu_instance=2)]
        out = tmp_path / "mig.json"
        document = record_nvml(
            out, seconds=2, interval=1.0, nvml=nvml, sleep=lambda _: None, clock=lambda: AT
        )
        assert document["source"]["ticks"] == 2
        direct = FakeNvml([_h100_mig_readings(), _h100_readings()])
        direct.pending_events = [_event(0, XID, 79, gpu_instance=2)]
        live = NvmlBackend(nvml=direct, clock=lambda: AT)
        replay = ReplayBackend(out, clock=lambda: AT)
        assert replay.gpus() == [dataclasses.replace(info, serial="REDACTED") for info in live.gpus()]
        assert len(replay.gpus()[0].mig_instances) == 2
        assert replay.sample() == live.sample()
        events = replay.poll_events()
        assert events == live.poll_events()
        assert [(event.kind, event.code, event.gpu_instance_id) for event in events] == [("xid", 79, 2)]
        assert replay.sample() == live.sample()
        assert replay.poll_events() == [] == live.poll_events()

    def test_records_pynvmls_ctypes_answers(self, tmp_path: Path) -> None:
        """Pointer handles, NVML structures and event data as pynvml returns them record and replay faithfully."""
        out = tmp_path / "ctypes.json"
        record_nvml(
            out, seconds=1, interval=1.0, nvml=_two_gpus_with_an_xid(), sleep=lambda _: None, clock=lambda: AT
        )
        document = _recording(out)
        pci = document["calls"]["open"]["gpu1"]["nvmlDeviceGetPciInfo"][""]["value"]
        assert (pci["busId"], pci["device"]) == ("00000000:19:00.0", 3)  # a number, not taken for a handle
        (event, timeout) = document["calls"]["ticks"][0]["calls"]["system"]["nvmlEventSetWait"]["event_set,0"]
        assert event["value"]["device"] == {"$handle": "gpu1"}
        assert timeout["error"] == "NVMLError_Timeout"
        live = NvmlBackend(nvml=_two_gpus_with_an_xid(), clock=lambda: AT)
        replay = ReplayBackend(out, clock=lambda: AT)
        assert replay.gpus() == [dataclasses.replace(info, serial="REDACTED") for info in live.gpus()]
        assert replay.sample() == live.sample()
        assert (
            replay.poll_events()
            == live.poll_events()
            == [GpuEvent(uuid="GPU-22222222-0000-1111-2222-333344445555", kind="xid", code=79, at=AT)]
        )

    def test_handle_key_compares_pointers_by_address(self) -> None:
        """Two pointer objects to the same device are one key; a pointer to another device is another."""
        devices = [pynvml.struct_c_nvmlDevice_t(), pynvml.struct_c_nvmlDevice_t()]

        def pointer(index: int) -> Any:
            return ctypes.cast(ctypes.addressof(devices[index]), pynvml.c_nvmlDevice_t)

        assert pointer(0) is not pointer(0)
        assert handle_key(pointer(0)) == handle_key(pointer(0)) != handle_key(pointer(1))
        assert handle_key(3) == 3

    def test_source_describes_the_recording(self, tmp_path: Path) -> None:
        """The source names the GPUs, driver and CUDA versions, when and how it was recorded, and no host name."""
        document = record_nvml(
            tmp_path / "r.json", seconds=3, interval=1.0, nvml=FakeNvml([_h100_readings()]),
            sleep=lambda _: None, clock=lambda: AT,
        )  # fmt: skip
        source = document["source"]
        assert source["gpus"] == ["NVIDIA H100 80GB HBM3"]
        assert (source["driver_version"], source["cuda_driver_version"]) == ("550.54.15", "12.4")
        assert source["recorded_at"] == AT.isoformat() and source["ticks"] == 3
        assert "NVML" in source["how"] and source["redacted"] == ["nvmlDeviceGetSerial"]
        assert not {key for key in source if "host" in key}
        assert len(document["calls"]["ticks"]) == 3
        assert json.loads((tmp_path / "r.json").read_text(encoding="utf-8")) == document

    def test_waits_between_passes_not_before_the_first(self, tmp_path: Path) -> None:
        """seconds / interval passes, each waiting for its deadline (k × interval after the first pass)."""
        waits: list[float] = []
        record_nvml(
            tmp_path / "r.json", seconds=2.0, interval=0.5, nvml=FakeNvml([_h100_readings()]),
            sleep=waits.append, clock=lambda: AT,
        )  # fmt: skip
        # This sleep returns at once, so each deadline is still nearly k × interval away.
        assert [round(wait, 1) for wait in waits] == [0.5, 1.0, 1.5]

    @pytest.mark.parametrize(("seconds", "interval"), [(0, 1.0), (5.0, 0.0), (-1, 1.0), (10_000, 1.0)])
    def test_rejects_durations_out_of_range(self, seconds: float, interval: float, tmp_path: Path) -> None:
        """No pass at all, a zero interval or more than an hour of passes is a ConfigError."""
        with pytest.raises(ConfigError):
            record_nvml(
                tmp_path / "r.json", seconds=seconds, interval=interval, nvml=FakeNvml([_h100_readings()])
            )

    def test_without_a_driver_raises_what_the_agent_raises(self, tmp_path: Path) -> None:
        """Where NVML cannot start, recording fails with the same GpuBackendUnavailable and writes nothing."""
        with pytest.raises(GpuBackendUnavailable, match="sim:4xRTX4090"):
            record_nvml(
                tmp_path / "r.json", nvml=FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
            )
        assert not (tmp_path / "r.json").exists()

    @pytest.mark.skipif(HAS_NVIDIA_DRIVER, reason="this host has an NVIDIA driver")
    def test_cli_entry_on_a_driverless_host_raises_gpu_backend_unavailable(self, tmp_path: Path) -> None:
        """main(out, seconds), behind `gpumarket agent record-nvml`, fails here as NvmlBackend does."""
        with pytest.raises(GpuBackendUnavailable) as caught:
            record_main(tmp_path / "r.json", 1.0)
        with pytest.raises(GpuBackendUnavailable) as expected:
            NvmlBackend()
        assert caught.value.message == expected.value.message
        assert not (tmp_path / "r.json").exists()
