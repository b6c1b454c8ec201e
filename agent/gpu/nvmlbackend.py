"""``NvmlBackend``: every GPU NVML sees on this host, read with ``agent.gpu.nvml``'s collection functions; and what
the agent says, with how to fix it, when NVML cannot start (no driver, driver not loaded, no permission)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pynvml

from agent.gpu.base import GpuEvent, GpuInfo, GpuSample, default_power_limit
from agent.gpu.nvml import (
    NvmlApi,
    handle_key,
    nvml_call,
    open_event_set,
    read_driver_versions,
    read_events,
    read_gpu_info,
    read_gpu_sample,
    set_power_limit,
)
from shared.clock import utcnow
from shared.errors import GpuBackendUnavailable, PowerLimitError

log = logging.getLogger(__name__)

_NO_DRIVER_HINT = (
    "Install the NVIDIA driver (on Ubuntu: `sudo ubuntu-drivers install`; otherwise the "
    "driver for your GPU from https://www.nvidia.com/Download/index.aspx or your "
    "distribution's packages), reboot, check that `nvidia-smi` lists your GPUs, then start "
    "the agent again. To demo the agent on a machine without NVIDIA GPUs, choose simulated "
    "GPUs explicitly with `--gpus sim:4xRTX4090`; a real provider host must never use them."
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
    simulated GPUs. Watches every GPU that supports them for XID and ECC events;
    ``poll_events()`` hands them over (stamped with ``clock()``), at most
    ``max_events_per_poll`` per call.
    """

    name: str = "nvml"

    def __init__(
        self,
        *,
        nvml: NvmlApi = pynvml,
        clock: Callable[[], datetime] = utcnow,
        max_events_per_poll: int = 256,
    ) -> None:
        if max_events_per_poll < 1:
            raise ValueError("max_events_per_poll must be at least 1")
        self._nvml = nvml
        self._clock = clock
        self._max_events_per_poll = max_events_per_poll
        self._event_set: Any = None
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
        self._uuid_by_handle = {
            handle_key(handle): info.uuid for handle, info in zip(self._handles, self._infos, strict=True)
        }
        try:
            self._event_set = open_event_set(nvml, self._handles)
        except pynvml.NVMLError as err:
            # Events are worth having, not worth refusing to report the GPUs over.
            log.warning("cannot watch the GPUs for XID and ECC events (NVML: %s)", err)

    def gpus(self) -> list[GpuInfo]:
        return list(self._infos)

    def sample(self) -> list[GpuSample]:
        if self._closed:
            raise GpuBackendUnavailable("the NVML backend is closed")
        # The limit in force is the one read at start-up or set since (no extra NVML call per pass; a limit
        # changed behind the agent's back, with nvidia-smi, shows after a restart).
        return [
            dataclasses.replace(read_gpu_sample(handle, info.index, info.uuid, nvml=self._nvml), power_limit_w=info.power_limit_w)
            for handle, info in zip(self._handles, self._infos, strict=True)
        ]

    def set_power_limit(self, index: int, watts: float) -> float:
        """Set GPU ``index``'s limit through NVML (needs root on real drivers: refused with
        ``power_limit_no_permission`` otherwise, and nothing changes)."""
        if self._closed:
            raise GpuBackendUnavailable("the NVML backend is closed")
        if not 0 <= index < len(self._infos):
            raise PowerLimitError(f"no GPU at index {index}", code="gpu_not_found")
        limit = set_power_limit(self._handles[index], self._infos[index], watts, nvml=self._nvml)
        self._infos[index] = dataclasses.replace(self._infos[index], power_limit_w=limit)
        return limit

    def restore_power_limit(self, index: int) -> float:
        if not 0 <= index < len(self._infos):
            raise PowerLimitError(f"no GPU at index {index}", code="gpu_not_found")
        return self.set_power_limit(index, default_power_limit(self._infos[index]))

    def poll_events(self) -> list[GpuEvent]:
        """XID and ECC events NVML queued since the last call; never blocks."""
        if self._closed or self._event_set is None:
            return []
        return read_events(
            self._nvml,
            self._event_set,
            self._uuid_by_handle,
            now=self._clock(),
            max_events=self._max_events_per_poll,
        )

    def close(self) -> None:
        """Free the event set and shut NVML down; calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        # Shutting down is best effort: a lost GPU must not keep the agent from exiting.
        if self._event_set is not None:
            with contextlib.suppress(pynvml.NVMLError):
                nvml_call(self._nvml, "nvmlEventSetFree", self._event_set)
            self._event_set = None
        with contextlib.suppress(pynvml.NVMLError):
            self._nvml.nvmlShutdown()
