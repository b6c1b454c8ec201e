"""Processes by pid and kernel start time: reading ``/proc``, signalling process groups, waiting.

A pid and its start time (``/proc/<pid>/stat`` field 22) name one process for good: a
reused pid has another start time. ``ProcessHandle`` waits for one process, whether the
agent spawned it in this life or adopted it after a restart, and reaps it when it is ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)


class ProcStat(NamedTuple):
    state: str  # "R", "S", "Z" (zombie), ...
    process_group: int
    start_time: int  # field 22: clock ticks after boot


def proc_stat(pid: int) -> ProcStat | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()  # the command name may itself contain ")"
    try:
        return ProcStat(fields[0], int(fields[2]), int(fields[19]))
    except (IndexError, ValueError):
        return None


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started (``/proc/<pid>/stat`` field 22), or ``None`` if it is not running.

    A pid and its start time name one process for good: a reused pid has another start time.
    """
    stat = proc_stat(pid)
    return None if stat is None or stat.state in ("Z", "X") else stat.start_time


def killpg(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        log.warning("not allowed to signal process group %d", pgid)


def group_alive(pgid: int) -> bool:
    """Whether a live process remains in the group (zombies, which no signal can end, do not count)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    for entry in os.scandir("/proc"):  # only when the group still has members: rare and short
        stat = proc_stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is not None and stat.process_group == pgid and stat.state not in ("Z", "X"):
            return True
    return False


class EndsOnce:
    """A workload handle's ending: ``exited`` and ``wait`` over ``_exited``, which the subclass resolves."""

    _exited: asyncio.Future[None]

    @property
    def exited(self) -> bool:
        return self._exited.done()

    async def wait(self, timeout: float | None) -> bool:
        """Whether the workload has ended, waiting up to ``timeout`` seconds. Cancelling is safe."""
        if not self._exited.done():
            await asyncio.wait({self._exited}, timeout=timeout)
        return self._exited.done()


class ProcessHandle(EndsOnce):
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
        stat = proc_stat(self.pid)
        if stat is None or (self.start_time is not None and stat.start_time != self.start_time):
            return True  # gone, reaped by someone else, or the pid now names another process
        if stat.state not in ("Z", "X"):
            return False
        with contextlib.suppress(ChildProcessError):
            waited, status = os.waitpid(self.pid, os.WNOHANG)
            if waited == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return True




def reap_if_ours(pid: int, start_time: int | None) -> int | None:
    """The exit code of a zombie that is our child (the agent is PID 1, or spawned it in this
    very process), else ``None`` — a process that is not our child leaves no exit code to us."""
    stat = proc_stat(pid)
    if stat is None or stat.start_time != start_time or stat.state not in ("Z", "X"):
        return None
    with contextlib.suppress(ChildProcessError):
        waited, status = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return os.waitstatus_to_exitcode(status)
    return None

