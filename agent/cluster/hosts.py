"""The cluster's names in a member container's ``/etc/hosts``: ``node-0 … node-(N-1)`` in a block of their own,
written in place into the engine's file on the host (the container sees a bind mount of it), never through a path the
container could turn into a symlink (``agent.cluster.net`` step 4)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Final

from agent.cluster.wgcontrol import ClusterNetworkError, address_of

HOSTS_BEGIN: Final = "# gpumarket cluster network: begin"
HOSTS_END: Final = "# gpumarket cluster network: end"
MAX_HOSTS_BYTES: Final = 1 << 20


def hosts_block(subnet: str, node_count: int) -> str:
    names = "".join(f"{address_of(subnet, rank)}\tnode-{rank}\n" for rank in range(node_count))
    return f"{HOSTS_BEGIN}\n{names}{HOSTS_END}\n"


def with_hosts_block(text: str, block: str | None) -> str:
    """``text`` (an /etc/hosts) without any earlier cluster block, and with ``block`` (``None``: none) at its end."""
    kept: list[str] = []
    inside = False
    for line in text.splitlines(keepends=True):
        if line.rstrip("\n") == HOSTS_BEGIN:
            inside = True
        elif line.rstrip("\n") == HOSTS_END:
            inside = False
        elif not inside:
            kept.append(line)
    out = "".join(kept)
    if out and not out.endswith("\n"):
        out += "\n"
    return out + (block or "")


def rewrite_hosts(path: Path, block: str | None) -> None:
    """Put ``block`` into the hosts file at ``path`` in place (the container sees it through a bind mount, so it is
    never replaced); refuses (``ClusterNetworkError``) a symlink, anything but a regular file, or a file grown past
    ``MAX_HOSTS_BYTES``. Bytes that are not UTF-8 (the container may write anything there) are kept as they were."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ClusterNetworkError(f"the container's hosts file {path} could not be opened ({exc.strerror or exc}); not written") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ClusterNetworkError(f"the container's hosts file {path} is not a regular file; not written")
        with os.fdopen(fd, "r+b", closefd=False) as hosts:
            data = hosts.read(MAX_HOSTS_BYTES + 1)  # bounded even if the file grows after a size check
            if len(data) > MAX_HOSTS_BYTES:
                raise ClusterNetworkError(f"the container's /etc/hosts is larger than {MAX_HOSTS_BYTES} bytes; not written")
            text = data.decode("utf-8", errors="surrogateescape")
            hosts.seek(0)
            hosts.write(with_hosts_block(text, block).encode("utf-8", errors="surrogateescape"))
            hosts.truncate()
    finally:
        os.close(fd)
