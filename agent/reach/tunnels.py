"""What the agent does with a renter's stream (``shared.streams``) the relay opens on its link.

The relay opens a stream only for a connect token the master signed, and names in its OPEN
header the rental, the port and the kind. The agent checks again what only it knows, and refuses
(resets) the stream with a ``TunnelCode`` otherwise:

* ``tcp``: the rental's container runs here; the bytes go to that port of the container
  (``ContainerRuntime.open_port``: inside its network namespace when the agent may, else its
  address on its private network), nowhere else — never a port of the host. Process and hold
  rentals serve no ports (``NOT_OFFERED``). Nothing listening: ``CONNECT_FAILED``.
* ``ssh``: the agent's own SSH server for the rental (``agent.reach.sshd``) over the stream itself (asyncssh on a
  ``shared.streams.transport.ChannelTransport``: no socket pair); it keeps serving SFTP after the workload exited,
  until the rental is released.

Streams are counted per rental (at most ``max_streams_per_rental`` at once: ``AGENT_LIMIT``) and
their bytes summed per rental for the master (``take_usage``, sent as ``tunnel_usage``). When a
rental stops, ``close_rental`` resets its streams at once (``RENTAL_STOPPED``), and refuses its ports' new ones while
its workload's stop grace runs (a connect token issued before the stop is still signed and unexpired); SSH goes on,
SFTP into the workspace until the rental is released.

Every stream's task is owned here: ``close`` cancels them all.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import weakref
from typing import TYPE_CHECKING, Protocol

from agent.cluster.relay import serve_stream
from shared.errors import GpumarketError
from shared.streams import OpenRequest, ResetCode, StreamProtocolError, TunnelCode, decode_open_header
from shared.streams.aio import Channel, splice

if TYPE_CHECKING:
    from agent.cluster.net import ClusterNetworks
    from agent.runtimes.base import Workload
    from agent.runtimes.manager import WorkloadManager

log = logging.getLogger(__name__)


class SshServer(Protocol):
    """What ``agent.reach.sshd.RentalSshServer`` offers the tunnels."""

    def knows(self, rental_id: str) -> bool: ...

    def access_disabled(self, rental_id: str) -> bool: ...

    async def serve(self, rental_id: str, sock: socket.socket | Channel) -> None: ...


class TunnelServer:
    def __init__(
        self,
        workloads: WorkloadManager,
        ssh: SshServer | None = None,
        *,
        clusters: ClusterNetworks | None = None,
        # Timeouts
        connect_timeout: float = 5.0,
        # Limits
        max_streams_per_rental: int = 32,
    ) -> None:
        if connect_timeout <= 0 or max_streams_per_rental < 1:
            raise ValueError("tunnel timeouts and limits must be positive")
        self.workloads = workloads
        self.ssh = ssh
        self.clusters = clusters
        self.connect_timeout = connect_timeout
        self.max_streams_per_rental = max_streams_per_rental
        self._tasks: dict[str, dict[asyncio.Task[None], Channel]] = collections.defaultdict(dict)
        self._usage: dict[str, list[int]] = {}  # rental -> [bytes from renters, bytes to renters], not yet reported
        self._reported: dict[Channel, tuple[int, int]] = {}  # what take_usage counted already of open streams
        # Rental -> its workload told to stop (while it is still the rental's workload: a new start is another one).
        self._stopped: weakref.WeakValueDictionary[str, Workload] = weakref.WeakValueDictionary()
        self.streams_served = 0

    def open_streams(self, rental_id: str) -> int:
        return len(self._tasks.get(rental_id, ()))

    def accept(self, channel: Channel) -> None:
        """The link's ``on_open``: start serving the stream, or refuse it."""
        try:
            request = decode_open_header(channel.header)
        except StreamProtocolError as exc:
            log.warning("refused a stream: %s", exc)
            channel.reset(ResetCode.REFUSED)
            return
        if not self._known(request):
            channel.reset(TunnelCode.NOT_HERE)
            return
        if self.ssh is not None and self.ssh.access_disabled(request.rental_id):
            channel.reset(TunnelCode.ACCESS_REVOKED)  # the account is disabled: not even a web port
            return
        if request.kind != "ssh" and self._stopping(request.rental_id):
            channel.reset(TunnelCode.RENTAL_STOPPED)
            return
        tasks = self._tasks[request.rental_id]
        if len(tasks) >= self.max_streams_per_rental:
            channel.reset(TunnelCode.AGENT_LIMIT)
            return
        task = asyncio.create_task(self._serve(channel, request), name=f"tunnel-{request.rental_id}-{channel.stream_id}")
        tasks[task] = channel
        task.add_done_callback(lambda done: self._done(request.rental_id, done, channel))

    def _known(self, request: OpenRequest) -> bool:
        if self.workloads.workload(request.rental_id) is not None:
            return True
        return request.kind == "ssh" and self.ssh is not None and self.ssh.knows(request.rental_id)

    def _stopping(self, rental_id: str) -> bool:
        stopped = self._stopped.get(rental_id)
        return stopped is not None and stopped is self.workloads.workload(rental_id)

    def _done(self, rental_id: str, task: asyncio.Task[None], channel: Channel) -> None:
        tasks = self._tasks.get(rental_id)
        if tasks is not None:
            tasks.pop(task, None)
            if not tasks:
                del self._tasks[rental_id]
        seen = self._reported.pop(channel, (0, 0))
        usage = self._usage.setdefault(rental_id, [0, 0])
        usage[0] += channel.bytes_in - seen[0]
        usage[1] += channel.bytes_out - seen[1]
        self.streams_served += 1
        if not task.cancelled() and task.exception() is not None:
            log.warning("stream to rental %s failed: %s", rental_id, task.exception())

    async def _serve(self, channel: Channel, request: OpenRequest) -> None:
        if request.kind == "ssh":
            await self._serve_ssh(channel, request.rental_id)
            return
        if request.kind == "wg":  # a cluster peer's tunnel datagrams, through the relays (agent.cluster.relay)
            port = self.clusters.listen_port(request.rental_id) if self.clusters is not None else None
            if port is None:
                channel.reset(TunnelCode.NOT_OFFERED)
                return
            await serve_stream(port, channel.read, channel.write)
            channel.close()
            return
        try:
            opened = await self.workloads.open_container_port(request.rental_id, request.port, timeout=self.connect_timeout)
        except GpumarketError as exc:  # the engine does not answer
            log.warning("rental %s: cannot reach its container (%s)", request.rental_id, exc)
            channel.reset(ResetCode.CONNECT_FAILED)
            return
        except (OSError, TimeoutError) as exc:
            log.info("rental %s: nothing answers on port %d (%s)", request.rental_id, request.port, exc)
            channel.reset(ResetCode.CONNECT_FAILED)
            return
        if opened is None:
            channel.reset(TunnelCode.NOT_OFFERED)
            return
        await splice(channel, *opened)

    async def _serve_ssh(self, channel: Channel, rental_id: str) -> None:
        if self.ssh is None or not self.ssh.knows(rental_id):
            channel.reset(TunnelCode.NOT_OFFERED)
            return
        await self.ssh.serve(rental_id, channel)

    def close_rental(self, rental_id: str, code: int = TunnelCode.RENTAL_STOPPED) -> int:
        """Reset every stream of the rental now (it stopped); returns how many there were. ``RENTAL_STOPPED``: its
        workload is being stopped, so new streams to its ports are refused too."""
        if code == TunnelCode.RENTAL_STOPPED and (workload := self.workloads.workload(rental_id)) is not None:
            self._stopped[rental_id] = workload
        tasks = self._tasks.get(rental_id, {})
        for channel in list(tasks.values()):
            channel.reset(code)
        return len(tasks)

    def take_usage(self) -> dict[str, tuple[int, int]]:
        """Bytes (from renters, to renters) per rental since the last call, streams still open included."""
        usage = {rental: (u[0], u[1]) for rental, u in self._usage.items() if u[0] or u[1]}
        self._usage.clear()
        for rental_id, tasks in self._tasks.items():
            for channel in tasks.values():
                seen = self._reported.get(channel, (0, 0))
                delta = (channel.bytes_in - seen[0], channel.bytes_out - seen[1])
                if delta[0] or delta[1]:
                    before = usage.get(rental_id, (0, 0))
                    usage[rental_id] = (before[0] + delta[0], before[1] + delta[1])
                    self._reported[channel] = (channel.bytes_in, channel.bytes_out)
        return usage

    async def close(self) -> None:
        """Cancel every stream's task and wait for them."""
        tasks = [task for tasks in self._tasks.values() for task in tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
