"""Ending a workload's processes: SIGTERM then SIGKILL to a process workload's group, and killing what any
workload left behind (its process group, its cgroups, its container) before its cgroups are removed.

The manager (``agent.runtimes.manager``) calls ``terminate`` from a stop and ``clean_up`` after every end
(a stop, an exit, one found dead at start-up); ``remove`` is the workload's runtime's (a container's removes
it and its network). Bounded by ``grace`` and ``kill_timeout``: what survives them is logged, never waited on.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Final

from agent.runtimes.base import Workload, WorkloadHandle
from agent.runtimes.cgroups import cgroup_members, kill_cgroups, remove_cgroups
from agent.runtimes.pids import group_alive, killpg

log = logging.getLogger(__name__)

_LEFTOVER_POLL_S: Final = 0.01

Remove = Callable[[Workload], Awaitable[None]]


async def terminate(workload: Workload, handle: WorkloadHandle, remove: Remove, *, grace: float, kill_timeout: float) -> None:
    """SIGTERM to the workload's process group; ``grace`` seconds later, if it still runs, its runtime's
    ``remove``, SIGKILL to the group and its cgroups, and ``kill_timeout`` more to die."""
    assert workload.pid is not None
    killpg(workload.pid, signal.SIGTERM)
    if await handle.wait(grace):
        return
    log.warning("rental %s ignored SIGTERM for %.1fs; killing it", workload.rental_id, grace)
    await remove(workload)
    killpg(workload.pid, signal.SIGKILL)
    kill_cgroups(workload.placement.cgroup_dirs)
    if not await handle.wait(kill_timeout):
        log.error("rental %s: pid %d survived SIGKILL for %.1fs", workload.rental_id, workload.pid, kill_timeout)


async def clean_up(workload: Workload, remove: Remove, *, kill_timeout: float, kill_group: bool = True) -> None:
    """Kill what the workload left (its process group, its cgroup, its container: ``remove``) and remove its cgroup.

    ``kill_group=False`` for a workload found dead at start-up: its pid (the group id) may
    name another process by now, but its cgroup and its container are still its own.
    """
    group = workload.pid if kill_group else None
    if group is not None:
        killpg(group, signal.SIGKILL)
    kill_cgroups(workload.placement.cgroup_dirs)
    await remove(workload)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + kill_timeout
    while (group is not None and group_alive(group)) or cgroup_members(workload.placement.cgroup_dirs):
        if loop.time() >= deadline:
            log.warning("rental %s: processes remain %.1fs after SIGKILL", workload.rental_id, kill_timeout)
            break
        await asyncio.sleep(_LEFTOVER_POLL_S)
    remove_cgroups(workload.placement.cgroup_dirs)
