"""Facts about the provider's host besides its GPUs: OS, CPU, memory and disk.

Read when the agent starts (and again on demand); the master shows them to renters
and uses RAM and disk to decide what a host can run. The standard library suffices
for everything here (the agent runs on Linux), so no psutil is needed.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shlex
import shutil
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIB = 1024**2
GIB = 1024**3

# Where systemd's os-release(5) says to look, in order.
OS_RELEASE_PATHS = (Path("/etc/os-release"), Path("/usr/lib/os-release"))
CPUINFO_PATH = Path("/proc/cpuinfo")
# Both files are a few KiB; refuse to read more than this from them.
_MAX_FACT_FILE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class HostFacts:
    hostname: str
    os_name: str  # "Linux"
    os_release: str | None  # "Ubuntu 22.04.4 LTS": PRETTY_NAME from os-release, when present
    kernel: str  # "6.5.0-35-generic"
    arch: str  # "x86_64"
    cpu_model: str | None  # "AMD EPYC 7763 64-Core Processor"
    cpu_count: int  # logical CPUs
    ram_total_mib: int
    disk_total_gib: float  # of the filesystem holding the workload directory
    disk_free_gib: float
    python_version: str
    agent_version: str

    def to_wire(self) -> dict[str, Any]:
        """A JSON-ready dict whose keys are exactly this class's fields."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


def parse_os_release(text: str) -> dict[str, str]:
    """The ``KEY=value`` pairs of an os-release file, values unquoted."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, raw_value = line.partition("=")
        try:
            words = shlex.split(raw_value)
        except ValueError:  # unbalanced quotes: keep the raw text
            words = [raw_value]
        fields[key.strip()] = " ".join(words)
    return fields


def parse_cpu_model(cpuinfo: str) -> str | None:
    """The CPU model name from ``/proc/cpuinfo`` text (x86 "model name", some ARM "Model")."""
    for wanted in ("model name", "Model", "Hardware"):
        for line in cpuinfo.splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == wanted and value.strip():
                return value.strip()
    return None


def _read_small_text(path: Path) -> str | None:
    try:
        with path.open("r", encoding="utf-8", errors="replace") as file:
            return file.read(_MAX_FACT_FILE_BYTES)
    except OSError:
        return None


def _os_pretty_name(paths: Sequence[Path]) -> str | None:
    for path in paths:
        text = _read_small_text(path)
        if text is None:
            continue
        fields = parse_os_release(text)
        name = fields.get("PRETTY_NAME") or " ".join(
            part for part in (fields.get("NAME"), fields.get("VERSION")) if part
        )
        return name or None
    return None


def _ram_total_bytes() -> int:
    # POSIX names for physical memory, on Linux and macOS alike.
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _existing_ancestor(path: Path) -> Path:
    # The workload directory may not exist yet on a fresh install; measure the
    # filesystem it will be created on.
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def collect_host_facts(
    *,
    workload_dir: Path,
    agent_version: str,
    os_release_paths: Sequence[Path] = OS_RELEASE_PATHS,
    cpuinfo_path: Path = CPUINFO_PATH,
) -> HostFacts:
    """Read this host's facts; disk figures are for the filesystem holding ``workload_dir``."""
    uname = platform.uname()
    cpuinfo = _read_small_text(cpuinfo_path)
    cpu_model = (parse_cpu_model(cpuinfo) if cpuinfo else None) or uname.processor or None
    disk = shutil.disk_usage(_existing_ancestor(workload_dir))
    return HostFacts(
        hostname=socket.gethostname(),
        os_name=uname.system,
        os_release=_os_pretty_name(os_release_paths),
        kernel=uname.release,
        arch=uname.machine,
        cpu_model=cpu_model,
        cpu_count=os.cpu_count() or 1,
        ram_total_mib=_ram_total_bytes() // MIB,
        disk_total_gib=round(disk.total / GIB, 1),
        disk_free_gib=round(disk.free / GIB, 1),
        python_version=platform.python_version(),
        agent_version=agent_version,
    )
