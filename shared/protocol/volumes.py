"""Volumes on the wire (docs/volumes.md): a renter's disk on one host that outlives its rentals.

The master sends ``create_volume`` once the volume is decided (idempotent: an existing volume keeps its size and
files), ``delete_volume`` when it is deleted (its files are gone; deleting one that is not there succeeds), and a
``start_workload`` names the volumes its container mounts (``VolumeMount``). ``copy_volume`` has the destination's
agent pull another host's volume into one of its own through the relays (``VolumeCopied``; its progress travels as
``workload_progress`` of stage ``copying`` under the destination volume's id). The agent keeps each volume as a
size-capped filesystem of its own (``agent/volumes.py``), mounted again after an agent restart or a reboot.
"""

from __future__ import annotations

import re
from typing import Annotated, Final, Literal

from pydantic import BeforeValidator, Field

from shared.protocol.base import LenientModel, StrictModel

VOLUME_ID_PATTERN: Final = r"^vol-[0-9a-f]{16}$"
_VOLUME_ID_RE: Final = re.compile(VOLUME_ID_PATTERN)
MAX_VOLUME_GIB: Final = 64 * 1024  # 64 TiB
MAX_VOLUMES_PER_RENTAL: Final = 8
MAX_MOUNT_CHARS: Final = 200
# A mount point may not be (or lie under) one of these: the container's own system, the platform's paths.
RESERVED_MOUNTS: Final = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run", "/sbin",
                          "/sys", "/usr", "/var", "/tmp")  # fmt: skip
_MOUNT_PART_RE: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _volume_id(value: object) -> object:
    if not isinstance(value, str) or not _VOLUME_ID_RE.fullmatch(value):
        raise ValueError(
            f"volume id {value!r:.80} must be 'vol-' and 16 hex digits, e.g. vol-3f9a0c1d2b4e5f60"
        )
    return value


def mount_problem(path: str) -> str | None:
    """Why ``path`` cannot be a volume's mount point in a container, or None: absolute, plain parts (letters,
    digits, '.', '_', '-'; no '.' or '..'), not ``/`` nor ``/workspace`` nor under a system folder."""
    if not isinstance(path, str) or not path.startswith("/") or len(path) > MAX_MOUNT_CHARS:
        return f"a mount point is an absolute path of at most {MAX_MOUNT_CHARS} characters, e.g. /data"
    parts = path.strip("/").split("/")
    if (
        path == "/"
        or path.endswith("/")
        or any(p in ("", ".", "..") or not _MOUNT_PART_RE.fullmatch(p) for p in parts)
    ):
        return f"mount point {path!r:.80} must be plain folder names after '/' (letters, digits, '.', '_', '-'), e.g. /data"
    if path == "/workspace":
        return "/workspace is the rental's own disk: mount a volume elsewhere, e.g. /data or /workspace/data"
    for reserved in RESERVED_MOUNTS:
        if path == reserved or path.startswith(reserved + "/"):
            return f"mount point {path!r:.80} lies in the container's system folder {reserved}: choose e.g. /data"
    return None


def _mount(value: object) -> object:
    problem = mount_problem(value) if isinstance(value, str) else "a mount point is a string, e.g. /data"
    if problem:
        raise ValueError(problem)
    return value


VolumeId = Annotated[str, Field(pattern=VOLUME_ID_PATTERN), BeforeValidator(_volume_id)]
MountPath = Annotated[str, Field(max_length=MAX_MOUNT_CHARS), BeforeValidator(_mount)]
VolumeGib = Annotated[int, Field(ge=1, le=MAX_VOLUME_GIB)]


class VolumeMount(StrictModel):
    """One volume in a rental's container: at ``mount``, read-write unless ``read_only``."""

    volume_id: VolumeId
    mount: MountPath
    read_only: bool = False


class CreateVolume(StrictModel):
    """Make the volume ``volume_id`` of ``size_gib`` GiB on this host (a filesystem of its own, ENOSPC at its size).
    Idempotent: a volume already made keeps its size and files. Fails ``volume_no_space`` when the host's disk lacks
    the room (the volume is sparse, but the agent never promises more than it has, less its reserve)."""

    kind: Literal["create_volume"] = "create_volume"
    volume_id: VolumeId
    size_gib: VolumeGib


class DeleteVolume(StrictModel):
    """Delete the volume and its files (none of its rentals runs any more). A volume that is not here is deleted."""

    kind: Literal["delete_volume"] = "delete_volume"
    volume_id: VolumeId


class VolumeCreated(LenientModel):
    """``create_volume``'s reply: the volume is made (``already``: it was, from an earlier delivery) and mounted."""

    volume_id: str
    size_gib: int
    already: bool = False


class VolumeDeleted(LenientModel):
    """``delete_volume``'s reply: its files are gone (``already``: there was nothing to delete)."""

    volume_id: str
    already: bool = False


SEALED_COPY_PATTERN: Final = (
    r"^ecies:v1:[A-Za-z0-9_-]+:[A-Za-z0-9_-]+:[A-Za-z0-9_-]+$"  # = shared.crypto.sealed_to's
)
MAX_SEALED_COPY_CHARS: Final = 8192
COPY_ID_PATTERN: Final = r"^vcp-[0-9a-f]{16}$"


def volume_copy_context(host_id: str, copy_id: str) -> str:
    """What a ``copy_volume``'s sealed login is bound to: the destination host and the copy (a token copied into
    another host's or another copy's command does not open)."""
    return f"volume_copy:{host_id}:{copy_id}"


class CopyLogin(StrictModel):
    """What ``CopyVolume.sealed_login`` holds once opened: an SSH private key (OpenSSH form) the source volume's
    session takes for this copy, and a connect token for the relay the source's host is on. Never logged."""

    private_key: str = Field(min_length=1, max_length=4096, repr=False)
    token: str = Field(min_length=1, max_length=4096, repr=False)


class CopyVolume(StrictModel):
    """Pull the files of the volume ``source_volume_id`` (another host's, reached through ``relay_url`` as the
    renter's ``gpumarket tunnel`` would) into this host's volume ``volume_id``, over SFTP; resumable (a file already
    here with the source's size and modification time is skipped); at the end the SHA-256 trees of both must match
    (``volume_copy_mismatch`` otherwise). ``sealed_login`` is a ``CopyLogin`` sealed to this host's certificate key
    (``volume_copy_context``). The result is ``VolumeCopied``."""

    kind: Literal["copy_volume"] = "copy_volume"
    copy_id: Annotated[str, Field(pattern=COPY_ID_PATTERN)]
    volume_id: VolumeId
    source_volume_id: VolumeId
    relay_url: Annotated[str, Field(min_length=1, max_length=2048, pattern=r"^wss?://")]
    source_host_key: Annotated[str, Field(min_length=1, max_length=1024)]
    sealed_login: Annotated[
        str, Field(min_length=1, max_length=MAX_SEALED_COPY_CHARS, pattern=SEALED_COPY_PATTERN)
    ]
    timeout_s: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] = 24 * 3600.0


class VolumeCopied(LenientModel):
    """``copy_volume``: what was copied (``files``/``bytes``: this run; ``skipped``: already complete here) and the
    tree both hosts computed (``<sha256> <files> <bytes>``)."""

    copy_id: str
    files: int
    bytes: int
    skipped: int
    tree: str
