"""A benchmark's child processes (the relay, the agent, a renter) and the one-JSON-line-each-way talk with them.

The parent ``Child.spawn``s the benchmark's own script with a hidden flag, ``send``s it its settings and then
``ask``s it commands; the child reads them with ``stdin_lines`` and ``answer``s each with one JSON line on stdout.
``bench_tunnel.py`` and ``bench_scp.py`` run their relay (and agent) this way, as production runs them: in processes
(machines) of their own, each on its own event loop. ``RelayProcess`` is the relay so (``bench_scp.py`` and
``bench_services.py --layout processes``): this script run with ``--relay-process``, on the Redis bus and registry
under a run's own key prefix (``run_prefix``; ``forget_prefix`` deletes its keys after).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpumarket.up import Marketplace

LINE_LIMIT = 64 << 20  # the longest command or answer line
REDIS_URL = os.environ.get("GPUMARKET_REDIS_URL", "redis://127.0.0.1:6379/0")


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


def run_prefix(bench: str) -> str:
    """A Redis key prefix of this run's own, for its bus and registry (``forget_prefix`` deletes its keys)."""
    return f"{bench}-{secrets.token_hex(4)}:"


class RelayProcess:
    """The relay in a child process (``--layout processes``) on uvloop, as ``gpumarket access``: the marketplace's
    CA and relay certificate, the Redis bus and registry under this run's prefix."""

    def __init__(self, child: Child, url: str) -> None:
        self.child = child
        self.url = url

    @classmethod
    async def start(cls, settings: dict[str, Any]) -> RelayProcess:
        child = await Child.spawn(__file__, "--relay-process")
        await child.send(settings)
        return cls(child, (await child.answer("start"))["url"])

    @classmethod
    async def beside(cls, market: Marketplace, data_dir: Path, prefix: str) -> RelayProcess:
        """A relay for ``market`` (started in ``data_dir`` with the Redis bus and registry under ``prefix``): its CA
        and relay certificate, its heartbeat and telemetry intervals."""
        settings = market.master.settings
        return await cls.start({
            "relay_dir": str(data_dir / "relay"), "ca_file": str(market.master.ca.cert_path), "redis_url": REDIS_URL,
            "prefix": prefix, "heartbeat_interval": settings.heartbeat_interval, "telemetry_interval": settings.telemetry_interval,
        })  # fmt: skip

    async def cpu_seconds(self) -> float:
        return float(await self.child.ask("cpu"))

    @property
    def pid(self) -> int:
        return self.child.process.pid

    async def close(self) -> None:
        await self.child.stop(timeout=30)


async def relay_main() -> None:
    """The relay's child process: its settings line, then ``cpu`` or ``exit`` commands."""
    from access.relay import Relay
    from shared.bus import open_bus
    from shared.crypto import ca_public_key, server_ssl_context
    from shared.registry import open_registry

    commands = await stdin_lines()
    settings = json.loads(await commands.readline())
    relay_dir, ca_file = Path(settings["relay_dir"]), Path(settings["ca_file"])
    bus = await open_bus(settings["redis_url"], prefix=settings["prefix"])
    registry = await open_registry(settings["redis_url"], prefix=settings["prefix"])
    relay = Relay(
        relay_id="bench-relay", bus=bus, registry=registry,
        ssl_context=server_ssl_context(relay_dir / "server.crt", relay_dir / "server.key", ca_file, require_client_cert=False),
        host="127.0.0.1", port=0, public_host="localhost",
        heartbeat_interval=settings["heartbeat_interval"], telemetry_interval=settings["telemetry_interval"],
        max_connections_per_source_per_minute=100_000, connection_burst_per_source=10_000,  # every client is 127.0.0.1
        token_key=ca_public_key(ca_file),
    )  # fmt: skip
    await relay.start()
    try:
        answer({"url": relay.url})
        while line := await commands.readline():
            if json.loads(line)["op"] == "exit":
                return
            answer(time.process_time())
    finally:
        await relay.close()
        await registry.close()
        await bus.close()


async def forget_prefix(prefix: str) -> None:
    """Delete this run's bus and registry keys from Redis."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if sys.argv[1:] != ["--relay-process"]:
        raise SystemExit("usage: _children.py --relay-process (a benchmark's relay child; RelayProcess.start runs it)")
    from shared.eventloop import run as run_on_loop

    run_on_loop(relay_main(), kind="auto")  # on uvloop, as ``gpumarket access`` runs the relay
