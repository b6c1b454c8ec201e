"""Real GPUs through NVML (the ``nvidia-ml-py`` package, imported as ``pynvml``).

The collection functions (``read_driver_versions``, ``read_gpu_info``,
``read_gpu_sample``, ``open_event_set``, ``read_events``) take the NVML API as an
``nvml`` argument, ``pynvml`` by default, so that a backend replaying readings
recorded on a real GPU (``agent.gpu.replay``) drives the very same code: such a
stand-in offers the ``pynvml`` functions it is asked for and raises ``pynvml``'s own
``NVMLError`` subclasses exactly as NVML would. Constants (clock types, event types,
error codes) are NVML's ABI and always come from ``pynvml`` itself.

``agent.gpu.nvmlbackend.NvmlBackend`` holds them together: NVML started, the GPUs' identity read once, sampled, watched
for events. ``set_power_limit`` is the one call here that changes a GPU: ``nvmlDeviceSetPowerManagementLimit``
(milliwatts), checked against the board's range first (``agent.gpu.base.check_power_limit``).

A field NVML cannot report on this GPU (not supported, no permission, not found, or
a function this driver or this ``pynvml`` lacks) becomes ``None``; any other NVML
error propagates. Imports ``agent.gpu.base`` and ``shared`` only.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeAlias, TypeVar

import pynvml

from agent.gpu.base import (
    MIB,
    GpuEvent,
    GpuEventKind,
    GpuInfo,
    GpuMigInstance,
    GpuProcess,
    GpuSample,
    check_power_limit,
)
from shared.errors import GpuBackendUnavailable, PowerLimitError

log = logging.getLogger(__name__)

NvmlApi: TypeAlias = Any
"""The ``pynvml`` module, or an object offering the same functions."""

_T = TypeVar("_T")

# NVML's ways of saying "this GPU or driver cannot report that".
_UNAVAILABLE_CODES = frozenset(
    {
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_NOT_FOUND,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_NO_DATA,
    }
)

# Bits of nvmlDeviceGetCurrentClocksEventReasons (called ...ThrottleReasons before driver 535),
# in bit order. The values are NVML's ABI (nvml.h, nvmlClocksEventReason*); ``pynvml`` spells
# them differently from one release to the next, so they are written out here.
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x0001, "gpu_idle"),
    (0x0002, "applications_clocks"),
    (0x0004, "sw_power_cap"),
    (0x0008, "hw_slowdown"),
    (0x0010, "sync_boost"),
    (0x0020, "sw_thermal"),
    (0x0040, "hw_thermal"),
    (0x0080, "hw_power_brake"),
    (0x0100, "display_clocks"),
    (0x0200, "board_limit"),
    (0x0400, "reliability"),
)

# The events the agent watches, and what it calls them.
_EVENT_KINDS: Mapping[int, GpuEventKind] = {
    pynvml.nvmlEventTypeXidCriticalError: "xid",
    pynvml.nvmlEventTypeDoubleBitEccError: "double_bit_ecc",
    pynvml.nvmlEventTypeSingleBitEccError: "single_bit_ecc",
}
WATCHED_EVENT_TYPES = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypeSingleBitEccError
)
# nvmlEventData_t's instance ids when the event belongs to no MIG instance.
_NO_INSTANCE = 0xFFFFFFFF
# A100 and H100 carve at most 7 MIG devices; the bound only guards against a garbage count.
_MAX_MIG_DEVICES = 64
_MIG_PROFILE_RE = re.compile(r"\bMIG\s+(\S+)\s*$")

def _maybe(fn: Callable[..., _T], *args: Any) -> _T | None:
    """``fn(*args)``, or ``None`` where NVML says the value is unavailable on this GPU."""
    try:
        return fn(*args)
    except pynvml.NVMLError as err:
        if err.value in _UNAVAILABLE_CODES:
            return None
        raise


def _first_available(nvml: NvmlApi, names: Sequence[str], *args: Any) -> Any:
    """Call the first of ``names`` that both this ``pynvml`` and this driver provide.

    Newer NVML functions replace deprecated ones; an older driver or ``pynvml`` lacks
    the new one, so each name is tried in turn. ``None`` when none can answer.
    """
    for name in names:
        fn = getattr(nvml, name, None)
        if fn is None:
            continue
        try:
            return fn(*args)
        except pynvml.NVMLError as err:
            if err.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                continue
            if err.value in _UNAVAILABLE_CODES:
                return None
            raise
    return None


def nvml_call(nvml: NvmlApi, name: str, *args: Any) -> Any:
    """``nvml.<name>(*args)``; ``None`` where it is unavailable, including a ``pynvml`` without it."""
    return _first_available(nvml, (name,), *args)


def _text(value: str | bytes | None) -> str | None:
    """NVML strings: ``pynvml`` before 11.5 returns ``bytes``, later versions ``str``."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    return value.strip("\x00").strip() or None


def _required_text(value: str | bytes | None, what: str) -> str:
    text = _text(value)
    if text is None:
        raise GpuBackendUnavailable(f"NVML returned an empty {what}")
    return text


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _flag(value: Any) -> bool | None:
    return None if value is None else bool(value)


def format_cuda_version(version: int) -> str:
    """NVML's CUDA version integer as text: 12040 → "12.4"."""
    return f"{version // 1000}.{version % 1000 // 10}"


def decode_throttle_reasons(mask: int) -> tuple[str, ...]:
    """The names of the bits set in a clocks-event-reasons mask, in bit order.

    A bit this agent does not know (a newer driver's) is kept as ``"unknown_0x..."``
    rather than dropped.
    """
    names = [name for bit, name in THROTTLE_REASONS if mask & bit]
    known = 0
    for bit, _ in THROTTLE_REASONS:
        known |= bit
    unknown = mask & ~known
    bit = 1
    while unknown >= bit:
        if unknown & bit:
            names.append(f"unknown_{bit:#x}")
        bit <<= 1
    return tuple(names)


def _milliwatts_to_watts(milliwatts: int | None) -> float | None:
    return None if milliwatts is None else milliwatts / 1000


def _bytes_to_mib(size: int | None) -> int | None:
    return None if size is None else int(size) // MIB


def handle_key(handle: Any) -> Hashable:
    """A hashable identity of an NVML handle, the same for every copy of it.

    ``pynvml`` hands out handles as ctypes pointers, and the pointer an event carries
    is a new Python object for the same device: pointers are compared by address.
    Any other handle (a stand-in's) is its own key.
    """
    if isinstance(handle, ctypes._Pointer):
        return ("nvml-pointer", ctypes.cast(handle, ctypes.c_void_p).value)
    return handle  # type: ignore[no-any-return]


def read_driver_versions(nvml: NvmlApi = pynvml) -> tuple[str | None, str | None]:
    """The driver version ("550.54.15") and the CUDA version it supports ("12.4")."""
    driver_version = _text(_maybe(nvml.nvmlSystemGetDriverVersion))
    cuda = _first_available(nvml, ("nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2"))
    return driver_version, None if cuda is None else format_cuda_version(int(cuda))


def read_mig_instances(handle: Any, *, nvml: NvmlApi = pynvml) -> tuple[GpuMigInstance, ...]:
    """The MIG devices configured on the MIG-enabled GPU behind ``handle``, by slot."""
    slots = nvml_call(nvml, "nvmlDeviceGetMaxMigDeviceCount", handle)
    instances: list[GpuMigInstance] = []
    for slot in range(min(int(slots or 0), _MAX_MIG_DEVICES)):
        # An empty slot answers NVML_ERROR_NOT_FOUND.
        mig = nvml_call(nvml, "nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
        if mig is None:
            continue
        uuid = _text(nvml_call(nvml, "nvmlDeviceGetUUID", mig))
        if uuid is None:
            continue
        name = _text(nvml_call(nvml, "nvmlDeviceGetName", mig))
        profile = None if name is None else _MIG_PROFILE_RE.search(name)
        memory = nvml_call(nvml, "nvmlDeviceGetMemoryInfo", mig)
        attributes = nvml_call(nvml, "nvmlDeviceGetAttributes", mig)
        instances.append(
            GpuMigInstance(
                uuid=uuid,
                gpu_instance_id=_int(nvml_call(nvml, "nvmlDeviceGetGpuInstanceId", mig)),
                compute_instance_id=_int(nvml_call(nvml, "nvmlDeviceGetComputeInstanceId", mig)),
                memory_total_mib=None if memory is None else _bytes_to_mib(memory.total),
                name=name,
                profile=None if profile is None else profile.group(1),
                multiprocessor_count=None if attributes is None else int(attributes.multiprocessorCount),
            )
        )
    return tuple(instances)


def read_gpu_info(
    handle: Any,
    index: int,
    *,
    driver_version: str | None,
    cuda_driver_version: str | None,
    nvml: NvmlApi = pynvml,
) -> GpuInfo:
    """The identity of the GPU behind ``handle``."""
    pci = _maybe(nvml.nvmlDeviceGetPciInfo, handle)
    capability = _maybe(nvml.nvmlDeviceGetCudaComputeCapability, handle)
    mig = _maybe(nvml.nvmlDeviceGetMigMode, handle)
    mig_enabled = None if mig is None else mig[0] == pynvml.NVML_DEVICE_MIG_ENABLE
    max_sm_clock = _maybe(nvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_SM)
    max_mem_clock = _maybe(nvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_MEM)
    # The enforced limit is the lowest of every limit in force (the administrator's, the board's).
    power_limit = _first_available(
        nvml, ("nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetPowerManagementLimit"), handle
    )
    limit_range = nvml_call(nvml, "nvmlDeviceGetPowerManagementLimitConstraints", handle)
    return GpuInfo(
        index=index,
        uuid=_required_text(nvml.nvmlDeviceGetUUID(handle), "GPU UUID"),
        name=_required_text(nvml.nvmlDeviceGetName(handle), "GPU name"),
        pci_bus_id=None if pci is None else _text(pci.busId),
        serial=_text(_maybe(nvml.nvmlDeviceGetSerial, handle)),
        memory_total_mib=int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // MIB,
        compute_capability=None if capability is None else f"{capability[0]}.{capability[1]}",
        driver_version=driver_version,
        cuda_driver_version=cuda_driver_version,
        power_limit_w=_milliwatts_to_watts(power_limit),
        power_limit_default_w=_milliwatts_to_watts(
            nvml_call(nvml, "nvmlDeviceGetPowerManagementDefaultLimit", handle)
        ),
        power_limit_min_w=None if limit_range is None else _milliwatts_to_watts(limit_range[0]),
        power_limit_max_w=None if limit_range is None else _milliwatts_to_watts(limit_range[1]),
        max_sm_clock_mhz=_int(max_sm_clock),
        max_mem_clock_mhz=_int(max_mem_clock),
        pcie_gen_max=_int(_maybe(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle)),
        pcie_width_max=_int(_maybe(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle)),
        mig_mode=mig_enabled,
        mig_instances=read_mig_instances(handle, nvml=nvml) if mig_enabled else (),
    )


def read_gpu_sample(handle: Any, index: int, uuid: str, *, nvml: NvmlApi = pynvml) -> GpuSample:
    """The live state of the GPU behind ``handle``."""
    utilization = _maybe(nvml.nvmlDeviceGetUtilizationRates, handle)
    memory = _maybe(nvml.nvmlDeviceGetMemoryInfo, handle)
    temperature = _first_available(
        nvml, ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"), handle, pynvml.NVML_TEMPERATURE_GPU
    )
    sm_clock = _maybe(nvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM)
    mem_clock = _maybe(nvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_MEM)
    fan = _maybe(nvml.nvmlDeviceGetFanSpeed, handle)
    pcie_tx = _maybe(nvml.nvmlDeviceGetPcieThroughput, handle, pynvml.NVML_PCIE_UTIL_TX_BYTES)
    pcie_rx = _maybe(nvml.nvmlDeviceGetPcieThroughput, handle, pynvml.NVML_PCIE_UTIL_RX_BYTES)
    throttle = _first_available(
        nvml, ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"), handle
    )
    ecc_volatile = _maybe(
        nvml.nvmlDeviceGetTotalEccErrors,
        handle,
        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        pynvml.NVML_VOLATILE_ECC,
    )
    ecc_aggregate = _maybe(
        nvml.nvmlDeviceGetTotalEccErrors,
        handle,
        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        pynvml.NVML_AGGREGATE_ECC,
    )
    # Only pre-Ampere GPUs retire pages; Ampere and later data-centre GPUs remap rows instead.
    retired_single = nvml_call(
        nvml,
        "nvmlDeviceGetRetiredPages",
        handle,
        pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
    )
    retired_double = nvml_call(
        nvml, "nvmlDeviceGetRetiredPages", handle, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
    )
    remapped = nvml_call(
        nvml, "nvmlDeviceGetRemappedRows", handle
    )  # (correctable, uncorrectable, pending, failure)
    processes = _first_available(
        nvml,
        (
            "nvmlDeviceGetComputeRunningProcesses_v3",
            "nvmlDeviceGetComputeRunningProcesses_v2",
            "nvmlDeviceGetComputeRunningProcesses",
        ),
        handle,
    )
    return GpuSample(
        index=index,
        uuid=uuid,
        gpu_util_pct=None if utilization is None else float(utilization.gpu),
        mem_util_pct=None if utilization is None else float(utilization.memory),
        memory_used_mib=None if memory is None else _bytes_to_mib(memory.used),
        memory_free_mib=None if memory is None else _bytes_to_mib(memory.free),
        temperature_c=None if temperature is None else float(temperature),
        power_draw_w=_milliwatts_to_watts(_maybe(nvml.nvmlDeviceGetPowerUsage, handle)),
        sm_clock_mhz=_int(sm_clock),
        mem_clock_mhz=_int(mem_clock),
        fan_pct=None if fan is None else float(fan),
        pcie_gen_current=_int(nvml_call(nvml, "nvmlDeviceGetCurrPcieLinkGeneration", handle)),
        pcie_width_current=_int(nvml_call(nvml, "nvmlDeviceGetCurrPcieLinkWidth", handle)),
        pcie_tx_kbps=_int(pcie_tx),
        pcie_rx_kbps=_int(pcie_rx),
        throttle_reasons=None if throttle is None else decode_throttle_reasons(int(throttle)),
        ecc_volatile_uncorrected=_int(ecc_volatile),
        ecc_aggregate_uncorrected=_int(ecc_aggregate),
        retired_pages_single_bit=None if retired_single is None else len(retired_single),
        retired_pages_double_bit=None if retired_double is None else len(retired_double),
        retired_pages_pending=_flag(nvml_call(nvml, "nvmlDeviceGetRetiredPagesPendingStatus", handle)),
        remapped_rows_correctable=None if remapped is None else int(remapped[0]),
        remapped_rows_uncorrectable=None if remapped is None else int(remapped[1]),
        remapped_rows_pending=None if remapped is None else bool(remapped[2]),
        remapped_rows_failure=None if remapped is None else bool(remapped[3]),
        # usedGpuMemory is None where the driver cannot tell (Windows WDDM, some containers).
        processes=tuple(
            GpuProcess(pid=int(process.pid), used_memory_mib=_bytes_to_mib(process.usedGpuMemory))
            for process in processes or ()
        ),
    )


# What NVML's refusal to set a limit means, and what to do about it.
_SET_LIMIT_REFUSALS: Mapping[int, tuple[str, str]] = {
    pynvml.NVML_ERROR_NO_PERMISSION: (
        "power_limit_no_permission",
        "setting a power limit needs root (or CAP_SYS_ADMIN) on this driver: run the agent with that right, or opt the host out",
    ),
    pynvml.NVML_ERROR_NOT_SUPPORTED: ("power_limit_unsupported", "this GPU does not let its power limit be set"),
    pynvml.NVML_ERROR_INVALID_ARGUMENT: ("power_limit_out_of_range", "the driver refused the value as out of range"),
}


def set_power_limit(handle: Any, info: GpuInfo, watts: float, *, nvml: NvmlApi = pynvml) -> float:
    """``nvmlDeviceSetPowerManagementLimit`` (milliwatts) for the GPU behind ``handle``, checked against its
    range first; ``PowerLimitError`` with NVML's reason (no permission, not supported, ...) if it refuses."""
    limit = check_power_limit(info, watts)
    try:
        nvml.nvmlDeviceSetPowerManagementLimit(handle, round(limit * 1000))
    except pynvml.NVMLError as err:
        code, hint = _SET_LIMIT_REFUSALS.get(err.value, ("power_limit_refused", "see the driver's log"))
        raise PowerLimitError(
            f"GPU {info.index} ({info.name}): NVML refused the power limit {limit:g} W ({err}): {hint}; nothing changed",
            code=code, details={"gpu_uuid": info.uuid, "nvml_error": str(err)},
        ) from err
    return limit


def _register_events(nvml: NvmlApi, handle: Any, event_types: int, event_set: Any) -> bool:
    """Register ``event_types`` of one GPU with ``event_set``; ``False`` where the GPU cannot."""
    try:
        nvml.nvmlDeviceRegisterEvents(handle, event_types, event_set)
    except pynvml.NVMLError as err:
        if err.value in _UNAVAILABLE_CODES:
            return False
        raise
    return True


def open_event_set(
    nvml: NvmlApi, handles: Sequence[Any], *, event_types: int = WATCHED_EVENT_TYPES
) -> Any | None:
    """An NVML event set with each GPU registered for the ``event_types`` it supports.

    A GPU that supports none (GeForce cards report no ECC events) is left out, and so is
    one whose registration fails (logged). ``None``, with nothing left allocated, when
    NVML offers no events at all or no GPU could be registered.
    """
    event_set = nvml_call(nvml, "nvmlEventSetCreate")
    if event_set is None:
        return None
    registered = 0
    for index, handle in enumerate(handles):
        try:
            supported = nvml_call(nvml, "nvmlDeviceGetSupportedEventTypes", handle)
            wanted = event_types if supported is None else event_types & int(supported)
            if not wanted:
                continue
            if _register_events(nvml, handle, wanted, event_set):
                registered += 1
            elif supported is None:
                # NVML could not say which types this GPU supports: offer them one at a time.
                bits = [bit for bit in _EVENT_KINDS if wanted & bit]
                if [bit for bit in bits if _register_events(nvml, handle, bit, event_set)]:
                    registered += 1
        except pynvml.NVMLError as err:
            log.warning("GPU %d: cannot watch it for XID and ECC events (NVML: %s)", index, err)
    if not registered:
        with contextlib.suppress(pynvml.NVMLError):
            nvml_call(nvml, "nvmlEventSetFree", event_set)
        return None
    return event_set


def read_events(
    nvml: NvmlApi,
    event_set: Any,
    uuid_by_handle: Mapping[Hashable, str],
    *,
    now: datetime,
    max_events: int = 256,
) -> list[GpuEvent]:
    """The events waiting in ``event_set``, without blocking, at most ``max_events`` of them.

    ``nvmlEventSetWait`` with a timeout of 0 returns one pending event or fails with
    NVML_ERROR_TIMEOUT when there is none. Events left over past ``max_events`` stay
    queued in NVML for the next call. ``uuid_by_handle`` maps ``handle_key(handle)`` to
    the GPU's UUID; an event for a handle not in it is logged and dropped.
    """
    events: list[GpuEvent] = []
    for _ in range(max_events):
        try:
            data = nvml.nvmlEventSetWait(event_set, 0)
        except pynvml.NVMLError as err:
            if err.value == pynvml.NVML_ERROR_TIMEOUT or err.value in _UNAVAILABLE_CODES:
                break
            raise
        uuid = uuid_by_handle.get(handle_key(data.device))
        if uuid is None:
            log.warning("NVML reported event type %#x for a GPU the agent does not know", data.eventType)
            continue
        event_type = int(data.eventType)
        kind = _EVENT_KINDS.get(event_type, "other")
        code = int(data.eventData) if kind == "xid" else event_type if kind == "other" else None
        gpu_instance = int(getattr(data, "gpuInstanceId", _NO_INSTANCE))
        compute_instance = int(getattr(data, "computeInstanceId", _NO_INSTANCE))
        events.append(
            GpuEvent(
                uuid=uuid,
                kind=kind,
                code=code,
                at=now,
                gpu_instance_id=None if gpu_instance == _NO_INSTANCE else gpu_instance,
                compute_instance_id=None if compute_instance == _NO_INSTANCE else compute_instance,
            )
        )
    return events
