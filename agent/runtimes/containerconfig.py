"""The engine's create body of a rental's container: what ``ContainerRuntime.start`` asks the engine for.

Its GPUs (``DeviceRequests`` by UUID where the engine has the NVIDIA toolkit, the environment always), the agent's
variables over the spec's and the image's, every capability dropped, ``no-new-privileges``, an init, the rental's
ceilings (memory without swap, CPU, pids, ``/dev/shm``; its writable layer's size where the engine enforces
``--storage-opt``), its own network and ``/workspace`` (a named volume, or its size-capped disk bind-mounted), and the
renter's volumes it mounts (``VolumeBind``: each a mounted filesystem of ``agent/volumes.py``, read-only where asked).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from agent.runtimes.containeropts import WORKSPACE, ContainerOptions, PreparedImage
from agent.runtimes.process import share_environment
from shared.ceilings import Ceilings
from shared.errors import BadRequest
from shared.protocol import ContainerWorkload, GpuShare, VolumeMount


class VolumeBind(NamedTuple):
    """One of the renter's volumes in the container: the host's mounted filesystem ``source`` at ``target``."""

    source: Path
    target: str
    read_only: bool


class VolumePaths(Protocol):
    """The renter's volumes on this host (``agent/volumes.py``'s ``VolumeStore``): where each is mounted."""

    def path(self, volume_id: str) -> Path:
        """The volume's mounted filesystem; raises ``BadRequest`` (``volume_not_found``) when it is not here."""
        ...


async def volume_binds(volumes: VolumePaths | None, mounts: Sequence[VolumeMount]) -> list[VolumeBind]:
    """Where each of ``mounts`` lies on this host (mounted again if a restart or a reboot left it unmounted), as the
    container's binds; ``BadRequest`` (``volume_not_found``) for one that is not here (``None``: this host keeps none)."""

    def path(volume_id: str) -> Path:
        if volumes is None:
            raise BadRequest(f"volume {volume_id} is not on this host: it keeps no volumes", code="volume_not_found")
        return volumes.path(volume_id)

    return [VolumeBind(await asyncio.to_thread(path, mount.volume_id), mount.mount, mount.read_only) for mount in mounts]


def create_body(
    options: ContainerOptions, rental_id: str, gpus: list[str], spec: ContainerWorkload, image: PreparedImage, share: GpuShare | None,
    *, user: str, name: str, labels: dict[str, str], ceilings: Ceilings | None = None, disk: Path | None = None,
    device_requests: bool, storage_opt: bool, volumes: Sequence[VolumeBind] = (), devices: Sequence[str] = (),
) -> dict[str, Any]:
    """The engine's create body: ``ceilings`` (default: the options' defaults) become its memory, CPU, pids
    and (where the engine enforces it) writable-layer limits; ``disk`` (a mounted size-capped filesystem) is
    bind-mounted at ``/workspace`` instead of the rental's named volume; each of ``volumes`` at its target; ``devices``
    (a cluster member's RDMA devices on a trusted fabric, ``/dev/infiniband/*``) at their own paths, read-write, with
    locked memory unbounded (RDMA registers its buffers: no capability is given back for it)."""
    visible = ",".join(gpus)
    env = dict(spec.env)
    image_env = {item.partition("=")[0] for item in image.env}
    if "HOME" not in env and "HOME" not in image_env:
        env["HOME"] = WORKSPACE
    # The agent's GPU variables win over the spec's and the image's (CUDA images set NVIDIA_VISIBLE_DEVICES=all).
    env.update(
        NVIDIA_VISIBLE_DEVICES=visible or "void", CUDA_VISIBLE_DEVICES=visible,
        GPUMARKET_GPU_UUIDS=visible, GPUMARKET_RENTAL_ID=rental_id,
    )
    if share is not None:
        env.update(share_environment(share))
    if ceilings is not None:
        memory_mib: int | None = ceilings.memory_mib or None
        cpu_cores: float | None = ceilings.cpu_cores
        pids_limit = ceilings.pids_limit
    else:
        memory_mib = spec.memory_mib if spec.memory_mib is not None else options.default_memory_mib
        cpu_cores = spec.cpu_cores if spec.cpu_cores is not None else options.default_cpu_cores
        pids_limit = spec.pids_limit or options.default_pids_limit
    mount: dict[str, Any] = {"Type": "volume", "Source": name, "Target": WORKSPACE}
    if disk is not None:
        mount = {"Type": "bind", "Source": str(disk), "Target": WORKSPACE, "BindOptions": {"Propagation": "rprivate"}}
    host: dict[str, Any] = {
        "CapDrop": ["ALL"],
        "SecurityOpt": ["no-new-privileges"],
        "Privileged": False,
        "ReadonlyRootfs": False,
        "Init": True,
        "PidsLimit": pids_limit,
        "ShmSize": (spec.shm_mib or options.default_shm_mib) << 20,
        "IpcMode": "private",
        "NetworkMode": name if options.isolate_network else "bridge",
        "Mounts": [mount, *(
            {"Type": "bind", "Source": str(v.source), "Target": v.target, "ReadOnly": v.read_only,
             "BindOptions": {"Propagation": "rprivate"}} for v in volumes
        )],
        "RestartPolicy": {"Name": "no"},
        "LogConfig": {"Type": "local", "Config": {"max-size": f"{options.log_max_mib}m", "max-file": "2", "compress": "false"}},
        "PublishAllPorts": False,
    }
    if memory_mib is not None:
        host["Memory"] = host["MemorySwap"] = memory_mib << 20
    if cpu_cores is not None:
        host["NanoCpus"] = int(cpu_cores * 1e9)
    if ceilings is not None and ceilings.disk_gib is not None and storage_opt:
        host["StorageOpt"] = {"size": f"{ceilings.disk_gib}G"}
    if devices:
        host["Devices"] = [{"PathOnHost": d, "PathInContainer": d, "CgroupPermissions": "rw"} for d in devices]
        host["Ulimits"] = [{"Name": "memlock", "Soft": -1, "Hard": -1}]
    if device_requests and gpus:
        host["DeviceRequests"] = [{"Driver": "nvidia", "DeviceIDs": list(gpus), "Capabilities": [["gpu"]]}]
    config: dict[str, Any] = {
        "Image": image.id,
        "User": user,
        "WorkingDir": WORKSPACE,
        "Env": [f"{k}={v}" for k, v in env.items()],
        "Labels": {**labels, "gpumarket.image": spec.image},
        "ExposedPorts": {f"{port}/tcp": {} for port in spec.ports},
        "Tty": False, "OpenStdin": False, "AttachStdin": False,
        "HostConfig": host,
    }
    if spec.command is not None:
        config["Entrypoint"] = list(spec.command)
    if spec.args is not None:
        config["Cmd"] = list(spec.args)
    return config
