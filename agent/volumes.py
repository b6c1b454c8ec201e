"""The renter's volumes on this host (docs/volumes.md): each a size-capped ext4 filesystem of its own on a loop
device (``agent/runtimes/diskquota.py``'s ``LoopDisks``), ``<data_dir>/volumes/<volume id>/disk.img`` mounted at
``<data_dir>/volumes/<volume id>/disk``, where no rental reaches but through a mount of it.

A volume outlives its rentals, the agent and a reboot: ``remount_all`` mounts every volume found again when the
agent starts. Its files are lost with the host's disk: nothing here copies them elsewhere. Where the agent cannot
mount loop disks (not root, no ``mkfs.ext4``), it has no volumes and says why (``unavailable``): a volume without
its size enforced would let one renter fill the provider's disk.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Final

from agent.runtimes.diskquota import LoopDisks, LoopTools, free_gib
from shared.errors import BadRequest
from shared.protocol import IsolationFacts
from shared.protocol.volumes import (
    VOLUME_ID_PATTERN,
    CreateVolume,
    DeleteVolume,
    VolumeCreated,
    VolumeDeleted,
)

log = logging.getLogger(__name__)

DEFAULT_OWNER: Final = (1000, 1000)  # a container's user when its image names none (ContainerOptions.user)


class VolumeStore:
    """The volumes under ``root`` (``<data_dir>/volumes``)."""

    def __init__(self, root: Path, tools: LoopTools | str, *, reserved_disk_gib: int = 0,
                 owner: tuple[int, int] = DEFAULT_OWNER) -> None:  # fmt: skip
        self.root = root
        self.unavailable: str | None = tools if isinstance(tools, str) else None
        self.disks = None if isinstance(tools, str) else LoopDisks(root, tools)
        self.reserved_disk_gib = reserved_disk_gib
        self.owner = owner

    def _disks(self) -> LoopDisks:
        if self.disks is None:
            raise BadRequest(f"this host keeps no volumes: {self.unavailable}", code="volume_unsupported")
        return self.disks

    def ids(self) -> list[str]:
        """The volumes made here (their image exists), sorted."""
        if self.disks is None or not self.root.is_dir():
            return []
        pattern = re.compile(VOLUME_ID_PATTERN)
        return sorted(
            p.name
            for p in self.root.iterdir()
            if pattern.fullmatch(p.name) and self.disks.image(p.name).exists()
        )

    def exists(self, volume_id: str) -> bool:
        return self.disks is not None and self.disks.image(volume_id).exists()

    def create(self, volume_id: str, size_gib: int) -> Path:
        """The volume made (once: an existing one keeps its size and files) and mounted; where it is mounted.
        Raises ``BadRequest`` (``volume_no_space``: the host's free disk, less its reserve, is less than the size)."""
        disks = self._disks()
        if not disks.image(volume_id).exists():
            room = free_gib(self.root) - self.reserved_disk_gib
            if size_gib > room:
                raise BadRequest(f"this host has {max(room, 0)} GiB free for volumes (its reserve kept), not {size_gib}",
                                 code="volume_no_space")  # fmt: skip
        return disks.ensure(volume_id, size_gib, owner=self.owner)

    def path(self, volume_id: str) -> Path:
        """Where the volume is mounted (mounting it again if an agent restart or a reboot left it unmounted).
        Raises ``BadRequest`` (``volume_not_found``) for a volume not made here."""
        disks = self._disks()
        if not disks.image(volume_id).exists():
            raise BadRequest(f"volume {volume_id} is not on this host", code="volume_not_found")
        return disks.ensure(volume_id, 1, owner=self.owner)  # an existing image keeps its size

    def delete(self, volume_id: str) -> None:
        """Unmount the volume and delete its files (idempotent)."""
        if self.disks is None:
            return
        self.disks.release(volume_id)
        folder = self.root / volume_id
        if folder.is_dir() and not os.path.ismount(folder / "disk"):
            shutil.rmtree(folder, ignore_errors=True)

    def remount_all(self) -> list[str]:
        """Mount every volume found again (after an agent restart or a reboot); the ids mounted. A volume that cannot
        be mounted is logged and left (its rentals' starts then fail naming it)."""
        mounted = []
        for volume_id in self.ids():
            try:
                self.path(volume_id)
                mounted.append(volume_id)
            except BadRequest as exc:
                log.warning("volume %s: %s", volume_id, exc.message)
        return mounted

    # ---- the master's commands (blocking: the executor runs them in a thread) ----------------------

    def run_create(self, command: CreateVolume) -> VolumeCreated:
        """``create_volume``: made and mounted (``already``: it was made before; it keeps its size and files)."""
        already = self.exists(command.volume_id)
        self.create(command.volume_id, command.size_gib)
        return VolumeCreated(volume_id=command.volume_id, size_gib=command.size_gib, already=already)

    def run_delete(self, command: DeleteVolume) -> VolumeDeleted:
        """``delete_volume``: unmounted and its files deleted (``already``: there was none here)."""
        already = not self.exists(command.volume_id)
        self.delete(command.volume_id)
        return VolumeDeleted(volume_id=command.volume_id, already=already)


def with_volumes(facts: IsolationFacts, store: VolumeStore | None) -> IsolationFacts:
    """``facts`` saying whether this agent keeps volumes, and why not (the master refuses hosts that keep none)."""
    if store is None:
        return facts.model_copy(
            update={"volumes": False, "volumes_unavailable": "this agent was started without volumes"}
        )
    if store.unavailable is not None:
        return facts.model_copy(update={"volumes": False, "volumes_unavailable": store.unavailable[:512]})
    return facts.model_copy(update={"volumes": True, "volumes_unavailable": ""})
