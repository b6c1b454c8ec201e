"""The agent's main loop: connect to a relay, say hello, stream heartbeats and telemetry,
execute commands, and never forget an unacknowledged message.

Every outgoing message enters the ``OutboundWindow`` first and leaves it only when the
relay acknowledges its ``seq`` (which the relay does once the message is on the bus).
After a reconnect, everything still in the window is sent again in order. When the
window is full, sampling pauses instead of dropping messages.

Commands run one at a time, in arrival order, by a worker that outlives connections;
a command id seen before is not executed again: its recorded result is re-sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
from collections import OrderedDict
from datetime import UTC, datetime
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from agent.gpu.base import GpuBackend
from agent.hostfacts import collect_host_facts
from agent.state import AgentState, SequenceLease
from agent.workloads import WorkloadManager
from shared import protocol
from shared.crypto import client_ssl_context
from shared.errors import ConfigError, GpumarketError, ProtocolError

log = logging.getLogger(__name__)

AGENT_VERSION = "0.1.0"


class Agent:
    def __init__(
        self,
        state: AgentState,
        backend: GpuBackend,
        *,
        relay_urls: list[str] | None = None,
        region: str | None = None,
        telemetry_interval: float = 10.0,
        heartbeat_interval: float = 10.0,
        # Timeouts
        open_timeout: float = 10.0,
        welcome_timeout: float = 10.0,
        reconnect_min_delay: float = 0.2,
        reconnect_max_delay: float = 30.0,
        # Limits
        max_unacked: int = 10_000,
        max_frame: int = protocol.DEFAULT_MAX_FRAME,
        max_pending_commands: int = 256,
        remembered_results: int = 1000,
    ) -> None:
        identity = state.identity()
        self.state = state
        self.host_id = identity.host_id
        self.backend = backend
        self.relay_urls = relay_urls or identity.relay_urls
        if not self.relay_urls:
            raise ConfigError("no relay to connect to: set GPUMARKET_RELAY_URL or enroll with a master that lists relays")
        self.region = region
        self.telemetry_interval = telemetry_interval
        self.heartbeat_interval = heartbeat_interval
        self.open_timeout = open_timeout
        self.welcome_timeout = welcome_timeout
        self.reconnect_min_delay = reconnect_min_delay
        self.reconnect_max_delay = reconnect_max_delay
        self.max_frame = max_frame
        self.lease = SequenceLease(state.lease_file)
        self.window = protocol.OutboundWindow(self.host_id, first_seq=self.lease.start, max_unacked=max_unacked)
        self.workloads = WorkloadManager(state.work_dir, backend)
        self._commands: asyncio.Queue[protocol.CommandBody] = asyncio.Queue(max_pending_commands)
        self._results: OrderedDict[str, protocol.CommandResultBody] = OrderedDict()
        self._remembered_results = remembered_results
        self._ws: ClientConnection | None = None
        self._started = time.monotonic()
        self.connected = asyncio.Event()
        self.relay_id: str | None = None
        self.connections = 0

    def _ssl(self) -> ssl.SSLContext:
        return client_ssl_context(self.state.ca_file, cert_file=self.state.cert_file, key_file=self.state.key_file)

    # ---- outgoing ---------------------------------------------------------------------

    async def _emit(self, seq: int, frame: str) -> None:
        """Send if connected; the frame stays in the window either way until acknowledged."""
        self.lease.reserve_through(seq + 1)
        ws = self._ws
        if ws is None:
            return
        with contextlib.suppress(ConnectionClosed):
            await ws.send(frame)

    def _hello(self) -> protocol.HelloBody:
        facts = collect_host_facts(workload_dir=self.state.work_dir, agent_version=AGENT_VERSION)
        return protocol.HelloBody(
            agent_version=AGENT_VERSION,
            gpu_backend=self.backend.name,
            region=self.region,
            host=facts.to_wire(),
            gpus=[protocol.GpuInfoModel.model_validate(g.to_wire()) for g in self.backend.gpus()],
            running_rentals=self.workloads.running(),
        )

    async def _sample(self) -> None:
        if self.window.full:
            log.warning("%d messages unacknowledged; pausing telemetry until the relay catches up", len(self.window))
            return
        samples = await asyncio.to_thread(self.backend.sample)
        body = protocol.TelemetryBody(
            sampled_at=datetime.now(UTC),
            gpus=[protocol.GpuSampleModel.model_validate(s.to_wire()) for s in samples],
        )
        await self._emit(*self.window.telemetry(body))

    async def _heartbeat(self) -> None:
        if self.window.full:
            return
        body = protocol.HeartbeatBody(uptime_s=time.monotonic() - self._started, running_rentals=self.workloads.running())
        await self._emit(*self.window.heartbeat(body))

    # ---- the connection ---------------------------------------------------------------

    async def run(self) -> None:
        """Stay connected until cancelled. Cancelling is safe: unacknowledged messages stay in the window."""
        worker = asyncio.create_task(self._command_worker(), name=f"agent-{self.host_id}-commands")
        delay = self.reconnect_min_delay
        attempt = 0
        try:
            while True:
                url = self.relay_urls[attempt % len(self.relay_urls)]
                attempt += 1
                try:
                    await self._session(url)
                    delay = self.reconnect_min_delay  # a session that got going resets the back-off
                except (OSError, TimeoutError, InvalidHandshake, ssl.SSLError) as exc:
                    log.warning("host %s: cannot connect to %s: %s", self.host_id, url, exc)
                except ConnectionClosed as exc:
                    log.info("host %s: relay closed the connection (%s)", self.host_id, exc)
                except InvalidURI as exc:
                    raise ConfigError(f"relay URL {url!r} is not a websocket URL: {exc}") from None
                except ProtocolError as exc:
                    log.error("host %s: relay spoke a protocol we do not understand: %s", self.host_id, exc)
                self._ws = None
                self.connected.clear()
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, self.reconnect_max_delay)
        finally:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker

    async def _session(self, url: str) -> None:
        async with connect(
            url,
            ssl=self._ssl(),
            open_timeout=self.open_timeout,
            max_size=self.max_frame,
            compression=None,
            close_timeout=2.0,
        ) as ws:
            async with asyncio.timeout(self.welcome_timeout):
                first = protocol.decode_server_frame(await ws.recv(), max_frame=self.max_frame)
            if not isinstance(first, protocol.Welcome):
                raise ProtocolError(f"expected welcome, got {first.type}")
            if first.body.host_id != self.host_id:
                raise ProtocolError(f"relay welcomed host {first.body.host_id}, but we are {self.host_id}")
            self.relay_id = first.body.relay_id
            self.heartbeat_interval = first.body.heartbeat_interval
            self.telemetry_interval = first.body.telemetry_interval
            self.connections += 1
            log.info("host %s connected to relay %s (%d unacknowledged to replay)", self.host_id, self.relay_id, len(self.window))
            self._ws = ws
            # Hello first, then everything the last connection left unacknowledged, in order.
            seq, hello = self.window.hello(self._hello())
            self.lease.reserve_through(seq + 1)
            await ws.send(hello)
            for old_seq, frame in self.window.pending():
                if old_seq != seq:
                    await ws.send(frame)
            self.connected.set()
            ticker = asyncio.create_task(self._tick(), name=f"agent-{self.host_id}-tick")
            try:
                await self._receive(ws)  # returns when the relay closes the connection
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await ws.close(1001, "agent shutting down")
                raise
            finally:
                ticker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ticker

    async def _receive(self, ws: ClientConnection) -> None:
        try:
            async for frame in ws:
                message = protocol.decode_server_frame(frame, max_frame=self.max_frame)
                match message:
                    case protocol.Ack():
                        self.window.ack(message.body.seq)
                    case protocol.Command():
                        try:
                            self._commands.put_nowait(message.body)
                        except asyncio.QueueFull:
                            log.warning("command queue full; %s will be resent by the master", message.body.command_id)
                    case protocol.Move():
                        log.info("relay asks us to move: %s", message.body.reason)
                        return
                    case protocol.Welcome():
                        log.warning("unexpected second welcome ignored")
        except ConnectionClosed as exc:
            log.info("host %s: connection closed: %s", self.host_id, exc)

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        next_beat = loop.time() + self.heartbeat_interval
        next_sample = loop.time()
        while True:
            now = loop.time()
            try:
                if now >= next_sample:
                    next_sample = now + self.telemetry_interval
                    await self._sample()
                if now >= next_beat:
                    next_beat = now + self.heartbeat_interval
                    await self._heartbeat()
            except Exception:
                # A GPU that fails to answer must not take the connection down; log and go on.
                log.exception("host %s: sampling failed", self.host_id)
            await asyncio.sleep(max(0.0, min(next_sample, next_beat) - loop.time()))

    # ---- commands ---------------------------------------------------------------------

    async def _command_worker(self) -> None:
        while True:
            command = await self._commands.get()
            result = self._results.get(command.command_id)
            if result is None:
                result = await self._execute(command)
                self._results[command.command_id] = result
                while len(self._results) > self._remembered_results:
                    self._results.popitem(last=False)
            else:
                log.info("command %s already executed; reporting its result again", command.command_id)
            await self._emit(*self.window.command_result(result))

    async def _execute(self, command: protocol.CommandBody) -> protocol.CommandResultBody:
        args: dict[str, Any] = command.args
        try:
            rental_id = str(args["rental_id"])
            if command.kind == "start_workload":
                data = await self.workloads.start(rental_id, list(args.get("gpu_uuids", [])), dict(args.get("workload") or {}))
            else:
                data = await self.workloads.stop(rental_id)
            ok, detail = True, ""
        except (GpumarketError, KeyError, TypeError, ValueError) as exc:
            log.warning("command %s (%s) failed: %s", command.command_id, command.kind, exc)
            ok, detail, data = False, str(exc), {}
        return protocol.CommandResultBody(
            command_id=command.command_id, ok=ok, detail=detail[:4096], data=data, finished_at=datetime.now(UTC)
        )

    async def close(self) -> None:
        """Stop every workload and release the GPU backend (after ``run`` was cancelled)."""
        await self.workloads.close()
        self.backend.close()
