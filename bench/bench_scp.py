"""``scp`` and ``rsync`` of one file into and out of a renter's files through the relay, beside OpenSSH, in one run.

The path measured is the renter's: ``gpumarket up``'s marketplace (master, relay and one real agent in this process,
as ``bench_volumes.py`` runs it; root: the agent's volume is a loop-mounted ext4 disk), ``gpumarket ssh-config
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

Each figure is the whole command's wall time (its ssh handshake and, through the relay, the ProxyCommand's start and
its ticket included), as a user waits for it, beside this process's CPU time meanwhile (the relay's, the agent's and the
master's: the steadier figure on a busy machine). Goal (issue 42): scp through the relay at least 0.5× OpenSSH's.

Usage: ``python bench/bench_scp.py [--quick] [--mb N] [--paths relay,agent,openssh]`` (root; needs openssh-server,
rsync). Profile it with ``py-spy record --subprocesses -- python bench/bench_scp.py --paths relay``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import describe_machine, record
from gpumarket.up import start_marketplace
from master.models import Volume
from shared.sshwire import openssh_ciphers

MB = 1_000_000
SSHD = "/usr/sbin/sshd"
PATHS = ("relay", "agent", "openssh")
LABELS = {"relay": "relay (ssh-config)", "agent": "agent sshd, TCP", "openssh": "OpenSSH sshd"}
OPS = ("scp up", "scp down", "rsync up", "rsync down")
COMMAND_S = 600.0  # a hang guard for one copy


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


async def main(args: argparse.Namespace) -> None:
    if os.geteuid() != 0:
        raise SystemExit("bench_scp needs root (the agent's volume is a loop-mounted disk; sshd runs as root)")
    size = args.mb * MB
    results: dict[tuple[str, str], float] = {}
    cpu_s: dict[tuple[str, str], float] = {}  # this process's (the relay's, the agent's, the master's) CPU per copy
    with tempfile.TemporaryDirectory(prefix="bench-scp-") as tmp:
        home = Path(tmp)
        key = home / "id_ed25519"
        await asyncio.to_thread(subprocess.run, ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        public_key = (home / "id_ed25519.pub").read_text().strip()
        source = home / "source.bin"
        with open(source, "wb") as file:
            for _ in range(args.mb):
                file.write(os.urandom(MB))
        source_sha = _sha256(source)
        market = await start_marketplace(home / "data", agents=1, http_port=0, relay_port=0)
        agent, volume_id = market.agents[0], f"vol-{secrets.token_hex(8)}"
        made = False
        try:
            api_key = market.credentials["renter"]["api_key"]
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {api_key}"}) as http:
                deadline = time.monotonic() + 60
                while True:
                    async with http.get(f"{market.api_url}/hosts") as response:
                        if any(h["state"] in ("online", "rented") for h in (await response.json())["items"]):
                            break
                    if time.monotonic() > deadline:
                        raise SystemExit("the agent did not come online in 60 s")
                    await asyncio.sleep(0.2)
                async with http.post(f"{market.api_url}/account/ssh-keys", json={"public_key": public_key}) as response:
                    assert response.status == 201, await response.text()
                async with http.get(f"{market.api_url}/account") as response:
                    account_id = (await response.json())["id"]
            if agent.volumes.unavailable:
                raise SystemExit(f"no volumes on this machine: {agent.volumes.unavailable}")
            size_gib = -(-size * 4 // (1 << 30))  # three copies at most, and rsync's temporary file
            mount = await asyncio.to_thread(agent.volumes.create, volume_id, size_gib)
            made = True
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
                agent_port = await servers.enter_async_context(agent_listener(agent.ssh.serve, volume_id))
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
                    copies = {
                        "scp up": (["scp", "-q", *options, str(source), f"{where}{path}-scp.bin"], f"{path}-scp.bin", None),
                        "scp down": (["scp", "-q", *options, f"{where}{path}-scp.bin", str(home / "down.bin")], None, home / "down.bin"),
                        "rsync up": (["rsync", "--whole-file", "-e", " ".join(["ssh", *options]), str(source), f"{where}{path}-rsync.bin"],
                                     f"{path}-rsync.bin", None),
                        "rsync down": (["rsync", "--whole-file", "-e", " ".join(["ssh", *options]), f"{where}{path}-rsync.bin",
                                        str(home / "down.bin")], None, home / "down.bin"),
                    }  # fmt: skip
                    for op in OPS:
                        argv, remote_name, local = copies[op]
                        for _ in range(args.repeat):  # the fastest of the runs, and the least CPU of them
                            cpu = time.process_time()
                            seconds = await _run(argv, env)
                            results[path, op] = min(seconds, results.get((path, op), seconds))
                            cpu_s[path, op] = min(time.process_time() - cpu, cpu_s.get((path, op), float("inf")))
                        landed = mount / remote_name if remote_name else local
                        assert landed is not None
                        if await asyncio.to_thread(_sha256, landed) != source_sha:
                            raise SystemExit(f"{path} {op}: the copy differs from the source")
                        if local is not None:
                            local.unlink()
                        print(f"  {LABELS[path]:<20} {op:<10} {size / results[path, op] / MB:7.1f} MB/s  ({results[path, op]:.2f} s; "
                              f"this process's CPU {cpu_s[path, op]:.2f} s)", flush=True)  # fmt: skip
                    for name in (f"{path}-scp.bin", f"{path}-rsync.bin"):  # the volume holds a few files at a time
                        (mount / name).unlink()
        finally:
            await market.stop()
            if made:
                await asyncio.to_thread(agent.volumes.delete, volume_id)
    report(args, results)


def report(args: argparse.Namespace, results: dict[tuple[str, str], float]) -> None:
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
                       "goal ≥ 0.5× (issue 42)" if path == "relay" and op.startswith("scp") else "")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=200, help="the file's size in MB (default 200)")
    parser.add_argument("--quick", action="store_true", help="a 20 MB file")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"which of {','.join(PATHS)} (default all)")
    parser.add_argument("--repeat", type=int, default=1, help="run each copy N times and keep the fastest (default 1)")
    parsed = parser.parse_args()
    if parsed.quick:
        parsed.mb = 20
    parsed.paths = [p for p in parsed.paths.split(",") if p]
    if parsed.mb < 1 or parsed.repeat < 1 or not parsed.paths or any(p not in PATHS for p in parsed.paths):
        parser.error(f"--mb must be positive and --paths a list of {', '.join(PATHS)}")
    shutil.which("rsync") or parser.error("rsync is missing: apt-get install -y rsync")
    asyncio.run(main(parsed))
