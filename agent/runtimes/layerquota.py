"""A container's writable layer against its rental's disk quota: can the engine bound it, and how much is written.

``storage_opt_supported`` asks whether the engine enforces ``--storage-opt size`` (``HostConfig.StorageOpt``)
on a container's writable layer; where it does not (overlay2 on ext4, as on this project's CI) the manager
watches the layer: every ``disk_check_interval`` it asks ``over_quota``, which reads the container's
``SizeRw`` (what it wrote outside its mounts, ``/workspace`` excluded), and stops a container over its
rental's ``disk_gib`` with the exit reason ``disk_quota_exceeded: ...`` (the renter's doing). Neither ever
raises: an engine that does not answer means "not supported" and "unknown".
"""

from __future__ import annotations

import asyncio
import os

import aiodocker

from agent.runtimes.base import Workload
from agent.runtimes.containeropts import ENGINE_ERRORS
from shared.protocol import DISK_QUOTA_EXCEEDED


async def storage_opt_supported(docker: aiodocker.Docker, *, timeout: float) -> bool:
    """Whether the engine enforces ``--storage-opt size`` on a container's writable layer: its storage driver is
    btrfs, zfs or devicemapper, or overlay2 on xfs — proven there by creating (not starting) a container with
    one from a local image, as project quotas need the ``pquota`` mount option. Never raises."""
    try:
        async with asyncio.timeout(timeout):
            info = await docker.system.info()
            driver = str(info.get("Driver") or "")
            backing = dict((str(k), str(v)) for k, v in info.get("DriverStatus") or () if isinstance(k, str))
            if driver in ("btrfs", "zfs", "devicemapper"):
                return True
            if driver != "overlay2" or backing.get("Backing Filesystem") != "xfs":
                return False
            images = await docker.images.list()
            if not images:
                return False
            probe = await docker.containers.create(
                {"Image": images[0]["Id"], "HostConfig": {"StorageOpt": {"size": "1G"}}}, name=f"gpumarket-probe-{os.getpid()}"
            )
            await probe.delete(force=True)
            return True
    except (ValueError, KeyError, TypeError, *ENGINE_ERRORS):
        return False


async def writable_layer_bytes(docker: aiodocker.Docker, workload: Workload, *, timeout: float) -> int | None:
    """What the rental's container has written outside its mounts (the engine's ``SizeRw``); None: unknown."""
    if workload.container is None:
        return None
    try:
        async with asyncio.timeout(timeout):
            info = await docker._query_json(f"containers/{workload.container[0]}/json", params={"size": "1"})
    except (ValueError, *ENGINE_ERRORS):
        return None
    size = info.get("SizeRw") if isinstance(info, dict) else None
    return size if isinstance(size, int) else None


async def over_quota(docker: aiodocker.Docker, workload: Workload, *, timeout: float) -> str | None:
    """Why the container must stop (``disk_quota_exceeded: ...``) when its writable layer outgrew its rental's
    ``disk_gib``; None: within it, no quota, or unknown."""
    if workload.disk_gib is None:
        return None
    written = await writable_layer_bytes(docker, workload, timeout=timeout)
    if written is None or written <= workload.disk_gib << 30:
        return None
    return (
        f"{DISK_QUOTA_EXCEEDED}: the container wrote {written / (1 << 30):.1f} GiB outside /workspace, "
        f"over its {workload.disk_gib} GiB quota"
    )
