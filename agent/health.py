"""The agent's health check: are the GPUs the master expects here, answering, and sound?

Run for the master's ``health_check`` command (``agent.runner``) through the host's
``GpuBackend``, so it judges exactly what the agent reports. A GPU fails when

* the backend does not list it (it vanished, or fell off the bus before the agent started);
* it does not answer a sample (the backend raised — NVML's "GPU is lost", for one);
* its memory holds uncorrected errors since the driver loaded (volatile uncorrected ECC > 0);
* it waits for a reset to retire pages or remap rows, or row remapping failed;
* it is hotter than ``max_temperature_c``.

Readings a GPU cannot give (``None``: GeForce cards have no ECC counters) are not
faults. The master reads the verdict from ``healthy``; the command itself succeeds
whenever the check could run. Blocking (NVML calls): run it in a thread. Imports
``agent.gpu`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.gpu.base import GpuBackend, GpuInfo, GpuSample

# Above every current NVIDIA GPU's slowdown temperature and near its shutdown one: a GPU this
# hot is not cooled properly, whatever it runs.
MAX_TEMPERATURE_C = 95.0


@dataclass
class GpuHealth:
    """What the check found on one GPU."""

    uuid: str
    index: int | None = None
    name: str | None = None
    expected: bool = True
    listed: bool = False
    answered: bool = False
    problems: list[str] = field(default_factory=list)
    readings: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "index": self.index,
            "name": self.name,
            "expected": self.expected,
            "listed": self.listed,
            "answered": self.answered,
            "ok": not self.problems,
            "problems": list(self.problems),
            "readings": dict(self.readings),
        }


@dataclass
class HealthReport:
    """The verdict (``healthy``), a one-line ``summary``, and every GPU's findings."""

    gpus: list[GpuHealth]
    problems: list[str] = field(default_factory=list)  # not tied to one GPU (the backend failed)

    @property
    def healthy(self) -> bool:
        return not self.problems and all(not g.problems for g in self.gpus)

    @property
    def summary(self) -> str:
        if self.healthy:
            return f"{len(self.gpus)} GPU(s) healthy"
        found = list(self.problems)
        found += [f"{g.uuid}: {problem}" for g in self.gpus for problem in g.problems]
        return "; ".join(found)

    def to_wire(self) -> dict[str, Any]:
        """The ``data`` of the ``health_check`` command's result."""
        return {
            "healthy": self.healthy,
            "summary": self.summary[:2000],
            "problems": list(self.problems),
            "gpus": [g.to_wire() for g in self.gpus],
        }


def _judge(gpu: GpuHealth, sample: GpuSample, *, max_temperature_c: float) -> None:
    gpu.answered = True
    gpu.readings = {
        "temperature_c": sample.temperature_c,
        "ecc_volatile_uncorrected": sample.ecc_volatile_uncorrected,
        "retired_pages_pending": sample.retired_pages_pending,
        "remapped_rows_pending": sample.remapped_rows_pending,
        "remapped_rows_failure": sample.remapped_rows_failure,
    }
    if sample.ecc_volatile_uncorrected:
        gpu.problems.append(f"{sample.ecc_volatile_uncorrected} uncorrected ECC error(s) since the driver loaded")
    if sample.retired_pages_pending:
        gpu.problems.append("memory pages wait to be retired: the GPU needs a reset")
    if sample.remapped_rows_pending:
        gpu.problems.append("memory rows wait to be remapped: the GPU needs a reset")
    if sample.remapped_rows_failure:
        gpu.problems.append("row remapping failed: the GPU's memory is failing")
    if sample.temperature_c is not None and sample.temperature_c >= max_temperature_c:
        gpu.problems.append(f"temperature {sample.temperature_c:g} °C is at or above {max_temperature_c:g} °C")


def check_health(
    backend: GpuBackend, expected_uuids: Sequence[str], *, max_temperature_c: float = MAX_TEMPERATURE_C
) -> HealthReport:
    """Check every GPU in ``expected_uuids`` and every other GPU ``backend`` lists."""
    report = HealthReport(gpus=[])
    try:
        inventory: list[GpuInfo] = backend.gpus()
    except Exception as exc:  # whatever the backend raises, the answer is "unhealthy", with why
        inventory = []
        report.problems.append(f"the GPU backend could not list the GPUs: {type(exc).__name__}: {exc}")
    found: dict[str, GpuHealth] = {}
    for uuid in expected_uuids:
        found.setdefault(uuid, GpuHealth(uuid=uuid))
    for info in inventory:
        gpu = found.setdefault(info.uuid, GpuHealth(uuid=info.uuid, expected=False))
        gpu.index, gpu.name, gpu.listed = info.index, info.name, True
    samples: dict[str, GpuSample] = {}
    sample_error: str | None = None
    if inventory:
        try:
            samples = {s.uuid: s for s in backend.sample()}
        except Exception as exc:  # NVML's "GPU is lost" and its kin: the GPUs did not answer
            sample_error = f"{type(exc).__name__}: {exc}"
    for gpu in found.values():
        if not gpu.listed:
            gpu.problems.append("missing: the GPU backend does not list this GPU")
        elif sample_error is not None:
            gpu.problems.append(f"did not answer a sample: {sample_error}")
        elif gpu.uuid not in samples:
            gpu.problems.append("did not answer a sample: no reading for this GPU")
        else:
            _judge(gpu, samples[gpu.uuid], max_temperature_c=max_temperature_c)
    report.gpus = sorted(found.values(), key=lambda g: (g.index is None, g.index or 0, g.uuid))
    return report
