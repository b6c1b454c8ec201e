"""``ContainerHandle``: one container rental's output followed into its ``output.log``, and its exit.

The engine keeps a container's output with its ``local`` log driver; the handle follows that
stream (stdout and stderr, with timestamps), appends it to the rental's log, and keeps the
last timestamp copied in ``container.since`` (at most a second old, written in a thread: its
fsync stays off the event loop), so a restarted agent resumes from there. The stream ending and the engine's state tell the exit and its code;
``wait``/``exited``/``returncode``/``close`` are the manager's ``WorkloadHandle``.
"""


from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final, Protocol

import aiodocker
import aiohttp
from aiodocker.exceptions import DockerError

from agent.runtimes.containeropts import SINCE_NAME, ContainerOptions, exit_code_of, parse_timestamp_ns
from agent.runtimes.logs import LOG_NAME
from agent.runtimes.pids import EndsOnce
from agent.state import atomic_write

log = logging.getLogger(__name__)

_HEADER: Final = struct.Struct(">BxxxL")  # the engine's multiplexed stream: stream type, 3 pad bytes, length


class Engine(Protocol):
    """What the handle needs of the runtime: its engine client and its options."""

    options: ContainerOptions

    def docker(self) -> aiodocker.Docker: ...


class ContainerHandle(EndsOnce):
    """Waits for one container and copies its output into the rental's ``output.log`` meanwhile.

    The same shape as ``pids.ProcessHandle``: ``wait(timeout)``, ``exited``, ``returncode``
    (``-N`` after signal N, ``None`` when the container was gone), ``close()``. While the
    engine does not answer, it asks again every ``retry_interval``; the container keeps running.
    """

    def __init__(self, runtime: Engine, container_id: str, folder: Path) -> None:
        self.runtime = runtime
        self.container_id = container_id
        self.folder = folder
        self.returncode: int | None = None
        self.oom_killed = False
        self._loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[None] = self._loop.create_future()
        self._since = self._read_since()
        self._saved_since = self._since
        self._saved_at = 0.0
        self._save_lock = threading.Lock()  # the thread's write and close()'s share the temporary file
        self.task = self._loop.create_task(self._follow(), name=f"container-{container_id[:12]}-follow")

    def close(self) -> None:
        """Stop following (the container itself is left alone)."""
        self.task.cancel()
        self._save_since(force=True)

    async def _follow(self) -> None:
        container = self.runtime.docker().containers.container(self.container_id)
        retry = self.runtime.options.retry_interval
        while True:
            try:
                info = await container.show()
            except DockerError as exc:
                if exc.status == 404:
                    break  # removed behind our back: the exit code is unknown
                await asyncio.sleep(retry)
                continue
            except (aiohttp.ClientError, OSError, TimeoutError):
                await asyncio.sleep(retry)
                continue
            state = info.get("State") or {}
            running = bool(state.get("Running") or state.get("Restarting"))
            began = time.monotonic()
            try:
                await self._copy(follow=running)
            except (DockerError, aiohttp.ClientError, OSError, TimeoutError) as exc:
                log.debug("container %s: log stream broke (%s)", self.container_id[:12], exc)
                await asyncio.sleep(retry)
                continue
            if not running:
                self.returncode = exit_code_of(state)
                self.oom_killed = bool(state.get("OOMKilled"))
                break
            if time.monotonic() - began < 0.05:
                await asyncio.sleep(min(retry, 0.2))  # the stream ended at once: never spin
        await asyncio.to_thread(self._save_since, force=True)
        self._exited.set_result(None)

    async def _copy(self, *, follow: bool) -> None:
        params: dict[str, Any] = {"stdout": "1", "stderr": "1", "timestamps": "1", "follow": "1" if follow else "0"}
        if self._since:
            params["since"] = f"{self._since // 1_000_000_000}.{self._since % 1_000_000_000:09d}"
        docker = self.runtime.docker()
        async with docker._query(  # raw frames: output is bytes, not necessarily UTF-8
            f"containers/{self.container_id}/logs", method="GET", params=params, timeout=aiohttp.ClientTimeout(total=None)
        ) as response:
            fd = os.open(self.folder / LOG_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            boundary = self._since  # what an earlier stream copied; entries are not in time order across stdout/stderr
            try:
                async for batch in _batches(response.content):
                    out = []
                    for frame in batch:
                        stamp, _, data = frame.partition(b" ")
                        at = parse_timestamp_ns(stamp)
                        if at is None:
                            data = frame
                        elif boundary and at <= boundary:
                            continue  # ``since`` counts the last copied entry again
                        elif at > self._since:
                            self._since = at
                        out.append(data)
                    if out:
                        os.write(fd, b"".join(out))  # one write for every entry that had arrived
                    if self._since != self._saved_since and time.monotonic() - self._saved_at >= 1.0:
                        await asyncio.to_thread(self._save_since, force=True)
            finally:
                os.close(fd)

    def _read_since(self) -> int:
        try:
            return int((self.folder / SINCE_NAME).read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def _save_since(self, *, force: bool = False) -> None:
        now, since = time.monotonic(), self._since
        if since == self._saved_since or (not force and now - self._saved_at < 1.0):
            return
        with self._save_lock, contextlib.suppress(OSError):
            if since > self._saved_since:  # a later value written meanwhile stays
                atomic_write(self.folder / SINCE_NAME, str(since).encode(), mode=0o600)
                self._saved_since, self._saved_at = since, now


async def _batches(stream: aiohttp.StreamReader, *, read_bytes: int = 256 << 10) -> AsyncIterator[list[bytes]]:
    """The payloads of the engine's multiplexed stream (stdout and stderr in the order written), in batches: every
    whole entry that has arrived, up to ``read_bytes`` a read (a chatty workload's lines cost one wake-up and one
    write each batch, not each line). An entry cut off by the stream's end is dropped, as the engine's own clients do."""
    buffer = bytearray()
    while data := await stream.read(read_bytes):
        buffer += data
        batch, start, size = [], 0, len(buffer)
        while size - start >= _HEADER.size:
            _, length = _HEADER.unpack_from(buffer, start)
            end = start + _HEADER.size + length
            if end > size:
                break
            if length:
                batch.append(bytes(buffer[start + _HEADER.size:end]))
            start = end
        del buffer[:start]
        if batch:
            yield batch
