"""A rental's disk quota: a size-capped ext4 filesystem on a loop device, one per rental, mounted by the agent.

Where the agent is root and the host has ``mkfs.ext4`` and loop devices (``detect_loop_disks``),
each rental's ``/workspace`` (a container's, bind-mounted into it) or home (a process rental's) is
its own filesystem: a sparse image ``<work_dir>/<rental>/disk.img`` (in the agent's data dir, which
no rental reaches), made with ``mkfs.ext4`` (no journal, no reserved blocks, its root owned by the
rental's user) and loop-mounted ``nosuid,nodev``. A renter who fills it gets ``ENOSPC`` and nothing
else on the host notices. The image is sparse: it takes the host's disk as the rental writes, so the
agent offers a rental at most the free space less the provider's ``reserved_disk_gib``.

Lifetime: made at the rental's first start, kept (and mounted again after an agent restart or a
reboot: ``ensure`` is idempotent) until the rental is forgotten (``release``: unmounted, deleted).
Every call here blocks (a few ms: ``mkfs`` of a sparse image with lazy init, ``mount``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from shared.errors import BadRequest

log = logging.getLogger(__name__)

IMAGE_NAME: Final = "disk.img"
MOUNT_NAME: Final = "disk"
GIB: Final = 1 << 30


@dataclass(frozen=True, slots=True)
class LoopTools:
    mkfs: str
    mount: str
    umount: str


def detect_loop_disks(*, euid: int | None = None) -> LoopTools | str:
    """The tools for loop-mounted quotas, or why this host cannot have them (one phrase)."""
    if (os.geteuid() if euid is None else euid) != 0:
        return "the agent is not root, so it cannot mount a rental's disk"
    found = {name: shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin") for name in ("mkfs.ext4", "mount", "umount")}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install e2fsprogs mount)"
    if not Path("/dev/loop-control").exists():
        return "no loop devices (/dev/loop-control is missing)"
    return LoopTools(found["mkfs.ext4"] or "", found["mount"] or "", found["umount"] or "")


def free_gib(path: Path) -> int:
    """Whole GiB free for the agent's files where ``path`` lies (the nearest existing folder above it)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize // GIB


class LoopDisks:
    """Size-capped filesystems for rentals under ``work_dir`` (``<work_dir>/<rental>/disk.img``)."""

    def __init__(self, work_dir: Path, tools: LoopTools, *, command_timeout: float = 30.0) -> None:
        self.work_dir = work_dir
        self.tools = tools
        self.command_timeout = command_timeout

    def image(self, rental_id: str) -> Path:
        return self.work_dir / rental_id / IMAGE_NAME

    def default_mountpoint(self, rental_id: str) -> Path:
        return self.work_dir / rental_id / MOUNT_NAME

    def ensure(self, rental_id: str, gib: int, *, owner: tuple[int, int], mountpoint: Path | None = None) -> Path:
        """The rental's filesystem of ``gib`` GiB made (once: an existing one keeps its size and files) and
        mounted at ``mountpoint`` (default ``<work_dir>/<rental>/disk``); returns where. Raises ``BadRequest``."""
        image = self.image(rental_id)
        target = mountpoint or self.default_mountpoint(rental_id)
        image.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        target.mkdir(mode=0o700, exist_ok=True)
        if os.path.ismount(target):
            return target
        if not image.exists():
            partial = image.with_suffix(".new")
            with open(partial, "wb") as file:
                file.truncate(gib * GIB)  # sparse: the host's disk is taken as the rental writes
            self._run(
                [self.tools.mkfs, "-q", "-F", "-m", "0", "-O", "^has_journal",
                 "-E", f"lazy_itable_init=1,nodiscard,root_owner={owner[0]}:{owner[1]}", str(partial)],
                f"cannot make the rental's {gib} GiB disk",
            )  # fmt: skip
            os.replace(partial, image)
        self._run([self.tools.mount, "-o", "loop,nosuid,nodev,noatime", str(image), str(target)], "cannot mount the rental's disk")
        with contextlib.suppress(OSError):
            (target / "lost+found").rmdir()
        os.chmod(target, 0o700)
        return target

    def release(self, rental_id: str, *, mountpoint: Path | None = None) -> None:
        """Unmount the rental's filesystem (lazily: a login still inside lets go later) and delete its image. Best effort."""
        target = mountpoint or self.default_mountpoint(rental_id)
        if os.path.ismount(target):
            try:
                self._run([self.tools.umount, "-l", str(target)], "cannot unmount the rental's disk")
            except BadRequest as exc:
                log.warning("rental %s: %s", rental_id, exc.message)
                return
        for path in (self.image(rental_id), self.image(rental_id).with_suffix(".new")):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _run(self, argv: list[str], what: str) -> None:
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=self.command_timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BadRequest(f"{what}: {exc}", code="workload_start_failed") from None
        if done.returncode != 0:
            detail = done.stderr.decode(errors="replace").strip().splitlines()
            raise BadRequest(f"{what}: {detail[-1] if detail else f'exit {done.returncode}'}", code="workload_start_failed")
