"""The agent's main loop: find a relay, stay connected, report, obey, and never forget a message.

Tasks the agent owns for its whole life (independent of any one connection):

* **sampler** — reads every GPU each ``sample_interval`` (1 s), keeps per-window
  aggregates, and every ``telemetry_interval`` (10 s) writes one telemetry message with
  the latest sample and the window's aggregates. XID and ECC events found on any pass
  are written at once as ``gpu_events`` (``agent.sampling``).
* **renewal** — asks for a new certificate at 70 % of its lifetime and installs it when it
  comes (``agent.certificates``).
* **commands** — executes the master's commands one at a time, at most once per id
  (``agent.commands``: decoding and the handlers).
* **network** — measures download/upload/latency/jitter/loss against the relay,
  periodically (hourly ± jitter, first run at a random point) and on command.
* **logs** — ships new workload output in bounded chunks (``agent.logship``).
* **power** — keeps the off-peak power policy: lowers idle GPUs in the window, restores them
  after it (``agent.power``); each sampling pass counts the energy it saved.

Every outgoing message is written to the on-disk spool first (``agent.spool``) and
leaves it only when the relay acknowledges its ``seq`` (which the relay does once the
message is on the bus). After reconnecting, the agent sends a fresh hello, then
everything still in the spool, in order. Connections are attempted in the order of
``agent.discovery.RelayDirectory``, with capped exponential back-off and full jitter so
a fleet whose relay died does not come back in lockstep.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import shutil
import ssl
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from agent.certificates import CertificateKeeper
from agent.challenge_image import DEFAULT_CUDA_BASE, CudaImageBuilder, challenge_image_for, cuda_image
from agent.cluster import paths as cluster_paths
from agent.cluster import wgkernel
from agent.cluster.net import ClusterNetworks
from agent.commands import CommandExecutor, CommandLanes
from agent.discovery import RelayDirectory
from agent.gpu.base import GpuBackend
from agent.hostfacts import collect_host_facts
from agent.logship import LogShipper
from agent.netmeasure import measure, next_delay
from agent.power import PowerPolicy
from agent.reach.sshd import RentalSshServer
from agent.reach.tunnels import TunnelServer
from agent.runtimes.ceilings import CeilingPolicy, with_ceilings
from agent.runtimes.containeropts import ContainerOptions, ProgressStage
from agent.runtimes.isolation import HostIsolation, ProcessIsolation, isolation_facts
from agent.runtimes.manager import WorkloadManager
from agent.sampling import Sampler
from agent.spool import SqliteSpool
from agent.state import AgentState, SequenceLease
from agent.timings import AgentTimings, Pacer
from agent.verification import ChallengeRunner, is_challenge
from agent.volumecopy import VolumeCopier
from agent.volumes import VolumeStore, with_volumes
from shared import protocol
from shared.cancelling import raise_if_cancelled
from shared.crypto import client_ssl_context
from shared.errors import ConfigError, GpumarketError, ProtocolError
from shared.outbound import OutboundWindow
from shared.streams import CONNECT_PATH, Multiplexer, StreamProtocolError, TunnelCode, frames
from shared.streams.aio import StreamLink, bound_send_buffer

log = logging.getLogger(__name__)

AGENT_VERSION = "0.2.0"
# Close codes after which the relay should not be retried first.
_MOVE_ON_CODES = frozenset({protocol.CLOSE_GOING_AWAY, protocol.CLOSE_BUS_UNAVAILABLE, protocol.CLOSE_TOO_MANY_CONNECTIONS})


class Agent:
    def __init__(
        self,
        state: AgentState,
        backend: GpuBackend,
        *,
        relay_urls: list[str] | None = None,
        zone: str | None = None,
        resolver: str | None = None,
        resolver_port: int = 53,
        resolver_source: str | None = None,
        region: str | None = None,
        timings: AgentTimings | None = None,
        network_probes: int = 20,
        network_max_bytes: int = 32 << 20,
        network_target_seconds: float = 2.0,
        # Limits
        max_frame: int = protocol.DEFAULT_MAX_FRAME,
        spool_max_messages: int = 100_000,
        spool_max_bytes: int = 256 << 20,
        max_pending_commands: int = 256,
        remembered_results: int = 1000,
        stop_workloads_on_close: bool = False,
        isolation: HostIsolation | None = None,
        container: ContainerOptions | None = None,
        ceilings: CeilingPolicy | None = None,
        rng: random.Random | None = None,
        # Renters' streams (agent.reach.tunnels): on the link, and per rental
        max_streams: int = 256,
        max_streams_per_rental: int = 32,
        max_stream_buffer: int = 64 << 20,
        stream_window: int = 1 << 20,
        stream_data: int = frames.LARGE_DATA,  # the DATA frame size offered to the relay (MAX_DATA: protocol v1's)
        link_send_buffer: int = 128 << 10,
        cluster_direct: bool = True,
        cluster_fabric: protocol.FabricDeclaration | None = None,
        cluster_tunnel_mtu: int | None = None,
        # GPU challenges (agent.verification): the challenge image (None: the CUDA image built FROM challenge_cuda_base on
        # NVML, the CPU image on sim and replay; agent.challenge_image), and a simulated host's behaviour (sim only)
        challenge_image: str | None = None,
        challenge_cuda_base: str = DEFAULT_CUDA_BASE,
        challenge_simulate: dict[str, Any] | None = None,
        volumes: VolumeStore | None = None,
    ) -> None:
        identity = state.identity()
        state.secure()
        self.state = state
        self.host_id = identity.host_id
        self.timings = timings or AgentTimings()
        # Its lifetime is checked here, before anything is opened: an expired certificate means enrolling again.
        self.certificate = CertificateKeeper(
            state, self.host_id, lambda body: self._emit(*self.window.renew_certificate(body)),
            renew_at_fraction=self.timings.renew_at_fraction, renewal_retry=self.timings.renewal_retry,
        )
        self.backend = backend
        self.region = region
        self.network_probes = network_probes
        self.network_max_bytes = network_max_bytes
        self.network_target_seconds = network_target_seconds
        self.max_frame = max_frame
        self.rng = rng or random.Random()
        static = relay_urls or identity.relay_urls
        if not static and not zone:
            raise ConfigError(
                "no relay to connect to: set GPUMARKET_ZONE (DNS discovery) or GPUMARKET_RELAY_URL, "
                "or enroll with a master that lists relays"
            )
        self.directory = RelayDirectory(
            zone=zone, static_urls=list(static), resolver=resolver, resolver_port=resolver_port, source=resolver_source
        )
        self.lease = SequenceLease(state.lease_file)
        self.spool = SqliteSpool(state.dir / "spool.db", max_messages=spool_max_messages, max_bytes=spool_max_bytes)
        self.window = OutboundWindow(self.host_id, first_seq=self.lease.start, store=self.spool)
        # None: nothing was decided for this agent, so process workloads are refused (hold still runs).
        self.isolation = isolation or HostIsolation(
            isolation_facts(ProcessIsolation("none", "no isolation was set up for this agent"), container_engine=None, allow_unisolated=False)
        )
        # Containers carry this host's id as their owner: agents sharing one engine never touch each other's.
        self.workloads = WorkloadManager(
            state.work_dir, backend, on_exit=self._workload_exited, on_progress=self._workload_progress,
            rental_users=self.isolation.users, isolation=self.isolation.facts,
            container=replace(container or ContainerOptions(), owner=self.host_id), ceilings=ceilings,
        )
        self.stop_workloads_on_close = stop_workloads_on_close
        self.lanes = CommandLanes(max_pending_commands)  # a worker each: an access change never waits behind a start
        self.logs = LogShipper(state.dir, self.workloads, self._send_logs)
        # Renters' volumes (agent.volumes): loop disks under <data_dir>/volumes where rentals' disks are loop disks too;
        # mounted into containers (the workloads) and served by the file-only sessions (the SSH server).
        policy = self.workloads.ceilings
        self.volumes = volumes or VolumeStore(
            state.dir / "volumes", policy.disks.tools if policy.disks is not None else policy.disk_reason or "no disk quotas here",
            reserved_disk_gib=policy.reserved_disk_gib,
        )
        self.workloads.volumes = self.volumes
        self.ssh = RentalSshServer(state.dir / "ssh", self.workloads, volumes=self.volumes)
        # Cluster members' private network (agent.cluster.net): peers reach this host where it reaches its relay from.
        self.clusters = ClusterNetworks(
            state.work_dir, self.workloads.container_namespace, self._local_address, relay_url=self._connect_url,
            relay_tls=lambda: client_ssl_context(self.state.ca_file), direct=cluster_direct,
            fabric=cluster_fabric, tunnel_mtu=cluster_tunnel_mtu,
        )
        self.cluster_network: protocol.ClusterNetworkFacts | None = None  # refresh_isolation finds it
        # Off-peak power limits (agent.power): what it lowered survives a restart in power.json.
        self.power = PowerPolicy(backend, state.dir / "power.json", in_use=self.workloads.gpus_in_use)
        cuda = cuda_image(challenge_cuda_base)
        image = challenge_image_for(backend.name, challenge_image, cuda)
        builder = CudaImageBuilder(lambda: self.workloads.containers.docker(), cuda) if image == cuda.name else None
        self.challenges = ChallengeRunner(
            self.workloads, image=image, simulate=challenge_simulate if backend.name == "sim" else None,
            prepare=builder.ensure if builder is not None else None,
        )
        copier = VolumeCopier(self.volumes, host_id=self.host_id, opening_keys=state.opening_keys,
                              ssl_context=lambda: client_ssl_context(self.state.ca_file), progress=self._copy_progress)  # fmt: skip
        self.commands = CommandExecutor(
            workloads=self.workloads, backend=backend, logs=self.logs, measure=self.measure_network,
            install_certificate=self.certificate.install, ssh=self.ssh, clusters=self.clusters, power=self.power,
            challenges=self.challenges, volumes=self.volumes,
            close_streams=lambda rental_id: self.tunnels.close_rental(rental_id, TunnelCode.ACCESS_REVOKED),
            host_id=self.host_id, opening_keys=state.opening_keys, remembered_results=remembered_results, copier=copier,
        )
        # Renters' streams the relay opens on this agent's link: SSH into a rental, its ports.
        self.tunnels = TunnelServer(self.workloads, self.ssh, clusters=self.clusters, max_streams_per_rental=max_streams_per_rental)
        self.max_streams = max_streams
        self.max_stream_buffer = max_stream_buffer
        self.stream_window, self.stream_data = stream_window, stream_data
        self.link_send_buffer = link_send_buffer
        self.streams: StreamLink | None = None
        self.sampler = Sampler(self.host_id, backend, self.power, self.window, self._emit)
        self._ws: ClientConnection | None = None
        self._started = time.monotonic()
        self.connected = asyncio.Event()
        self.pacer = Pacer()
        self.relay_id: str | None = None
        self.relay_url: str | None = None
        self.connections = 0

    def _ssl(self) -> ssl.SSLContext:
        return client_ssl_context(self.state.ca_file, cert_file=self.state.cert_file, key_file=self.state.key_file)

    # ---- outgoing ---------------------------------------------------------------------

    async def _emit(self, seq: int, frame: str) -> None:
        """Send if connected, once the frame is on disk (the spool's group commit, off the loop); the frame
        stays in the spool either way until acknowledged."""
        self.lease.reserve_through(seq + 1)
        await self.spool.sync()
        ws = self._ws
        if ws is None:
            return
        await self.pacer.take()
        with contextlib.suppress(ConnectionClosed):
            await ws.send(frame)

    async def refresh_isolation(self) -> None:
        """Ask the container engine, and put the rentals' network guard in place and self-test it, so that
        the hello says what this host runs and whether it is isolated. Cancelling is safe: the facts stay
        as they were."""
        facts = await self.workloads.container_facts()
        if facts is not None:
            self.isolation = self.isolation.with_container_engine(facts.engine)
        self.isolation = self.isolation.with_network(await self.workloads.network_facts())
        self.cluster_network = await cluster_paths.detect(self.clusters.fabric, wireguard_go=self.clusters.wireguard_go)
        # New tunnels use kernel WireGuard where the host has it and ``wg`` to configure it (agent.cluster.wgkernel).
        self.clusters.kernel = self.cluster_network.kernel_wireguard and shutil.which(wgkernel.WG) is not None

    def _hello(self) -> protocol.HelloBody:
        facts = collect_host_facts(workload_dir=self.state.work_dir, agent_version=AGENT_VERSION)
        return protocol.HelloBody(
            agent_version=AGENT_VERSION,
            gpu_backend=self.backend.name,
            region=self.region,
            host=facts.to_wire(),
            gpus=[protocol.GpuInfoModel.model_validate(g.to_wire()) for g in self.backend.gpus()],
            running_rentals=self._rentals_running(),
            isolation=with_volumes(with_ceilings(self.isolation.facts, self.workloads.ceilings), self.volumes),
            cluster_network=self.cluster_network,
        )

    # ---- sampling (agent.sampling) -----------------------------------------------------

    async def sample_once(self) -> None:
        """One sampling pass: read the GPUs, update the window, push any GPU events at once."""
        await self.sampler.sample_once()

    async def report_telemetry(self) -> None:
        """Write one telemetry message: the latest sample and the window's aggregates."""
        await self.sampler.report_telemetry()

    @property
    def samples_taken(self) -> int:
        return self.sampler.taken

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.timings.heartbeat_interval)
            body = protocol.HeartbeatBody(
                uptime_s=time.monotonic() - self._started,
                running_rentals=self._rentals_running(),
                spool=protocol.SpoolStats(pending=len(self.spool), evicted=self.spool.evicted),
            )
            await self._emit(*self.window.heartbeat(body))
            await self.report_tunnel_usage()

    async def report_tunnel_usage(self) -> None:
        """Send the bytes renters moved per rental since the last report (nothing when none)."""
        usage = self.tunnels.take_usage()
        logins = self.ssh.take_logins()
        if usage or logins:
            items = [
                protocol.TunnelUsageItem(rental_id=r, bytes_in=usage.get(r, (0, 0))[0], bytes_out=usage.get(r, (0, 0))[1],
                                         keys_used=sorted(logins.get(r, ())))
                for r in sorted(set(usage) | set(logins))
            ]
            for start in range(0, len(items), 1024):
                body = protocol.TunnelUsageBody(at=datetime.now(UTC), rentals=items[start:start + 1024])
                await self._emit(*self.window.tunnel_usage(body))

    def _connect_url(self) -> str | None:
        """Where cluster peers reach this host's members through its relay: the relay's ``/v1/connect`` (``None``: not connected)."""
        if not self.relay_url:
            return None
        parts = urlsplit(self.relay_url)
        return urlunsplit((parts.scheme, parts.netloc, CONNECT_PATH, "", ""))

    def _local_address(self) -> str | None:
        """The address this host reaches its relay from (the connection's own end; ``None`` while not connected):
        where its cluster members' peers send their tunnel's packets."""
        ws = self._ws
        if ws is None:
            return None
        try:
            address = ws.local_address
        except (AttributeError, OSError):
            return None
        return address[0] if isinstance(address, tuple) and address and isinstance(address[0], str) else None

    # ---- the connection ---------------------------------------------------------------

    async def run(self) -> None:
        """Run until cancelled. Cancelling is safe: unacknowledged messages stay in the spool."""
        await self.refresh_isolation()
        await self.workloads.resume()  # re-adopted workloads; report those that died while we were down
        await self.clusters.resume()
        await self.challenges.remove_orphans()  # a challenge from before a restart is over: the master fails it
        await asyncio.to_thread(self.volumes.remount_all)  # volumes outlive the agent and a reboot (docs/volumes.md)
        for rental_id in self.workloads.running():
            self.logs.follow(rental_id)
        tasks = [
            asyncio.create_task(self.certificate.run(self.connected), name=f"agent-{self.host_id}-renewal"),
            *(asyncio.create_task(self._command_worker(queue), name=f"agent-{self.host_id}-{lane}") for lane, queue in self.lanes.queues.items()),
            asyncio.create_task(
                self.sampler.run(lambda: self.timings.sample_interval, lambda: self.timings.telemetry_interval),
                name=f"agent-{self.host_id}-sampler",
            ),
            asyncio.create_task(self._log_shipper(), name=f"agent-{self.host_id}-logs"),
            asyncio.create_task(self.power.run(), name=f"agent-{self.host_id}-power"),
            asyncio.create_task(self._prepare_challenge_image(), name=f"agent-{self.host_id}-challenge-image"),
        ]
        if self.timings.network_interval > 0:
            tasks.append(asyncio.create_task(self._network_loop(), name=f"agent-{self.host_id}-network"))
        try:
            await self._connection_loop()
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _prepare_challenge_image(self) -> None:
        """Build the GPU challenge's image now where this host builds it (the CUDA image: a base of several GB to pull),
        so that the first challenge does not wait for it; a failure is logged, and the next challenge tries again."""
        try:
            await self.challenges.prepare_image()
        except GpumarketError as exc:
            log.warning("the GPU challenge's image is not ready (the next challenge tries again): %s", exc)

    def backoff(self, failures: int) -> float:
        """Full jitter: uniform in [0, min(cap, base · 2^failures)] (AWS architecture blog, 2015)."""
        ceiling = min(self.timings.reconnect_max_delay, self.timings.reconnect_base_delay * (2 ** min(failures, 30)))
        return self.rng.uniform(0, ceiling)

    async def _connection_loop(self) -> None:
        failures = 0
        await self._refresh_directory()
        while True:
            raise_if_cancelled()  # a stop some library lost (shared.cancelling) must not become a new connection
            if self.directory.needs_refresh():
                await self._refresh_directory()
            url = self.directory.next()
            self.certificate.check()  # raises once it has expired: retrying cannot help
            started = time.monotonic()
            try:
                await self._session(url)
            except (OSError, TimeoutError, InvalidHandshake, ssl.SSLError) as exc:
                log.warning("host %s: cannot connect to %s: %s", self.host_id, url, exc)
                self.directory.mark_failed(url)
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd else None
                if code == protocol.CLOSE_REVOKED:
                    # Final: every relay refuses a revoked certificate, so retrying cannot help.
                    revoked = ConfigError(
                        f"this host's certificate was revoked (relay {url} said: {exc.rcvd.reason if exc.rcvd else ''}); "
                        "the host must enroll again with a new token from its provider"
                    )
                    log.error("host %s: stopping: %s", self.host_id, revoked.message)
                    raise revoked from None
                log.info("host %s: relay %s closed the connection (%s)", self.host_id, url, exc)
                if code in _MOVE_ON_CODES:
                    self.directory.mark_draining(url)
            except InvalidURI as exc:
                raise ConfigError(f"relay URL {url!r} is not a websocket URL: {exc}") from None
            except ProtocolError as exc:
                log.error("host %s: relay %s sent something we do not understand (%s); trying another", self.host_id, url, exc)
                self.directory.mark_failed(url)
            finally:
                self._ws = None
                self.connected.clear()
            failures = 0 if time.monotonic() - started >= self.timings.stable_after else failures + 1
            await asyncio.sleep(self.backoff(failures))

    async def _refresh_directory(self) -> None:
        try:
            await self.directory.refresh()
        except GpumarketError as exc:
            log.warning("host %s: relay discovery failed: %s", self.host_id, exc)

    async def _session(self, url: str) -> None:
        async with connect(
            url,
            ssl=self._ssl(),
            open_timeout=self.timings.open_timeout,
            max_size=self.max_frame,
            max_queue=4,  # frames waiting here are in order whatever their stream: few, so a keystroke is not behind MBs
            compression=None, additional_headers={frames.MAX_DATA_HEADER: str(self.stream_data)},  # the welcome agrees
            close_timeout=2.0,
        ) as ws:
            async with asyncio.timeout(self.timings.welcome_timeout):
                first = protocol.decode_server_frame(await ws.recv(), max_frame=self.max_frame)
            if not isinstance(first, protocol.Welcome):
                raise ProtocolError(f"expected welcome, got {first.type}")
            if first.body.host_id != self.host_id:
                raise ProtocolError(f"relay welcomed host {first.body.host_id}, but we are {self.host_id}")
            self.relay_id, self.relay_url = first.body.relay_id, url
            self.timings.heartbeat_interval = first.body.heartbeat_interval
            self.timings.telemetry_interval = first.body.telemetry_interval
            self.pacer.configure(first.body.max_messages_per_second, first.body.message_burst)
            self.connections += 1
            log.info("host %s connected to relay %s (%d unacknowledged to replay)", self.host_id, self.relay_id, len(self.window))
            self._ws = ws
            # Hello first, then everything the last connection left unacknowledged, in order.
            seq, hello = self.window.hello(self._hello())
            self.lease.reserve_through(seq + 1)
            await self.spool.sync()  # what the relay sees is on disk
            await self.pacer.take()
            await ws.send(hello)
            await self.spool.sync()  # and so is what is replayed (nothing awaits between this and the snapshot)
            for old_seq, frame in self.window.pending():
                if old_seq != seq:
                    await self.pacer.take()  # a long outage's replay stays within the relay's budget
                    await ws.send(frame)
            bound_send_buffer(ws.transport, self.link_send_buffer)
            max_data = frames.welcomed_max_data(first.body.max_stream_data, self.stream_data)
            self.streams = StreamLink(
                Multiplexer(initiator=True, max_streams=self.max_streams, max_link_buffer=self.max_stream_buffer,
                            window=self.stream_window, max_data=max_data),
                ws.send, on_open=self.tunnels.accept,
            )
            pump = asyncio.create_task(self._pump(self.streams), name=f"agent-{self.host_id}-streams")
            self.connected.set()
            beats = asyncio.create_task(self._heartbeats(), name=f"agent-{self.host_id}-heartbeats")
            try:
                await self._receive(ws)  # returns when the relay closes the connection
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await ws.close(1001, "agent shutting down")
                raise
            finally:
                for task in (beats, pump):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                self.streams.lost()  # every renter's stream on this link ends; they connect again
                self.streams = None

    @staticmethod
    async def _pump(streams: StreamLink) -> None:
        with contextlib.suppress(ConnectionClosed):
            await streams.run()

    async def _receive(self, ws: ClientConnection) -> None:
        async for frame in ws:
            if isinstance(frame, bytes):  # a renter's stream (shared.streams)
                try:
                    assert self.streams is not None
                    self.streams.feed(frame)
                except StreamProtocolError as exc:
                    log.error("host %s: relay broke the stream framing (%s); reconnecting", self.host_id, exc)
                    await ws.close(exc.close_code, str(exc)[:120])
                    return
                continue
            message = protocol.decode_server_frame(frame, max_frame=self.max_frame)
            match message:
                case protocol.Ack():
                    self.window.ack(message.body.seq)
                case protocol.Command():
                    self.lanes.put(message.body)
                case protocol.Move():
                    log.info("relay asks us to move: %s", message.body.reason)
                    if self.relay_url:
                        self.directory.mark_draining(self.relay_url)
                    await ws.close(1000, "moving to another relay")
                    return
                case protocol.Welcome():
                    log.warning("unexpected second welcome ignored")
        # The iterator ends quietly on a normal close; re-raise it so the loop sees the close code.
        await ws.wait_closed()
        if ws.close_code != 1000:
            raise ws.protocol.close_exc

    # ---- commands ---------------------------------------------------------------------

    async def _command_worker(self, queue: asyncio.Queue[protocol.CommandBody]) -> None:
        """Run the commands of ``queue`` (a lane of ``self.lanes``) one at a time, in the order they came."""
        while True:
            command = await queue.get()
            if command.kind == "stop_workload" and isinstance(rental_id := command.args.get("rental_id"), str):
                self.tunnels.close_rental(rental_id)  # its renters' connections end now, not after the grace
            result = await self.commands.result_for(command)
            await self._emit(*self.window.command_result(result))

    def _rentals_running(self) -> list[str]:
        """The rentals whose workloads run (a GPU challenge's workload is the agent's, not a rental's)."""
        return [rental_id for rental_id in self.workloads.running() if not is_challenge(rental_id)]

    async def _workload_exited(self, rental_id: str, exit_code: int | None) -> None:
        """Called by the workload manager when a workload ends on its own."""
        if is_challenge(rental_id):
            return  # its runner sees it end (agent.verification)
        self.logs.exited(rental_id)
        body = protocol.WorkloadExitedBody(
            rental_id=rental_id, exit_code=exit_code, at=datetime.now(UTC),
            reason=self.workloads.exit_reason(rental_id) or ("exited" if exit_code is not None else "ended while the agent was not watching"),
        )
        await self._emit(*self.window.workload_exited(body))

    async def _workload_progress(self, rental_id: str, stage: ProgressStage, text: str, percent: float | None) -> None:
        """Called by the workload manager on a step of a start (an image pull): a rental event for the renter."""
        body = protocol.WorkloadProgressBody(rental_id=rental_id, at=datetime.now(UTC), stage=stage, text=text[:512], percent=percent)
        await self._emit(*self.window.workload_progress(body))

    async def _copy_progress(self, volume_id: str, text: str, percent: float | None) -> None:
        """Called by a running volume copy now and then: a volume event for the renter (stage ``copying``)."""
        body = protocol.WorkloadProgressBody(rental_id=volume_id, at=datetime.now(UTC), stage="copying", text=text[:512], percent=percent)
        await self._emit(*self.window.workload_progress(body))

    # ---- network ----------------------------------------------------------------------

    async def measure_network(self) -> protocol.NetworkReportBody:
        url = self.relay_url or self.directory.next()
        try:
            result = await measure(
                url, ssl_context=self._ssl(), probes=self.network_probes,
                target_seconds=self.network_target_seconds, max_bytes=self.network_max_bytes,
            )
            body = protocol.NetworkReportBody.model_validate(result.to_wire())
        except (OSError, TimeoutError, InvalidHandshake, ConnectionClosed, GpumarketError) as exc:
            body = protocol.NetworkReportBody(
                relay_url=url, measured_at=datetime.now(UTC), loss=1.0, probes_sent=0, probes_answered=0,
                duration_s=0.0, error=f"{type(exc).__name__}: {exc}"[:1024],
            )
        await self._emit(*self.window.network_report(body))
        return body

    async def _network_loop(self) -> None:
        interval = self.timings.network_interval
        await asyncio.sleep(self.rng.uniform(0, interval))  # spread a fleet's first tests over the interval
        while True:
            await self.connected.wait()
            await self.measure_network()
            await asyncio.sleep(next_delay(interval, rng=self.rng))

    # ---- workload logs ----------------------------------------------------------------

    async def _send_logs(self, body: protocol.WorkloadLogsBody) -> None:
        await self._emit(*self.window.workload_logs(body))

    async def ship_logs(self) -> int:
        """Write new output of every known workload to the spool; returns bytes shipped."""
        return await self.logs.ship()

    async def _log_shipper(self) -> None:
        while True:
            await asyncio.sleep(self.timings.log_ship_interval)
            try:
                await self.ship_logs()
            except Exception:
                log.exception("host %s: shipping workload logs failed", self.host_id)

    async def close(self) -> None:
        """Release everything after ``run`` was cancelled. Workloads keep running unless told otherwise."""
        await self.tunnels.close()
        await self.clusters.close()
        await self.ssh.close()
        await self.workloads.close(stop_workloads=self.stop_workloads_on_close)
        await self.power.close()
        self.backend.close()
        self.spool.close()
