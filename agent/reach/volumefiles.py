"""A volume's file-only session (docs/volumes.md, "Data in and out"): what a renter's SSH connection to a volume
without a rental may do besides SFTP (``agent.reach.sftp``, jailed in the volume's mount).

No shell and no command of the renter's choosing. Two commands are served, each jailed in the volume:

* ``rsync --server …`` (what ``rsync -e ssh`` runs on the far side): the host's own rsync, run in namespaces of its
  own (``unshare``: mount, pid, network, IPC, UTS) over a root that holds only the host's ``/usr`` and libraries
  read-only, ``/dev/null`` and the volume at ``/data``, as the volume's owner (uid 1000 by default) with no
  capabilities and ``no_new_privs``. Its absolute paths are the volume's (``/x`` is ``/data/x``). Nothing else of the
  host is there to read or write, and the volume's size caps what it writes.
* ``gpumarket-sha256-tree``: the SHA-256 of the volume's tree (``tree_sha256``), computed by the agent, read-only;
  ``gpumarket volume copy`` compares both ends' with it.

Anything else is refused with one line (``refusal``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import posixpath
import shlex
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from agent.reach.sessions import Process
from agent.reach.sessions import _run_piped as run_piped
from agent.runtimes.users import TRUSTED_PATH
from shared.volumetree import SKIPPED_AT_ROOT, TREE_SHA256

log = logging.getLogger(__name__)

NOT_A_SHELL: Final = (
    "a volume's session serves files only (sftp, scp, rsync -e ssh, gpumarket cp): no shell or command; "
    "mount the volume in a rental to run things on it"
)
JAIL_DATA: Final = "/data"
_CHUNK: Final = 1 << 20

# Run as root by the agent, in fresh namespaces (unshare); "$1".. are the volume, its owner and the jail's base.
_JAIL_SCRIPT: Final = r"""set -e
vol=$1 uid=$2 gid=$3 base=$4; shift 4
mount -t tmpfs -o size=1m,mode=0755 gm-volume-jail "$base"
for d in usr lib lib32 lib64 libx32 bin sbin; do
  if [ -L "/$d" ]; then ln -s "$(readlink "/$d")" "$base/$d"
  elif [ -d "/$d" ]; then mkdir "$base/$d"; mount --rbind "/$d" "$base/$d"; mount -o remount,bind,ro "$base/$d"; fi
done
mkdir "$base/dev" "$base/data"; : > "$base/dev/null"; mount --bind /dev/null "$base/dev/null"
mount --bind "$vol" "$base/data"
exec chroot "$base" /usr/bin/setpriv --reuid="$uid" --regid="$gid" --clear-groups --no-new-privs --inh-caps=-all \
  --bounding-set=-all -- /bin/sh -c 'cd /data && exec rsync "$@"' rsync "$@"
"""


@dataclass(frozen=True, slots=True)
class TreeDigest:
    sha256: str
    files: int
    bytes: int

    def line(self) -> str:
        return f"{self.sha256} {self.files} {self.bytes}\n"


def tree_sha256(root: Path) -> TreeDigest:
    """The SHA-256 of the tree under ``root``: for every entry, in byte order of its path relative to ``root``, one
    record — ``d <path>\\0`` for a folder, ``f <path>\\0<sha256 of its bytes>`` for a file, ``l <path>\\0<target>``
    for a symbolic link (never followed) — skipping ``lost+found`` at the root and anything else (sockets, FIFOs).
    Modes, owners and times are not part of it. Reads through folder descriptors (``os.fwalk``): no link planted in
    the tree leads the walk outside it. Blocking: run it in a thread."""
    entries: list[tuple[bytes, bytes]] = []
    files = size = 0
    for folder, dirs, names, dir_fd in os.fwalk(root, follow_symlinks=False):
        relative = os.path.relpath(folder, root)
        base = b"" if relative == "." else os.fsencode(relative) + b"/"
        if not base:
            dirs[:] = [d for d in dirs if d not in SKIPPED_AT_ROOT]
        for name in dirs:
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode):  # fwalk lists a link to a folder among the folders
                entries.append(
                    (base + os.fsencode(name), b"l" + os.fsencode(os.readlink(name, dir_fd=dir_fd)))
                )
            else:
                entries.append((base + os.fsencode(name), b"d"))
        for name in names:
            path = base + os.fsencode(name)
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode):
                entries.append((path, b"l" + os.fsencode(os.readlink(name, dir_fd=dir_fd))))
            elif stat.S_ISREG(info.st_mode):
                digest, length = _file_sha256(name, dir_fd)
                entries.append((path, b"f" + digest))
                files += 1
                size += length
    total = hashlib.sha256()
    for path, record in sorted(entries):
        total.update(record[:1] + b" " + path + b"\0" + record[1:] + b"\n")
    return TreeDigest(total.hexdigest(), files, size)


def _file_sha256(name: str, dir_fd: int) -> tuple[bytes, int]:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    digest = hashlib.sha256()
    length = 0
    try:
        while chunk := os.read(fd, _CHUNK):
            digest.update(chunk)
            length += len(chunk)
    finally:
        os.close(fd)
    return digest.digest(), length


def rsync_argv(command: str) -> list[str] | None:
    """The arguments of an ``rsync --server`` command (what follows ``rsync``), absolute paths made the volume's
    (``/x`` → ``/data/x``); None for anything else (a daemon over SSH included)."""
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    if len(words) < 2 or words[0] != "rsync" or words[1] != "--server" or "--daemon" in words:
        return None
    args = words[1:]
    if "." in args:  # rsync --server [options] . PATH...: the paths follow the lone "."
        at = args.index(".") + 1
        args[at:] = [_in_volume(p) if p.startswith("/") else p for p in args[at:]]
    return args


def _in_volume(path: str) -> str:
    """An absolute path of the client's, inside the jail's ``/data`` (a trailing ``/`` kept: rsync reads it)."""
    inside = JAIL_DATA + posixpath.normpath("/" + path.lstrip("/")).rstrip("/")
    return inside + "/" if path.endswith("/") else inside


def jailed_rsync(
    volume_root: Path, owner: tuple[int, int], jail_base: Path, args: list[str]
) -> list[str] | None:
    """The argv that runs ``rsync`` with ``args`` jailed in the volume (see the module), or None where the host
    lacks what the jail needs (``unshare``, ``chroot``, ``setpriv``, ``rsync``)."""
    tools = [shutil.which(name, path=TRUSTED_PATH) for name in ("unshare", "chroot", "setpriv", "rsync")]
    if any(tool is None for tool in tools) or os.geteuid() != 0:
        return None
    jail_base.mkdir(mode=0o700, exist_ok=True)
    unshare = tools[0]
    assert unshare is not None
    return [unshare, "--mount", "--pid", "--fork", "--kill-child", "--net", "--ipc", "--uts", "--propagation", "private",
            "/bin/sh", "-c", _JAIL_SCRIPT, "sh", str(volume_root), str(owner[0]), str(owner[1]), str(jail_base), *args]  # fmt: skip


async def run_volume_command(
    process: Process, volume_root: Path, owner: tuple[int, int], jail_base: Path
) -> int:
    """A command sent to a volume's session: ``rsync --server`` jailed, ``gpumarket-sha256-tree``, or a refusal
    (one line on stderr, status 1); the exit status."""
    command = (process.command or "").strip()
    if command == TREE_SHA256:
        digest = await asyncio.to_thread(tree_sha256, volume_root)
        process.stdout.write(digest.line().encode())
        return 0
    args = None if process.term_type else rsync_argv(command)
    argv = None if args is None else jailed_rsync(volume_root, owner, jail_base, args)
    if argv is None:
        problem = (
            NOT_A_SHELL
            if args is None
            else "this host lacks what a jailed rsync needs (root, unshare, setpriv, rsync); use sftp or scp"
        )
        process.stderr.write(f"{problem}\n".encode())
        return 1
    log.info("volume session runs rsync in %s", volume_root)
    return await run_piped(process, argv, Path("/"))
