"""``scp`` and ``rsync`` of one file into and out of a renter's files through the relay, beside OpenSSH, in one run.

The path measured is the renter's: ``gpumarket up``'s marketplace with one real agent (root: the agent's volume is a
loop-mounted ext4 disk), ``gpumarket ssh-config
--write`` for the account's ready volume, then the system's OpenSSH ``scp`` and ``rsync -e ssh`` with that config:
ssh → the ProxyCommand (``gpumarket tunnel``, a Python process) → TLS websocket → the relay → the agent's link
(TLS) → the agent's own SSH server (asyncssh, ``agent/reach/sshd.py``) → SFTP jailed in the volume
(``agent/reach/sftp.py``), or the jailed ``rsync --server`` a volume's session runs. The file is the volume's,
the same bytes a rental's ``/workspace`` gets through the same server.

Three paths, the same commands and the same file (``--mb`` MB, random bytes) each way, every copy checked by SHA-256:

* ``relay``: through ``gpumarket ssh-config``'s ProxyCommand, as above;
* ``agent sshd, TCP``: straight to the agent's SSH server over loopback TCP (a listener here hands each socket to
  ``RentalSshServer.serve``, the relay's stream's place), with the ciphers ``ssh-config`` gives: the SSH server's own
  cost, without the relay path;
* ``OpenSSH sshd`` (the baseline): the system's ``/usr/sbin/sshd`` on a port of its own, with a host key and
  ``authorized_keys`` made for this run, writing into the same volume's mount.

Processes (``--layout``): by default as production runs them, on three machines: the master (with ``gpumarket up``'s
API, on asyncio's loop) in this process, the relay in a child process of its own and the agent in another, both on
uvloop (``shared.eventloop``, as ``gpumarket access`` and ``gpumarket agent run``), the master and the relay talking
over the Redis bus and relay registry (``GPUMARKET_REDIS_URL``, default ``redis://127.0.0.1:6379/0``; keys under a
prefix of this run's own). ``--layout one-process`` is ``gpumarket up``'s embedded shape: master, relay and agent in
this process on one asyncio loop (what ``bench_volumes.py`` runs).

Each figure is the whole command's wall time (its ssh handshake and, through the relay, the ProxyCommand's start and
its ticket included), as a user waits for it, beside the CPU time meanwhile of the relay and the agent (their child
processes' in ``--layout processes``; in ``one-process`` this process's, the master's included): the steadier figure
on a busy machine; and the client's (scp or rsync, ssh and, through the relay, the ProxyCommand: this process's
finished children's). Goal (issue 42): scp through the relay at least 0.5× OpenSSH's.

Usage: ``python bench/bench_scp.py [--quick] [--mb N] [--paths relay,agent,openssh] [--layout processes|one-process]``
(root; needs openssh-server, rsync, and Redis for the processes layout). Profile it with ``py-spy record
--subprocesses -- python bench/bench_scp.py --paths relay``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import resource
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
from sqlalchemy import select

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.enroll import enroll
from agent.gpu import open_backend
from agent.runner import Agent
from agent.state import AgentState
from agent.timings import AgentTimings
from bench._children import REDIS_URL, Child, RelayProcess, answer, forget_prefix, run_prefix, stdin_lines
from bench._common import describe_machine, record
from gpumarket.up import Marketplace, start_marketplace
from master.models import Account, Volume
from master.services import hosts
from shared.bus import open_bus
from shared.eventloop import run as run_on_loop
from shared.registry import open_registry
from shared.sshwire import openssh_ciphers

MB = 1_000_000
SSHD = "/usr/sbin/sshd"
PATHS = ("relay", "agent", "openssh")
LABELS = {"relay": "relay (ssh-config)", "agent": "agent sshd, TCP", "openssh": "OpenSSH sshd"}
OPS = ("scp up", "scp down", "rsync up", "rsync down")
COMMAND_S = 600.0  # a hang guard for one copy
LAYOUTS = {
    "processes": "the master in this process (asyncio), the relay and the agent in a child process each (uvloop), Redis bus",
    "one-process": "master, relay and agent in this process on one asyncio loop (gpumarket up's embedded shape)",
}


def _children_cpu() -> float:
    """CPU seconds of this process's finished children and theirs: a copy's scp or rsync, its ssh, the ProxyCommand."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


async def _run(argv: list[str], env: dict[str, str]) -> float:
    """Run a command to its end; its wall time. ``SystemExit`` with its stderr when it fails."""
    started = time.perf_counter()
    child = await asyncio.create_subprocess_exec(*argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        async with asyncio.timeout(COMMAND_S):
            _, err = await child.communicate()
    except TimeoutError:
        child.kill()
        await child.wait()
        raise SystemExit(f"{argv[0]} took over {COMMAND_S:g} s: {' '.join(argv)[:300]}") from None
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(argv)[:300]} failed ({child.returncode}): {err.decode(errors='replace')[-2000:]}")
    return time.perf_counter() - started


@contextlib.asynccontextmanager
async def openssh_server(folder: Path, public_key: str) -> AsyncIterator[tuple[int, str]]:
    """The system's sshd on a free loopback port with a host key and ``authorized_keys`` of this run's own;
    yields its port and host public key line. Stopped (and its files left to ``folder``'s owner) at the end."""
    if not os.access(SSHD, os.X_OK):
        raise SystemExit(f"{SSHD} is missing: apt-get install -y openssh-server")
    folder.mkdir()
    host_key = folder / "host_ed25519"
    await asyncio.to_thread(subprocess.run, ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True)
    (folder / "authorized_keys").write_text(public_key + "\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = folder / "sshd_config"
    config.write_text(
        f"ListenAddress 127.0.0.1\nPort {port}\nHostKey {host_key}\nAuthorizedKeysFile {folder / 'authorized_keys'}\n"
        f"PidFile {folder / 'sshd.pid'}\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
        "PermitRootLogin prohibit-password\nStrictModes no\nSubsystem sftp internal-sftp\n"
    )
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation folder
    server = await asyncio.create_subprocess_exec(SSHD, "-D", "-e", "-f", str(config), stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            except OSError:
                if time.monotonic() > deadline or server.returncode is not None:
                    raise SystemExit(f"sshd did not listen on 127.0.0.1:{port} in 10 s") from None
                await asyncio.sleep(0.05)
        yield port, " ".join(host_key.with_suffix(".pub").read_text().split()[:2])
    finally:
        server.terminate()
        await server.wait()


@contextlib.asynccontextmanager
async def agent_listener(serve: Callable[[str, socket.socket], Coroutine[Any, Any, None]], volume_id: str) -> AsyncIterator[int]:
    """A loopback listener that hands each connection to the agent's SSH server for the volume; yields its port."""
    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    served: set[asyncio.Task[None]] = set()

    async def accept() -> None:
        while True:
            sock, _ = await loop.sock_accept(listener)
            sock.setblocking(False)
            task = loop.create_task(serve(volume_id, sock))
            served.add(task)
            task.add_done_callback(served.discard)

    accepting = loop.create_task(accept())
    try:
        yield listener.getsockname()[1]
    finally:
        accepting.cancel()
        for task in list(served):
            task.cancel()
        await asyncio.gather(accepting, *served, return_exceptions=True)
        listener.close()


class AgentHere:
    """The marketplace's own agent, in this process (``--layout one-process``): its CPU is this process's."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.host_id = agent.host_id
        self.unavailable = agent.volumes.unavailable

    async def create_volume(self, volume_id: str, size_gib: int) -> Path:
        return await asyncio.to_thread(self.agent.volumes.create, volume_id, size_gib)

    async def delete_volume(self, volume_id: str) -> None:
        await asyncio.to_thread(self.agent.volumes.delete, volume_id)

    def listener(self, volume_id: str) -> contextlib.AbstractAsyncContextManager[int]:
        return agent_listener(self.agent.ssh.serve, volume_id)

    async def cpu_seconds(self) -> float:
        return time.process_time()

    async def close(self) -> None:
        pass  # the marketplace stops it


class AgentProcess:
    """The agent in a child process (``--layout processes``) on uvloop, as ``gpumarket agent run``: it enrolls with
    the master over HTTP, connects to the relay and answers the bench's commands (a volume, a listener, its CPU)."""

    def __init__(self, child: Child, started: dict[str, Any]) -> None:
        self.child = child
        self.host_id: str = started["host_id"]
        self.unavailable: str | None = started["unavailable"]

    @classmethod
    async def start(cls, folder: Path, base_url: str, token: str, relay_url: str) -> AgentProcess:
        child = await Child.spawn(__file__, "--agent-process")
        await child.send({"folder": str(folder), "base_url": base_url, "token": token, "relay_url": relay_url})
        return cls(child, await child.answer("start"))

    async def create_volume(self, volume_id: str, size_gib: int) -> Path:
        return Path(await self.child.ask("create_volume", volume_id=volume_id, size_gib=size_gib))

    async def delete_volume(self, volume_id: str) -> None:
        await self.child.ask("delete_volume", volume_id=volume_id)

    @contextlib.asynccontextmanager
    async def listener(self, volume_id: str) -> AsyncIterator[int]:
        yield int(await self.child.ask("listen", volume_id=volume_id))  # closed with the agent

    async def cpu_seconds(self) -> float:
        return float(await self.child.ask("cpu"))

    async def close(self) -> None:
        await self.child.stop(timeout=30)


async def agent_main() -> None:
    """The agent's child process: its settings line, then commands, one JSON answer each."""
    commands = await stdin_lines()
    settings = json.loads(await commands.readline())
    folder = Path(settings["folder"])
    await enroll(settings["base_url"], settings["token"], folder, hostname="bench-scp-host", gpus="sim:1xRTX4090",
                 relay_url=settings["relay_url"])  # fmt: skip
    state = AgentState(folder)
    identity = state.identity()
    agent = Agent(state, open_backend(identity.gpus or "sim:1xRTX4090", seed=identity.host_id), relay_urls=[settings["relay_url"]],
                  timings=AgentTimings(network_interval=0), stop_workloads_on_close=True)  # fmt: skip
    running = asyncio.create_task(agent.run(), name="bench-agent")
    here = AgentHere(agent)
    async with contextlib.AsyncExitStack() as listeners:
        try:
            answer({"host_id": agent.host_id, "unavailable": agent.volumes.unavailable})
            while line := await commands.readline():
                command = json.loads(line)
                op = command.pop("op")
                if op == "exit":
                    return
                if op == "cpu":
                    answer(time.process_time())
                elif op == "create_volume":
                    answer(str(await here.create_volume(**command)))
                elif op == "delete_volume":
                    answer(await here.delete_volume(**command))
                elif op == "listen":
                    answer(await listeners.enter_async_context(here.listener(**command)))
        finally:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
            await agent.close()


@contextlib.asynccontextmanager
async def host_side(
    market: Marketplace, data_dir: Path, args: argparse.Namespace, prefix: str
) -> AsyncIterator[tuple[AgentHere | AgentProcess, Callable[[], Coroutine[Any, Any, float]]]]:
    """The agent (and in ``--layout processes`` the relay, each in a child process) and how to read the relay's and
    the agent's CPU seconds (one-process: this process's, the master's included)."""
    if args.layout == "one-process":
        here = AgentHere(market.agents[0])
        yield here, here.cpu_seconds
        return
    relay = await RelayProcess.beside(market, data_dir, prefix)
    agent: AgentProcess | None = None
    try:
        async with market.master.db.session() as session:
            provider_id = await session.scalar(select(Account.id).where(Account.name == "demo-provider"))
        assert provider_id is not None
        token, _ = await hosts.create_token(market.master, provider_id)
        agent = await AgentProcess.start(data_dir / "agents" / "bench-agent", market.api_url.removesuffix("/api/v1"), token, relay.url)
        started = agent

        async def both() -> float:
            return await relay.cpu_seconds() + await started.cpu_seconds()

        yield agent, both
    finally:
        if agent is not None:
            await agent.close()
        await relay.close()


async def main(args: argparse.Namespace) -> None:
    if os.geteuid() != 0:
        raise SystemExit("bench_scp needs root (the agent's volume is a loop-mounted disk; sshd runs as root)")
    print(f"layout: {LAYOUTS[args.layout]}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-scp-") as tmp:
        home = Path(tmp)
        prefix = run_prefix("bench-scp")
        market_args: dict[str, Any] = {}
        if args.layout == "processes":  # the master and the relay talk over Redis, as in production
            market_args = {"bus": await open_bus(REDIS_URL, prefix=prefix), "registry": await open_registry(REDIS_URL, prefix=prefix)}
        market = await start_marketplace(home / "data", agents=1 if args.layout == "one-process" else 0, http_port=0, relay_port=0,
                                         **market_args)  # fmt: skip
        try:
            async with host_side(market, home / "data", args, prefix) as (agent, cpu_seconds):
                results, cpu_s = await copies(args, home, market, agent, cpu_seconds)
        finally:
            await market.stop()
            if args.layout == "processes":
                await forget_prefix(prefix)
    report(args, results, cpu_s)


async def copies(
    args: argparse.Namespace, home: Path, market: Marketplace, agent: AgentHere | AgentProcess,
    cpu_seconds: Callable[[], Coroutine[Any, Any, float]],
) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]:
    """Every copy of ``args.paths`` × OPS; each one's best wall time and least relay + agent CPU seconds."""
    size = args.mb * MB
    results: dict[tuple[str, str], float] = {}
    cpu_s: dict[tuple[str, str], float] = {}
    client_s: dict[tuple[str, str], float] = {}
    key = home / "id_ed25519"
    await asyncio.to_thread(subprocess.run, ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    public_key = (home / "id_ed25519.pub").read_text().strip()
    source = home / "source.bin"
    with open(source, "wb") as file:
        for _ in range(args.mb):
            file.write(os.urandom(MB))
    source_sha = _sha256(source)
    volume_id = f"vol-{secrets.token_hex(8)}"
    api_key = market.credentials["renter"]["api_key"]
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {api_key}"}) as http:
        deadline = time.monotonic() + 60
        while True:
            async with http.get(f"{market.api_url}/hosts") as response:
                if any(h["id"] == agent.host_id and h["state"] in ("online", "rented") for h in (await response.json())["items"]):
                    break
            if time.monotonic() > deadline:
                raise SystemExit("the agent did not come online in 60 s")
            await asyncio.sleep(0.2)
        async with http.post(f"{market.api_url}/account/ssh-keys", json={"public_key": public_key}) as response:
            assert response.status == 201, await response.text()
        async with http.get(f"{market.api_url}/account") as response:
            account_id = (await response.json())["id"]
    if agent.unavailable:
        raise SystemExit(f"no volumes on this machine: {agent.unavailable}")
    size_gib = -(-size * 4 // (1 << 30))  # three copies at most, and rsync's temporary file
    mount = await agent.create_volume(volume_id, size_gib)
    try:
        async with market.master.db.session() as session:
            session.add(Volume(id=volume_id, account_id=account_id, name="bench-scp", size_gib=size_gib, host_id=agent.host_id,
                               state="ready", price_per_gib_hour=Decimal("0.0001")))  # fmt: skip
            await session.commit()
        env = {**os.environ, "GPUMARKET_API_URL": market.api_url.removesuffix("/api/v1"), "GPUMARKET_API_KEY": api_key,
               "XDG_CONFIG_HOME": str(home / "config"), "HOME": str(home)}  # fmt: skip
        await _run([sys.executable, "-m", "gpumarket", "ssh-config", "--write"], env)
        gm_config = home / "config" / "gpumarket" / "ssh_config"
        known_hosts = home / "config" / "gpumarket" / "known_hosts"
        alias = next(line.split()[1] for line in gm_config.read_text().splitlines() if line.startswith("Host "))
        login = ["-i", str(key), "-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none", "-o", "BatchMode=yes"]
        async with contextlib.AsyncExitStack() as servers:
            sshd_port, sshd_key = await servers.enter_async_context(openssh_server(home / "sshd", public_key)) if "openssh" in args.paths else (0, "")
            agent_port = await servers.enter_async_context(agent.listener(volume_id))
            (home / "known_hosts.direct").write_text(f"[127.0.0.1]:{sshd_port} {sshd_key}\n")
            pinned = ["-o", "StrictHostKeyChecking=yes", "-o", "GlobalKnownHostsFile=/dev/null", "-F", "/dev/null"]
            ssh_options = {
                "relay": ["-F", str(gm_config), *login],
                "agent": [*login, *pinned, "-o", f"Ciphers={openssh_ciphers()}", "-o", f"UserKnownHostsFile={known_hosts}", "-o", f"HostKeyAlias={alias}",
                          "-o", f"Port={agent_port}", "-o", "User=gpumarket"],
                "openssh": [*login, *pinned, "-o", f"UserKnownHostsFile={home / 'known_hosts.direct'}",
                            "-o", f"Port={sshd_port}", "-o", "User=root"],
            }  # fmt: skip
            remote_host = {"relay": alias, "agent": "127.0.0.1", "openssh": "127.0.0.1"}
            remote_dir = {"relay": "/", "agent": "/", "openssh": f"{mount}/"}
            for path in args.paths:
                options = ssh_options[path]
                where = f"{remote_host[path]}:{remote_dir[path]}"
                commands = {
                    "scp up": (["scp", "-q", *options, str(source), f"{where}{path}-scp.bin"], f"{path}-scp.bin", None),
                    "scp down": (["scp", "-q", *options, f"{where}{path}-scp.bin", str(home / "down.bin")], None, home / "down.bin"),
                    "rsync up": (["rsync", "--whole-file", "-e", " ".join(["ssh", *options]), str(source), f"{where}{path}-rsync.bin"],
                                 f"{path}-rsync.bin", None),
                    "rsync down": (["rsync", "--whole-file", "-e", " ".join(["ssh", *options]), f"{where}{path}-rsync.bin",
                                    str(home / "down.bin")], None, home / "down.bin"),
                }  # fmt: skip
                for op in OPS:
                    argv, remote_name, local = commands[op]
                    for _ in range(args.repeat):  # the fastest of the runs, and the least CPU of them
                        cpu, client = await cpu_seconds(), _children_cpu()
                        seconds = await _run(argv, env)
                        results[path, op] = min(seconds, results.get((path, op), seconds))
                        cpu_s[path, op] = min(await cpu_seconds() - cpu, cpu_s.get((path, op), float("inf")))
                        client_s[path, op] = min(_children_cpu() - client, client_s.get((path, op), float("inf")))
                    landed = mount / remote_name if remote_name else local
                    assert landed is not None
                    if await asyncio.to_thread(_sha256, landed) != source_sha:
                        raise SystemExit(f"{path} {op}: the copy differs from the source")
                    if local is not None:
                        local.unlink()
                    print(f"  {LABELS[path]:<20} {op:<10} {size / results[path, op] / MB:7.1f} MB/s  ({results[path, op]:.2f} s; "
                          f"relay+agent CPU {cpu_s[path, op]:.2f} s; client {client_s[path, op]:.2f} s)", flush=True)  # fmt: skip
                for name in (f"{path}-scp.bin", f"{path}-rsync.bin"):  # the volume holds a few files at a time
                    (mount / name).unlink()
    finally:
        await agent.delete_volume(volume_id)
    return results, cpu_s


def report(args: argparse.Namespace, results: dict[tuple[str, str], float], cpu_s: dict[tuple[str, str], float]) -> None:
    size = args.mb * MB
    print(describe_machine(with_openssl=True))
    best = f", the fastest of {args.repeat} runs" if args.repeat > 1 else ""
    print(f"{args.mb} MB, one file, each command's wall time{best} (MB/s); ratios to OpenSSH's sshd in this run")
    print(f"  {'':<12}" + "".join(f"{LABELS[p]:>22}" for p in args.paths) + "   ratio relay/OpenSSH")
    for op in OPS:
        rates = {p: size / results[p, op] / MB for p in args.paths}
        line = f"  {op:<12}" + "".join(f"{rates[p]:>17.1f} MB/s" for p in args.paths)
        if "relay" in rates and "openssh" in rates:
            ratio = rates["relay"] / rates["openssh"]
            goal = f"   goal ≥ 0.5×: {'OK' if ratio >= 0.5 else 'MISSED'}" if op.startswith("scp") else ""
            line += f"   {ratio:5.2f}×{goal}"
        print(line)
    for op in OPS:
        for path, baseline in (("relay", "openssh"), ("agent", "openssh")):
            if (path, op) in results and (baseline, op) in results:
                record("scp", f"{op}, {args.mb} MB, {LABELS[path]}", size / results[path, op] / MB, "MB/s",
                       f"OpenSSH {op.split()[0]} to a local sshd", size / results[baseline, op] / MB,
                       ("goal ≥ 0.5× (issue 42); " if path == "relay" and op.startswith("scp") else "")
                       + f"relay+agent CPU {cpu_s[path, op]:.2f} s; layout {args.layout}")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=200, help="the file's size in MB (default 200)")
    parser.add_argument("--quick", action="store_true", help="a 20 MB file")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"which of {','.join(PATHS)} (default all)")
    parser.add_argument("--repeat", type=int, default=1, help="run each copy N times and keep the fastest (default 1)")
    parser.add_argument("--layout", choices=tuple(LAYOUTS), default="processes",
                        help="the relay and the agent in processes of their own as in production (default), or all in one")
    parser.add_argument("--agent-process", action="store_true", help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.agent_process:  # a child: on uvloop, as production runs the agent (the relay's: bench/_children.py)
        run_on_loop(agent_main(), kind="auto")
        sys.exit(0)
    if parsed.quick:
        parsed.mb = 20
    parsed.paths = [p for p in parsed.paths.split(",") if p]
    if parsed.mb < 1 or parsed.repeat < 1 or not parsed.paths or any(p not in PATHS for p in parsed.paths):
        parser.error(f"--mb must be positive and --paths a list of {', '.join(PATHS)}")
    shutil.which("rsync") or parser.error("rsync is missing: apt-get install -y rsync")
    asyncio.run(main(parsed))  # the master on asyncio's loop, as gpumarket up and the master's API run
