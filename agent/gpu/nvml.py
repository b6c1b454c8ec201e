"""Real GPUs through NVML (the ``nvidia-ml-py`` package, imported as ``pynvml``).

The collection functions (``read_driver_versions``, ``read_gpu_info``,
``read_gpu_sample``) take the NVML API as an ``nvml`` argument, ``pynvml`` by
default, so that a backend replaying readings recorded on a real GPU drives the very
same code: such a stand-in offers the ``pynvml`` functions and constants it needs and
raises ``pynvml.NVMLError`` exactly as NVML would.

A field NVML cannot report on this GPU (not supported, no permission, not found, or
a function this driver lacks) becomes ``None``; any other NVML error propagates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, TypeVar

import pynvml

from agent.gpu.base import MIB, GpuInfo, GpuProcess, GpuSample
from shared.errors import GpuBackendUnavailable

NvmlApi: TypeAlias = Any
"""The ``pynvml`` module, or an object offering the same functions and constants."""

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

_NO_DRIVER_HINT = (
    "Install the NVIDIA driver (on Ubuntu: `sudo ubuntu-drivers install`; otherwise the "
    "driver for your GPU from https://www.nvidia.com/Download/index.aspx or your "
    "distribution's packages), reboot, check that `nvidia-smi` lists your GPUs, then start "
    "the agent again. To demo the agent on a machine without NVIDIA GPUs, choose simulated "
    "GPUs explicitly with `--gpus sim:4xRTX4090`; a real provider host must never use them."
)


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


def format_cuda_version(version: int) -> str:
    """NVML's CUDA version integer as text: 12040 → "12.4"."""
    return f"{version // 1000}.{version % 1000 // 10}"


def _milliwatts_to_watts(milliwatts: int | None) -> float | None:
    return None if milliwatts is None else milliwatts / 1000


def _bytes_to_mib(size: int | None) -> int | None:
    return None if size is None else int(size) // MIB


def read_driver_versions(nvml: NvmlApi = pynvml) -> tuple[str | None, str | None]:
    """The driver version ("550.54.15") and the CUDA version it supports ("12.4")."""
    driver_version = _text(_maybe(nvml.nvmlSystemGetDriverVersion))
    cuda = _first_available(nvml, ("nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2"))
    return driver_version, None if cuda is None else format_cuda_version(int(cuda))


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
    max_sm_clock = _maybe(nvml.nvmlDeviceGetMaxClockInfo, handle, nvml.NVML_CLOCK_SM)
    max_mem_clock = _maybe(nvml.nvmlDeviceGetMaxClockInfo, handle, nvml.NVML_CLOCK_MEM)
    pcie_gen = _maybe(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle)
    pcie_width = _maybe(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle)
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
        power_limit_w=_milliwatts_to_watts(_maybe(nvml.nvmlDeviceGetPowerManagementLimit, handle)),
        max_sm_clock_mhz=None if max_sm_clock is None else int(max_sm_clock),
        max_mem_clock_mhz=None if max_mem_clock is None else int(max_mem_clock),
        pcie_gen_max=None if pcie_gen is None else int(pcie_gen),
        pcie_width_max=None if pcie_width is None else int(pcie_width),
        mig_mode=None if mig is None else mig[0] == nvml.NVML_DEVICE_MIG_ENABLE,
    )


def read_gpu_sample(handle: Any, index: int, uuid: str, *, nvml: NvmlApi = pynvml) -> GpuSample:
    """The live state of the GPU behind ``handle``."""
    utilization = _maybe(nvml.nvmlDeviceGetUtilizationRates, handle)
    memory = _maybe(nvml.nvmlDeviceGetMemoryInfo, handle)
    temperature = _first_available(
        nvml, ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"), handle, nvml.NVML_TEMPERATURE_GPU
    )
    sm_clock = _maybe(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM)
    mem_clock = _maybe(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_MEM)
    fan = _maybe(nvml.nvmlDeviceGetFanSpeed, handle)
    pcie_tx = _maybe(nvml.nvmlDeviceGetPcieThroughput, handle, nvml.NVML_PCIE_UTIL_TX_BYTES)
    pcie_rx = _maybe(nvml.nvmlDeviceGetPcieThroughput, handle, nvml.NVML_PCIE_UTIL_RX_BYTES)
    ecc_volatile = _maybe(
        nvml.nvmlDeviceGetTotalEccErrors,
        handle,
        nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        nvml.NVML_VOLATILE_ECC,
    )
    ecc_aggregate = _maybe(
        nvml.nvmlDeviceGetTotalEccErrors,
        handle,
        nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        nvml.NVML_AGGREGATE_ECC,
    )
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
        sm_clock_mhz=None if sm_clock is None else int(sm_clock),
        mem_clock_mhz=None if mem_clock is None else int(mem_clock),
        fan_pct=None if fan is None else float(fan),
        pcie_tx_kbps=None if pcie_tx is None else int(pcie_tx),
        pcie_rx_kbps=None if pcie_rx is None else int(pcie_rx),
        ecc_volatile_uncorrected=None if ecc_volatile is None else int(ecc_volatile),
        ecc_aggregate_uncorrected=None if ecc_aggregate is None else int(ecc_aggregate),
        # usedGpuMemory is None where the driver cannot tell (Windows WDDM, some containers).
        processes=tuple(
            GpuProcess(pid=int(process.pid), used_memory_mib=_bytes_to_mib(process.usedGpuMemory))
            for process in processes or ()
        ),
    )


def _unavailable_message(err: BaseException) -> str:
    if isinstance(err, OSError) or (
        isinstance(err, pynvml.NVMLError) and err.value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    ):
        problem = (
            "No NVIDIA driver found on this host: the NVML library (libnvidia-ml.so.1) could not be loaded."
        )
    elif isinstance(err, pynvml.NVMLError) and err.value == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
        problem = (
            "The NVIDIA driver is not loaded on this host (NVML: driver not loaded); "
            "the driver may be missing, or installed but its kernel module not running."
        )
    elif isinstance(err, pynvml.NVMLError) and err.value == pynvml.NVML_ERROR_NO_PERMISSION:
        problem = (
            "The agent may not use the NVIDIA driver (NVML: no permission); "
            "give its user access to /dev/nvidia*."
        )
    else:
        problem = f"The NVIDIA driver could not be initialized (NVML: {err})."
    return f"{problem} {_NO_DRIVER_HINT}"


class NvmlBackend:
    """Every GPU NVML sees on this host, identity read once at construction.

    Raises ``GpuBackendUnavailable``, saying how to install the driver and that
    ``--gpus sim:...`` exists for demos, when NVML cannot start. Never falls back to
    simulated GPUs.
    """

    name: str = "nvml"

    def __init__(self, *, nvml: NvmlApi = pynvml) -> None:
        self._nvml = nvml
        try:
            nvml.nvmlInit()
        except (pynvml.NVMLError, OSError) as err:
            raise GpuBackendUnavailable(_unavailable_message(err), details={"nvml_error": str(err)}) from err
        self._closed = False
        try:
            count = int(nvml.nvmlDeviceGetCount())
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(index) for index in range(count)]
            driver_version, cuda_driver_version = read_driver_versions(nvml)
            self._infos = [
                read_gpu_info(
                    handle,
                    index,
                    driver_version=driver_version,
                    cuda_driver_version=cuda_driver_version,
                    nvml=nvml,
                )
                for index, handle in enumerate(self._handles)
            ]
        except pynvml.NVMLError as err:
            self.close()
            raise GpuBackendUnavailable(
                f"NVML started but could not read this host's GPUs ({err}); check `nvidia-smi` and the "
                "kernel log (`dmesg`) for GPU errors.",
                details={"nvml_error": str(err)},
            ) from err
        except BaseException:
            self.close()
            raise

    def gpus(self) -> list[GpuInfo]:
        return list(self._infos)

    def sample(self) -> list[GpuSample]:
        if self._closed:
            raise GpuBackendUnavailable("the NVML backend is closed")
        return [
            read_gpu_sample(handle, info.index, info.uuid, nvml=self._nvml)
            for handle, info in zip(self._handles, self._infos, strict=True)
        ]

    def close(self) -> None:
        """Shut NVML down; calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        # Shutting down is best effort: a lost GPU must not keep the agent from exiting.
        with contextlib.suppress(pynvml.NVMLError):
            self._nvml.nvmlShutdown()
