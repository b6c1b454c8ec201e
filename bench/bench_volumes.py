"""``gpumarket volume copy`` host to host, beside a direct ``rsync`` of the same files, in one run.

The path measured is the renter's: ``gpumarket up``'s marketplace with two real agents (root, each volume a loop-mounted
ext4 disk of its own), ``gpumarket volume copy SRC DST`` as a child process — DST's agent pulling SRC's files over
SFTP through the relay's websocket and SRC's agent's link (``POST /volumes/{dst}/copy``, ``agent/volumecopy.py``),
the CLI following its progress — and both hosts' SHA-256 of their trees compared at the end. A second run of the same
copy (nothing left to copy: every file is skipped, the checksums are computed again) is timed too, and the same copy
driven by the CLI (``--via-client``: two file-only sessions, every byte through this process) into another volume.

The baseline is ``rsync -a --whole-file`` of the same files from one volume's mount to a third, empty volume on the same
machine: what the bytes cost without the relay, SSH and the sessions. Both hosts, the relay and the master share
this machine (in production they are apart), so the copy's figures are a lower bound.

Figures: the copy's MB/s against rsync's, and the resumed copy's seconds (against the first copy's).

Usage: ``python bench/bench_volumes.py [--quick] [--mb N] [--files N]`` (root).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import subprocess
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import describe_machine, record
from gpumarket.up import start_marketplace
from master.models import Volume


def _write_tree(root: Path, total_mb: int, files: int) -> None:
    """``files`` files (one of half the bytes, the rest equal) under two folders, owned by the volume's user."""
    (root / "set" / "shards").mkdir(parents=True, exist_ok=True)
    big = total_mb << 19
    rest = max((total_mb << 20) - big, 0) // max(files - 1, 1)
    (root / "set" / "big.bin").write_bytes(os.urandom(big))
    for i in range(files - 1):
        (root / "set" / "shards" / f"{i:05}.bin").write_bytes(os.urandom(rest))
    subprocess.run(["chown", "-R", "1000:1000", str(root / "set")], check=True)


async def _wait(check, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise SystemExit("the marketplace did not come up in time")
        await asyncio.sleep(0.2)


async def main(args: argparse.Namespace) -> None:
    if os.geteuid() != 0:
        raise SystemExit("bench_volumes needs root (the agents' volumes are loop-mounted disks)")
    with tempfile.TemporaryDirectory(prefix="bench-volumes-") as tmp:
        home = Path(tmp)
        key = home / "id_ed25519"
        await asyncio.to_thread(
            subprocess.run, ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True
        )
        market = await start_marketplace(home / "data", agents=2, http_port=0, relay_port=0)
        made: list[tuple[object, str]] = []
        try:
            api_key = market.credentials["renter"]["api_key"]
            headers = {"Authorization": f"Bearer {api_key}"}
            async with aiohttp.ClientSession(headers=headers) as http:

                async def online() -> bool:
                    async with http.get(f"{market.api_url}/hosts") as response:
                        hosts = (await response.json())["items"]
                    return sum(h["state"] in ("online", "rented") for h in hosts) == 2

                await _wait(online)
                async with http.post(
                    f"{market.api_url}/account/ssh-keys",
                    json={"public_key": (home / "id_ed25519.pub").read_text()},
                ) as r:
                    assert r.status == 201, await r.text()
                async with http.get(f"{market.api_url}/account") as r:
                    account_id = (await r.json())["id"]
            roots = []
            size_gib = max(1, (args.mb * 3) >> 10)
            for name, agent in (
                ("bench-a", market.agents[0]),
                ("bench-b", market.agents[1]),
                ("bench-c", market.agents[1]),
                ("bench-d", market.agents[1]),
            ):
                volume_id = f"vol-{secrets.token_hex(8)}"
                if agent.volumes.unavailable:
                    raise SystemExit(f"no volumes on this machine: {agent.volumes.unavailable}")
                roots.append(await asyncio.to_thread(agent.volumes.create, volume_id, size_gib))
                made.append((agent, volume_id))
                async with market.master.db.session() as session:
                    session.add(Volume(id=volume_id, account_id=account_id, name=name, size_gib=size_gib, host_id=agent.host_id,
                                       state="ready", price_per_gib_hour=Decimal("0.0001")))  # fmt: skip
                    await session.commit()
            await asyncio.to_thread(_write_tree, roots[0], args.mb, args.files)
            env = {**os.environ, "GPUMARKET_API_URL": market.api_url.removesuffix("/api/v1"), "GPUMARKET_API_KEY": api_key,
                   "XDG_CONFIG_HOME": str(home / "config"), "HOME": str(home)}  # fmt: skip
            argv = [
                sys.executable,
                "-m",
                "gpumarket",
                "volume",
                "copy",
                "bench-a",
                "bench-b",
                "-q",
                "-i",
                str(key),
            ]

            async def timed(command: list[str]) -> float:
                started = time.perf_counter()
                child = await asyncio.create_subprocess_exec(
                    *command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
                )
                _, err = await child.communicate()
                if child.returncode != 0:
                    raise SystemExit(f"{command[2:5]} failed: {err.decode()[-2000:]}")
                return time.perf_counter() - started

            copy_s = await timed(argv)
            resumed_s = await timed(argv)
            client_s = await timed([*argv[:5], "bench-a", "bench-d", "--via-client", *argv[7:]])
            rsync_s = await timed(["rsync", "-a", "--whole-file", f"{roots[0]}/set/", f"{roots[2]}/set/"])
        finally:
            await market.stop()
            for agent, volume_id in made:
                await asyncio.to_thread(agent.volumes.delete, volume_id)  # type: ignore[attr-defined]
    mb = args.mb * 1.048576
    print(f"machine: {describe_machine()}")
    print(f"{args.mb} MiB in {args.files} files: volume copy host to host {copy_s:.2f} s ({mb / copy_s:.1f} MB/s), resumed "
          f"{resumed_s:.2f} s; driven by the client {client_s:.2f} s ({mb / client_s:.1f} MB/s); direct rsync {rsync_s:.2f} s "
          f"({mb / rsync_s:.1f} MB/s)")  # fmt: skip
    record(
        "volumes",
        f"volume copy host to host, {args.mb} MiB in {args.files} files",
        mb / copy_s,
        "MB/s",
        "direct rsync",
        mb / rsync_s,
    )
    record(
        "volumes",
        f"volume copy --via-client (the CLI drives it), {args.mb} MiB in {args.files} files",
        mb / client_s,
        "MB/s",
        "host to host",
        mb / copy_s,
    )
    record(
        "volumes",
        "the same copy again (all skipped, both checksums)",
        resumed_s,
        "s",
        "the first copy",
        copy_s,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=int, default=512, help="MiB to copy")
    parser.add_argument("--files", type=int, default=200, help="how many files they are")
    parser.add_argument("--quick", action="store_true", help="64 MiB in 50 files")
    parsed = parser.parse_args()
    if parsed.quick:
        parsed.mb, parsed.files = 64, 50
    asyncio.run(main(parsed))
