"""CPU, memory and pids limits through cgroups: detecting what the host allows, and one limiter per way.

``detect_cgroup_support`` picks, in order of preference, cgroup v2, cgroup v1, transient
systemd scopes, or nothing (saying why); ``cgroup_limiter`` returns the matching
``CgroupLimiter`` — ``CgroupFsLimiter``, ``SystemdScopeLimiter`` or ``NoCgroupLimiter`` —
which gives each workload a cgroup of its own with its ``ResourceLimits``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, NamedTuple, Protocol

from shared.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_SLICE: Final = "gpumarket.slice"
MIB: Final = 1 << 20
_CPU_PERIOD_US: Final = 100_000
_SLICE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True, slots=True)
class ResourceLimits:
    """CPU, memory and processes (``pids``: tasks, threads included) a workload may use; ``None`` is unlimited."""

    cpu_cores: float | None = None
    memory_mib: int | None = None
    pids: int | None = None

    @property
    def requested(self) -> bool:
        return self.cpu_cores is not None or self.memory_mib is not None or self.pids is not None

    @property
    def cpu_quota_us(self) -> int | None:
        """CPU time per ``100 ms`` period, the unit of ``cpu.max`` and ``cpu.cfs_quota_us``."""
        return None if self.cpu_cores is None else max(1000, round(self.cpu_cores * _CPU_PERIOD_US))

    @property
    def memory_bytes(self) -> int | None:
        return None if self.memory_mib is None else self.memory_mib * MIB



CgroupMode = Literal["cgroup2", "cgroup1", "systemd", "none"]


@dataclass(frozen=True, slots=True)
class CgroupSupport:
    """How this host lets the agent limit a workload's CPU and memory, decided at start-up.

    ``slices``: where rental cgroups go — one folder for cgroup2, the cpu and the memory
    folder for cgroup1, and its pids folder where that hierarchy is mounted. ``reason`` is for people: what was chosen, or why nothing could be.
    """

    mode: CgroupMode
    reason: str
    slices: tuple[Path, ...] = ()
    systemd_run: str | None = None
    systemd_scope: Literal["system", "user"] | None = None

    @property
    def available(self) -> bool:
        return self.mode != "none"


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one workload's processes go: cgroup folders the pid is written to before the
    program runs, or a command prefix (``systemd-run --scope … --``) that places itself.
    ``error`` says why the limits could not be applied (then nothing is placed)."""

    cgroup_dirs: tuple[Path, ...] = ()
    argv_prefix: tuple[str, ...] = ()
    unit: str | None = None
    error: str | None = None

    @property
    def placed(self) -> bool:
        return bool(self.cgroup_dirs or self.argv_prefix)


class CgroupLimiter(Protocol):
    """Gives each workload a cgroup of its own with its CPU and memory limits."""

    @property
    def support(self) -> CgroupSupport: ...

    def create(self, rental_id: str, limits: ResourceLimits) -> Placement:
        """Make the rental's cgroup with its limits; a failure comes back in ``Placement.error``."""
        ...

    def attach(self, placement: Placement, pid: int) -> None:
        """Move ``pid`` into the placement's cgroup; raises ``OSError``."""
        ...

    def close(self) -> None:
        """Remove what ``create`` made that no workload uses any more."""
        ...


class _Mount(NamedTuple):
    mount_point: Path
    root: str  # the mount's root inside its hierarchy
    fstype: str  # "cgroup" or "cgroup2"
    options: frozenset[str]  # super options: the v1 controllers


def _unescape(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def _cgroup_mounts(mountinfo: str) -> list[_Mount]:
    mounts = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if sep and len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            mounts.append(_Mount(Path(_unescape(fields[4])), _unescape(fields[3]), tail[0], frozenset(tail[2].split(","))))
    return mounts


def _own_cgroups(text: str) -> dict[str, str]:
    """The agent's cgroup per v1 controller, and per ``""`` its cgroup2 path."""
    own: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                own[controller] = parts[2]
    return own


def _visible_dir(mount: _Mount, own_path: str | None) -> Path | None:
    if own_path is None:
        return None
    root = mount.root.rstrip("/")
    if own_path != mount.root and not own_path.startswith(root + "/"):
        return None
    relative = own_path[len(root) :].strip("/")
    return mount.mount_point / relative if relative else mount.mount_point


def _cgroup2_parent_problem(parent: Path) -> str | None:
    try:
        offered = set((parent / "cgroup.controllers").read_text().split())
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
        is_root = not (parent / "cgroup.type").exists()  # only the real root has no cgroup.type
        busy = not is_root and bool((parent / "cgroup.procs").read_text().strip())
    except OSError as exc:
        return f"cannot read cgroup v2 at {parent}: {exc.strerror or exc}"
    missing = sorted({"cpu", "memory"} - offered)
    if missing:
        return f"cgroup v2 at {parent} does not offer {' and '.join(missing)} (bound to cgroup v1, or not delegated to the agent)"
    if not os.access(parent, os.W_OK):
        return f"cgroup v2 at {parent} is not writable by uid {os.geteuid()}"
    if busy and {"cpu", "memory"} - enabled:
        # cgroup2 lets a non-root cgroup hand controllers down only when it holds no process itself.
        return f"cgroup v2 at {parent} holds processes, so it cannot hand cpu and memory to sub-cgroups (run the agent in a leaf cgroup, e.g. systemd DelegateSubgroup=)"
    return None


def _detect_cgroup2(mounts: list[_Mount], own: dict[str, str], slice_name: str, reasons: list[str]) -> CgroupSupport | None:
    unified = next((m for m in mounts if m.fstype == "cgroup2"), None)
    if unified is None:
        reasons.append("no cgroup2 filesystem is mounted")
        return None
    # The hierarchy's root as the agent sees it (the host's root, or a container's own cgroup
    # under a cgroup namespace) keeps workloads out of the agent's service cgroup, so a
    # restart of the agent's unit does not kill them; else the agent's own, if delegated.
    own_dir = _visible_dir(unified, own.get(""))
    for parent in dict.fromkeys(p for p in (unified.mount_point, own_dir) if p is not None):
        problem = _cgroup2_parent_problem(parent)
        if problem is None:
            slice_dir = parent / slice_name
            return CgroupSupport("cgroup2", f"cgroup v2: a cgroup per workload under {slice_dir} (cpu.max, memory.max, pids.max)", slices=(slice_dir,))
        reasons.append(problem)
    return None


def _detect_cgroup1(mounts: list[_Mount], own: dict[str, str], slice_name: str, reasons: list[str]) -> CgroupSupport | None:
    # cgroup1 has no "no internal processes" rule, so rental cgroups nest under the agent's
    # own: they stay inside whatever limits the operator put on the agent (or its container).
    slices = []
    for controller in ("cpu", "memory"):
        mount = next((m for m in mounts if m.fstype == "cgroup" and controller in m.options), None)
        if mount is None:
            reasons.append(f"no cgroup v1 {controller} hierarchy is mounted")
            return None
        own_dir = _visible_dir(mount, own.get(controller))
        if own_dir is None:
            reasons.append(f"the agent's cgroup v1 {controller} group is not visible under {mount.mount_point}")
            return None
        if not os.access(own_dir, os.W_OK):
            reasons.append(f"cgroup v1 {controller} group {own_dir} is not writable by uid {os.geteuid()}")
            return None
        slices.append(own_dir / slice_name)
    pids = next((m for m in mounts if m.fstype == "cgroup" and "pids" in m.options), None)
    pids_dir = None if pids is None else _visible_dir(pids, own.get("pids"))
    pids_note = " (no pids hierarchy: processes unlimited)"
    if pids_dir is not None and os.access(pids_dir, os.W_OK):
        slices.append(pids_dir / slice_name)
        pids_note = f" and {slices[2]} (pids.max)"
    return CgroupSupport(
        "cgroup1",
        f"cgroup v1: a cgroup per workload under {slices[0]} (cpu.cfs_quota_us), {slices[1]} (memory.limit_in_bytes){pids_note}",
        slices=tuple(slices),
    )


def _detect_systemd(probe_timeout: float, reasons: list[str]) -> CgroupSupport | None:
    systemd_run = shutil.which("systemd-run")
    if not Path("/run/systemd/system").is_dir():
        reasons.append("systemd is not running (no /run/systemd/system), so systemd-run cannot make scopes")
        return None
    if systemd_run is None:
        reasons.append("systemd-run is not installed")
        return None
    scope: Literal["system", "user"] = "system" if os.geteuid() == 0 else "user"
    try:
        probe = subprocess.run(
            [systemd_run, f"--{scope}", "--scope", "--quiet", "--collect", "--", "true"],
            stdin=subprocess.DEVNULL, capture_output=True, timeout=probe_timeout, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        reasons.append(f"systemd-run --{scope} --scope does not work: {exc}")
        return None
    if probe.returncode != 0:
        reasons.append(f"systemd-run --{scope} --scope failed: {probe.stderr.decode(errors='replace').strip()[:300]}")
        return None
    return CgroupSupport(
        "systemd", f"systemd-run --{scope} --scope with CPUQuota= and MemoryMax= (the cgroup filesystem is not writable)",
        systemd_run=systemd_run, systemd_scope=scope,
    )


def detect_cgroup_support(*, slice_name: str = DEFAULT_SLICE, probe_timeout: float = 5.0) -> CgroupSupport:
    """Decide how this host can limit workloads, in order of preference.

    1. cgroup v2 with the cpu and memory controllers: ``<root>/<slice_name>/rental-<id>``
       (or under the agent's own cgroup where that is delegated to it);
    2. cgroup v1 cpu and memory hierarchies: ``<agent's cgroup>/<slice_name>/rental-<id>``;
    3. ``systemd-run --scope`` when systemd runs but the cgroup filesystem is not writable;
    4. none, with the reason each way is closed.

    Creates nothing (the slice is made with the first workload); only the systemd probe
    runs a command (``true`` in a transient scope, up to ``probe_timeout`` seconds).
    """
    if not _SLICE_RE.fullmatch(slice_name):
        raise ConfigError(f"cgroup slice name {slice_name!r} must be letters, digits, '.', '_' or '-'")
    reasons: list[str] = []
    try:
        mounts = _cgroup_mounts(Path("/proc/self/mountinfo").read_text())
        own = _own_cgroups(Path("/proc/self/cgroup").read_text())
    except OSError as exc:
        mounts, own = [], {}
        reasons.append(f"cannot read /proc/self/mountinfo or /proc/self/cgroup: {exc.strerror or exc}")
    support = (
        _detect_cgroup2(mounts, own, slice_name, reasons)
        or _detect_cgroup1(mounts, own, slice_name, reasons)
        or _detect_systemd(probe_timeout, reasons)
    )
    return support or CgroupSupport("none", "no way to limit CPU and memory: " + "; ".join(reasons))


def _write(path: Path, value: str) -> None:
    with open(path, "w") as file:  # one write(2): cgroup files take one value per write
        file.write(value)


def _enable_controllers(folder: Path) -> None:
    control = folder / "cgroup.subtree_control"
    offered = set((folder / "cgroup.controllers").read_text().split())
    missing = [c for c in ("cpu", "memory", "pids") if c in offered and c not in control.read_text().split()]
    if missing:
        _write(control, " ".join(f"+{c}" for c in missing))


def cgroup_members(dirs: Sequence[Path]) -> set[int]:
    members: set[int] = set()
    for folder in dirs:
        with contextlib.suppress(OSError, ValueError):
            members.update(int(line) for line in (folder / "cgroup.procs").read_text().split())
    return members


def kill_cgroups(dirs: Sequence[Path]) -> None:
    """SIGKILL everything in the cgroups, even processes that left the workload's process group."""
    for folder in dirs:
        kill_file = folder / "cgroup.kill"  # cgroup2, Linux 5.14+: atomic, races no fork
        if kill_file.exists():
            with contextlib.suppress(OSError):
                _write(kill_file, "1")
    for _ in range(3):  # a few rounds catch processes forked while we read cgroup.procs
        members = cgroup_members(dirs)
        if not members:
            return
        for pid in members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def remove_cgroups(dirs: Sequence[Path]) -> None:
    for folder in reversed(dirs):
        try:
            folder.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cgroup %s not removed (%s); it is reused if the rental starts again", folder, exc.strerror)


class CgroupFsLimiter:
    """Writes cgroup files directly (cgroup v1 or v2)."""

    def __init__(self, support: CgroupSupport) -> None:
        if support.mode not in ("cgroup1", "cgroup2"):
            raise ValueError(f"CgroupFsLimiter needs cgroup1 or cgroup2 support, not {support.mode}")
        self._support = support

    @property
    def support(self) -> CgroupSupport:
        return self._support

    def create(self, rental_id: str, limits: ResourceLimits) -> Placement:
        name = f"rental-{rental_id}"
        made: list[Path] = []
        quota, memory, pids = limits.cpu_quota_us, limits.memory_bytes, limits.pids
        try:
            if self._support.mode == "cgroup2":
                (slice_dir,) = self._support.slices
                _enable_controllers(slice_dir.parent)
                slice_dir.mkdir(exist_ok=True)
                _enable_controllers(slice_dir)
                group = slice_dir / name
                group.mkdir(exist_ok=True)
                made.append(group)
                # Written even when unlimited: a reused cgroup must not keep an older rental's limits.
                _write(group / "cpu.max", f"{quota or 'max'} {_CPU_PERIOD_US}")
                _write(group / "memory.max", str(memory or "max"))
                if (group / "pids.max").exists():
                    _write(group / "pids.max", str(pids or "max"))
            else:
                cpu_slice, memory_slice, *pids_slice = self._support.slices
                slices = (cpu_slice, memory_slice, *pids_slice)
                for folder in dict.fromkeys((*slices, *(s / name for s in slices))):
                    folder.mkdir(exist_ok=True)
                made.extend(dict.fromkeys(s / name for s in slices))
                _write(cpu_slice / name / "cpu.cfs_period_us", str(_CPU_PERIOD_US))
                _write(cpu_slice / name / "cpu.cfs_quota_us", str(quota or -1))
                _write(memory_slice / name / "memory.limit_in_bytes", str(memory or -1))
                for pids_dir in pids_slice:
                    _write(pids_dir / name / "pids.max", str(pids or "max"))
        except OSError as exc:
            remove_cgroups(made)
            return Placement(error=f"cannot set up the rental's cgroup: {exc.strerror or exc} ({exc.filename})")
        return Placement(cgroup_dirs=tuple(made))

    def attach(self, placement: Placement, pid: int) -> None:
        for folder in placement.cgroup_dirs:
            _write(folder / "cgroup.procs", str(pid))

    def close(self) -> None:
        for slice_dir in self._support.slices:
            with contextlib.suppress(OSError):  # still in use by running workloads: keep it
                slice_dir.rmdir()


class SystemdScopeLimiter:
    """Runs each workload as ``systemd-run --scope`` (systemd places it before it execs)."""

    def __init__(self, support: CgroupSupport) -> None:
        if support.mode != "systemd" or support.systemd_run is None:
            raise ValueError("SystemdScopeLimiter needs systemd support")
        self._support = support

    @property
    def support(self) -> CgroupSupport:
        return self._support

    def create(self, rental_id: str, limits: ResourceLimits) -> Placement:
        assert self._support.systemd_run is not None
        # A suffix keeps a restarted rental clear of a scope systemd has not collected yet.
        unit = f"gpumarket-rental-{rental_id}-{secrets.token_hex(3)}"
        prefix = [self._support.systemd_run, f"--{self._support.systemd_scope}", "--scope", "--quiet", "--collect", f"--unit={unit}"]
        if limits.cpu_cores is not None:
            prefix += ["-p", f"CPUQuota={round(limits.cpu_cores * 100)}%"]
        if limits.memory_mib is not None:
            prefix += ["-p", f"MemoryMax={limits.memory_mib}M"]
        if limits.pids is not None:
            prefix += ["-p", f"TasksMax={limits.pids}"]
        return Placement(argv_prefix=(*prefix, "--"), unit=f"{unit}.scope")

    def attach(self, placement: Placement, pid: int) -> None:
        """Nothing to do: systemd-run moved itself into the scope."""

    def close(self) -> None:
        """Nothing to do: ``--collect`` unloads each scope once it is empty."""


class NoCgroupLimiter:
    """No cgroups on this host: workloads run unlimited, and say why."""

    def __init__(self, support: CgroupSupport) -> None:
        self._support = support

    @property
    def support(self) -> CgroupSupport:
        return self._support

    def create(self, rental_id: str, limits: ResourceLimits) -> Placement:
        return Placement(error=self._support.reason)

    def attach(self, placement: Placement, pid: int) -> None:
        """Nothing to attach to."""

    def close(self) -> None:
        """Nothing was made."""


def cgroup_limiter(support: CgroupSupport) -> CgroupLimiter:
    """The limiter for what ``detect_cgroup_support`` found."""
    if support.mode in ("cgroup1", "cgroup2"):
        return CgroupFsLimiter(support)
    if support.mode == "systemd":
        return SystemdScopeLimiter(support)
    return NoCgroupLimiter(support)

