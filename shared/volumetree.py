"""A volume's tree as both ends of a copy read it over SFTP (docs/volumes.md, "Data in and out"): the destination
agent's pull (``agent/volumecopy.py``) and the renter's client-driven copy (``gpumarket/renter/volumefiles.py``).

``walk`` lists every entry under a file-only session's root, folders before what they hold, leaving out ext4's
``lost+found`` at the root and files still being written by a copy (``<name>.gmpart``).
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from typing import Final

import asyncssh

TREE_SHA256: Final = "gpumarket-sha256-tree"  # the session's one command besides rsync: the tree's SHA-256
PARTIAL: Final = ".gmpart"  # a file a copy is still writing, renamed once complete
SKIPPED_AT_ROOT: Final = frozenset({"lost+found"})  # ext4's own folder at a filesystem's root: not the renter's


@dataclass(frozen=True, slots=True)
class Entry:
    path: str  # relative, "a/b"
    kind: str  # "d", "f" or "l"
    size: int = 0
    mtime: int = 0
    mode: int = 0o644
    target: str = ""


async def walk(sftp: asyncssh.SFTPClient, folder: str = "") -> list[Entry]:
    """Every entry under the session's root, folders before what they hold."""
    found: list[Entry] = []
    async for name in sftp.scandir(folder or "/"):
        text = name.filename if isinstance(name.filename, str) else name.filename.decode()
        if text in (".", "..") or (not folder and text in SKIPPED_AT_ROOT):
            continue
        path = f"{folder}/{text}" if folder else text
        mode = name.attrs.permissions or 0
        if stat.S_ISDIR(mode):
            found.append(Entry(path, "d", mode=mode & 0o7777))
            found += await walk(sftp, path)
        elif stat.S_ISLNK(mode):
            found.append(Entry(path, "l", target=await sftp.readlink("/" + path)))
        elif stat.S_ISREG(mode) and not path.endswith(PARTIAL):
            found.append(Entry(path, "f", size=name.attrs.size or 0, mtime=name.attrs.mtime or 0, mode=mode & 0o777))
    return found
