"""Running renters' workloads on this host, idempotently by rental id.

Kinds: ``hold`` reserves GPUs and runs nothing; ``process`` runs ``argv``, directly or, when
the spec names an ``image``, in a container (docker or podman, whichever answers).

Isolation. A workload sees only its GPUs: ``CUDA_VISIBLE_DEVICES``,
``NVIDIA_VISIBLE_DEVICES`` and ``GPUMARKET_GPU_UUIDS`` name the allocated GPU (or MIG
instance, ``MIG-…``) UUIDs. It runs in ``work_dir/<rental_id>/`` (also its ``HOME``),
in a session of its own, with an environment built from scratch (``PATH``, locale,
``TZ``, the spec's ``env``), and, where the host allows, in a cgroup of its own that
carries the spec's ``cpu_cores`` and ``memory_mib`` (see ``detect_cgroup_support``).

Processes are spawned with ``os.posix_spawn`` through a two-line ``/bin/sh`` shim, and
reaped with ``waitpid`` by this module alone: asyncio's subprocess transport kills its
child when closed and a dropped ``subprocess.Popen`` is reaped behind our back, while a
workload must outlive the manager that started it and be adopted by the next one.

GPU shares. A workload may get a fractional share of one GPU (``GpuShare``: thousandths
of its compute, MiB of its memory) instead of whole GPUs. Several shares may hold one GPU
while their thousandths sum to at most 1000 and their memory to at most the GPU's; a
whole-GPU workload needs its GPUs unheld. The share reaches the workload as
``GPUMARKET_GPU_MILLI``/``GPUMARKET_GPU_MEMORY_MIB`` and as the CUDA MPS client limits
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, which bind
only where an MPS control daemon serves the GPU: this module starts none.

Logs. stdout and stderr go to ``output.log``. Offsets into it are byte positions since
the file was created and never move; to keep it under ``max_log_bytes`` a watcher
punches a hole in its head (``fallocate(PUNCH_HOLE)``: the old blocks are freed, the
file keeps its length), so the writer is never disturbed and no byte is lost between a
copy and a truncate. ``read_log`` skips the hole. Logs outlive the workload until
``forget``.

Exits. A watcher task per process (owned by the manager, cancelled by ``stop`` and
``close``) notices a workload that ends on its own, kills what it left behind and calls
``on_exit(rental_id, exit_code)`` — at least once: the exit is kept in the registry until
the callback returns. ``stop()`` never triggers ``on_exit``; it returns the exit code. It
first writes one line to the workload's log (``gpumarket: stopping (reason); SIGKILL in
30s``) so a renter reading it sees why it ended.

Restarts. ``work_dir/workloads.json`` (rewritten atomically on every change) records
each workload's pid and kernel start time; a new manager re-adopts the processes that
are still alive and genuinely the same, keeps ``hold`` workloads, and reports the ones
that ended meanwhile. ``close()`` leaves workloads running unless ``stop_workloads=True``.

Logging: start, stop and exit at INFO; a degraded isolation or log cap at WARNING.
This module imports nothing from the master or the relay; its specs are the wire protocol's models.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import functools
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal, NamedTuple, Protocol, TypeVar

from agent.gpu.base import GpuBackend
from agent.gpu.sim import SimulatedBackend
from agent.state import atomic_write
from shared.errors import BadRequest, ConfigError, Conflict, GpumarketError, NotFound
from shared.protocol import (
    MILLI_PER_GPU,
    RENTAL_ID_PATTERN,
    GpuShare,
    HoldWorkload,
    ProcessWorkload,
    WorkloadSpec,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

ExitCallback = Callable[[str, int | None], Awaitable[None]]
"""``on_exit(rental_id, exit_code)``; ``exit_code`` is ``-N`` when signal N ended it, ``None`` when unknown."""

LOG_NAME: Final = "output.log"
REGISTRY_NAME: Final = "workloads.json"
DEFAULT_SLICE: Final = "gpumarket.slice"
DEFAULT_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PASSED_ENV: Final = ("PATH", "LANG", "LC_ALL", "TZ")  # all a workload inherits from the agent
# What the docker/podman client itself needs to find its daemon; never given to the container.
CONTAINER_CLIENT_ENV: Final = (
    "PATH", "HOME", "DOCKER_HOST", "DOCKER_CONTEXT", "DOCKER_CONFIG", "DOCKER_CERT_PATH",
    "DOCKER_TLS_VERIFY", "CONTAINER_HOST", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME",
)
MIB: Final = 1 << 20

_CPU_PERIOD_US: Final = 100_000
_LEFTOVER_POLL_S: Final = 0.01
_RENTAL_ID_RE = re.compile(RENTAL_ID_PATTERN)
_SLICE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_IMAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}$")  # never starts with "-"
_MIG_RE = re.compile(r"^MIG-(?:GPU-[0-9a-f-]{36}/\d+/\d+|[0-9a-f-]{36})$", re.IGNORECASE)

# The first process of a workload runs /bin/sh, which changes into the rental's folder
# (os.posix_spawn cannot), optionally waits on stdin for the agent's "go" — sent once the
# process is in its cgroup, so not one instruction of the renter's runs outside it — and
# execs the program: the pid the agent recorded becomes the renter's program.
# Exit 125: the agent never said "go"; 126: no folder; 127: no program.
_SH: Final = "/bin/sh"
_SHIM_CD: Final = 'cd -- "$1" || exit 126; unset OLDPWD; shift; '
_SHIM_GATE: Final = 'IFS= read -r go && [ "$go" = go ] || exit 125; '
_SHIM_EXEC: Final = 'exec "$@" </dev/null'


def _now() -> str:
    return datetime.now(UTC).isoformat()


# ---- the spec ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResourceLimits:
    """CPU and memory a workload may use; ``None`` is unlimited."""

    cpu_cores: float | None = None
    memory_mib: int | None = None

    @property
    def requested(self) -> bool:
        return self.cpu_cores is not None or self.memory_mib is not None

    @property
    def cpu_quota_us(self) -> int | None:
        """CPU time per ``100 ms`` period, the unit of ``cpu.max`` and ``cpu.cfs_quota_us``."""
        return None if self.cpu_cores is None else max(1000, round(self.cpu_cores * _CPU_PERIOD_US))

    @property
    def memory_bytes(self) -> int | None:
        return None if self.memory_mib is None else self.memory_mib * MIB


@dataclass(frozen=True, slots=True)
class ContainerSpec:
    """An image to run in a container (docker or podman): not on the wire yet — the "Isolated
    rentals" issue adds a ``container`` workload kind; until then only the agent's own callers
    (and tests) start one."""

    image: str
    argv: tuple[str, ...] = ()  # empty: the image's own command
    env: Mapping[str, str] = field(default_factory=dict)
    limits: ResourceLimits = ResourceLimits()

    def __post_init__(self) -> None:
        if not _IMAGE_RE.match(self.image):
            raise BadRequest("'image' must be an image reference such as 'nvcr.io/nvidia/pytorch:24.05-py3'", code="bad_workload_spec")


def limits_of(spec: ProcessWorkload) -> ResourceLimits:
    return ResourceLimits(cpu_cores=spec.cpu_cores, memory_mib=spec.memory_mib)


def share_environment(share: GpuShare) -> dict[str, str]:
    """What a workload on a GPU share is told: the share itself, and the CUDA MPS client limits.

    The workload sees one device, so the pinned memory limit names device ``0``.
    """
    env = {
        "GPUMARKET_GPU_MILLI": str(share.milli),
        "GPUMARKET_GPU_MEMORY_MIB": str(share.memory_mib),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, share.milli * 100 // MILLI_PER_GPU)),
    }
    if share.memory_mib:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={share.memory_mib}M"
    return env


def _check_rental_id(rental_id: str) -> None:
    # The id names a folder, a cgroup, a unit and a container: keep it to safe characters.
    if not isinstance(rental_id, str) or not _RENTAL_ID_RE.match(rental_id):
        raise BadRequest(f"rental id {rental_id!r} must be 1-64 letters, digits, '.', '_' or '-'", code="bad_rental_id")


# ---- processes --------------------------------------------------------------------------


class _ProcStat(NamedTuple):
    state: str  # "R", "S", "Z" (zombie), ...
    process_group: int
    start_time: int  # field 22: clock ticks after boot


def _proc_stat(pid: int) -> _ProcStat | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()  # the command name may itself contain ")"
    try:
        return _ProcStat(fields[0], int(fields[2]), int(fields[19]))
    except (IndexError, ValueError):
        return None


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started (``/proc/<pid>/stat`` field 22), or ``None`` if it is not running.

    A pid and its start time name one process for good: a reused pid has another start time.
    """
    stat = _proc_stat(pid)
    return None if stat is None or stat.state in ("Z", "X") else stat.start_time


def _killpg(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        log.warning("not allowed to signal process group %d", pgid)


def _group_alive(pgid: int) -> bool:
    """Whether a live process remains in the group (zombies, which no signal can end, do not count)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    for entry in os.scandir("/proc"):  # only when the group still has members: rare and short
        stat = _proc_stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is not None and stat.process_group == pgid and stat.state not in ("Z", "X"):
            return True
    return False


class _ProcessHandle:
    """Waits for one process, whether the agent spawned it in this life or adopted it.

    Event-driven through a pidfd where the kernel has them (Linux 5.3+), else polled every
    ``poll_interval``. The process is reaped here if it is our child (spawned by this
    process, or the agent is PID 1 / a subreaper); otherwise its exit code is unknown.
    """

    def __init__(self, pid: int, start_time: int | None, *, poll_interval: float) -> None:
        self.pid = pid
        self.start_time = start_time
        self.returncode: int | None = None
        self._poll_interval = poll_interval
        self._loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[None] = self._loop.create_future()
        self._timer: asyncio.TimerHandle | None = None
        self._pidfd: int | None = None
        with contextlib.suppress(OSError):
            self._pidfd = os.pidfd_open(pid)
        if self._pidfd is not None:
            self._loop.add_reader(self._pidfd, self._on_readable)
        self._check()

    @property
    def exited(self) -> bool:
        return self._exited.done()

    async def wait(self, timeout: float | None) -> bool:
        """Whether the process has exited, waiting up to ``timeout`` seconds. Cancelling is safe."""
        if not self._exited.done():
            await asyncio.wait({self._exited}, timeout=timeout)
        return self._exited.done()

    def close(self) -> None:
        """Stop watching (closes the pidfd); the process itself is left alone."""
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_readable(self) -> None:
        if not self._has_exited():  # cannot happen with a sane pidfd; never spin on it
            self.close()
        self._check()

    def _check(self) -> None:
        if self._exited.done():
            return
        if self._has_exited():
            self.close()
            self._exited.set_result(None)
        elif self._pidfd is None:
            self._timer = self._loop.call_later(self._poll_interval, self._check)

    def _has_exited(self) -> bool:
        stat = _proc_stat(self.pid)
        if stat is None or (self.start_time is not None and stat.start_time != self.start_time):
            return True  # gone, reaped by someone else, or the pid now names another process
        if stat.state not in ("Z", "X"):
            return False
        with contextlib.suppress(ChildProcessError):
            waited, status = os.waitpid(self.pid, os.WNOHANG)
            if waited == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return True


# ---- cgroups ----------------------------------------------------------------------------

CgroupMode = Literal["cgroup2", "cgroup1", "systemd", "none"]


@dataclass(frozen=True, slots=True)
class CgroupSupport:
    """How this host lets the agent limit a workload's CPU and memory, decided at start-up.

    ``slices``: where rental cgroups go — one folder for cgroup2, the cpu and the memory
    folder for cgroup1. ``reason`` is for people: what was chosen, or why nothing could be.
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
            return CgroupSupport("cgroup2", f"cgroup v2: a cgroup per workload under {slice_dir} (cpu.max, memory.max)", slices=(slice_dir,))
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
    return CgroupSupport(
        "cgroup1",
        f"cgroup v1: a cgroup per workload under {slices[0]} (cpu.cfs_quota_us) and {slices[1]} (memory.limit_in_bytes)",
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
    if not _SLICE_RE.match(slice_name):
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
    missing = [c for c in ("cpu", "memory") if c not in control.read_text().split()]
    if missing:
        _write(control, " ".join(f"+{c}" for c in missing))


def _cgroup_members(dirs: Sequence[Path]) -> set[int]:
    members: set[int] = set()
    for folder in dirs:
        with contextlib.suppress(OSError, ValueError):
            members.update(int(line) for line in (folder / "cgroup.procs").read_text().split())
    return members


def _kill_cgroups(dirs: Sequence[Path]) -> None:
    """SIGKILL everything in the cgroups, even processes that left the workload's process group."""
    for folder in dirs:
        kill_file = folder / "cgroup.kill"  # cgroup2, Linux 5.14+: atomic, races no fork
        if kill_file.exists():
            with contextlib.suppress(OSError):
                _write(kill_file, "1")
    for _ in range(3):  # a few rounds catch processes forked while we read cgroup.procs
        members = _cgroup_members(dirs)
        if not members:
            return
        for pid in members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _remove_cgroups(dirs: Sequence[Path]) -> None:
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
        quota, memory = limits.cpu_quota_us, limits.memory_bytes
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
            else:
                cpu_slice, memory_slice = self._support.slices
                for folder in dict.fromkeys((cpu_slice, memory_slice, cpu_slice / name, memory_slice / name)):
                    folder.mkdir(exist_ok=True)
                made.extend(dict.fromkeys((cpu_slice / name, memory_slice / name)))
                _write(cpu_slice / name / "cpu.cfs_period_us", str(_CPU_PERIOD_US))
                _write(cpu_slice / name / "cpu.cfs_quota_us", str(quota or -1))
                _write(memory_slice / name / "memory.limit_in_bytes", str(memory or -1))
        except OSError as exc:
            _remove_cgroups(made)
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


# ---- containers -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ContainerRuntime:
    name: str  # "docker" | "podman"
    path: str
    version: str


@dataclass(frozen=True, slots=True)
class ContainerSupport:
    """The usable container runtime, or why there is none."""

    runtime: ContainerRuntime | None
    reason: str


async def _probe(argv: list[str], *, timeout: float) -> tuple[bool, str]:
    try:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
    except OSError as exc:
        return False, exc.strerror or str(exc)
    try:
        async with asyncio.timeout(timeout):
            out, err = await process.communicate()
    except TimeoutError:
        return False, f"no answer within {timeout:g}s"
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    text = (out if process.returncode == 0 else err).decode(errors="replace").strip()
    return process.returncode == 0, (text.splitlines() or [""])[-1][:300]


async def detect_container_runtime(*, candidates: Sequence[str] = ("docker", "podman"), timeout: float = 5.0) -> ContainerSupport:
    """The first of ``candidates`` that is installed and can run containers now.

    docker must reach its daemon (``docker version``); podman must work (``podman info``).
    Cancelling is safe: a probe still running is killed.
    """
    reasons = []
    for name in candidates:
        path = shutil.which(name)
        if path is None:
            reasons.append(f"{name} is not installed")
            continue
        if name == "podman":
            argv = [path, "info", "--format", "{{.Version.Version}}"]
        else:
            argv = [path, "version", "--format", "{{.Server.Version}}"]
        ok, answer = await _probe(argv, timeout=timeout)
        if ok and answer:
            return ContainerSupport(ContainerRuntime(name, path, answer), f"{name} {answer}")
        reasons.append(f"{name} ({path}) is installed but cannot run containers: {answer or 'no version reported'}")
    return ContainerSupport(None, "; ".join(reasons) or "no container runtime is configured")


def container_name(rental_id: str) -> str:
    return f"gpumarket-{rental_id}"


def container_argv(
    runtime: ContainerRuntime, rental_id: str, spec: ContainerSpec, gpu_uuids: Sequence[str], *, folder: Path, env_file: Path
) -> list[str]:
    """The ``docker run``/``podman run`` command for an image workload: its GPUs, limits, env file and folder."""
    argv = [runtime.path, "run", "--rm", "--init", "--name", container_name(rental_id), "--label", f"gpumarket.rental={rental_id}"]
    if runtime.name == "podman":
        for gpu_uuid in gpu_uuids:
            argv += ["--device", f"nvidia.com/gpu={gpu_uuid}"]  # CDI names GPUs and MIG instances by UUID
    elif gpu_uuids:
        argv += ["--gpus", f'"device={",".join(gpu_uuids)}"']  # the quotes keep the comma list one value
    if spec.limits.cpu_cores is not None:
        argv += ["--cpus", f"{spec.limits.cpu_cores:g}"]
    if spec.limits.memory_mib is not None:
        argv += ["--memory", f"{spec.limits.memory_mib}m"]
    return [*argv, "--env-file", str(env_file), "-v", f"{folder}:/workspace", "-w", "/workspace", spec.image, *spec.argv]


# ---- logs -------------------------------------------------------------------------------

_FALLOC_FL_KEEP_SIZE: Final = 0x01
_FALLOC_FL_PUNCH_HOLE: Final = 0x02


@functools.cache
def _fallocate() -> Callable[[int, int, int, int], int]:
    libc = ctypes.CDLL(None, use_errno=True)
    function = libc.fallocate
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    function.restype = ctypes.c_int
    return function


def _punch_head(fd: int, start: int, end: int) -> None:
    """Free bytes ``[start, end)`` of the file; reading them gives zeros and the length stays."""
    if _fallocate()(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, start, end - start) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _first_data(fd: int, offset: int) -> int | None:
    """The first byte at or after ``offset`` that is not in a punched hole (``None``: none)."""
    try:
        return os.lseek(fd, offset, os.SEEK_DATA)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return None
        raise


# ---- the manager ------------------------------------------------------------------------

WorkloadKind = Literal["hold", "process", "container"]


@dataclass(eq=False)
class Workload:
    """One rental's workload as the manager tracks it (and records in ``workloads.json``)."""

    rental_id: str
    kind: WorkloadKind
    gpu_uuids: list[str]
    started_at: str
    pid: int | None = None  # also the process group and session id
    start_time: int | None = None
    placement: Placement = Placement()
    container: tuple[str, str] | None = None  # (runtime path, container name)
    share: GpuShare | None = None  # a fraction of its one GPU; None: its GPUs whole
    handle: _ProcessHandle | None = None
    watcher: asyncio.Task[None] | None = None
    stop_task: asyncio.Task[dict[str, Any]] | None = None

    def to_record(self) -> dict[str, Any]:
        return {
            "rental_id": self.rental_id,
            "kind": self.kind,
            "gpu_uuids": self.gpu_uuids,
            "started_at": self.started_at,
            "pid": self.pid,
            "start_time": self.start_time,
            "cgroup_dirs": [str(d) for d in self.placement.cgroup_dirs],
            "systemd_unit": self.placement.unit,
            "container": None if self.container is None else {"runtime": self.container[0], "name": self.container[1]},
            "share": None if self.share is None else self.share.model_dump(),
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Workload:
        rental_id, kind, pid, start_time = record["rental_id"], record["kind"], record["pid"], record["start_time"]
        _check_rental_id(rental_id)
        if kind not in ("hold", "process", "container"):
            raise ValueError(f"unknown kind {kind!r}")
        if (kind == "hold") != (pid is None) or not isinstance(pid, int | None) or not isinstance(start_time, int | None):
            raise ValueError("pid and start_time do not fit the kind")
        container = record.get("container")
        gpu_uuids = [str(u) for u in record["gpu_uuids"]]
        raw_share = record.get("share")  # absent in records written before shares
        share = None if raw_share is None else GpuShare.model_validate(raw_share)
        if share is not None and len(gpu_uuids) != 1:
            raise ValueError("a GPU share names exactly one GPU")
        return cls(
            rental_id=rental_id,
            kind=kind,
            gpu_uuids=gpu_uuids,
            started_at=str(record.get("started_at", "")),
            pid=pid,
            start_time=start_time,
            placement=Placement(cgroup_dirs=tuple(Path(d) for d in record.get("cgroup_dirs") or ()), unit=record.get("systemd_unit")),
            container=None if not container else (str(container["runtime"]), str(container["name"])),
            share=share,
        )


class WorkloadManager:
    """Starts, watches, stops and re-adopts the workloads of this host's rentals.

    ``on_exit`` hears of workloads that end on their own (not of ``stop()``). ``cgroups``
    defaults to what ``detect_cgroup_support()`` finds. Call ``await resume()`` once at
    start-up (``start``/``stop`` do it too) so that workloads adopted from an earlier life
    are watched and the ones that ended meanwhile are reported.
    """

    def __init__(
        self,
        work_dir: Path,
        backend: GpuBackend,
        *,
        on_exit: ExitCallback | None = None,
        cgroups: CgroupLimiter | None = None,
        container_runtimes: Sequence[str] = ("docker", "podman"),
        # Timeouts
        stop_timeout: float = 10.0,
        kill_timeout: float = 5.0,
        check_interval: float = 1.0,
        runtime_probe_timeout: float = 5.0,
        # Limits
        max_log_bytes: int = 64 << 20,
        max_read_bytes: int = 1 << 20,
    ) -> None:
        for name, value, low, high in (
            ("stop_timeout", stop_timeout, 0.0, 3600.0),
            ("kill_timeout", kill_timeout, 0.01, 600.0),
            ("check_interval", check_interval, 0.001, 60.0),
            ("runtime_probe_timeout", runtime_probe_timeout, 0.1, 120.0),
            ("max_log_bytes", max_log_bytes, 16 << 10, 1 << 40),
            ("max_read_bytes", max_read_bytes, 1, 64 << 20),
        ):
            if not low <= value <= high:
                raise ConfigError(f"workload setting {name}={value!r} must lie between {low:g} and {high:g}")
        self.work_dir = work_dir
        self.backend = backend
        self.on_exit = on_exit
        self.cgroups = cgroups if cgroups is not None else cgroup_limiter(detect_cgroup_support())
        self.container_runtimes = tuple(container_runtimes)
        self.stop_timeout = stop_timeout
        self.kill_timeout = kill_timeout
        self.check_interval = check_interval
        self.runtime_probe_timeout = runtime_probe_timeout
        self.max_log_bytes = max_log_bytes
        self.max_read_bytes = max_read_bytes
        self._workloads: dict[str, Workload] = {}
        self._unreported: dict[str, int | None] = {}  # exits on_exit has not yet taken
        self._dead_at_load: list[Workload] = []
        self._tasks: set[asyncio.Task[Any]] = set()  # watchers, reports, clean-ups: cancelled by close()
        self._stops: set[asyncio.Task[Any]] = set()  # stops in flight: awaited by close()
        self._runtime: ContainerRuntime | None = None
        self._resumed = False
        self._closed = False
        self._log_cap_failed = False
        work_dir.mkdir(parents=True, exist_ok=True)
        self._load_registry()

    @property
    def registry_path(self) -> Path:
        return self.work_dir / REGISTRY_NAME

    @property
    def cgroup_support(self) -> CgroupSupport:
        return self.cgroups.support

    def running(self) -> list[str]:
        """Rental ids whose workload runs (or holds its GPUs), stopping ones included."""
        return sorted(self._workloads)

    # ---- start ------------------------------------------------------------------------

    async def start(
        self, rental_id: str, gpu_uuids: list[str], spec: WorkloadSpec | ContainerSpec, *, share: GpuShare | None = None
    ) -> dict[str, Any]:
        """Start the rental's workload unless it already runs (then report it again).

        ``spec`` and ``share`` come validated (``shared.protocol.StartWorkload``). ``share`` gives
        the workload a fraction of its one GPU, which other shares may hold too; without it the workload
        needs its GPUs unheld. Returns ``{"kind", "pid", "limits": "applied" | "unavailable"
        | "none requested", ...}`` (with ``limits_reason`` when unavailable). Cancelling is
        safe: the only await — asking docker/podman whether it can run containers — comes
        before anything starts.
        """
        self._check_open()
        _check_rental_id(rental_id)
        await self.resume()
        existing = self._workloads.get(rental_id)
        if existing is not None:
            return self._already_running(existing)
        gpu_share = share
        gpus = self._check_gpus(gpu_uuids, gpu_share)
        runtime = None
        if isinstance(spec, ContainerSpec):
            runtime = await self._require_container_runtime(spec.image)
            self._check_open()
            existing = self._workloads.get(rental_id)  # a concurrent start may have won meanwhile
            if existing is not None:
                return self._already_running(existing)
            gpus = self._check_gpus(gpu_uuids, gpu_share)
        if isinstance(spec, HoldWorkload):
            workload = Workload(rental_id, "hold", gpus, _now())
            result: dict[str, Any] = {"kind": "hold", "pid": None}
        elif isinstance(spec, ContainerSpec):
            assert runtime is not None
            workload, result = self._spawn_container(rental_id, gpus, spec, runtime, gpu_share)
        else:
            workload, result = self._spawn_process(rental_id, gpus, spec, gpu_share)
        workload.share = gpu_share
        self._workloads[rental_id] = workload
        if workload.pid is not None:
            workload.handle = _ProcessHandle(workload.pid, workload.start_time, poll_interval=self.check_interval)
            workload.watcher = self._own(self._watch(workload), name=f"workload-{rental_id}-watch")
        self._save_registry()
        self._set_busy(gpus, True)
        log.info("rental %s started (%s, pid %s, %d GPU, limits %s)", rental_id, workload.kind, workload.pid, len(gpus), result.get("limits"))
        return result

    def _already_running(self, workload: Workload) -> dict[str, Any]:
        if workload.stop_task is not None:
            raise Conflict(f"rental {workload.rental_id}'s workload is stopping; start it again once stopped", code="workload_stopping")
        return {"already_running": True, "kind": workload.kind, "pid": workload.pid}

    def _check_gpus(self, gpu_uuids: Sequence[str], share: GpuShare | None) -> list[str]:
        """The GPUs, checked to be on this host and free for the workload (whole, or room for its ``share``)."""
        if not isinstance(gpu_uuids, list | tuple) or not all(isinstance(u, str) for u in gpu_uuids):
            raise BadRequest("gpu_uuids must be a list of GPU UUIDs", code="bad_gpu_uuids")
        if len(set(gpu_uuids)) != len(gpu_uuids):
            raise BadRequest("gpu_uuids names a GPU twice", code="bad_gpu_uuids")
        if share is not None and len(gpu_uuids) != 1:
            raise BadRequest(f"a GPU share is a fraction of exactly one GPU, but gpu_uuids names {len(gpu_uuids)}", code="bad_gpu_share")
        infos = self.backend.gpus()
        memory: dict[str, int | None] = {g.uuid: g.memory_total_mib for g in infos}
        memory.update({m.uuid: m.memory_total_mib for g in infos for m in g.mig_instances})
        # The backend lists physical GPUs only; MIG instances are taken on a MIG-enabled host by their form.
        mig = any(g.mig_mode for g in infos)
        unknown = [u for u in gpu_uuids if u not in memory and not (mig and _MIG_RE.match(u))]
        if unknown:
            raise BadRequest(f"GPU(s) {', '.join(unknown)} are not on this host", code="gpu_not_found")
        holders: dict[str, list[Workload]] = {}
        for workload in self._workloads.values():
            for gpu_uuid in workload.gpu_uuids:
                holders.setdefault(gpu_uuid, []).append(workload)
        if share is None:
            taken = [f"{u} ({_holder_names(holders[u])})" for u in gpu_uuids if u in holders]
            if taken:
                raise Conflict(f"GPU(s) {', '.join(taken)} already serve another rental; stop it first", code="gpu_in_use")
            return list(gpu_uuids)
        (gpu_uuid,) = gpu_uuids
        total_mib = memory.get(gpu_uuid)
        if total_mib is not None and share.memory_mib > total_mib:
            raise BadRequest(f"the share asks for {share.memory_mib} MiB, but GPU {gpu_uuid} has {total_mib} MiB", code="bad_gpu_share")
        sharing = holders.get(gpu_uuid, [])
        if any(w.share is None for w in sharing):
            raise Conflict(f"GPU {gpu_uuid} serves {_holder_names(sharing)} whole; a share cannot join it", code="gpu_in_use")
        milli = sum(w.share.milli for w in sharing if w.share is not None) + share.milli
        memory_mib = sum(w.share.memory_mib for w in sharing if w.share is not None) + share.memory_mib
        if milli > MILLI_PER_GPU:
            raise Conflict(
                f"GPU {gpu_uuid} has {MILLI_PER_GPU + share.milli - milli}/{MILLI_PER_GPU} left, not the {share.milli} asked for: "
                f"{_holder_names(sharing)} hold the rest",
                code="gpu_in_use",
            )
        if total_mib is not None and memory_mib > total_mib:
            raise Conflict(
                f"GPU {gpu_uuid} has {total_mib + share.memory_mib - memory_mib} MiB left, not the {share.memory_mib} MiB asked for: "
                f"{_holder_names(sharing)} hold the rest",
                code="gpu_in_use",
            )
        return [gpu_uuid]

    def _environment(
        self, rental_id: str, gpus: Sequence[str], extra: Mapping[str, str], *, home: Path, share: GpuShare | None
    ) -> dict[str, str]:
        env = {name: os.environ[name] for name in PASSED_ENV if name in os.environ}
        env.setdefault("PATH", DEFAULT_PATH)
        env["HOME"] = str(home)
        env.update(extra)
        visible = ",".join(gpus)
        env.update(
            CUDA_VISIBLE_DEVICES=visible,
            NVIDIA_VISIBLE_DEVICES=visible or "none",
            GPUMARKET_GPU_UUIDS=visible,
            GPUMARKET_RENTAL_ID=rental_id,
        )
        if share is not None:
            env.update(share_environment(share))
        return env

    def _folder(self, rental_id: str) -> Path:
        return self.work_dir / rental_id

    def _spawn(self, argv: Sequence[str], *, folder: Path, env: Mapping[str, str], gated: bool) -> tuple[int, int | None]:
        """Start ``argv`` in ``folder`` in a new session, output to the log; returns the pid and,
        when ``gated``, the pipe end that releases it (write ``go``), which the caller closes."""
        script = _SHIM_CD + (_SHIM_GATE if gated else "") + _SHIM_EXEC
        # Whatever the agent ignores (Python ignores SIGPIPE and SIGXFSZ) the workload must not inherit.
        ignored = [s for s in signal.valid_signals() if signal.getsignal(s) == signal.SIG_IGN]
        log_fd = os.open(folder / LOG_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        gate_read = gate_write = -1
        try:
            stdin: tuple[Any, ...] = (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)
            if gated:
                gate_read, gate_write = os.pipe()
                stdin = (os.POSIX_SPAWN_DUP2, gate_read, 0)
            pid = os.posix_spawn(
                _SH, [_SH, "-c", script, "gpumarket-shim", str(folder), *argv], dict(env),
                file_actions=[stdin, (os.POSIX_SPAWN_DUP2, log_fd, 1), (os.POSIX_SPAWN_DUP2, log_fd, 2)],
                setsid=True, setsigdef=ignored,
            )
        except BaseException:
            if gate_write >= 0:
                os.close(gate_write)
            raise
        finally:
            os.close(log_fd)
            if gate_read >= 0:
                os.close(gate_read)
        return pid, gate_write if gated else None

    def _spawn_process(
        self, rental_id: str, gpus: list[str], spec: ProcessWorkload, share: GpuShare | None
    ) -> tuple[Workload, dict[str, Any]]:
        folder = self._folder(rental_id)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        env = self._environment(rental_id, gpus, spec.env, home=folder, share=share)
        program = _resolve_program(spec.argv[0], path=env["PATH"], folder=folder)
        limits = limits_of(spec)
        placement = self.cgroups.create(rental_id, limits)
        argv = [*placement.argv_prefix, program, *spec.argv[1:]]
        try:
            pid, gate = self._spawn(argv, folder=folder, env=env, gated=bool(placement.cgroup_dirs))
        except OSError as exc:
            _remove_cgroups(placement.cgroup_dirs)
            raise BadRequest(f"cannot start {spec.argv[0]!r}: {exc.strerror or exc}", code="workload_start_failed") from None
        if gate is not None:
            try:
                self.cgroups.attach(placement, pid)
            except OSError as exc:
                # Degrade like a host without cgroups: the process runs, unlimited, and says why.
                error = f"cannot move the workload into {placement.cgroup_dirs[0]}: {exc.strerror or exc}"
                log.warning("rental %s: %s", rental_id, error)
                _remove_cgroups(placement.cgroup_dirs)
                placement = Placement(error=error)
            finally:
                with contextlib.suppress(BrokenPipeError):
                    os.write(gate, b"go\n")
                os.close(gate)
        if limits.requested and not placement.placed:
            log.warning("rental %s runs without its CPU/memory limits: %s", rental_id, placement.error)
        stat = _proc_stat(pid)
        workload = Workload(
            rental_id, "process", gpus, _now(), pid=pid, start_time=None if stat is None else stat.start_time, placement=placement
        )
        return workload, {"kind": "process", "pid": pid, **_limits_report(limits, placement)}

    def _spawn_container(
        self, rental_id: str, gpus: list[str], spec: ContainerSpec, runtime: ContainerRuntime, share: GpuShare | None
    ) -> tuple[Workload, dict[str, Any]]:
        folder = self._folder(rental_id)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        visible = ",".join(gpus)
        inside = {**spec.env, "GPUMARKET_GPU_UUIDS": visible, "GPUMARKET_RENTAL_ID": rental_id}
        if share is not None:
            inside.update(share_environment(share))
        if any("\n" in value for value in inside.values()):
            raise BadRequest("a container workload's environment values cannot contain newlines", code="bad_workload_spec")
        # An env file (0600) rather than "-e NAME=value", which anyone could read in ps.
        env_file = folder / "container.env"
        atomic_write(env_file, "".join(f"{k}={v}\n" for k, v in inside.items()).encode(), mode=0o600)
        name = container_name(rental_id)
        client_env = {k: os.environ[k] for k in CONTAINER_CLIENT_ENV if k in os.environ}
        argv = container_argv(runtime, rental_id, spec, gpus, folder=folder, env_file=env_file)
        try:
            pid, _ = self._spawn(argv, folder=folder, env=client_env, gated=False)
        except OSError as exc:
            raise BadRequest(f"cannot start {runtime.name}: {exc.strerror or exc}", code="workload_start_failed") from None
        stat = _proc_stat(pid)
        workload = Workload(
            rental_id, "container", gpus, _now(), pid=pid, start_time=None if stat is None else stat.start_time,
            container=(runtime.path, name),
        )
        limits = "applied" if spec.limits.requested else "none requested"
        return workload, {"kind": "container", "pid": pid, "container": name, "runtime": runtime.name, "limits": limits}

    async def _require_container_runtime(self, image: str) -> ContainerRuntime:
        if self._runtime is None:  # asked again each time until one answers: a daemon may start later
            support = await detect_container_runtime(candidates=self.container_runtimes, timeout=self.runtime_probe_timeout)
            if support.runtime is None:
                raise BadRequest(
                    f"this host cannot run container image {image!r}: {support.reason}. Install and start docker "
                    "(with the NVIDIA Container Toolkit) or podman (with NVIDIA CDI), or rent without 'image'",
                    code="container_runtime_unavailable",
                )
            self._runtime = support.runtime
        return self._runtime

    # ---- watching and exits -----------------------------------------------------------

    async def resume(self) -> None:
        """Watch workloads adopted from an earlier life and report those that ended meanwhile.

        Idempotent. Cancelling is safe: it does its work without waiting; the reports run
        in tasks the manager owns.
        """
        if self._resumed or self._closed:
            return
        self._resumed = True
        for workload in self._workloads.values():
            if workload.pid is not None and workload.handle is None:
                workload.handle = _ProcessHandle(workload.pid, workload.start_time, poll_interval=self.check_interval)
                workload.watcher = self._own(self._watch(workload), name=f"workload-{workload.rental_id}-watch")
        for workload in self._dead_at_load:
            self._own(self._clean_up(workload, kill_group=False), name=f"workload-{workload.rental_id}-cleanup")
        self._dead_at_load.clear()
        for rental_id in list(self._unreported):
            self._own(self._report_exit(rental_id), name=f"workload-{rental_id}-report")

    async def _watch(self, workload: Workload) -> None:
        handle = workload.handle
        assert handle is not None
        while not await handle.wait(self.check_interval):
            self._cap_log(workload.rental_id)
        # The main process ended on its own: the workload is over. (stop() cancels this task first.)
        self._workloads.pop(workload.rental_id, None)
        self._unreported[workload.rental_id] = handle.returncode
        self._save_registry()
        self._set_busy(workload.gpu_uuids, False)
        log.info("rental %s: workload exited on its own (exit code %s)", workload.rental_id, handle.returncode)
        await self._clean_up(workload)
        self._cap_log(workload.rental_id)
        await self._report_exit(workload.rental_id)

    async def _report_exit(self, rental_id: str) -> None:
        if rental_id not in self._unreported:
            return
        exit_code = self._unreported[rental_id]
        if self.on_exit is not None:
            try:
                await self.on_exit(rental_id, exit_code)
            except Exception:
                log.exception("on_exit(%s, %s) failed; the exit is not reported again", rental_id, exit_code)
        # Cancelled above (close()): the exit stays recorded and the next manager reports it.
        self._unreported.pop(rental_id, None)
        self._save_registry()

    async def _clean_up(self, workload: Workload, *, kill_group: bool = True) -> None:
        """Kill what the workload left (its process group, its cgroup, its container) and remove its cgroup.

        ``kill_group=False`` for a workload found dead at start-up: its pid (the group id) may
        name another process by now, but its cgroup and its container are still its own.
        """
        group = workload.pid if kill_group else None
        if group is not None:
            _killpg(group, signal.SIGKILL)
        _kill_cgroups(workload.placement.cgroup_dirs)
        if workload.container is not None:
            await self._remove_container(workload)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.kill_timeout
        while (group is not None and _group_alive(group)) or _cgroup_members(workload.placement.cgroup_dirs):
            if loop.time() >= deadline:
                log.warning("rental %s: processes remain %.1fs after SIGKILL", workload.rental_id, self.kill_timeout)
                break
            await asyncio.sleep(_LEFTOVER_POLL_S)
        _remove_cgroups(workload.placement.cgroup_dirs)

    async def _remove_container(self, workload: Workload) -> None:
        assert workload.container is not None
        runtime, name = workload.container
        ok, answer = await _probe([runtime, "rm", "--force", name], timeout=self.kill_timeout)
        if not ok and "no such container" not in answer.lower():
            log.warning("rental %s: cannot remove container %s: %s", workload.rental_id, name, answer)

    # ---- stop -------------------------------------------------------------------------

    async def stop(self, rental_id: str, *, timeout: float | None = None, reason: str | None = None) -> dict[str, Any]:
        """Stop the workload: SIGTERM to its process group, SIGKILL ``timeout`` seconds later
        (0 to ``MAX_STOP_GRACE_S``; default ``stop_timeout``) if it still runs.

        A running process first gets one line in its log saying why (``reason``, one line of
        at most ``MAX_STOP_REASON_CHARS``: ``shared.protocol.StopWorkload`` checks both) and
        when SIGKILL follows.

        Returns ``{"exit_code": ...}`` (``-N`` after signal N, ``None`` for ``hold`` or when
        unknown), or ``{"already_stopped": True}``. Idempotent; concurrent calls share one
        stop, with the first call's timeout and reason. ``on_exit`` is not called.
        Cancelling is safe: the stop goes on in a task the manager owns, and a later
        ``stop()`` or ``close()`` waits for it.
        """
        self._check_open()
        _check_rental_id(rental_id)
        await self.resume()
        workload = self._workloads.get(rental_id)
        if workload is None:
            return {"already_stopped": True}
        if workload.stop_task is None:
            grace = self.stop_timeout if timeout is None else timeout
            workload.stop_task = self._own(self._stop(workload, grace, reason), name=f"workload-{rental_id}-stop", stop=True)
        return await asyncio.shield(workload.stop_task)

    async def _stop(self, workload: Workload, grace: float, reason: str | None) -> dict[str, Any]:
        if workload.watcher is not None:
            workload.watcher.cancel()
            await asyncio.wait({workload.watcher})
        exit_code = None
        handle = workload.handle
        if handle is not None and workload.pid is not None:
            if not handle.exited:
                why = f" ({reason})" if reason else ""
                self._append_log(workload.rental_id, f"gpumarket: stopping{why}; SIGKILL in {grace:g}s")
                log.info("rental %s: stopping%s, SIGKILL in %gs", workload.rental_id, why, grace)
                _killpg(workload.pid, signal.SIGTERM)  # docker/podman pass it on to the container
                if not await handle.wait(grace):
                    log.warning("rental %s ignored SIGTERM for %.1fs; killing it", workload.rental_id, grace)
                    if workload.container is not None:
                        await self._remove_container(workload)
                    _killpg(workload.pid, signal.SIGKILL)
                    _kill_cgroups(workload.placement.cgroup_dirs)
                    if not await handle.wait(self.kill_timeout):
                        log.error("rental %s: pid %d survived SIGKILL for %.1fs", workload.rental_id, workload.pid, self.kill_timeout)
            exit_code = handle.returncode
            handle.close()
        await self._clean_up(workload)
        self._cap_log(workload.rental_id)
        self._workloads.pop(workload.rental_id, None)
        self._save_registry()
        self._set_busy(workload.gpu_uuids, False)
        log.info("rental %s stopped (exit code %s)", workload.rental_id, exit_code)
        return {"exit_code": exit_code}

    async def close(self, *, stop_workloads: bool = False) -> None:
        """Release the manager; ``stop_workloads=False`` (an agent restarting) leaves every workload
        running, recorded for the next manager; ``True`` (the demo) stops them all, concurrently.

        Waits for stops in flight (each bounded by ``stop_timeout`` plus twice ``kill_timeout``);
        cancels watchers and pending ``on_exit`` reports (an unreported exit is reported by the
        next manager). Cancelling ``close()`` leaves those tasks running; call it again.
        """
        if stop_workloads and not self._closed:
            results = await asyncio.gather(*(self.stop(r) for r in list(self._workloads)), return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    log.error("stopping a workload at close failed", exc_info=result)
        self._closed = True
        if self._stops:
            await asyncio.wait(set(self._stops))
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for workload in self._workloads.values():
            if workload.handle is not None:
                workload.handle.close()
                workload.handle = None
        self.cgroups.close()
        self._save_registry()

    def _check_open(self) -> None:
        if self._closed:
            raise Conflict("the workload manager is closed (the agent is shutting down)", code="agent_closing")

    def _own(self, coro: Coroutine[Any, Any, T], *, name: str, stop: bool = False) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        (self._stops if stop else self._tasks).add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        self._stops.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("workload task %s failed", task.get_name(), exc_info=task.exception())

    def _set_busy(self, gpu_uuids: Sequence[str], busy: bool) -> None:
        """Show the simulated GPUs busy, or idle once no workload holds them (call after dropping the workload)."""
        if isinstance(self.backend, SimulatedBackend):
            known = {g.uuid for g in self.backend.gpus()}
            held = {u for w in self._workloads.values() for u in w.gpu_uuids}
            self.backend.set_busy([u for u in gpu_uuids if u in known and (busy or u not in held)], busy)

    # ---- logs -------------------------------------------------------------------------

    def read_log(self, rental_id: str, *, offset: int, limit: int = 64 << 10) -> tuple[bytes, int]:
        """Up to ``limit`` bytes of the rental's output from ``offset``, and the offset after them.

        Offsets count every byte the workload ever wrote. When the cap dropped the bytes at
        ``offset``, reading starts at the oldest byte kept: the chunk's own offset is always
        ``next_offset - len(chunk)``. Past the end: ``(b"", offset)``. Works after the workload
        ended, until ``forget``. Raises ``NotFound`` for a rental this host has no log of.
        """
        _check_rental_id(rental_id)
        if not isinstance(offset, int) or offset < 0:
            raise BadRequest("offset must be a byte offset >= 0", code="bad_log_offset")
        if not 1 <= limit <= self.max_read_bytes:
            raise BadRequest(f"limit must be from 1 to {self.max_read_bytes} bytes", code="bad_log_limit")
        try:
            fd = os.open(self._folder(rental_id) / LOG_NAME, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if rental_id in self._workloads or self._folder(rental_id).is_dir():
                return b"", offset
            raise NotFound(f"no workload log for rental {rental_id} on this host", code="workload_log_not_found") from None
        except OSError as exc:
            raise GpumarketError(f"cannot read the log of rental {rental_id}: {exc.strerror}", code="workload_log_unreadable") from None
        try:
            size = os.fstat(fd).st_size
            if offset >= size:
                return b"", offset
            start = _first_data(fd, offset)
            if start is None or start >= size:
                return b"", size
            data = os.pread(fd, min(limit, size - start), start)
            return data, start + len(data)
        except OSError as exc:
            raise GpumarketError(f"cannot read the log of rental {rental_id}: {exc.strerror}", code="workload_log_unreadable") from None
        finally:
            os.close(fd)

    def _append_log(self, rental_id: str, line: str) -> None:
        """Add one line of the agent's own to the rental's log (on a line of its own)."""
        try:
            fd = os.open(self._folder(rental_id) / LOG_NAME, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            log.warning("rental %s: cannot write to its log (%s)", rental_id, exc.strerror)
            return
        try:
            size = os.fstat(fd).st_size
            # The workload's own last line may lack its newline yet: do not glue ours to it.
            separate = size > 0 and os.pread(fd, 1, size - 1) not in (b"\n", b"")
            os.write(fd, (("\n" if separate else "") + line + "\n").encode())
        except OSError as exc:
            log.warning("rental %s: cannot write to its log (%s)", rental_id, exc.strerror)
        finally:
            os.close(fd)

    def _cap_log(self, rental_id: str) -> None:
        """Free the head of ``output.log`` so at most ``max_log_bytes`` of it are kept (the newest)."""
        try:
            fd = os.open(self._folder(rental_id) / LOG_NAME, os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            size = os.fstat(fd).st_size
            block = os.fstatvfs(fd).f_bsize or 4096
            end = -(-(size - self.max_log_bytes) // block) * block  # whole blocks, so they are really freed
            start = _first_data(fd, 0)
            if size > self.max_log_bytes and start is not None and start < end:
                _punch_head(fd, start - start % block, end)
        except OSError as exc:
            if not self._log_cap_failed:
                self._log_cap_failed = True
                log.warning("cannot cap workload logs at %d bytes on this filesystem (%s); they grow unbounded", self.max_log_bytes, exc.strerror)
        finally:
            os.close(fd)

    async def forget(self, rental_id: str) -> None:
        """Delete the rental's folder and log; refused while its workload runs.

        Cancelling is safe: the deletion finishes in its thread.
        """
        _check_rental_id(rental_id)
        if rental_id in self._workloads:
            raise Conflict(f"rental {rental_id}'s workload still runs; stop it first", code="workload_running")
        await asyncio.to_thread(shutil.rmtree, self._folder(rental_id), ignore_errors=True)

    # ---- the registry -----------------------------------------------------------------

    def _load_registry(self) -> None:
        path = self.registry_path
        try:
            raw = json.loads(path.read_text())
            records = raw["workloads"]
            unreported = raw.get("unreported_exits", {})
            if not isinstance(records, list) or not isinstance(unreported, dict):
                raise ValueError("unexpected layout")
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            aside = path.with_name(f"{REGISTRY_NAME}.unreadable")
            log.error("workload registry %s is unreadable (%s); moved to %s — the workloads it listed are not adopted", path, exc, aside)
            with contextlib.suppress(OSError):
                os.replace(path, aside)
            self._save_registry()
            return
        for record in records:
            try:
                workload = Workload.from_record(record)
            except (KeyError, TypeError, ValueError, GpumarketError) as exc:
                log.error("skipping unreadable workload record %r: %s", record, exc)
                continue
            if workload.pid is None or (workload.start_time is not None and process_start_time(workload.pid) == workload.start_time):
                self._workloads[workload.rental_id] = workload
                self._set_busy(workload.gpu_uuids, True)
                log.info("rental %s: adopted its %s workload (pid %s)", workload.rental_id, workload.kind, workload.pid)
            else:
                # Ended while the agent was down, or its pid now names another process: never touch that one.
                self._unreported[workload.rental_id] = _reap_if_ours(workload.pid, workload.start_time)
                self._dead_at_load.append(workload)
                log.info("rental %s: its workload (pid %s) ended while the agent was down", workload.rental_id, workload.pid)
        for rental_id, exit_code in unreported.items():
            if isinstance(rental_id, str) and isinstance(exit_code, int | None):
                self._unreported.setdefault(rental_id, exit_code)
        self._save_registry()

    def _save_registry(self) -> None:
        body = {
            "version": 1,
            "workloads": [self._workloads[r].to_record() for r in sorted(self._workloads)],
            "unreported_exits": self._unreported,
        }
        try:
            atomic_write(self.registry_path, json.dumps(body, indent=2, sort_keys=True).encode(), mode=0o600)
        except OSError as exc:
            # The workloads themselves are fine; only an agent restart would lose track of them.
            log.error("cannot write %s (%s); an agent restart would orphan the workloads", self.registry_path, exc.strerror)


def _holder_names(workloads: Sequence[Workload]) -> str:
    """``rental r-1 (250/1000)`` for each holder of a GPU: who to stop, and how much each holds."""
    return ", ".join(
        f"rental {w.rental_id}" + ("" if w.share is None else f" ({w.share.milli}/{MILLI_PER_GPU})")
        for w in sorted(workloads, key=lambda w: w.rental_id)
    )


def _reap_if_ours(pid: int, start_time: int | None) -> int | None:
    """The exit code of a zombie that is our child (the agent is PID 1, or spawned it in this
    very process), else ``None`` — a process that is not our child leaves no exit code to us."""
    stat = _proc_stat(pid)
    if stat is None or stat.start_time != start_time or stat.state not in ("Z", "X"):
        return None
    with contextlib.suppress(ChildProcessError):
        waited, status = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return os.waitstatus_to_exitcode(status)
    return None


def _resolve_program(name: str, *, path: str, folder: Path) -> str:
    if "/" in name:
        candidate = Path(name) if os.path.isabs(name) else folder / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
        raise BadRequest(f"cannot start {name!r}: no executable file at {candidate}", code="workload_start_failed")
    found = shutil.which(name, path=path)
    if found is None:
        raise BadRequest(f"cannot start {name!r}: not found on PATH {path}", code="workload_start_failed")
    return found


def _limits_report(limits: ResourceLimits, placement: Placement) -> dict[str, Any]:
    report: dict[str, Any] = {"cpu_cores": limits.cpu_cores, "memory_mib": limits.memory_mib}
    if placement.cgroup_dirs:
        report["cgroups"] = [str(d) for d in placement.cgroup_dirs]
    if placement.unit:
        report["systemd_unit"] = placement.unit
    if not limits.requested:
        report["limits"] = "none requested"
    elif placement.placed:
        report["limits"] = "applied"
    else:
        report["limits"] = "unavailable"
        report["limits_reason"] = placement.error or "no cgroup for this workload"
    return report
