"""The workload manager: starts, watches, stops and re-adopts the workloads of this host's rentals.

Idempotent by rental id; one runtime per kind (``hold``, ``process``, ``container``: see
``agent.runtimes.base.Runtime``). GPUs: a workload sees only its GPUs (or MIG instances),
unheld or shared as ``agent.runtimes.gpuclaims`` checks.

Exits. A watcher task per process (owned by the manager, cancelled by ``stop`` and
``close``) notices a workload that ends on its own, kills what it left behind and calls
``on_exit(rental_id, exit_code)`` — at least once: the exit is kept in the registry until
the callback returns. ``stop()`` never triggers ``on_exit``; it returns the exit code. It
first writes one line to the workload's log (``gpumarket: stopping (reason); SIGKILL in
30s``) so a renter reading it sees why it ended.

Restarts. The registry (``agent.runtimes.registry``) records each workload's pid and
kernel start time; a new manager re-adopts the processes that are still alive and
genuinely the same, keeps ``hold`` workloads, and reports the ones that ended meanwhile.
Containers (``agent.runtimes.container``) are watched through the engine rather than a
pid: a new manager follows again the ones its registry lists and reports those that ended,
and removes every container, network and volume labelled with its owner that no rental of
its registry owns (a volume only once its rental's folder is gone too). ``close()`` leaves
workloads running unless ``stop_workloads=True``.

Containers' volumes: ``stop`` (or an exit) removes a container and its network; the
rental's ``/workspace`` volume (or its size-capped disk) stays until ``forget`` (the rental is deleted).

Ceilings (``agent.runtimes.ceilings``): every process and container runs within memory, CPU, pids
and disk limits, the ones its rental named (refused with ``limits_exceed_host`` when the host cannot
give them) or its share of the host. Where the engine does not bound a container's writable layer,
its watcher stops one over its quota every ``disk_check_interval`` (``agent.runtimes.layerquota``).

Logging: start, stop and exit at INFO; a degraded isolation or log cap at WARNING.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from agent.gpu.base import GpuBackend
from agent.runtimes.base import ExitCallback, RentalAccess, Runtime, Workload, check_rental_id, now_iso
from agent.runtimes.ceilings import CeilingPolicy
from agent.runtimes.cgroups import CgroupLimiter, CgroupSupport, cgroup_limiter, detect_cgroup_support
from agent.runtimes.container import ContainerRuntime
from agent.runtimes.containerconfig import VolumePaths, volume_binds
from agent.runtimes.containeropts import ContainerFacts, ContainerOptions, ProgressCallback
from agent.runtimes.gpuclaims import check_gpus, show_load
from agent.runtimes.hold import HoldRuntime
from agent.runtimes.isolation import RentalNetworkFacts, prove_rental_network
from agent.runtimes.layerquota import over_quota, storage_opt_supported
from agent.runtimes.logs import OutputLogs
from agent.runtimes.pids import ProcessHandle
from agent.runtimes.process import ProcessRuntime
from agent.runtimes.registry import Registry
from agent.runtimes.registry_login import SealedLogin
from agent.runtimes.starts import StartsInFlight
from agent.runtimes.teardown import clean_up, terminate
from agent.runtimes.users import RentalUsers
from shared.ceilings import Ceilings
from shared.errors import BadRequest, ConfigError, Conflict
from shared.protocol import (
    ContainerWorkload,
    GpuShare,
    HoldWorkload,
    IsolationFacts,
    ProcessWorkload,
    VolumeMount,
    WorkloadSpec,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


class WorkloadManager:
    """Starts, watches, stops and re-adopts the workloads of this host's rentals.

    ``on_exit`` hears of workloads that end on their own (not of ``stop()``). ``cgroups``
    defaults to what ``detect_cgroup_support()`` finds. ``container`` configures the
    container runtime (``None``: container workloads are refused); ``on_progress`` hears of
    an image pull's progress and a container's start. Call ``await resume()`` once at
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
        rental_users: RentalUsers | None = None,
        isolation: IsolationFacts | None = None,
        container: ContainerOptions | None = None,
        on_progress: ProgressCallback | None = None,
        ceilings: CeilingPolicy | None = None,
        volumes: VolumePaths | None = None,
        # Timeouts
        stop_timeout: float = 10.0,
        kill_timeout: float = 5.0,
        check_interval: float = 1.0,
        disk_check_interval: float = 30.0,
        # Limits
        max_log_bytes: int = 64 << 20,
        max_read_bytes: int = 1 << 20,
    ) -> None:
        ConfigError.check_bounds("workload setting", (
            ("stop_timeout", stop_timeout, 0.0, 3600.0),
            ("kill_timeout", kill_timeout, 0.01, 600.0),
            ("check_interval", check_interval, 0.001, 60.0),
            ("disk_check_interval", disk_check_interval, 0.01, 3600.0),
            ("max_log_bytes", max_log_bytes, 16 << 10, 1 << 40),
            ("max_read_bytes", max_read_bytes, 1, 64 << 20),
        ))
        self.work_dir = work_dir
        self.backend = backend
        self.on_exit = on_exit
        self.cgroups = cgroups if cgroups is not None else cgroup_limiter(detect_cgroup_support())
        self.stop_timeout = stop_timeout
        self.kill_timeout = kill_timeout
        self.check_interval = check_interval
        self.disk_check_interval = disk_check_interval
        self._exit_reasons: dict[str, str] = {}  # why the agent ended a workload it stopped on its own (disk_quota_exceeded)
        self.max_log_bytes = max_log_bytes
        self.max_read_bytes = max_read_bytes
        self._workloads: dict[str, Workload] = {}
        self._unreported: dict[str, int | None] = {}  # exits on_exit has not yet taken
        self._dead_at_load: list[Workload] = []
        self._tasks: set[asyncio.Task[Any]] = set()  # watchers, reports, clean-ups: cancelled by close()
        self._stops: set[asyncio.Task[Any]] = set()  # stops in flight: awaited by close()
        self._pending: dict[str, Workload] = {}  # container starts in flight: their GPUs are taken
        self._starts = StartsInFlight()  # a lock per container start, its image's pull: a stop cancels it
        self._resumed = False
        self._closed = False
        self._network: RentalNetworkFacts | None = None
        self.logs = OutputLogs(work_dir, max_log_bytes=max_log_bytes)
        self.registry = Registry(work_dir)
        self.holds = HoldRuntime()
        self.processes = ProcessRuntime(work_dir, self.cgroups, users=rental_users, isolation=isolation, kill_timeout=kill_timeout)
        self.container_options = container
        self.volumes = volumes  # the renter's volumes on this host (agent/volumes.py's VolumeStore); None: it keeps none
        self.containers = ContainerRuntime(
            work_dir, container or ContainerOptions(), device_requests=backend.name == "nvml", on_progress=on_progress
        )
        work_dir.mkdir(parents=True, exist_ok=True)
        self.ceilings = ceilings or CeilingPolicy.detect(
            work_dir, container_pids_limit=None if container is None else container.default_pids_limit,
            container_memory_mib=None if container is None else container.default_memory_mib,
        )
        self._storage_opt_asked = False
        self.processes.disks = self.containers.disks = self.ceilings.disks
        self.containers.disk_quota = self.ceilings.disk_quota
        self._load_registry()

    @property
    def registry_path(self) -> Path:
        return self.registry.path

    @property
    def cgroup_support(self) -> CgroupSupport:
        return self.cgroups.support

    async def network_facts(self) -> RentalNetworkFacts:
        """The rentals' network guard put in place and self-tested (``isolation.prove_rental_network``), once:
        a proven answer is kept; one that is not is tried again on the next call."""
        if self._network is None or not self._network.proven:
            egress = None if self.container_options is None else self.container_options.egress
            self._network = await prove_rental_network(egress, self.processes.users)
        return self._network

    async def container_facts(self) -> ContainerFacts | None:
        """The container engine's version and the network guard's state, for the host's hello
        (``None``: this manager runs no containers). Installs the guard when it can."""
        if self.container_options is None:
            return None
        facts = await self.containers.facts()
        if facts.engine is not None and not self._storage_opt_asked:
            self._storage_opt_asked = True
            self.ceilings = self.ceilings.with_storage_opt(await storage_opt_supported(self.containers.docker(), timeout=self.containers.options.engine_timeout))
            self.containers.disk_quota = self.ceilings.disk_quota
        return facts

    def exit_reason(self, rental_id: str) -> str | None:
        """Why the agent itself ended the rental's workload (``disk_quota_exceeded: ...``); None: it ended on its own."""
        return self._exit_reasons.get(rental_id)

    def _ceilings_of(self, spec: ContainerWorkload | ProcessWorkload, gpus: Sequence[str], share: GpuShare | None) -> Ceilings:
        """The workload's ceilings from what it named and its share of this host; ``limits_exceed_host`` when too large."""
        return self.ceilings.resolve(spec, self.ceilings.fraction(gpus, share, self.backend.gpus()))

    def workload(self, rental_id: str) -> Workload | None:
        """The rental's workload while it runs here (``None`` once it ended or before it started)."""
        return self._workloads.get(rental_id)

    async def open_container_port(
        self, rental_id: str, port: int, *, timeout: float = 5.0
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A connection to ``port`` of the rental's container (``ContainerRuntime.open_port``); ``None``:
        no container runs for it. Raises ``OSError``/``TimeoutError`` (nothing listens), ``BadRequest`` (no engine)."""
        workload = self._workloads.get(rental_id)
        if workload is None or workload.container is None:
            return None
        return await self.containers.open_port(rental_id, port, timeout=timeout)

    async def container_namespace(self, rental_id: str) -> tuple[int, Path] | None:
        """(process id, host-side hosts file) of the rental's running container (``ContainerRuntime.namespace``);
        ``None``: no container runs for it."""
        workload = self._workloads.get(rental_id)
        if workload is None or workload.container is None:
            return None
        return await self.containers.namespace(rental_id)

    def running(self) -> list[str]:
        """Rental ids whose workload runs (or holds its GPUs), stopping ones included."""
        return sorted(self._workloads)

    def gpus_in_use(self) -> set[str]:
        """The GPU (or MIG instance) UUIDs a workload holds: running, stopping or still starting (an image pulling)."""
        return {gpu_uuid for workload in [*self._workloads.values(), *self._pending.values()] for gpu_uuid in workload.gpu_uuids}

    def access(self, rental_id: str) -> RentalAccess | None:
        """What a login into the rental's workload reaches (``agent.reach.sshd``); ``None``: none runs here."""
        workload = self._workloads.get(rental_id)
        if workload is None:
            return None
        users = self.processes.users
        user = users.lookup(rental_id) if workload.kind == "process" and users is not None else None
        return RentalAccess.of(workload, None if user is None else (user.uid, user.gid, user.home))

    # ---- start ------------------------------------------------------------------------

    async def start(
        self, rental_id: str, gpu_uuids: list[str], spec: WorkloadSpec, *, share: GpuShare | None = None,
        registry_auth: SealedLogin | None = None, preempts: Sequence[str] = (),
        before_start: Callable[[], Awaitable[None]] | None = None, volumes: Sequence[VolumeMount] = (), devices: Sequence[str] = (),
    ) -> dict[str, Any]:
        """Start the rental's workload unless it already runs (then report it again).

        ``volumes``: the renter's volumes a container mounts (each must be on this host: else the start fails
        ``volume_not_found`` before the image is pulled). ``devices``: host devices a container gets (a cluster member's
        RDMA devices on a trusted fabric).

        ``spec`` and ``share`` come validated (``shared.protocol.StartWorkload``). ``share`` gives
        the workload a fraction of its one GPU, which other shares may hold too; without it the workload
        needs its GPUs unheld. Returns ``{"kind", "pid", "limits": "applied" | "unavailable"
        | "none requested", ...}`` (with ``limits_reason`` when unavailable). A container
        start waits on the engine (an image pull, the container's creation) with its GPUs
        reserved; a second start of the same rental waits for the first. Cancelling is safe:
        a container start cancelled half-way removes what it made. ``registry_auth``: the login for a container's
        image pull, sealed to this host (opened only if a pull is needed, for that pull; never stored, never logged).

        Preemption: ``preempts`` names rentals whose GPUs this one takes; they count as gone for the GPUs'
        first check. ``before_start`` (which stops them) is awaited once everything that can fail without
        touching them is done — the check, a container's image pull — and before the workload is made; the
        GPUs are checked again after it. A start that fails before ``before_start`` leaves them running.
        """
        self._check_open()
        check_rental_id(rental_id)
        await self.resume()
        if isinstance(spec, ContainerWorkload):
            return await self._start_container(rental_id, gpu_uuids, spec, share, registry_auth, preempts, before_start, volumes, devices)
        if volumes:
            raise BadRequest("volumes are mounted into a container workload only", code="bad_workload_spec")
        existing = self._workloads.get(rental_id) or self._pending.get(rental_id)
        if existing is not None:
            return self._already_running(existing)
        gpus = self._check_gpus(gpu_uuids, share, ignoring=preempts)
        if before_start is not None:
            await before_start()  # nothing to fetch for a hold or a process: the victims go now
            gpus = self._check_gpus(gpu_uuids, share)
        if isinstance(spec, HoldWorkload):
            workload, result = self.holds.start(rental_id, gpus, spec, share)
        else:
            workload, result = self.processes.start(rental_id, gpus, spec, share, self._ceilings_of(spec, gpus, share))
        workload.share = share
        self._workloads[rental_id] = workload
        if workload.pid is not None:
            workload.handle = ProcessHandle(workload.pid, workload.start_time, poll_interval=self.check_interval)
            workload.watcher = self._own(self._watch(workload), name=f"workload-{rental_id}-watch")
        self._save_registry()
        self._show_load()
        log.info("rental %s started (%s, pid %s, %d GPU, limits %s)", rental_id, workload.kind, workload.pid, len(gpus), result.get("limits"))
        return result

    async def _start_container(
        self, rental_id: str, gpu_uuids: list[str], spec: ContainerWorkload, share: GpuShare | None, registry_auth: SealedLogin | None,
        preempts: Sequence[str] = (), before_start: Callable[[], Awaitable[None]] | None = None, volumes: Sequence[VolumeMount] = (),
        devices: Sequence[str] = (),
    ) -> dict[str, Any]:
        if self.container_options is None:
            raise BadRequest(
                "this agent runs no container workloads: it was started without container settings "
                "(the agent passes ContainerOptions when a container engine is configured)",
                code="container_runtime_unavailable",
            )
        self.containers.check_image(spec.image)  # a refusal by policy needs no engine
        async with self._starts.one_at_a_time(rental_id):
            return await self._start_container_locked(rental_id, gpu_uuids, spec, share, registry_auth, preempts, before_start, volumes,
                                                       devices)  # fmt: skip

    async def _start_container_locked(
        self, rental_id: str, gpu_uuids: list[str], spec: ContainerWorkload, share: GpuShare | None, registry_auth: SealedLogin | None,
        preempts: Sequence[str], before_start: Callable[[], Awaitable[None]] | None, volumes: Sequence[VolumeMount] = (),
        devices: Sequence[str] = (),
    ) -> dict[str, Any]:
        self._check_open()
        existing = self._workloads.get(rental_id)
        if existing is not None:
            return self._already_running(existing)
        gpus = self._check_gpus(gpu_uuids, share, ignoring=preempts)
        binds = await volume_binds(self.volumes, volumes)
        ceilings = self._ceilings_of(spec, gpus, share)
        workload = Workload(rental_id, "container", gpus, now_iso(), share=share, disk_gib=ceilings.disk_gib)
        self._pending[rental_id] = workload  # its GPUs are taken while the image comes and the container starts
        pull = self._own(self.containers.prepare(rental_id, spec, registry_auth), name=f"workload-{rental_id}-image")
        try:
            image = await self._starts.image(rental_id, pull, check_open=self._check_open)
            self._check_open()
            if before_start is not None:
                await before_start()  # the image is here: only now do the preempted workloads go
                self._check_gpus(gpu_uuids, share, ignoring=(rental_id,))  # ... and their GPUs are free
            result = await self.containers.start(workload, spec, image, share, ceilings, volumes=binds, devices=devices)
        finally:
            self._pending.pop(rental_id, None)
        self._workloads[rental_id] = workload
        workload.handle = self.containers.handle(workload)
        workload.watcher = self._own(self._watch(workload), name=f"workload-{rental_id}-watch")
        self._save_registry()
        self._show_load()
        log.info("rental %s started (container %s, image %s, %d GPU)", rental_id, result["container"], spec.image, len(gpus))
        return result

    def _already_running(self, workload: Workload) -> dict[str, Any]:
        if workload.stop_task is not None:
            raise Conflict(f"rental {workload.rental_id}'s workload is stopping; start it again once stopped", code="workload_stopping")
        return {"already_running": True, "kind": workload.kind, "pid": workload.pid}

    def _check_gpus(self, gpu_uuids: Sequence[str], share: GpuShare | None, *, ignoring: Sequence[str] = ()) -> list[str]:
        """The GPUs, checked to be on this host and free for the workload (whole, or room for its ``share``);
        ``ignoring``: rentals whose workloads count as gone (ones it preempts, its own pending start)."""
        held = [w for w in [*self._workloads.values(), *self._pending.values()] if w.rental_id not in ignoring]
        return check_gpus(self.backend, held, gpu_uuids, share)

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
            if workload.handle is not None:
                continue
            if workload.kind == "container":
                # Followed again through the engine: one that ended meanwhile is reported by its watcher.
                workload.handle = self.containers.handle(workload)
            elif workload.pid is not None:
                workload.handle = ProcessHandle(workload.pid, workload.start_time, poll_interval=self.check_interval)
            else:
                continue
            workload.watcher = self._own(self._watch(workload), name=f"workload-{workload.rental_id}-watch")
        if self.container_options is not None:
            self._own(self.containers.sweep(self._owns), name="containers-sweep")
        for workload in self._dead_at_load:
            self._own(self._clean_up(workload, kill_group=False), name=f"workload-{workload.rental_id}-cleanup")
        self._dead_at_load.clear()
        for rental_id in list(self._unreported):
            self._own(self._report_exit(rental_id), name=f"workload-{rental_id}-report")

    async def _watch(self, workload: Workload) -> None:
        handle = workload.handle
        assert handle is not None
        loop = asyncio.get_running_loop()
        next_disk_check = loop.time() + self.disk_check_interval
        while not await handle.wait(self.check_interval):
            self.logs.cap(workload.rental_id)
            if workload.kind == "container" and workload.disk_gib is not None and self.containers.disk_quota == "loop":
                if loop.time() >= next_disk_check:
                    await self._check_writable_layer(workload)
                    next_disk_check = loop.time() + self.disk_check_interval
        # The main process ended on its own: the workload is over. (stop() cancels this task first.)
        self._workloads.pop(workload.rental_id, None)
        self._unreported[workload.rental_id] = handle.returncode
        self._save_registry()
        self._show_load()
        log.info("rental %s: workload exited on its own (exit code %s)", workload.rental_id, handle.returncode)
        await self._clean_up(workload)
        self.logs.cap(workload.rental_id)
        await self._report_exit(workload.rental_id)

    async def _check_writable_layer(self, workload: Workload) -> None:
        """Stop a container whose writable layer outgrew its rental's disk quota (the engine does not bound it here)."""
        why = await over_quota(self.containers.docker(), workload, timeout=self.containers.options.engine_timeout)
        if why is None:
            return
        self._exit_reasons[workload.rental_id] = why
        self.logs.append(workload.rental_id, f"gpumarket: stopping ({why})")
        log.info("rental %s: %s", workload.rental_id, why)
        await self.containers.stop(workload, 0)

    def _owns(self, rental_id: str) -> bool:
        """Whether a container, network or volume of ``rental_id`` belongs to a workload of ours (running or starting)."""
        return rental_id in self._workloads or rental_id in self._pending or rental_id in self._starts

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
        self._exit_reasons.pop(rental_id, None)
        self._save_registry()

    async def _clean_up(self, workload: Workload, *, kill_group: bool = True) -> None:
        """Kill what the workload left and remove its cgroup (``teardown.clean_up``)."""
        await clean_up(workload, self._runtime_of(workload).remove, kill_timeout=self.kill_timeout, kill_group=kill_group)

    # ---- stop -------------------------------------------------------------------------

    async def stop(self, rental_id: str, *, timeout: float | None = None, reason: str | None = None) -> dict[str, Any]:
        """Stop the workload: SIGTERM to its process group, SIGKILL ``timeout`` seconds later
        (0 to ``MAX_STOP_GRACE_S``; default ``stop_timeout``) if it still runs. A container gets
        the engine's stop (SIGTERM to its init, SIGKILL after the grace, in whole seconds) and
        is then removed with its network; its volume stays until ``forget``. A container still
        being started is stopped once started; one whose image is still being pulled never
        starts (its start fails with ``workload_stopped``).

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
        check_rental_id(rental_id)
        await self.resume()
        await self._starts.stop(rental_id)  # a pull still running is cancelled; a container still being made is stopped once made
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
        if handle is not None and (workload.kind == "container" or workload.pid is not None):
            if not handle.exited:
                why = f" ({reason})" if reason else ""
                self.logs.append(workload.rental_id, f"gpumarket: stopping{why}; SIGKILL in {grace:g}s")
                log.info("rental %s: stopping%s, SIGKILL in %gs", workload.rental_id, why, grace)
                if workload.kind != "container":
                    await terminate(workload, handle, self._runtime_of(workload).remove, grace=grace, kill_timeout=self.kill_timeout)
                else:
                    await self.containers.stop(workload, grace)  # the engine's SIGTERM, then its SIGKILL
                    if not await handle.wait(self.kill_timeout):
                        log.error("rental %s: its container still runs %.1fs after the engine's stop", workload.rental_id, self.kill_timeout)
            exit_code = handle.returncode
            handle.close()
        await self._clean_up(workload)
        self.logs.cap(workload.rental_id)
        self._workloads.pop(workload.rental_id, None)
        self._save_registry()
        self._show_load()
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
        await self.containers.close()
        self.cgroups.close()
        self._save_registry()

    def _runtime_of(self, workload: Workload) -> Runtime[Any] | ContainerRuntime:
        return self.containers if workload.kind == "container" else self.processes if workload.kind == "process" else self.holds

    def _folder(self, rental_id: str) -> Path:
        return self.work_dir / rental_id

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

    def _show_load(self) -> None:
        show_load(self.backend, self._workloads.values())

    # ---- logs -------------------------------------------------------------------------

    def read_log(self, rental_id: str, *, offset: int, limit: int = 64 << 10) -> tuple[bytes, int]:
        """Up to ``limit`` bytes of the rental's output from ``offset``, and the offset after them.

        Offsets count every byte the workload ever wrote. When the cap dropped the bytes at
        ``offset``, reading starts at the oldest byte kept: the chunk's own offset is always
        ``next_offset - len(chunk)``. Past the end: ``(b"", offset)``. Works after the workload
        ended, until ``forget``. Raises ``NotFound`` for a rental this host has no log of.
        """
        check_rental_id(rental_id)
        if not isinstance(offset, int) or offset < 0:
            raise BadRequest("offset must be a byte offset >= 0", code="bad_log_offset")
        if not 1 <= limit <= self.max_read_bytes:
            raise BadRequest(f"limit must be from 1 to {self.max_read_bytes} bytes", code="bad_log_limit")
        return self.logs.read(rental_id, offset=offset, limit=limit, running=rental_id in self._workloads)

    async def forget(self, rental_id: str, *, keep_log: bool = False) -> None:
        """Delete the rental's container ``/workspace`` volume and (unless ``keep_log``: the log
        shipper still reads it) its folder and log; refused while its workload runs.

        Cancelling is safe: the deletion finishes in its thread.
        """
        check_rental_id(rental_id)
        if rental_id in self._workloads or rental_id in self._pending:
            raise Conflict(f"rental {rental_id}'s workload still runs; stop it first", code="workload_running")
        if self.container_options is not None:
            await self.containers.forget_volume(rental_id)
        if not keep_log:
            await asyncio.to_thread(shutil.rmtree, self._folder(rental_id), ignore_errors=True)

    # ---- the registry -----------------------------------------------------------------

    def _load_registry(self) -> None:
        loaded = self.registry.adopt()
        if loaded is None:
            return
        alive, dead, unreported = loaded
        self._workloads.update((workload.rental_id, workload) for workload in alive)
        self._unreported.update((workload.rental_id, exit_code) for workload, exit_code in dead)
        self._dead_at_load.extend(workload for workload, _ in dead)  # never touch a pid that may name another process by now
        for rental_id, exit_code in unreported.items():
            self._unreported.setdefault(rental_id, exit_code)
        if alive:
            self._show_load()
        self._save_registry()

    def _save_registry(self) -> None:
        self.registry.save(self._workloads, self._unreported)

