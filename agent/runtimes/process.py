"""The ``process`` runtime: the renter's program as a host process in a session of its own.

Processes are spawned with ``os.posix_spawn`` through a two-line ``/bin/sh`` shim, and
reaped with ``waitpid`` by the manager alone (``agent.runtimes.pids``): asyncio's
subprocess transport kills its child when closed and a dropped ``subprocess.Popen`` is
reaped behind our back, while a workload must outlive the manager that started it and be
adopted by the next one. The pid is also the process group and session id; with the
kernel start time it is what the registry records for re-adoption.

Isolation: the environment is built from scratch (``PATH``, locale, ``TZ``, ``HOME``, the
spec's ``env``, the GPU variables); the output goes to ``work_dir/<rental_id>/output.log``
(the agent's, mode 0600: the workload only holds its descriptor); where the host allows,
the process runs in a cgroup of its own that carries the spec's ``cpu_cores`` and
``memory_mib``, entered before the renter's first instruction runs. With ``users``
(``agent.runtimes.users``: the agent runs as root) each rental runs under a uid of its own,
in its own network (``agent.runtimes.procnet``), PID, mount and IPC namespaces, in a home only it can read; without, only where
the ``IsolationFacts`` allow it (``allow_unisolated_workloads``), as the agent's own user
in ``work_dir/<rental_id>/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from agent.runtimes.base import Workload, now_iso
from agent.runtimes.cgroups import CgroupLimiter, Placement, ResourceLimits, remove_cgroups
from agent.runtimes.diskquota import LoopDisks
from agent.runtimes.isolation import ProcessIsolation, check_workload_allowed, isolation_facts
from agent.runtimes.logs import LOG_NAME
from agent.runtimes.pids import proc_stat
from agent.runtimes.users import (
    ENV_FD,
    TRUSTED_PATH,
    RentalUser,
    RentalUsers,
    environment_fd,
    isolated_argv,
    kill_uid,
    resolve_program_for,
    running_uids,
)
from shared.ceilings import Ceilings
from shared.errors import BadRequest, ConfigError
from shared.protocol import MILLI_PER_GPU, GpuShare, IsolationFacts, ProcessWorkload

log = logging.getLogger(__name__)

DEFAULT_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PASSED_ENV: Final = ("PATH", "LANG", "LC_ALL", "TZ")  # all a workload inherits from the agent

# The first process of a workload runs /bin/sh, which changes into the rental's folder
# (os.posix_spawn cannot), optionally waits on stdin for the agent's "go" — sent once the
# process is in its cgroup, so not one instruction of the renter's runs outside it — and
# execs the program: the pid the agent recorded becomes the renter's program.
# Exit 125: the agent never said "go"; 126: no folder; 127: no program.
_SH: Final = "/bin/sh"
_SHIM_CD: Final = 'cd -- "$1" || exit 126; unset OLDPWD; shift; '
_SHIM_GATE: Final = 'IFS= read -r go && [ "$go" = go ] || exit 125; '
_SHIM_EXEC: Final = 'exec "$@" </dev/null'
# A uid-isolated workload's program is not the recorded pid's: that stays this root shell,
# waiting for ``unshare``. SIGTERM to the group reaches the program (the namespace's init,
# PID 1, ignores it), and an exit of 128+N — the init saying "killed by signal N" — becomes
# this shell dying of signal N, so the manager sees the exit a bare process would give
# (``-N``; core dumps off for the ones that would dump). Stop signals are left as codes.
_SHIM_WAIT: Final = (
    'trap : TERM; "$@" </dev/null; s=$?; trap - TERM; '
    'case $s in 129|130|137|138|140|141|142|143|154|155|157|158) kill -$((s - 128)) $$;; '
    '131|132|133|134|135|136|139|152|153|159) ulimit -c 0; kill -$((s - 128)) $$;; esac; exit $s'
)


def limits_of(spec: ProcessWorkload, ceilings: Ceilings | None = None) -> ResourceLimits:
    """The cgroup limits of a workload: its ``ceilings`` (the manager's, every one set), else only what ``spec`` names."""
    if ceilings is not None:
        return ResourceLimits(cpu_cores=ceilings.cpu_cores, memory_mib=ceilings.memory_mib, pids=ceilings.pids_limit)
    return ResourceLimits(cpu_cores=spec.cpu_cores, memory_mib=spec.memory_mib, pids=spec.pids_limit)


def share_environment(share: GpuShare) -> dict[str, str]:
    """What a workload on a GPU share is told: the share itself, and the CUDA MPS client limits.

    The workload sees one device, so the pinned memory limit names device ``0``. These
    limits bind only where an MPS control daemon serves the GPU: the agent starts none.
    """
    env = {
        "GPUMARKET_GPU_MILLI": str(share.milli),
        "GPUMARKET_GPU_MEMORY_MIB": str(share.memory_mib),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, share.milli * 100 // MILLI_PER_GPU)),
    }
    if share.memory_mib:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={share.memory_mib}M"
    return env


def workload_environment(
    rental_id: str, gpus: Sequence[str], extra: Mapping[str, str], *, home: Path, share: GpuShare | None
) -> dict[str, str]:
    """A workload's whole environment: only its GPUs visible, nothing of the agent's but ``PASSED_ENV``."""
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


def spawn(
    argv: Sequence[str], *, folder: Path, env: Mapping[str, str], gated: bool, cwd: Path | None = None, env_fd: int | None = None
) -> tuple[int, int | None]:
    """Start ``argv`` in ``cwd`` (default ``folder``) in a new session, output to ``folder``'s log;
    returns the pid and, when ``gated``, the pipe end that releases it (write ``go``), which the
    caller closes. With ``env_fd`` (uid isolation: ``env`` is then the root steps' clean one) that
    descriptor becomes ``ENV_FD`` and the shim waits for the program instead of becoming it."""
    script = _SHIM_CD + (_SHIM_GATE if gated else "") + (_SHIM_EXEC if env_fd is None else _SHIM_WAIT)
    # Whatever the agent ignores (Python ignores SIGPIPE and SIGXFSZ) the workload must not inherit.
    ignored = [s for s in signal.valid_signals() if signal.getsignal(s) == signal.SIG_IGN]
    log_fd = os.open(folder / LOG_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    gate_read = gate_write = -1
    try:
        stdin: tuple[Any, ...] = (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)
        if gated:
            gate_read, gate_write = os.pipe()
            stdin = (os.POSIX_SPAWN_DUP2, gate_read, 0)
        actions = [stdin, (os.POSIX_SPAWN_DUP2, log_fd, 1), (os.POSIX_SPAWN_DUP2, log_fd, 2)]
        if env_fd is not None:
            actions.append((os.POSIX_SPAWN_DUP2, env_fd, ENV_FD))
        pid = os.posix_spawn(
            _SH, [_SH, "-c", script, "gpumarket-shim", str(cwd or folder), *argv], dict(env),
            file_actions=actions, setsid=True, setsigdef=ignored,
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


def resolve_program(name: str, *, path: str, folder: Path) -> str:
    if "/" in name:
        candidate = Path(name) if os.path.isabs(name) else folder / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
        raise BadRequest(f"cannot start {name!r}: no executable file at {candidate}", code="program_not_executable")
    found = shutil.which(name, path=path)
    if found is None:
        raise BadRequest(f"cannot start {name!r}: not found on PATH {path}", code="program_not_executable")
    return found


def limits_report(limits: ResourceLimits, placement: Placement) -> dict[str, Any]:
    report: dict[str, Any] = {"cpu_cores": limits.cpu_cores, "memory_mib": limits.memory_mib, "pids_limit": limits.pids}
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


class ProcessRuntime:
    """Runs ``ProcessWorkload``s, each in its cgroup from ``cgroups``: under a uid of its own
    from ``users`` when given, else (only where ``isolation`` allows it) as the agent's user.

    ``isolation`` defaults to what ``users`` implies, with unisolated workloads refused.
    ``kill_timeout`` bounds the wait for a rental's last processes when it is removed.
    """

    def __init__(
        self,
        work_dir: Path,
        cgroups: CgroupLimiter,
        *,
        users: RentalUsers | None = None,
        isolation: IsolationFacts | None = None,
        kill_timeout: float = 5.0,
    ) -> None:
        self.work_dir = work_dir
        self.cgroups = cgroups
        self.users = users
        if isolation is None:
            found = ProcessIsolation("uid", "", users.tools) if users is not None else ProcessIsolation("none", "no rental users configured")
            isolation = isolation_facts(found, container_engine=None, allow_unisolated=False)
        if isolation.process_isolation == "uid" and users is None:
            raise ConfigError("the isolation facts promise uid isolation, but no rental users were given")
        self.isolation = isolation
        self.kill_timeout = kill_timeout
        self.disks: LoopDisks | None = None  # size-capped homes (the manager's ceiling policy), under uid isolation

    async def prepare(self, spec: ProcessWorkload) -> None:
        """Nothing to wait for."""

    def start(
        self, rental_id: str, gpus: list[str], spec: ProcessWorkload, share: GpuShare | None, ceilings: Ceilings | None = None
    ) -> tuple[Workload, dict[str, Any]]:
        """Start the workload within ``ceilings`` (its cgroup's CPU, memory and pids; its home's size where the
        agent has loop disks and a user per rental). Blocking for a few ms (``mkfs`` and ``mount`` of a home)."""
        check_workload_allowed("process", self.isolation)
        folder = self.work_dir / rental_id
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        user = None if self.users is None else self.users.claim(rental_id)
        try:
            disk = None
            if user is not None and self.disks is not None and ceilings is not None and ceilings.disk_gib is not None:
                self.disks.ensure(rental_id, ceilings.disk_gib, owner=(user.uid, user.gid), mountpoint=user.home)
                disk = ceilings.disk_gib
            workload, result = self._start(rental_id, gpus, spec, share, folder, user, ceilings)
            result.update(disk_gib=disk, disk_quota="none" if disk is None else "loop")
            return workload, result
        except BaseException:
            if user is not None and self.users is not None:
                self.users.networks.remove(user.uid)
                if self.disks is not None:
                    self.disks.release(rental_id, mountpoint=user.home)
                self.users.release(user)
            raise

    def _start(
        self, rental_id: str, gpus: list[str], spec: ProcessWorkload, share: GpuShare | None, folder: Path, user: RentalUser | None,
        ceilings: Ceilings | None,
    ) -> tuple[Workload, dict[str, Any]]:
        home = folder if user is None else user.home
        env = workload_environment(rental_id, gpus, spec.env, home=home, share=share)
        if user is None:
            program = resolve_program(spec.argv[0], path=env["PATH"], folder=folder)
            command, spawn_env = [program, *spec.argv[1:]], env
        else:
            assert self.users is not None
            # The uid names no user in /etc/passwd; getpass.getuser() (torch's caches, ...) reads these first.
            for name in ("USER", "LOGNAME"):
                env.setdefault(name, f"rental-{user.uid}")
            program = resolve_program_for(spec.argv[0], path=env["PATH"], home=home, user=user)
            netns = self.users.networks.create(user.uid)  # its own loopback; a guarded veth once the guard is in place
            command = isolated_argv(user, self.users.tools, program, spec.argv[1:], netns=netns)
            spawn_env = {"PATH": TRUSTED_PATH}
        limits = limits_of(spec, ceilings)
        placement = self.cgroups.create(rental_id, limits)
        argv = [*placement.argv_prefix, *command]
        env_fd = None if user is None else environment_fd(env)
        try:
            pid, gate = spawn(argv, folder=folder, env=spawn_env, gated=bool(placement.cgroup_dirs), cwd=home, env_fd=env_fd)
        except OSError as exc:
            remove_cgroups(placement.cgroup_dirs)
            raise BadRequest(f"cannot start {spec.argv[0]!r}: {exc.strerror or exc}", code="workload_start_failed") from None
        finally:
            if env_fd is not None:
                os.close(env_fd)
        if gate is not None:
            try:
                self.cgroups.attach(placement, pid)
            except OSError as exc:
                # Degrade like a host without cgroups: the process runs, unlimited, and says why.
                error = f"cannot move the workload into {placement.cgroup_dirs[0]}: {exc.strerror or exc}"
                log.warning("rental %s: %s", rental_id, error)
                remove_cgroups(placement.cgroup_dirs)
                placement = Placement(error=error)
            finally:
                with contextlib.suppress(BrokenPipeError):
                    os.write(gate, b"go\n")
                os.close(gate)
        if limits.requested and not placement.placed:
            log.warning("rental %s runs without its CPU/memory limits: %s", rental_id, placement.error)
        stat = proc_stat(pid)
        workload = Workload(
            rental_id, "process", gpus, now_iso(), pid=pid, start_time=None if stat is None else stat.start_time, placement=placement
        )
        result: dict[str, Any] = {"kind": "process", "pid": pid, **limits_report(limits, placement)}
        result["isolation"] = "none" if user is None else "uid"
        if user is not None:
            result["uid"] = user.uid
            result["network"] = "own namespace, guarded egress" if self.users is not None and self.users.networks.egress else "own namespace, loopback only"
            log.info("rental %s runs as uid %d in %s", rental_id, user.uid, user.home)
        return workload, result

    async def remove(self, workload: Workload) -> None:
        """Under uid isolation: kill every process of the rental's uid, then remove its home and
        give the uid back (kept while a process of it survives). Cancelling is safe: the work
        finishes in its thread, and a later ``remove`` finds the uid still claimed."""
        if self.users is None:
            return
        user = self.users.lookup(workload.rental_id)
        if user is not None:
            await asyncio.to_thread(self._kill_and_release, user)

    def _kill_and_release(self, user: RentalUser) -> None:
        assert self.users is not None
        deadline = time.monotonic() + self.kill_timeout
        while user.uid in running_uids():
            kill_uid(user, self.users.tools, timeout=max(0.1, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        self.users.networks.remove(user.uid)  # a survivor keeps no way out
        if user.uid in running_uids():
            self.users.release(user)  # keeps the uid and home (and so its disk) while a process of it survives
            return
        if self.disks is not None:
            self.disks.release(user.rental_id, mountpoint=user.home)
        self.users.release(user)
