"""The master's commands on the agent: decoded by the protocol, run at most once per id.

``CommandExecutor.result_for`` decodes a ``command`` body into its typed model
(``shared.protocol.decode_command``) and runs its handler; a command the protocol refuses
(unknown kind or field) or one that fails is answered with a failed result saying why. The
result of each of the last ``remembered_results`` ids is kept, so a resent command is
answered again without running twice.

A ``start_workload`` that ``preempts`` other rentals stops them only once its image is here
(``WorkloadManager.start``'s ``before_start``), each as its own ``stop_workload`` would; its
reply, or its failed result's ``data``, lists in ``preempted`` the ones it stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Final

from cryptography.hazmat.primitives.asymmetric import ec

from agent.cluster.net import ClusterNetworks
from agent.cluster.paths import present_devices
from agent.cluster.wgcontrol import ClusterNetworkError
from agent.gpu.base import GpuBackend
from agent.health import check_health
from agent.logship import LogShipper
from agent.power import PowerPolicy
from agent.reach.sshd import VOLUME, RentalSshServer
from agent.runtimes.manager import WorkloadManager
from agent.runtimes.registry_login import SealedLogin
from agent.verification import ChallengeRunner, is_challenge
from agent.volumecopy import VolumeCopier
from agent.volumes import VolumeStore
from shared import protocol
from shared.errors import ConfigError, GpumarketError, ProtocolError

log = logging.getLogger(__name__)


class CommandLanes:
    """The agent's command queues, each run by a worker of its own, one command at a time in the order they came: the
    main lane (starts, stops: a start may pull an image for minutes), ``access`` (an access change never waits behind a
    start), ``challenges`` (a GPU challenge waits on its program) and ``copies`` (a volume copy runs for hours)."""

    FAST: Final = frozenset({"update_access", "open_volume"})
    CHALLENGES: Final = frozenset({"start_challenge", "reveal_challenge"})
    COPIES: Final = frozenset({"copy_volume"})

    def __init__(self, max_pending: int) -> None:
        self.queues: dict[str, asyncio.Queue[protocol.CommandBody]] = {
            lane: asyncio.Queue(max_pending) for lane in ("commands", "access", "challenges", "copies")
        }

    def lane(self, kind: str) -> str:
        return ("challenges" if kind in self.CHALLENGES else "copies" if kind in self.COPIES
                else "access" if kind in self.FAST else "commands")  # fmt: skip

    def put(self, command: protocol.CommandBody) -> None:
        """Queue ``command`` on its lane; a full lane drops it (the master resends what has no result)."""
        try:
            self.queues[self.lane(command.kind)].put_nowait(command)
        except asyncio.QueueFull:
            log.warning("command queue full; %s will be resent by the master", command.command_id)


class CommandExecutor:
    """Runs commands against this host's workloads, GPUs, network and certificate.

    ``measure`` measures the network (and reports it); ``install_certificate`` installs a
    renewed certificate: both belong to the agent's loops, which hand them in. ``ssh`` serves
    SSH into the rentals: a start prepares the rental's host key (the reply's ``ssh_host_key``),
    an ``update_access`` replaces its authorized keys (closing connections of removed keys), a stop
    ends its SSH connections. ``clusters`` joins member containers to their cluster's
    private network (``agent.cluster.net``); a stop takes the member out. ``power`` keeps the off-peak power
    policy (``agent.power``): a start restores its GPUs' limits first, and fails if that cannot be done. ``challenges``
    runs the master's GPU challenges (``agent.verification``): a rental's start stops any challenge on its GPUs first.
    """

    def __init__(
        self,
        *,
        workloads: WorkloadManager,
        backend: GpuBackend,
        logs: LogShipper,
        measure: Callable[[], Awaitable[protocol.NetworkReportBody]],
        install_certificate: Callable[[protocol.InstallCertificate], Awaitable[protocol.CertificateInstalled]],
        ssh: RentalSshServer | None = None,
        clusters: ClusterNetworks | None = None,
        power: PowerPolicy | None = None,
        challenges: ChallengeRunner | None = None,
        volumes: VolumeStore | None = None,
        close_streams: Callable[[str], int] | None = None,
        host_id: str | None = None,
        opening_keys: Callable[[], Sequence[ec.EllipticCurvePrivateKey]] | None = None,
        copier: VolumeCopier | None = None,
        # Limits
        remembered_results: int = 1000,
    ) -> None:
        self.workloads = workloads
        self.backend = backend
        self.logs = logs
        self.measure = measure
        self.install_certificate = install_certificate
        self.ssh = ssh
        self.clusters = clusters
        self.power = power
        self.challenges = challenges
        self.volumes = volumes  # renters' volumes (agent.volumes): create_volume, delete_volume
        self.close_streams = close_streams  # ends every renter stream of a rental now; returns how many
        # This host's id and private keys (``AgentState.opening_keys``): what a start's sealed registry login opens with.
        self.host_id = host_id
        self.opening_keys = opening_keys
        self.copier = copier  # copy_volume: pulls another host's volume into one of ours (agent.volumecopy)
        self.remembered_results = remembered_results
        self._results: OrderedDict[str, protocol.CommandResultBody] = OrderedDict()
        self._preempted: dict[str, list[str]] = {}  # command id → rentals its start stopped (while it runs)

    async def result_for(self, body: protocol.CommandBody) -> protocol.CommandResultBody:
        """The command's result: run now, or remembered from an earlier delivery of the same id."""
        result = self._results.get(body.command_id)
        if result is not None:
            log.info("command %s already executed; reporting its result again", body.command_id)
            return result
        result = await self.execute(body)
        self._results[body.command_id] = result
        while len(self._results) > self.remembered_results:
            self._results.popitem(last=False)
        return result

    async def execute(self, body: protocol.CommandBody) -> protocol.CommandResultBody:
        """Run one command; a command the protocol refuses (unknown kind or field) fails with its error code."""
        try:
            command = protocol.decode_command(body)
        except ProtocolError as exc:
            log.warning("command %s (%s) refused: %s", body.command_id, body.kind, exc)
            return _result(body.command_id, ok=False, detail=str(exc), data={"code": exc.code})
        try:
            reply = await self._handle(command, body.command_id)
        except (GpumarketError, TypeError, ValueError) as exc:
            log.warning("command %s (%s) failed: %s", body.command_id, body.kind, exc)
            # The stable code (workload_not_isolated, gpu_in_use, ...) lets the master tell the renter why.
            data: dict[str, Any] = {"code": exc.code} if isinstance(exc, GpumarketError) and exc.code else {}
            if isinstance(command, protocol.StartWorkload) and command.preempts is not None:
                data["preempted"] = self._preempted.get(body.command_id, [])  # stopped before the start failed
            return _result(body.command_id, ok=False, detail=str(exc), data=data or None)
        finally:
            self._preempted.pop(body.command_id, None)
        return _result(body.command_id, ok=True, data=reply.model_dump(mode="json", exclude_unset=True))

    async def _handle(self, command: protocol.AnyCommand, command_id: str) -> protocol.CommandReply:
        match command:
            case protocol.StartWorkload():
                return await self._start_workload(command, command_id)
            case protocol.StopWorkload():
                return await self._stop_workload(command)
            case protocol.UpdateAccess():
                return self._update_access(command)
            case protocol.MeasureNetwork():
                return await self._measure_network()
            case protocol.HealthCheck():
                return await self._health_check(command)
            case protocol.InstallCertificate():
                return await self.install_certificate(command)
            case protocol.CreateCluster():
                return await self._cluster_networks().create(command)
            case protocol.DeleteCluster():
                return await self._cluster_networks().delete(command)
            case protocol.SetPowerPolicy():
                if self.power is None:
                    raise ConfigError("this agent keeps no power policy", code="power_policy_unavailable")
                return await self.power.apply(command)
            case protocol.StartChallenge():
                return await self._challenges().start(command)
            case protocol.RevealChallenge():
                return await self._challenges().reveal(command)
            case protocol.CancelChallenge():
                return await self._challenges().cancel(command.challenge_id, command.reason or "cancelled by the master")
            case protocol.OpenVolume():
                return await self._open_volume(command)
            case protocol.CopyVolume():
                if self.copier is None:
                    raise ConfigError("this agent keeps no volumes", code="volume_unsupported")
                return await self.copier.copy(command)
            case protocol.CreateVolume():
                return await asyncio.to_thread(self._volumes().run_create, command)  # mkfs and mount block
            case protocol.DeleteVolume():
                deleted = await asyncio.to_thread(self._volumes().run_delete, command)
                if self.ssh is not None:
                    self.ssh.forget(command.volume_id)  # its file-only session's keys and logins go with it
                return deleted

    def _volumes(self) -> VolumeStore:
        if self.volumes is None:
            raise ConfigError("this agent keeps no volumes", code="volume_unsupported")
        return self.volumes

    def _challenges(self) -> ChallengeRunner:
        if self.challenges is None:
            raise ConfigError("this agent runs no GPU challenges (no container runtime)", code="container_runtime_unavailable")
        return self.challenges

    def _cluster_networks(self) -> ClusterNetworks:
        if self.clusters is None:
            raise ClusterNetworkError("this agent makes no cluster networks")
        return self.clusters

    async def _start_workload(self, command: protocol.StartWorkload, command_id: str) -> protocol.WorkloadStarted:
        login = None
        if command.sealed_registry_auth is not None:
            # Opened by the container runtime at pull time, with this host's keys; never here.
            login = SealedLogin(command.sealed_registry_auth, self.host_id or "", command_id, self.opening_keys or _no_keys)
        if self.ssh is not None:
            self.ssh.check_keys(command.authorized_keys)  # a bad key fails the start before anything runs
        preempts = command.preempts or []
        stopped = self._preempted.setdefault(command_id, [])

        async def stop_preempted() -> None:
            """Stop the rentals this start takes the GPUs of: called once nothing before the start can fail on its own."""
            for victim in preempts:
                if victim.rental_id not in stopped:
                    await self._stop_workload(protocol.StopWorkload(rental_id=victim.rental_id, grace_s=victim.grace_s, reason=victim.reason))
                    stopped.append(victim.rental_id)

        if self.challenges is not None and not is_challenge(command.rental_id):
            # A challenge never delays a rental (docs/verification.md): it stops, the master hears it was cancelled.
            await self.challenges.yield_gpus(command.gpu_uuids, reason=f"rental {command.rental_id} needs the GPU")
        async with contextlib.AsyncExitStack() as stack:
            if self.power is not None:
                # Every GPU it gets back to its full limit before anything runs (or the start fails): docs/power.md.
                await stack.enter_async_context(self.power.ready_for_start(command.gpu_uuids))
            data = await self.workloads.start(
                command.rental_id, list(command.gpu_uuids), command.workload, share=command.share, registry_auth=login,
                preempts=[victim.rental_id for victim in preempts], before_start=stop_preempted if preempts else None,
                volumes=command.volumes or (), devices=present_devices(command.rdma_devices or ()),
            )  # fmt: skip
        if command.preempts is not None:
            data["preempted"] = list(stopped)
        self.logs.follow(command.rental_id, save=True)
        if self.ssh is not None:
            # Every kind gets a host key: a hold rental's login is answered with why it has no shell.
            data["ssh_host_key"] = self.ssh.prepare(
                command.rental_id, command.authorized_keys, kind=data.get("kind"), version=command.access_version
            )
        return protocol.WorkloadStarted.model_validate(data)

    def _update_access(self, command: protocol.UpdateAccess) -> protocol.AccessUpdated:
        """The rental's keys are the command's now (an older version changes nothing): runs at once, never waits."""
        if self.ssh is None:
            # No SSH server, so nothing to log into: the list has nothing to change.
            return protocol.AccessUpdated(applied=False, version=command.version, known=False, closed=0)
        updated = self.ssh.update_access(command.rental_id, command.authorized_keys, version=command.version, disabled=command.disabled)
        if updated.applied and command.disabled and self.close_streams is not None:
            # A disabled account keeps no way in: its web and TCP port streams end too, not only its SSH logins.
            updated = updated.model_copy(update={"closed": updated.closed + self.close_streams(command.rental_id)})
        return updated

    async def _open_volume(self, command: protocol.OpenVolume) -> protocol.VolumeOpened:
        """Serve the volume's files to its renter's keys (a file-only session: ``agent.reach.volumefiles``)."""
        if self.ssh is None or self.ssh.volumes is None:
            raise ConfigError("this agent keeps no volumes", code="volume_unsupported")
        await asyncio.to_thread(self.ssh.volumes.path, command.volume_id)  # volume_not_found when not made here
        key = self.ssh.prepare(command.volume_id, command.authorized_keys, kind=VOLUME, version=command.version)
        return protocol.VolumeOpened(ssh_host_key=key)

    async def _stop_workload(self, command: protocol.StopWorkload) -> protocol.WorkloadStopped:
        """Stop the workload and release the rental: its ``/workspace`` and SSH keys go (a stop is the
        renter's release, or the end of a rental whose workload exited and kept its workspace:
        ``reason == RELEASED``, which drops its folder and log too — shipped long ago)."""
        data = await self.workloads.stop(command.rental_id, timeout=command.grace_s, reason=command.reason)
        self.logs.exited(command.rental_id)
        await self.forget_rental(command.rental_id, keep_log=command.reason != protocol.RELEASED)
        return protocol.WorkloadStopped.model_validate(data)

    async def forget_rental(self, rental_id: str, *, keep_log: bool = False) -> None:
        """The rental is released: delete its ``/workspace`` volume, its SSH host key and authorized keys, and
        (unless ``keep_log``) its folder and log; refused while its workload runs. Cancelling is safe: the
        deletion finishes."""
        if self.clusters is not None:
            await self.clusters.forget_rental(rental_id)
        await self.workloads.forget(rental_id, keep_log=keep_log)
        if self.ssh is not None:
            await self.ssh.close_rental(rental_id)
            self.ssh.forget(rental_id)

    async def _measure_network(self) -> protocol.NetworkReportBody:
        body = await self.measure()
        if body.error:
            raise ConfigError(f"network measurement failed: {body.error}")
        return protocol.NetworkReportBody.model_validate(body.model_dump())  # every field set: the whole report is the reply

    async def _health_check(self, command: protocol.HealthCheck) -> protocol.HealthCheckResult:
        """Check the GPUs the master expects (``gpu_uuids``) and any others; the verdict is ``data["healthy"]``."""
        report = await asyncio.to_thread(check_health, self.backend, list(command.gpu_uuids))
        return protocol.HealthCheckResult.model_validate(report.to_wire())


def _result(command_id: str, *, ok: bool, detail: str = "", data: dict[str, Any] | None = None) -> protocol.CommandResultBody:
    return protocol.CommandResultBody(
        command_id=command_id, ok=ok, detail=detail[:4096], data=data or {}, finished_at=datetime.now(UTC)
    )


def _no_keys() -> Sequence[ec.EllipticCurvePrivateKey]:
    return ()
