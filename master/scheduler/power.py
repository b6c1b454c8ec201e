"""A datacenter's power draw from what is allocated on it: the model ``pwr_fgd`` scores with and the simulator reports.

Pure: no database, no I/O. Every figure and its source is in docs/power.md ("Power-aware placement").

* **A GPU** draws ``idle_w`` when nothing is allocated on it; with anything allocated,
  ``idle_w + active_w + (max_w − idle_w − active_w) · u`` with ``u`` its allocated share (milli-GPU in use / 1000; a
  MIG GPU: the share of its slots taken) — linear up to its board power (TDP) at ``u = 1``, plus a step
  ``active_w`` as soon as a task holds it (a process with a CUDA context moves a GPU out of its idle P-state: measured
  +26 to +66 W on H100, A100 and L40S). ``active_w = 0`` is the plain linear curve idle → TDP.
* **A host's CPUs** draw ``cpu_idle_w`` per vCPU and, in between, up to ``cpu_max_w`` per vCPU in proportion to the
  share of its vCPUs allocated (one CPU family assumed for every host of the trace, which does not name them).
* **Every host is on**: an empty host draws its idle power (nothing is switched off).
* **Off-peak caps** (docs/power.md, "The policy"): with ``idle_cap_factor < 1`` a GPU with nothing allocated draws
  ``idle_w · idle_cap_factor`` — capped idle GPUs; a GPU with anything on it is restored, as the agent does.

``PowerModel.delta_w(node, request)`` is the power a placement adds: what PWR scores.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from master.scheduler.fleet import MILLI, Gpu, Node, Request
from shared.errors import ValidationFailed


@dataclass(frozen=True, slots=True)
class GpuPower:
    """One GPU model's power: ``idle_w`` with nothing allocated, ``max_w`` (board power, TDP) fully allocated."""

    model: str
    idle_w: float
    max_w: float
    active_w: float = 0.0  # the step as soon as anything is allocated

    def __post_init__(self) -> None:
        if not 0 <= self.idle_w <= self.idle_w + self.active_w <= self.max_w or self.active_w < 0:
            raise ValidationFailed(
                f"{self.model}: need 0 <= idle_w, 0 <= active_w and idle_w + active_w <= max_w, not "
                f"{self.idle_w}, {self.active_w} and {self.max_w}"
            )

    @property
    def slope_w(self) -> float:
        """Watts per whole GPU of allocation above the step."""
        return self.max_w - self.idle_w - self.active_w

    def at(self, utilisation: float) -> float:
        """Watts at ``utilisation`` (0..1, the allocated share): idle at 0, else the step plus the linear part."""
        if not 0 <= utilisation <= 1:
            raise ValidationFailed(f"utilisation must be 0..1, not {utilisation}")
        if utilisation == 0:
            return self.idle_w
        return self.idle_w + self.active_w + self.slope_w * utilisation

    def linear(self) -> GpuPower:
        """The same board without the step: linear from idle to ``max_w``."""
        return replace(self, active_w=0.0)


@dataclass(frozen=True, slots=True)
class CpuPower:
    """Per vCPU: ``idle_w`` with none allocated, ``max_w`` allocated (the host's share of its sockets' power)."""

    idle_w: float
    max_w: float

    def __post_init__(self) -> None:
        if not 0 <= self.idle_w <= self.max_w:
            raise ValidationFailed(f"CPU: need 0 <= idle_w <= max_w, not {self.idle_w} and {self.max_w}")


# Sources in docs/power.md. V100 and P100: board power from NVIDIA's datasheets (V100 SXM2 300 W; P100 PCIe
# 250 W), idle from nvidia-smi readings of idle V100-PCIE-16GB (27.3 W) and P100-PCIE-16GB (28.5 W). T4 70 W and
# A10 150 W: NVIDIA's datasheets; their idle: typical nvidia-smi P8 readings (assumed, as in agent/gpu/sim.py).
# G2 and G3 are Alibaba's undisclosed codes: assumed a V100-class (G2) and an A100-SXM4-class (G3, 400 W) board.
# The step: 10 % of the board power for every model (assumed; measured steps are 7–19 % of TDP, arXiv 2605.23918).
ACTIVE_FRACTION = 0.10
TRACE_GPUS: Mapping[str, GpuPower] = MappingProxyType({
    model: GpuPower(model, idle, tdp, round(ACTIVE_FRACTION * tdp, 4))
    for model, idle, tdp in (
        ("V100M16", 27.3, 300.0),
        ("V100M32", 27.3, 300.0),
        ("P100", 28.5, 250.0),
        ("T4", 10.0, 70.0),
        ("A10", 18.0, 150.0),
        ("G2", 27.3, 300.0),
        ("G3", 55.0, 400.0),
    )
})  # fmt: skip
# Intel Xeon Platinum 8160 class (Skylake-SP, 24 cores, 48 threads, 150 W TDP per socket, Intel ARK): 3.125 W per
# vCPU at full load; idle taken as 30 % of it (assumed: a server's idle CPU draw is commonly a quarter to a third of
# its full load).
TRACE_CPU = CpuPower(idle_w=round(0.3 * 150.0 / 48, 4), max_w=round(150.0 / 48, 4))
# A GPU model missing from the table (none in the trace): the V100-class figures.
FALLBACK_GPU = GpuPower("unknown", 27.3, 300.0, ACTIVE_FRACTION * 300.0)
# Off-peak caps: an idle GPU lowered to 60 % of its default limit draws 0.7 + 0.3 × 0.6 = 0.88 of its idle power —
# the simulated backend's stated assumption (docs/power.md, "What the simulated and replay backends model").
OFF_PEAK_IDLE_FACTOR = 0.7 + 0.3 * 0.6


@dataclass(frozen=True, slots=True)
class PowerModel:
    """Per GPU model its power curve, the CPUs' per vCPU, and the factor on idle GPUs (1: not capped)."""

    gpus: Mapping[str, GpuPower] = field(default_factory=lambda: TRACE_GPUS)
    cpu: CpuPower = TRACE_CPU
    fallback: GpuPower = FALLBACK_GPU
    idle_cap_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.idle_cap_factor <= 1:
            raise ValidationFailed(f"idle_cap_factor must be in (0, 1], not {self.idle_cap_factor}")

    def capped(self, factor: float = OFF_PEAK_IDLE_FACTOR) -> PowerModel:
        """The same model with idle GPUs capped: each draws ``factor`` of its idle power."""
        return replace(self, idle_cap_factor=factor)

    def linear(self) -> PowerModel:
        """The same model without the step: every GPU linear from idle to its board power."""
        gpus = MappingProxyType({model: gpu.linear() for model, gpu in self.gpus.items()})
        return replace(self, gpus=gpus, fallback=self.fallback.linear())

    def gpu(self, model: str) -> GpuPower:
        return self.gpus.get(model, self.fallback)

    def gpu_w(self, model: str, gpu: Gpu) -> float:
        """One GPU's watts from its allocation."""
        curve = self.gpu(model)
        if gpu.mig is not None:
            taken = sum(1 for slot in gpu.mig if not slot.free)
            used = taken / len(gpu.mig) if gpu.mig else 0.0
        else:
            used = (MILLI - gpu.milli_free) / MILLI
        if used == 0:
            return curve.idle_w * self.idle_cap_factor
        return curve.at(used)

    def cpu_w(self, node: Node) -> float:
        """The host's CPUs' watts: idle for every vCPU, plus the dynamic part of the allocated ones."""
        dynamic = self.cpu.max_w - self.cpu.idle_w
        return (self.cpu.idle_w * node.cpu_milli + dynamic * (node.cpu_milli - node.cpu_milli_free)) / 1000

    def node_w(self, node: Node) -> float:
        """The host's watts: its GPUs' and its CPUs'."""
        return sum(self.gpu_w(node.model, gpu) for gpu in node.gpus) + self.cpu_w(node)

    def fleet_w(self, nodes: Iterable[Node]) -> float:
        return sum(self.node_w(node) for node in nodes)

    def delta_w(self, node: Node, request: Request, free_values: Iterable[int] = ()) -> float:
        """The watts placing ``request`` on ``node`` adds: its vCPUs at the CPUs' slope, its GPU share at the node
        model's, and the step (and, capped, the idle GPU's cap undone) for each GPU it takes that was idle.

        ``free_values`` are the free milli of the GPUs it takes, before (default: whole GPUs take idle ones, a
        share an idle GPU only if the node has no partly used GPU it fits on — the best fit)."""
        cpu = (self.cpu.max_w - self.cpu.idle_w) * request.cpu_milli / 1000
        if request.num_gpu == 0 or request.mig_profile is not None:
            return cpu  # a MIG slice's share of its GPU is not known here; MIG placements keep their own rule
        curve = self.gpu(node.model)
        taken = list(free_values)
        if not taken:
            if request.gpu_milli >= MILLI:
                taken = [MILLI] * request.num_gpu
            else:
                fitting = sorted(free for free in node.free_desc if free >= request.gpu_milli)
                taken = fitting[: request.num_gpu] or [MILLI] * request.num_gpu
        woken = sum(1 for free in taken if free == MILLI)
        wake = curve.active_w + curve.idle_w * (1 - self.idle_cap_factor)
        return cpu + curve.slope_w * request.gpu_milli_total / MILLI + wake * woken


TRACE_POWER = PowerModel()

__all__ = [
    "ACTIVE_FRACTION", "FALLBACK_GPU", "OFF_PEAK_IDLE_FACTOR", "TRACE_CPU", "TRACE_GPUS", "TRACE_POWER", "CpuPower", "GpuPower",
    "PowerModel",
]  # fmt: skip
