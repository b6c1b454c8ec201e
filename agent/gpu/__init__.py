"""GPU backends: where the agent's GPU identity, live readings and GPU events come from.

``open_backend("nvml")`` reads real GPUs through NVML; ``open_backend("replay:FILE")``
replays an NVML recording made on a real host through the same NVML code;
``open_backend("sim:4xRTX4090")`` simulates GPUs for demos and tests. Neither stand-in
is ever used unless the spec asks for it: a host without an NVIDIA driver fails with
``GpuBackendUnavailable``, never silently reports other GPUs. Everything else in the
agent sees only the ``GpuBackend`` protocol (and ``GpuEventSource`` for events).
"""

from __future__ import annotations

from pathlib import Path

from agent.gpu.base import (
    GpuBackend,
    GpuEvent,
    GpuEventSource,
    GpuInfo,
    GpuMigInstance,
    GpuProcess,
    GpuSample,
    poll_events,
)
from agent.gpu.nvmlbackend import NvmlBackend
from agent.gpu.replay import REPLAY_PREFIX, ReplayBackend
from agent.gpu.sim import SIM_MODELS, SIM_PREFIX, SimulatedBackend, parse_sim_items, parse_sim_spec
from shared.errors import ConfigError

__all__ = [
    "SIM_MODELS",
    "GpuBackend",
    "GpuEvent",
    "GpuEventSource",
    "GpuInfo",
    "GpuMigInstance",
    "GpuProcess",
    "GpuSample",
    "NvmlBackend",
    "ReplayBackend",
    "SimulatedBackend",
    "open_backend",
    "parse_sim_items",
    "parse_sim_spec",
    "poll_events",
]


def open_backend(spec: str, *, seed: str = "") -> GpuBackend:
    """Open the GPU backend that ``spec`` names: ``"nvml"``, ``"replay:FILE"`` or ``"sim:..."``.

    ``seed`` (the host's identity) makes simulated GPU UUIDs stable and unique per
    host; the simulated backend requires it, the others ignore it. Raises
    ``ConfigError`` for any other spec or an unusable recording, and
    ``GpuBackendUnavailable`` when NVML cannot start.
    """
    text = spec.strip()
    if text.lower() == "nvml":
        return NvmlBackend()
    if text.lower().startswith(REPLAY_PREFIX):
        path = text[len(REPLAY_PREFIX) :].strip()
        if not path:
            raise ConfigError(
                "the replay GPU backend needs a recording: write it as 'replay:PATH', e.g. "
                "'replay:tests/fixtures/nvml/h100-80gb-hbm3.json'",
                details={"setting": "gpus"},
            )
        return ReplayBackend(Path(path).expanduser())
    if text.lower().startswith(SIM_PREFIX):
        return SimulatedBackend(text, seed=seed)
    raise ConfigError(
        f"unknown GPU backend {spec!r}: use 'nvml' for this host's real NVIDIA GPUs, "
        f"'replay:PATH' to replay an NVML recording, or "
        f"'sim:[COUNTx]MODEL[,...]' (e.g. 'sim:4xRTX4090') to simulate GPUs for a demo; "
        f"simulated models: {', '.join(SIM_MODELS)}",
        details={"setting": "gpus"},
    )
