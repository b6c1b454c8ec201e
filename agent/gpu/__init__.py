"""GPU backends: where the agent's GPU identity and live readings come from.

``open_backend("nvml")`` reads real GPUs through NVML; ``open_backend("sim:4xRTX4090")``
simulates GPUs for demos and tests. The simulation is used only when the spec asks
for it: a host without an NVIDIA driver fails with ``GpuBackendUnavailable``, never
silently reports simulated GPUs. Everything else in the agent sees only the
``GpuBackend`` protocol.
"""

from __future__ import annotations

from agent.gpu.base import GpuBackend, GpuInfo, GpuProcess, GpuSample
from agent.gpu.nvml import NvmlBackend
from agent.gpu.sim import SIM_MODELS, SIM_PREFIX, SimulatedBackend, parse_sim_spec
from shared.errors import ConfigError

__all__ = [
    "SIM_MODELS",
    "GpuBackend",
    "GpuInfo",
    "GpuProcess",
    "GpuSample",
    "NvmlBackend",
    "SimulatedBackend",
    "open_backend",
    "parse_sim_spec",
]


def open_backend(spec: str, *, seed: str = "") -> GpuBackend:
    """Open the GPU backend that ``spec`` names: ``"nvml"`` or ``"sim:..."``.

    ``seed`` (the host's identity) makes simulated GPU UUIDs stable and unique per
    host; the simulated backend requires it, NVML ignores it. Raises ``ConfigError``
    for any other spec and ``GpuBackendUnavailable`` when NVML cannot start.
    """
    text = spec.strip()
    if text.lower() == "nvml":
        return NvmlBackend()
    if text.lower().startswith(SIM_PREFIX):
        return SimulatedBackend(text, seed=seed)
    raise ConfigError(
        f"unknown GPU backend {spec!r}: use 'nvml' for this host's real NVIDIA GPUs, or "
        f"'sim:[COUNTx]MODEL[,...]' (e.g. 'sim:4xRTX4090') to simulate GPUs for a demo; "
        f"simulated models: {', '.join(SIM_MODELS)}",
        details={"setting": "gpus"},
    )
