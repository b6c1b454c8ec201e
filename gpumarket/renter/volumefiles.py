"""``gpumarket volume open | copy``: a volume's files without a rental (docs/volumes.md, "Data in and out").

``open`` asks for the volume's file-only session (``POST /volumes/{id}/connect``), pins its host key and prints how
to reach it with sftp, scp and rsync. ``copy SRC DST`` copies one volume's files to another (on another host): by
default DST's host pulls them from SRC's through the relays (``POST /volumes/{dst}/copy``) and this follows its
progress (``GET /volumes/{dst}/copy``) to the end; with ``--via-client`` two file-only sessions are driven from here
instead (each file read from SRC's host and written to DST's as it comes, never kept on this machine). It resumes: a file already at DST with the same size and modification time is
skipped, a file is written under ``<name>.gmpart`` and renamed once complete. At the end each host computes the
SHA-256 of its volume's tree (``gpumarket-sha256-tree``, ``agent/reach/volumefiles.py``), and a mismatch fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import stat
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

import asyncssh

from gpumarket.renter.api import Client, CliError
from gpumarket.renter.commands import finish
from gpumarket.renter.connect import Ticket, rental_arg
from gpumarket.renter.sshcmds import ssh_ticket
from gpumarket.renter.sshfiles import known_hosts_path, option_args, pinning_options
from shared import sshwire
from shared.volumetree import PARTIAL, TREE_SHA256, Entry, walk

CHUNK: Final = 8 << 20  # one read or write call; asyncssh splits it into parallel requests


class CopyMismatch(CliError):
    """The two volumes' trees differ after the copy."""


def tunnel_argv(target: str, config: Path | None) -> list[str]:
    argv = [sys.executable, "-m", "gpumarket.renter", "tunnel"]
    if config is not None:
        argv += ["--config", str(config.absolute())]
    return [*argv, target]


@contextlib.asynccontextmanager
async def session(
    ticket: Ticket, target: str, *, config: Path | None, identity: str | None
) -> AsyncIterator[asyncssh.SSHClientConnection]:
    """An SSH connection to the volume's file-only session through its relay, its host key pinned."""
    assert ticket.ssh is not None
    options = {"client_keys": [identity]} if identity else {}
    try:
        async with asyncssh.connect(
            ticket.ssh.host_alias, username=ticket.ssh.user, proxy_command=tunnel_argv(target, config),
            known_hosts=([asyncssh.import_public_key(ticket.ssh.host_key)], [], []), **options,
            encryption_algs=list(sshwire.CIPHERS), window=sshwire.WINDOW, max_pktsize=sshwire.MAX_PACKET,
        ) as conn:  # fmt: skip
            yield conn
    except (asyncssh.Error, OSError) as exc:
        raise CliError(f"cannot open volume {target}'s files: {exc}") from None


class Progress:
    def __init__(self, total_files: int, total_bytes: int, *, quiet: bool) -> None:
        self.total_files, self.total_bytes, self.quiet = total_files, total_bytes, quiet
        self.files = self.bytes = self.skipped = 0
        self.started = self.shown = time.monotonic()

    def add(self, data: int) -> None:
        self.bytes += data
        if time.monotonic() - self.shown >= 1.0:
            self.show()

    def show(self, end: str = "\r") -> None:
        self.shown = time.monotonic()
        if self.quiet:
            return
        rate = self.bytes / max(self.shown - self.started, 1e-6) / 2**20
        print(f"  {self.files + self.skipped}/{self.total_files} files, {self.bytes / 2**20:.1f} MiB copied "
              f"({self.skipped} already there), {rate:.1f} MiB/s", end=end, file=sys.stderr, flush=True)  # fmt: skip


async def copy_tree(
    source: asyncssh.SFTPClient, dest: asyncssh.SFTPClient, *, quiet: bool = False
) -> Progress:
    """Copy every entry of ``source`` to ``dest`` (see the module: resumable); the figures."""
    entries = await walk(source)
    files = [e for e in entries if e.kind == "f"]
    progress = Progress(len(files), sum(e.size for e in files), quiet=quiet)
    for entry in entries:
        path = "/" + entry.path
        if entry.kind == "d":
            if not await dest.isdir(path):
                await dest.mkdir(path, asyncssh.SFTPAttrs(permissions=entry.mode))
        elif entry.kind == "l":
            with contextlib.suppress(asyncssh.SFTPError):
                if await dest.readlink(path) == entry.target:
                    continue
                await dest.remove(path)
            await dest.symlink(entry.target, path)
        else:
            await _copy_file(source, dest, entry, progress)
    progress.show(end="\n")
    return progress


async def _copy_file(
    source: asyncssh.SFTPClient, dest: asyncssh.SFTPClient, entry: Entry, progress: Progress
) -> None:
    path = "/" + entry.path
    with contextlib.suppress(asyncssh.SFTPError):
        there = await dest.lstat(path)
        if stat.S_ISREG(there.permissions or 0) and there.size == entry.size and there.mtime == entry.mtime:
            progress.skipped += 1
            return
    partial = path + PARTIAL
    async with source.open(path, "rb") as reader, dest.open(partial, "wb") as writer:
        offset = 0
        while data := await reader.read(CHUNK, offset):
            await writer.write(data, offset)
            offset += len(data)
            progress.add(len(data))
    await dest.setstat(
        partial, asyncssh.SFTPAttrs(permissions=entry.mode, atime=entry.mtime, mtime=entry.mtime)
    )
    await dest.posix_rename(partial, path)
    progress.files += 1


async def tree_sha256(conn: asyncssh.SSHClientConnection) -> str:
    """``<sha256> <files> <bytes>`` of the session's volume, computed by its host."""
    result = await conn.run(TREE_SHA256, check=False)
    text = result.stdout if isinstance(result.stdout, str) else (result.stdout or b"").decode()
    if result.exit_status != 0 or len(text.split()) != 3:
        raise CliError(f"the volume's host did not compute its checksum: {str(result.stderr).strip()[:200]}")
    return text.strip()


async def cmd_volume_copy(args: argparse.Namespace, client: Client) -> int:
    if args.src == args.dst:
        raise CliError("SRC and DST are the same volume")
    if not args.via_client:
        return await host_copy(args, client)
    src_ticket, dst_ticket = await ssh_ticket(client, args.src), await ssh_ticket(client, args.dst)
    config = getattr(args, "config", None)
    async with (
        session(src_ticket, args.src, config=config, identity=args.identity) as src,
        session(dst_ticket, args.dst, config=config, identity=args.identity) as dst,
        src.start_sftp_client() as source,
        dst.start_sftp_client() as dest,
    ):
        progress = await copy_tree(source, dest, quiet=args.quiet)
        src_sum, dst_sum = await asyncio.gather(tree_sha256(src), tree_sha256(dst))
    if src_sum != dst_sum:
        raise CopyMismatch(f"the copy does not match: {args.src} has sha256 {src_sum}, {args.dst} has {dst_sum}; "
                           "run the copy again (it resumes), and report it if it persists")  # fmt: skip
    print(f"copied {progress.files} files ({progress.bytes} bytes; {progress.skipped} already there) from {args.src} "
          f"to {args.dst}; sha256 {src_sum.split()[0]} on both")  # fmt: skip
    return 0


async def host_copy(args: argparse.Namespace, client: Client, *, every: float = 1.0) -> int:
    """Start the host-to-host copy and follow it: progress on stderr, the result on stdout; exit 1 if it failed."""
    started = await client.request("POST", f"/volumes/{args.dst}/copy", json_body={"from": args.src})
    copy_id = str(started["copy_id"])
    shown = ""
    while True:
        view = await client.get(f"/volumes/{args.dst}/copy", params={"copy_id": copy_id})
        line = str(view.get("progress") or "")
        if line and line != shown and not args.quiet:
            print(f"  {line}", end="\r", file=sys.stderr, flush=True)
            shown = line
        if view["state"] != "running":
            break
        await asyncio.sleep(every)
    if shown and not args.quiet:
        print(file=sys.stderr)
    if view["state"] == "failed":
        raise CopyMismatch(f"copy {copy_id} from {args.src} to {args.dst} failed: {view.get('detail', '')}")
    print(f"copied {args.src} to {args.dst} host to host (copy {copy_id}): {view.get('detail', '')}")
    return 0


async def cmd_volume_open(args: argparse.Namespace, client: Client) -> int:
    ticket = await ssh_ticket(client, args.volume)
    assert ticket.ssh is not None
    options = option_args(pinning_options(ticket.rental_id, ticket.ssh, known_hosts_path(os.environ),
                                          config=getattr(args, "config", None)))  # fmt: skip
    opts = shlex.join(options)
    where = f"{ticket.ssh.user}@{ticket.ssh.host_alias}"
    print(f"volume {args.volume} ({ticket.rental_id}): files only (sftp, scp, rsync; no shell), its host key pinned\n"
          f"  sftp {opts} {where}\n"
          f"  scp {opts} FILE {where}:PATH\n"
          f"  rsync -a -e {shlex.quote('ssh ' + opts)} DIR/ {where}:PATH/\n"
          f"or: gpumarket cp FILE {args.volume}:PATH, and `gpumarket ssh-config --write` for plain ssh, scp and rsync")  # fmt: skip
    return 0


def add_parsers(volume: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``open`` and ``copy`` under ``gpumarket volume``."""
    opener = volume.add_parser(
        "open", help="print how to reach a volume's files without a rental (sftp, scp, rsync)"
    )
    opener.add_argument("volume", type=rental_arg, metavar="VOLUME", help="the volume's name or id")
    finish(opener, cmd_volume_open)
    copier = volume.add_parser("copy", help="copy a volume's files to another volume (another host), resumable, checked",
                               description="Copy SRC's files to DST host to host through the relays (DST's host pulls them): "
                               "resumable (files already complete at DST are skipped), with progress, and a SHA-256 of both "
                               "trees compared at the end.")  # fmt: skip
    copier.add_argument("src", type=rental_arg, metavar="SRC", help="the volume to copy from (name or id)")
    copier.add_argument("dst", type=rental_arg, metavar="DST", help="the volume to copy to (name or id)")
    copier.add_argument(
        "-i", "--identity", help="the SSH private key to log in with (default: ssh's usual keys and agent)"
    )
    copier.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    copier.add_argument("--via-client", action="store_true",
                        help="drive the copy from this machine (two file-only sessions; slower: every byte passes "
                        "through here) instead of DST's host pulling from SRC's")  # fmt: skip
    finish(copier, cmd_volume_copy)
