"""The ``container`` runtime: a ``ContainerWorkload``'s image run through the Docker Engine API (aiodocker).

The agent talks to the engine over its socket (``ContainerOptions.docker_url``; Podman's
compatible socket works the same way) — never a CLI, never a shell. Each rental gets:

- a container ``gpumarket-<rental_id>-<owner tag>``, labelled ``gpumarket.rental=<id>`` and
  ``gpumarket.owner=<owner>`` (several agents on one engine never touch each other's);
- its GPUs only: on a real NVIDIA host through ``HostConfig.DeviceRequests`` by UUID (the
  NVIDIA Container Toolkit), on a simulated backend through the environment alone;
  ``NVIDIA_VISIBLE_DEVICES``, ``CUDA_VISIBLE_DEVICES``, ``GPUMARKET_GPU_UUIDS`` and
  ``GPUMARKET_RENTAL_ID`` are always set by the agent, over the spec's and the image's;
- a non-root user (``ContainerOptions.user``) unless the image names one, every capability
  dropped, ``no-new-privileges``, the engine's default seccomp profile, an init (PID 1 that
  reaps and forwards signals), pids, memory (no swap), CPU and ``/dev/shm`` limits;
- one named volume at ``/workspace`` (its working directory and ``HOME`` unless the image
  sets one), made writable by the container's user; no host path, no engine socket;
- a bridge network of its own (``gm`` + hash, inter-container traffic off) on a small
  subnet from ``subnet_pool``: it reaches outward through the engine's NAT; the host and
  link-local metadata are shut off by ``agent.runtimes.netguard``.

Output: the engine keeps it with its ``local`` log driver (bytes as written, two files of
``log_max_mib``); a ``ContainerHandle`` (``agent.runtimes.containerlogs``) follows that stream (stdout and stderr, with
timestamps) into the rental's ``output.log``; the last timestamp copied is kept in
``container.since`` (at most a second old), so a restarted agent resumes from there: after
a ``kill -9`` up to a second of output may appear twice, none is lost while the engine keeps it.
The same handle notices the exit (the stream ends, the engine's state says so) and its code.

Facts for the host's hello: ``facts()`` (the engine's name and version, or why none answers;
the network guard's state). The image's policy check and pull are ``agent.runtimes.containerimages``'; the create
body is ``agent.runtimes.containerconfig``'s; whether the engine bounds the writable layer, and what a container
wrote there, ``agent.runtimes.layerquota``'s.

Lifetime: ``stop``/exit removes the container and its network; the volume stays until
``forget_volume`` (the rental is forgotten). ``sweep`` removes this owner's containers,
networks and volumes that no rental owns.
"""


from __future__ import annotations

import asyncio
import contextlib
import io
import ipaddress
import json
import logging
import math
import os
import tarfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aiodocker
import aiohttp
from aiodocker.exceptions import DockerError

from agent.runtimes.base import Workload
from agent.runtimes.ceilings import DiskQuota
from agent.runtimes.containerconfig import VolumeBind, create_body
from agent.runtimes.containerimages import check_image, pull_image
from agent.runtimes.containerlogs import ContainerHandle
from agent.runtimes.containeropts import (
    DEFAULT_SOCKET,
    ENGINE_ERRORS,
    OWNER_LABEL,
    RENTAL_LABEL,
    SINCE_NAME,
    ContainerFacts,
    ContainerOptions,
    PreparedImage,
    ProgressCallback,
    ProgressStage,
    bridge_name,
    resource_name,
)
from agent.runtimes.diskquota import LoopDisks
from agent.runtimes.netguard import NetGuardStatus, install_guard
from agent.runtimes.netns import NamespaceUnavailable, connect_in_namespace
from agent.runtimes.registry_login import SealedLogin
from shared.ceilings import Ceilings
from shared.errors import BadRequest
from shared.imageref import ImageReference
from shared.protocol import ContainerWorkload, GpuShare

log = logging.getLogger(__name__)
T = TypeVar("T")

# What runc (through the engine) says when the container's program cannot be executed: `exec: "x": executable file not
# found in $PATH`, `exec: "/x": stat /x: no such file or directory`, `exec: "/x": permission denied`.
_PROGRAM_NOT_EXECUTABLE = "unable to start container process: exec:"


def start_failure_code(message: str) -> str:
    """The stable code of a container the engine would not start: ``program_not_executable`` when the OCI runtime
    could not execute the image's program (the renter's command or entrypoint), else ``workload_start_failed``."""
    return "program_not_executable" if _PROGRAM_NOT_EXECUTABLE in message else "workload_start_failed"


class ContainerRuntime:
    """Runs ``ContainerWorkload``s through one engine, owned by ``options.owner``.

    Not a ``base.Runtime``: ``start`` waits on the engine (the manager reserves the GPUs
    meanwhile); ``remove`` has the same meaning. ``close`` ends the followers and the session.
    """

    def __init__(
        self, work_dir: Path, options: ContainerOptions, *, device_requests: bool, on_progress: ProgressCallback | None = None
    ) -> None:
        self.work_dir = work_dir
        self.options = options
        self.device_requests = device_requests if options.device_requests is None else options.device_requests
        self.on_progress = on_progress
        self.network_guard: NetGuardStatus | None = None  # None: not tried yet
        self._docker: aiodocker.Docker | None = None
        self._connector: aiohttp.BaseConnector | None = None
        self._followers: set[asyncio.Task[None]] = set()
        self._network_lock: asyncio.Lock | None = None
        self._taken_subnets: set[ipaddress.IPv4Network] = set()
        self.disks: LoopDisks | None = None  # size-capped /workspace filesystems (the manager's ceiling policy)
        self.disk_quota: DiskQuota = "none"  # how a rental's writable layer is bounded: "storage_opt" (the engine), "loop" (watched)

    # ---- the engine ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.options.docker_url or os.environ.get("DOCKER_HOST") or DEFAULT_SOCKET

    def docker(self) -> aiodocker.Docker:
        if self._docker is None:
            url = self.url
            if url.startswith("unix://"):
                # Our own connector: a follower per running container holds one connection each.
                self._connector = aiohttp.UnixConnector(url.removeprefix("unix://"), limit=0)
                self._docker = aiodocker.Docker(url="unix://localhost", connector=self._connector)
            else:
                self._docker = aiodocker.Docker(url=url)
        return self._docker

    def unavailable(self, exc: BaseException | str) -> BadRequest:
        return BadRequest(
            f"the container engine at {self.url} does not answer ({exc}): install and start docker "
            "(`apt-get install docker.io`, `systemctl start docker`; with the NVIDIA Container Toolkit on GPU hosts) "
            "or point the agent's docker_url at a podman/docker socket",
            code="container_runtime_unavailable",
        )

    async def ping(self) -> None:
        try:
            async with asyncio.timeout(self.options.engine_timeout):
                await self._ping()
        except ENGINE_ERRORS as exc:
            raise self.unavailable(exc) from None

    async def facts(self) -> ContainerFacts:
        """Ask the engine its version and put the network guard in place (idempotent); never raises."""
        try:
            async with asyncio.timeout(self.options.engine_timeout):
                version = await self.docker().version()
        except (ValueError, *ENGINE_ERRORS) as exc:
            guard = self.network_guard or NetGuardStatus(False, "no container engine")
            return ContainerFacts(None, str(self.unavailable(exc).message), guard)
        if self.options.isolate_network and (self.network_guard is None or not self.network_guard.active):
            self.network_guard = await install_guard(policy=self.options.egress)
        guard = self.network_guard or NetGuardStatus(False, "isolate_network is off: rentals share the engine's default bridge")
        name = "podman" if "podman" in json.dumps(version.get("Components") or []).lower() else "docker"
        return ContainerFacts(f"{name} {version.get('Version', '?')}", "", guard)

    async def _ping(self) -> None:
        async with self.docker()._query("_ping", method="GET", versioned_api=False) as response:
            await response.read()

    async def close(self) -> None:
        """Stop following logs (the containers keep running) and close the engine session."""
        for task in list(self._followers):
            task.cancel()
        if self._followers:
            await asyncio.wait(set(self._followers))
        if self._docker is not None:
            await self._docker.close()
            self._docker = None
        if self._connector is not None:
            await self._connector.close()
            self._connector = None

    # ---- images -------------------------------------------------------------------------

    def check_image(self, image: str) -> ImageReference:
        """``image`` parsed and allowed by this host's policy, else ``BadRequest`` (``containerimages.check_image``)."""
        return check_image(image, self.options.allowed_images)

    async def prepare(self, rental_id: str, spec: ContainerWorkload, registry_auth: SealedLogin | None = None) -> PreparedImage:
        """Check the image against the policy, pull it when it is not here (reporting progress), check its size.

        ``registry_auth`` is opened with the host's key only when a pull is needed, and goes to the engine with that
        pull only (the ``X-Registry-Auth`` header); nothing keeps it. One that does not open fails the start with
        ``registry_auth_unreadable`` (the platform's fault) before the registry is asked.
        A registry that refuses the login or knows no such image fails the start as the renter's doing
        (``registry_auth_failed``, ``image_not_found``, with the registry's words); any other pull failure is
        ``image_pull_failed``. Cancelling is safe: a pull cancelled half-way leaves the engine's partial layers, as
        ``docker pull`` would.
        """
        reference = self.check_image(spec.image)
        await self.ping()
        pulled = False
        info = await self._inspect_image(spec.image)
        if info is None:
            await self._pull(rental_id, spec.image, reference, registry_auth)
            pulled = True
            info = await self._inspect_image(spec.image)
            if info is None:
                raise BadRequest(f"image {spec.image} was pulled but the engine does not list it", code="image_pull_failed")
        size = int(info.get("Size") or 0)
        limit = self.options.max_image_mib
        if limit is not None and size > limit << 20:
            if pulled:
                with contextlib.suppress(*ENGINE_ERRORS):
                    async with asyncio.timeout(self.options.engine_timeout):
                        await self.docker().images.delete(info["Id"])
            raise BadRequest(
                f"image {spec.image} is {size / (1 << 20):.0f} MiB; this host runs images of at most {limit} MiB",
                code="image_too_large",
            )
        config = info.get("Config") or {}
        return PreparedImage(
            id=str(info["Id"]), user=str(config.get("User") or ""), env=tuple(config.get("Env") or ()), size=size, pulled=pulled
        )

    async def _inspect_image(self, image: str) -> dict[str, Any] | None:
        return await self._engine_read(self.docker().images.inspect(image))

    async def _engine_read(self, call: Awaitable[T]) -> T | None:
        """One read from the engine: ``None`` for 404, ``BadRequest`` (``unavailable``) when it does not answer."""
        try:
            async with asyncio.timeout(self.options.engine_timeout):
                return await call
        except DockerError as exc:
            if exc.status == 404:
                return None
            raise self.unavailable(exc.message) from None
        except ENGINE_ERRORS as exc:
            raise self.unavailable(exc) from None

    async def _pull(self, rental_id: str, image: str, reference: ImageReference, registry_auth: SealedLogin | None = None) -> None:
        async def progress(stage: ProgressStage, text: str, percent: float | None) -> None:
            await self._progress(rental_id, stage, text, percent)

        try:
            await pull_image(self.docker(), self.options, image, reference, registry_auth, progress)
        except (aiohttp.ClientError, OSError) as exc:
            raise self.unavailable(exc) from None

    async def _progress(self, rental_id: str, stage: ProgressStage, text: str, percent: float | None) -> None:
        if self.on_progress is None:
            return
        try:
            await self.on_progress(rental_id, stage, text, percent)
        except Exception:
            log.exception("rental %s: on_progress failed", rental_id)

    # ---- start ---------------------------------------------------------------------------

    async def start(
        self, workload: Workload, spec: ContainerWorkload, image: PreparedImage, share: GpuShare | None, ceilings: Ceilings | None = None,
        volumes: Sequence[VolumeBind] = (), devices: Sequence[str] = (),
    ) -> dict[str, Any]:
        """Make the rental's network, volume (or its size-capped disk) and container and start it, within
        ``ceilings`` (default: the options' defaults), with the renter's ``volumes`` bind-mounted; fills in
        ``workload.container``.

        All or nothing: on any failure (or cancellation) the container and network made
        here are removed (the volume or disk stays, like a stopped rental's, until forgotten).
        """
        ceilings = ceilings or Ceilings(
            cpu_cores=self.options.default_cpu_cores or float(os.cpu_count() or 1), memory_mib=self.options.default_memory_mib or 0,
            pids_limit=self.options.default_pids_limit, disk_gib=None,
        )
        rental_id, owner = workload.rental_id, self.options.owner
        name = resource_name(rental_id, owner)
        labels = {RENTAL_LABEL: rental_id, OWNER_LABEL: owner}
        folder = self.work_dir / rental_id
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            (folder / SINCE_NAME).unlink()  # a new container: its whole log
        await self._progress(rental_id, "starting", f"starting {spec.image}", None)
        if self.options.isolate_network and self.network_guard is None:
            self.network_guard = await install_guard(policy=self.options.egress)
            if not self.network_guard.active:
                log.warning("container network guard is off: %s", self.network_guard.reason)
        user = image.user or self.options.user
        disk = None
        if ceilings.disk_gib is not None and self.disks is not None:
            uid, _, gid = user.partition(":")
            disk_owner = (int(uid), int(gid or uid)) if uid.isdigit() and (not gid or gid.isdigit()) else (0, 0)  # a name: chowned below
            disk = await asyncio.to_thread(self.disks.ensure, rental_id, ceilings.disk_gib, owner=disk_owner)
        config = self.container_config(
            rental_id, workload.gpu_uuids, spec, image, share, user=user, name=name, labels=labels, ceilings=ceilings, disk=disk,
            volumes=volumes, devices=devices,
        )
        docker = self.docker()
        try:
            async with asyncio.timeout(self.options.engine_timeout * 4):
                await self._remove_container(name)  # a leftover of a start that failed half-way
                if self.options.isolate_network:
                    await self._network(rental_id, name, labels)
                if disk is None:
                    await self._volume(name, labels)
                container = await docker.containers.create(config, name=name)
                workload.container = (container.id, name)
                # /workspace belongs to the container's user: the engine chowns the tar's one dir entry to it.
                await self._own_workspace(container.id, user)
                await container.start()
        except BaseException as exc:
            await asyncio.shield(self._remove_named(name))
            workload.container = None
            if isinstance(exc, DockerError):
                raise BadRequest(f"the engine refused to start {spec.image}: {exc.message}", code=start_failure_code(str(exc.message))) from None
            if isinstance(exc, aiohttp.ClientError | OSError | TimeoutError):
                raise self.unavailable(exc) from None
            raise
        limits = {
            "cpu_cores": ceilings.cpu_cores, "memory_mib": ceilings.memory_mib or None, "pids_limit": ceilings.pids_limit,
            "shm_mib": spec.shm_mib or self.options.default_shm_mib, "disk_gib": ceilings.disk_gib,
            "disk_quota": self.disk_quota if ceilings.disk_gib is not None else "none",
        }
        return {
            "kind": "container", "pid": None, "container": name, "container_id": container.id[:12], "image": spec.image,
            "user": user, "gpus": "device_requests" if self.device_requests else "environment",
            "network": name if self.options.isolate_network else "bridge",
            "network_guard": None if self.network_guard is None else self.network_guard.active,
            "limits": "applied", **limits,
        }

    def container_config(
        self, rental_id: str, gpus: list[str], spec: ContainerWorkload, image: PreparedImage, share: GpuShare | None,
        *, user: str, name: str, labels: dict[str, str], ceilings: Ceilings | None = None, disk: Path | None = None,
        volumes: Sequence[VolumeBind] = (), devices: Sequence[str] = (),
    ) -> dict[str, Any]:
        """The engine's create body (``containerconfig.create_body``) with this runtime's options and disk quota."""
        return create_body(
            self.options, rental_id, gpus, spec, image, share, user=user, name=name, labels=labels, ceilings=ceilings, disk=disk,
            device_requests=self.device_requests, storage_opt=self.disk_quota == "storage_opt", volumes=volumes, devices=devices,
        )

    async def _own_workspace(self, container_id: str, user: str) -> None:
        """Make ``/workspace`` the container user's: a tar of that one directory, extracted by the engine.

        A numeric ``uid[:gid]`` goes in the tar entry; a user name is resolved by the engine
        in the image's ``/etc/passwd`` (``copyUIDGID``).
        """
        uid, _, gid = user.partition(":")
        numeric = uid.isdigit() and (not gid or gid.isdigit())
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            entry = tarfile.TarInfo("workspace")
            entry.type, entry.mode, entry.mtime = tarfile.DIRTYPE, 0o700, int(time.time())
            if numeric:
                entry.uid, entry.gid = int(uid), int(gid or uid)
            tar.addfile(entry)
        params = {"path": "/"} if numeric else {"path": "/", "copyUIDGID": "1"}
        async with self.docker()._query(  # aiodocker's put_archive cannot ask for copyUIDGID
            f"containers/{container_id}/archive", method="PUT", data=buffer.getvalue(),
            headers={"content-type": "application/x-tar"}, params=params,
        ) as response:
            await response.read()

    async def _network(self, rental_id: str, name: str, labels: dict[str, str]) -> None:
        docker = self.docker()
        if self._network_lock is None:
            self._network_lock = asyncio.Lock()
        async with self._network_lock:
            with contextlib.suppress(DockerError):
                existing = await docker.networks.get(name)
                await existing.delete()  # a leftover of a start that failed half-way
            pool = ipaddress.IPv4Network(self.options.subnet_pool)
            in_use = set(self._taken_subnets)
            for network in await docker.networks.list():
                for entry in (network.get("IPAM") or {}).get("Config") or ():
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        in_use.add(ipaddress.ip_network(entry["Subnet"]))  # type: ignore[arg-type]
            for attempt in range(8):
                subnet = next((s for s in pool.subnets(new_prefix=self.options.subnet_prefix) if not any(s.overlaps(u) for u in in_use)), None)
                if subnet is None:
                    raise BadRequest(f"no free /{self.options.subnet_prefix} subnet left in {pool} for another rental network", code="workload_start_failed")
                try:
                    await docker.networks.create({
                        "Name": name, "Driver": "bridge", "CheckDuplicate": True, "Internal": False, "Attachable": False,
                        "Labels": labels,
                        "IPAM": {"Driver": "default", "Config": [{"Subnet": str(subnet)}]},
                        "Options": {
                            "com.docker.network.bridge.name": bridge_name(rental_id, self.options.owner),
                            "com.docker.network.bridge.enable_icc": "false",
                            "com.docker.network.bridge.enable_ip_masquerade": "true",
                        },
                    })
                    self._taken_subnets.add(subnet)
                    return
                except DockerError as exc:
                    if "overlap" not in exc.message.lower() or attempt == 7:
                        raise
                    in_use.add(subnet)  # another engine user took it meanwhile

    async def _volume(self, name: str, labels: dict[str, str]) -> None:
        await self.docker()._query_json(  # aiodocker's volumes API is untyped
            "volumes/create", method="POST", data={"Name": name, "Driver": "local", "Labels": labels}
        )

    # ---- watching, stopping, removing -----------------------------------------------------

    def handle(self, workload: Workload) -> ContainerHandle:
        """Follow the workload's container: its output into ``output.log``, its exit."""
        assert workload.container is not None
        container_id, name = workload.container
        handle = ContainerHandle(self, container_id or name, self.work_dir / workload.rental_id)
        self._followers.add(handle.task)
        handle.task.add_done_callback(self._followers.discard)
        return handle

    async def stop(self, workload: Workload, grace: float) -> None:
        """The engine's stop: SIGTERM to the container's init, SIGKILL ``grace`` seconds later."""
        if workload.container is None:
            return
        try:
            async with asyncio.timeout(grace + self.options.engine_timeout):
                await self.docker().containers.container(workload.container[0]).stop(t=max(0, math.ceil(grace)))
        except DockerError as exc:
            if exc.status not in (304, 404):
                log.warning("rental %s: the engine could not stop its container: %s", workload.rental_id, exc.message)
        except ENGINE_ERRORS as exc:
            log.warning("rental %s: cannot reach the engine to stop its container: %s", workload.rental_id, exc)

    async def remove(self, workload: Workload) -> None:
        """Remove the workload's container and network (its volume stays until ``forget_volume``)."""
        await self._remove_named(resource_name(workload.rental_id, self.options.owner))

    async def _remove_named(self, name: str) -> None:
        try:
            async with asyncio.timeout(self.options.engine_timeout):
                await self._remove_container(name)
                await self._remove_network(name)
        except ENGINE_ERRORS as exc:
            log.warning("cannot remove container/network %s: %s", name, exc)

    async def _remove_container(self, name: str) -> None:
        try:
            await self.docker().containers.container(name).delete(force=True, v=True)
        except DockerError as exc:
            if exc.status != 404:
                raise

    async def _remove_network(self, name: str) -> None:
        try:
            network = await self.docker().networks.get(name)
            await network.delete()
        except DockerError as exc:
            if exc.status != 404:
                raise

    async def forget_volume(self, rental_id: str) -> None:
        """Remove the rental's ``/workspace`` volume or size-capped disk (the rental is deleted); best effort."""
        name = resource_name(rental_id, self.options.owner)
        if self.disks is not None:
            await asyncio.to_thread(self.disks.release, rental_id)
        try:
            async with asyncio.timeout(self.options.engine_timeout):
                await self.docker()._query_json(f"volumes/{name}", method="DELETE", params={"force": "1"})
        except DockerError as exc:
            if exc.status != 404:
                log.warning("rental %s: cannot remove its volume %s: %s", rental_id, name, exc.message)
        except (ValueError, *ENGINE_ERRORS) as exc:
            log.debug("rental %s: no engine to remove its volume from (%s)", rental_id, exc)

    async def workspace_path(self, rental_id: str) -> Path | None:
        """Where the rental's ``/workspace`` volume lies on this host (its ``Mountpoint``), also after its
        container ended, until ``forget_volume``; ``None`` when it has none. Raises ``BadRequest`` without an engine."""
        if self.disks is not None and self.disks.image(rental_id).exists():
            # Its own filesystem: mounted again if a reboot (or an unmount) took it away meanwhile.
            return await asyncio.to_thread(self.disks.ensure, rental_id, 1, owner=(0, 0))
        name = resource_name(rental_id, self.options.owner)
        volume = await self._engine_read(self.docker()._query_json(f"volumes/{name}"))
        if volume is None:
            return None
        mountpoint = volume.get("Mountpoint")
        return Path(mountpoint) if isinstance(mountpoint, str) and mountpoint.startswith("/") else None

    async def container_address(self, rental_id: str) -> str | None:
        """The rental's container's IPv4 address on its own network (``None``: not running). Raises ``BadRequest`` without an engine."""
        return (await self._running_container(rental_id))[0]

    async def _running_container(self, rental_id: str) -> tuple[str | None, int | None]:
        """(address, main process id) of the rental's running container; ``(None, None)``: not running."""
        name = resource_name(rental_id, self.options.owner)
        info = await self._engine_read(self.docker().containers.container(name).show())
        state = (info or {}).get("State") or {}
        if info is None or not state.get("Running"):
            return None, None
        networks = (info.get("NetworkSettings") or {}).get("Networks") or {}
        network = networks.get(name if self.options.isolate_network else "bridge") or {}
        address = network.get("IPAddress")
        pid = state.get("Pid")
        return (address if isinstance(address, str) and address else None), (pid if isinstance(pid, int) and pid > 0 else None)

    async def namespace(self, rental_id: str) -> tuple[int, Path] | None:
        """(main process id, the engine's host-side ``/etc/hosts`` file) of the rental's running container, for
        joining it to its cluster's network (``agent.cluster.net``); ``None``: not running. Raises ``BadRequest`` without an engine."""
        name = resource_name(rental_id, self.options.owner)
        info = await self._engine_read(self.docker().containers.container(name).show())
        state = (info or {}).get("State") or {}
        pid, hosts = state.get("Pid"), (info or {}).get("HostsPath")
        if info is None or not state.get("Running") or not isinstance(pid, int) or pid <= 0:
            return None
        if not isinstance(hosts, str) or not hosts.startswith("/"):
            return None
        return pid, Path(hosts)

    async def open_port(self, rental_id: str, port: int, *, timeout: float = 5.0) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A connection to ``port`` of the rental's running container (``None``: none runs): from inside its
        network namespace to its loopback when the agent may (``agent.runtimes.netns``: listeners on
        127.0.0.1 answer too), else to its address. Raises ``OSError``/``TimeoutError`` when nothing
        listens, ``BadRequest`` without an engine."""
        address, pid = await self._running_container(rental_id)
        if pid is not None:
            try:
                return await connect_in_namespace(pid, port, timeout=timeout)
            except NamespaceUnavailable as exc:
                log.debug("rental %s: cannot enter its network namespace (%s); using its address", rental_id, exc)
        if address is None:
            return None
        async with asyncio.timeout(timeout):
            return await asyncio.open_connection(address, port)

    async def sweep(self, owned: Callable[[str], bool]) -> list[str]:
        """Remove this owner's containers and networks whose rental ``owned`` denies, and volumes whose
        rental is not owned and has no folder left (forgotten). Returns the names removed; best effort."""
        removed: list[str] = []
        if self.url.startswith("unix://") and not os.path.exists(self.url.removeprefix("unix://")):
            log.debug("no container engine at %s: nothing to sweep", self.url)
            return removed
        owner_filter = {"label": [f"{OWNER_LABEL}={self.options.owner}"]}
        docker = self.docker()

        async def drop(what: str, rental: str, removal: Awaitable[Any]) -> None:
            try:
                await removal
                removed.append(f"{what} {rental}")
            except DockerError as exc:  # gone meanwhile (its own exit removed it), or still in use: the next sweep
                if exc.status != 404:
                    log.warning("cannot remove %s of rental %s no rental owns: %s", what, rental, exc.message)

        try:
            async with asyncio.timeout(self.options.engine_timeout * 4):
                for container in await docker.containers.list(all=True, filters=owner_filter):
                    rental = (container["Labels"] or {}).get(RENTAL_LABEL, "")
                    if not owned(rental):
                        await drop("container", rental, container.delete(force=True, v=True))
                for network in await docker.networks.list(filters=owner_filter):
                    rental = (network.get("Labels") or {}).get(RENTAL_LABEL, "")
                    if not owned(rental):
                        await drop("network", rental, self._remove_network(str(network["Name"])))
                volumes = await docker._query_json("volumes", params={"filters": json.dumps(owner_filter)})
                for volume in volumes.get("Volumes") or ():
                    rental = (volume.get("Labels") or {}).get(RENTAL_LABEL, "")
                    if not owned(rental) and not (rental and (self.work_dir / rental).is_dir()):
                        await drop("volume", rental, docker._query_json(f"volumes/{volume['Name']}", method="DELETE", params={"force": "1"}))
        except (ValueError, *ENGINE_ERRORS) as exc:
            log.warning("cannot look for containers no rental owns (%s); they stay until the next start", exc)
        if removed:
            log.info("removed what no rental of owner %s owns: %s", self.options.owner, ", ".join(removed))
        return removed


async def probe_container_engine(options: ContainerOptions, work_dir: Path) -> ContainerFacts:
    """What ``ContainerRuntime.facts`` says, from a runtime opened for the question and closed
    again (``gpumarket up`` asks before its agents exist). Never raises; cancelling is safe."""
    runtime = ContainerRuntime(work_dir, options, device_requests=False)
    try:
        return await runtime.facts()
    finally:
        await runtime.close()
