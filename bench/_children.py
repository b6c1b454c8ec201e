"""A benchmark's child processes (the relay, the agent, a renter) and the one-JSON-line-each-way talk with them.

The parent ``Child.spawn``s the benchmark's own script with a hidden flag, ``send``s it its settings and then
``ask``s it commands; the child reads them with ``stdin_lines`` and ``answer``s each with one JSON line on stdout.
``bench_tunnel.py`` and ``bench_scp.py`` run their relay (and agent) this way, as production runs them: in processes
(machines) of their own, each on its own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from typing import Any

LINE_LIMIT = 64 << 20  # the longest command or answer line


class Child:
    """A child process of a benchmark script, one JSON line each way."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def spawn(cls, script: str, *args: str) -> Child:
        """``script`` run by this interpreter with ``args``, the working folder on its ``PYTHONPATH``."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
        process = await asyncio.create_subprocess_exec(
            sys.executable, os.path.abspath(script), *args,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env, limit=LINE_LIMIT,
        )  # fmt: skip
        return cls(process)

    async def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(message) + "\n").encode())
        await self.process.stdin.drain()

    async def answer(self, op: str) -> Any:
        assert self.process.stdout is not None
        line = await self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the child process ended during {op} (exit {await self.process.wait()})")
        return json.loads(line)

    async def ask(self, op: str, **args: Any) -> Any:
        await self.send({"op": op, **args})
        return await self.answer(op)

    async def stop(self, *, timeout: float = 10.0) -> None:
        """Ask it to exit; killed if it has not within ``timeout`` seconds."""
        with contextlib.suppress(Exception):
            await self.send({"op": "exit"})
        try:
            async with asyncio.timeout(timeout):
                await self.process.wait()
        except TimeoutError:
            self.process.kill()
            await self.process.wait()


async def stdin_lines() -> asyncio.StreamReader:
    """A child's commands: this process's standard input, a line each."""
    reader = asyncio.StreamReader(limit=LINE_LIMIT)
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


def answer(value: Any) -> None:
    """A child's answer to its parent: one JSON line on stdout."""
    sys.stdout.write(json.dumps(value) + "\n")
    sys.stdout.flush()
