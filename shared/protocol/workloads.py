"""What a rental runs, on the wire: the rental id and its GPUs, the workload specs (``container``, ``process``,
``hold``), the ceilings a workload may name and their bounds, and a fractional ``GpuShare``. The commands that carry
them (``StartWorkload`` and the rest) are in ``shared.protocol.commands``.

Each check runs before pydantic's own (``BeforeValidator``) so that a refusal says what to write instead; the
``Field`` bounds are what the OpenAPI document shows.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, SerializerFunctionWrapHandler, model_serializer

from shared.imageref import IMAGE_HINT, MAX_REFERENCE_CHARS, parse_image_reference
from shared.protocol.base import StrictModel

RENTAL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # a folder, a cgroup, a unit and a container name
MILLI_PER_GPU = 1000  # a share's compute is counted in thousandths of one GPU
MIN_CPU_CORES = 0.01  # cpu.max refuses a quota under 1 ms per 100 ms period
MAX_CPU_CORES = 1024.0
MIN_MEMORY_MIB = 16  # less cannot even start a shell
MAX_MEMORY_MIB = 1 << 24  # 16 TiB
MAX_ARGV_BYTES = 128 << 10
MAX_ENV_VARS = 256
MAX_PORTS = 32  # ports one container workload may declare
MIN_SHM_MIB = 1
MAX_SHM_MIB = 1 << 20  # 1 TiB of /dev/shm
MIN_PIDS = 16  # a shell and a few children
MAX_PIDS = 1 << 22  # the kernel's own most (pid_max on 64-bit Linux); a host allows a rental its share of its pid_max
MIN_DISK_GIB = 1
MAX_DISK_GIB = 1 << 16  # 64 TiB
RESERVED_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"})  # and every GPUMARKET_* name
SHARE_ENV = frozenset({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"})

_RENTAL_ID_RE = re.compile(RENTAL_ID_PATTERN)
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def is_number(value: object) -> bool:
    """A finite int or float, not a bool (what a bound on a number accepts)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _rental_id(value: object) -> object:
    if not isinstance(value, str) or not _RENTAL_ID_RE.fullmatch(value):
        raise ValueError(f"rental id {value!r:.80} must be 1-64 letters, digits, '.', '_' or '-'")
    return value


def _gpu_uuids(value: object) -> object:
    if not isinstance(value, list) or not all(isinstance(u, str) for u in value):
        raise ValueError("gpu_uuids must be a list of GPU UUIDs")
    return value


def _argv(value: object) -> object:
    if not isinstance(value, list) or not value or not all(isinstance(a, str) and "\0" not in a for a in value):
        raise ValueError("a process workload needs 'argv', a non-empty list of strings")
    if sum(len(a.encode(errors="surrogatepass")) + 1 for a in value) > MAX_ARGV_BYTES:
        raise ValueError(f"'argv' is longer than {MAX_ARGV_BYTES} bytes; put the long part in a file")
    return value


def _env(value: object) -> object:
    if not isinstance(value, dict):
        raise ValueError("'env' must be an object of NAME: value")
    if len(value) > MAX_ENV_VARS:
        raise ValueError(f"'env' has more than {MAX_ENV_VARS} variables")
    for name, text in value.items():
        if not isinstance(name, str) or not _ENV_NAME_RE.fullmatch(name):
            raise ValueError(f"environment variable name {name!r:.80} is not a valid NAME")
        if name in RESERVED_ENV or name.startswith("GPUMARKET_"):
            raise ValueError(f"'env' may not set {name}: the agent sets it to the rental's GPUs")
        if not isinstance(text, str) or "\0" in text:
            raise ValueError(f"environment variable {name} must be a string")
    return value


def _image(value: object) -> object:
    parse_image_reference(value)  # type: ignore[arg-type]  # raises ValueError with the grammar
    return value


def _words(what: str) -> Any:
    def check(value: object) -> object:
        if value is None:
            return value
        if not isinstance(value, list) or not all(isinstance(a, str) and "\0" not in a for a in value):
            raise ValueError(f"'{what}' must be a list of strings")
        if sum(len(a.encode(errors="surrogatepass")) + 1 for a in value) > MAX_ARGV_BYTES:
            raise ValueError(f"'{what}' is longer than {MAX_ARGV_BYTES} bytes; put the long part in a file")
        return value

    return check


def _ports(value: object) -> object:
    if not isinstance(value, list):
        raise ValueError("'ports' must be a list of TCP port numbers, e.g. [8888]")
    for port in value:
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"port {port!r:.40} is out of range: each port is a whole number from 1 to 65535")
    if len(set(value)) != len(value):
        raise ValueError("'ports' names a port twice")
    if len(value) > MAX_PORTS:
        raise ValueError(f"'ports' declares more than {MAX_PORTS} ports")
    return value


def _bounded_int(what: str, low: int, high: int, example: int) -> Any:
    def check(value: object) -> object:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
            raise ValueError(f"'{what}' must be a whole number from {low} to {high}, e.g. {example}")
        return value

    return check


def _cpu_cores(value: object) -> object:
    if value is not None and not (is_number(value) and MIN_CPU_CORES <= value <= MAX_CPU_CORES):  # type: ignore[operator]
        raise ValueError(f"'cpu_cores' must be a number of cores from {MIN_CPU_CORES} to {MAX_CPU_CORES:g}, e.g. 2.0")
    return value


def _memory_mib(value: object) -> object:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not MIN_MEMORY_MIB <= value <= MAX_MEMORY_MIB):
        raise ValueError(f"'memory_mib' must be a whole number of MiB from {MIN_MEMORY_MIB} to {MAX_MEMORY_MIB}, e.g. 4096")
    return value


def _share_milli(value: object) -> object:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < MILLI_PER_GPU:
        raise ValueError(
            f"'share.milli' must be a whole number of thousandths of a GPU from 1 to {MILLI_PER_GPU - 1}, e.g. 250; "
            "for a whole GPU send no 'share'"
        )
    return value


def _share_memory(value: object) -> object:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_MEMORY_MIB:
        raise ValueError(f"'share.memory_mib' must be a whole number of MiB from 0 (no limit) to {MAX_MEMORY_MIB}, e.g. 8192")
    return value


RentalId = Annotated[str, Field(pattern=RENTAL_ID_PATTERN), BeforeValidator(_rental_id)]
GpuUuid = Annotated[str, Field(min_length=1, max_length=128)]
GpuUuids = Annotated[list[GpuUuid], BeforeValidator(_gpu_uuids)]
Argv = Annotated[list[str], Field(min_length=1, max_length=256, description="Program and arguments, run with the rented GPUs visible."), BeforeValidator(_argv)]
Env = Annotated[dict[str, str], Field(max_length=MAX_ENV_VARS), BeforeValidator(_env)]
CpuCores = Annotated[float, Field(ge=MIN_CPU_CORES, le=MAX_CPU_CORES), BeforeValidator(_cpu_cores)]
MemoryMib = Annotated[int, Field(ge=MIN_MEMORY_MIB, le=MAX_MEMORY_MIB), BeforeValidator(_memory_mib)]
PidsLimit = Annotated[int, Field(ge=MIN_PIDS, le=MAX_PIDS), BeforeValidator(_bounded_int("pids_limit", MIN_PIDS, MAX_PIDS, 4096))]
DiskGib = Annotated[int, Field(ge=MIN_DISK_GIB, le=MAX_DISK_GIB), BeforeValidator(_bounded_int("disk_gib", MIN_DISK_GIB, MAX_DISK_GIB, 50))]


class ProcessWorkload(StrictModel):
    """Run ``argv`` on the host with the rented GPUs visible, within CPU, memory, pids and disk ceilings
    (each, unless named, the rental's share of the host)."""

    kind: Literal["process"] = "process"
    argv: Argv
    env: Env = Field(default_factory=dict)
    cpu_cores: CpuCores | None = Field(None, description="CPU cores the workload may use (a cgroup quota), e.g. 2.0; none: the rental's share of the host.")
    memory_mib: MemoryMib | None = Field(None, description="Memory the workload may use, MiB; none: the rental's share of the host.")
    pids_limit: PidsLimit | None = Field(None, description="Most processes and threads at once; none: the rental's share of the host's pid_max.")
    disk_gib: DiskGib | None = Field(None, description="Size of the rental's home, GiB (a quota); none: the host's default.")

    @model_serializer(mode="wrap")
    def _omit_unset_limits(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # No limit is no key: the stored and sent form of a workload that names none stays {kind, argv, env}.
        data: dict[str, Any] = handler(self)
        for name in ("cpu_cores", "memory_mib", "pids_limit", "disk_gib"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


Image = Annotated[
    str, Field(min_length=1, max_length=MAX_REFERENCE_CHARS, description=f"The image to run: {IMAGE_HINT}."), BeforeValidator(_image)
]
Words = Annotated[list[str], Field(max_length=256)]


class ContainerWorkload(StrictModel):
    """Run ``image`` in a container of the rental's own: its GPUs only, every capability dropped,
    a non-root user unless the image names one, one volume at ``/workspace``, a network of its own.

    ``command`` replaces the image's entrypoint and ``args`` its default arguments (as in
    Kubernetes); absent, the image's own run. ``ports`` are the TCP ports the workload serves
    (reached through the relays, never published on the provider's host).
    """

    kind: Literal["container"] = "container"
    image: Image
    command: Annotated[Words, BeforeValidator(_words("command"))] | None = Field(
        None, description="Replaces the image's ENTRYPOINT, e.g. [\"python\", \"-m\", \"http.server\"]; none: the image's own."
    )
    args: Annotated[Words, BeforeValidator(_words("args"))] | None = Field(
        None, description="Replaces the image's CMD (the entrypoint's arguments); none: the image's own."
    )
    env: Env = Field(default_factory=dict)
    ports: Annotated[list[Annotated[int, Field(ge=1, le=65535)]], Field(max_length=MAX_PORTS), BeforeValidator(_ports)] = Field(
        default_factory=list, description="TCP ports the workload serves, e.g. [8888]."
    )
    shm_mib: Annotated[int, Field(ge=MIN_SHM_MIB, le=MAX_SHM_MIB), BeforeValidator(_bounded_int("shm_mib", MIN_SHM_MIB, MAX_SHM_MIB, 1024))] | None = Field(
        None, description="Size of /dev/shm, MiB (PyTorch data loaders want several GiB); none: the agent's default."
    )
    cpu_cores: CpuCores | None = Field(None, description="CPU cores the container may use, e.g. 8.0; none: the rental's share of the host.")
    memory_mib: MemoryMib | None = Field(None, description="Memory the container may use, MiB; none: the rental's share of the host.")
    pids_limit: PidsLimit | None = Field(None, description="Most processes and threads at once; none: the rental's share of the host's pid_max.")
    disk_gib: DiskGib | None = Field(None, description="Size of /workspace and of the writable layer, GiB (a quota each); none: the host's default.")

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in ("command", "args", "shm_mib", "cpu_cores", "memory_mib", "pids_limit", "disk_gib"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


class HoldWorkload(StrictModel):
    """Reserve the GPUs and run nothing."""

    kind: Literal["hold"] = "hold"


WorkloadSpec = Annotated[ContainerWorkload | ProcessWorkload | HoldWorkload, Field(discriminator="kind")]
"""What a rental runs, tagged by ``kind``: ``container`` (an image), ``process`` (on the host, under a uid of
its own) or ``hold`` (GPUs reserved, nothing run)."""
WORKLOAD_KINDS = ("container", "process", "hold")


class GpuShare(StrictModel):
    """A fractional share of one GPU: ``milli`` thousandths of its compute and ``memory_mib`` of
    its memory (``0``: no memory limit of its own)."""

    milli: Annotated[int, Field(ge=1, le=MILLI_PER_GPU - 1), BeforeValidator(_share_milli)]
    memory_mib: Annotated[int, Field(ge=0, le=MAX_MEMORY_MIB), BeforeValidator(_share_memory)]
