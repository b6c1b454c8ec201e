"""``copy_volume``: this host pulls another host's volume into one of its own, through the relays (docs/volumes.md,
"Data in and out").

The master sends the source's file-only session's relay URL and pinned host key, and a ``CopyLogin`` (an SSH key
minted for this copy, which the source's session takes, and a connect token) sealed to this host's certificate key.
The agent opens the login with its own keys, opens a websocket to the relay with the token as the renter's
``gpumarket tunnel`` does, runs asyncssh over it (a socket pair spliced to the websocket), and pulls the tree over
SFTP: ``parallel_files`` files at once, each read in ``read_chunk`` calls that asyncssh splits into up to
``max_requests`` reads of ``block_size`` in flight. It resumes: a file here with the source's size and modification
time is skipped; a file is written as ``<name>.gmpart`` and renamed once complete.

Writes never leave the volume: every path is opened component by component from the volume's root with
``O_NOFOLLOW`` (a link planted in the volume, by a rental or by the source, is never followed), names from the source
must be plain (no ``/``, ``.``, ``..``), and what is written belongs to the volume's owner. At the end both hosts
compute the tree's SHA-256 (``agent.reach.volumefiles.tree_sha256`` here, ``gpumarket-sha256-tree`` there); a
difference fails the command with ``volume_copy_mismatch``. A full volume fails it with ``volume_no_space``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import ssl
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import asyncssh
from cryptography.hazmat.primitives.asymmetric import ec
from pydantic import ValidationError
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from agent.reach.volumefiles import tree_sha256
from agent.volumes import VolumeStore
from shared import protocol, sshwire
from shared.crypto import sealed_to
from shared.errors import GpumarketError
from shared.volumetree import PARTIAL, TREE_SHA256, Entry, walk

log = logging.getLogger(__name__)

SSH_USER: Final = "gpumarket"
Progress = Callable[[str, str, float | None], Awaitable[None]]  # (volume id, text, percent)


class VolumeCopyError(GpumarketError):
    """A copy that did not finish: ``code`` says why (``volume_copy_failed``, ``volume_copy_mismatch``,
    ``volume_no_space``, ``volume_copy_login_unreadable``)."""


@dataclass
class Tally:
    total_files: int = 0
    total_bytes: int = 0
    files: int = 0
    bytes: int = 0
    skipped: int = 0
    started: float = 0.0

    def line(self) -> tuple[str, float | None]:
        rate = self.bytes / max(time.monotonic() - self.started, 1e-6) / 2**20
        text = (f"{self.files + self.skipped}/{self.total_files} files, {self.bytes / 2**20:.1f} MiB copied "
                f"({self.skipped} already there), {rate:.1f} MiB/s")  # fmt: skip
        percent = (
            None
            if not self.total_files
            else min(100.0, 100.0 * (self.files + self.skipped) / self.total_files)
        )
        return text, percent


def open_login(
    token: str, host_id: str, copy_id: str, keys: Sequence[ec.EllipticCurvePrivateKey]
) -> protocol.CopyLogin:
    """The copy's login, opened with one of this host's keys; ``volume_copy_login_unreadable`` otherwise."""
    context = protocol.volume_copy_context(host_id, copy_id)
    for key in keys:
        try:
            plaintext = sealed_to.open_with(key, token, context)
        except sealed_to.SealedToError:
            continue
        try:
            return protocol.CopyLogin.model_validate_json(plaintext)
        except ValidationError:
            break
    raise VolumeCopyError("the copy's login does not open with this host's keys (sealed to another certificate, or "
                          "altered on the way); start the copy again", code="volume_copy_login_unreadable")  # fmt: skip


def _plain(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name


class LocalTree:
    """The destination volume, written only through descriptors opened from its root without following links."""

    def __init__(self, root: Path, owner: tuple[int, int]) -> None:
        self.root, self.owner = root, owner

    def _folder(self, parts: Sequence[str], *, create: bool) -> int:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in parts:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                        os.chown(part, *self.owner, dir_fd=fd, follow_symlinks=False)
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = inner
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def split(path: str) -> tuple[list[str], str]:
        parts = path.split("/")
        if not all(_plain(p) for p in parts):
            raise VolumeCopyError(
                f"the source named a path that is not plain: {path!r:.200}", code="volume_copy_failed"
            )
        return parts[:-1], parts[-1]

    def mkdir(self, path: str, mode: int) -> None:
        folders, name = self.split(path)
        fd = self._folder([*folders, name], create=True)
        try:
            os.chmod(fd, mode & 0o7777 or 0o755)
        finally:
            os.close(fd)

    def symlink(self, path: str, target: str) -> None:
        folders, name = self.split(path)
        fd = self._folder(folders, create=True)
        try:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    if os.readlink(name, dir_fd=fd) == target:
                        return
                os.unlink(name, dir_fd=fd)
            os.symlink(target, name, dir_fd=fd)
            os.chown(name, *self.owner, dir_fd=fd, follow_symlinks=False)
        finally:
            os.close(fd)

    def complete(self, entry: Entry) -> bool:
        """Whether ``entry``'s file is here already: a regular file of its size and modification time."""
        folders, name = self.split(entry.path)
        try:
            fd = self._folder(folders, create=False)
        except OSError:
            return False
        try:
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return False
        finally:
            os.close(fd)
        return stat.S_ISREG(info.st_mode) and info.st_size == entry.size and int(info.st_mtime) == entry.mtime

    def open_partial(self, path: str) -> tuple[int, int, str]:
        """(folder fd, file fd, name) of ``path``'s partial file, made empty."""
        folders, name = self.split(path)
        folder = self._folder(folders, create=True)
        try:
            fd = os.open(name + PARTIAL, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=folder)  # fmt: skip
        except BaseException:
            os.close(folder)
            raise
        return folder, fd, name

    def finish(self, folder: int, fd: int, name: str, entry: Entry) -> None:
        """Give the partial file its mode, owner and time, and its name."""
        try:
            os.fchmod(fd, entry.mode & 0o777)
            os.fchown(fd, *self.owner)
            os.utime(fd, (entry.mtime, entry.mtime))
            os.close(fd)
            fd = -1
            os.rename(name + PARTIAL, name, src_dir_fd=folder, dst_dir_fd=folder)
        finally:
            if fd >= 0:
                os.close(fd)
            os.close(folder)


@contextlib.asynccontextmanager
async def relay_socket(url: str, token: str, context: ssl.SSLContext, *, open_timeout: float = 15,
                       max_message: int = 2**20) -> AsyncIterator[socket.socket]:  # fmt: skip
    """One end of a socket pair whose other end is spliced to a websocket to the relay (the bytes of one stream)."""
    try:
        ws = await connect(url, additional_headers={"Authorization": f"Bearer {token}"}, ssl=context, proxy=None,
                           compression=None, open_timeout=open_timeout, max_size=max_message)  # fmt: skip
    except (OSError, TimeoutError, InvalidURI, InvalidHandshake) as exc:
        raise VolumeCopyError(f"cannot reach the source's relay: {exc}", code="volume_copy_failed") from None
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=theirs)

    async def upstream() -> None:
        with contextlib.suppress(ConnectionClosed, OSError):
            while data := await reader.read(1 << 18):
                await ws.send(data)
            await ws.send(b"")

    async def downstream(ws: ClientConnection) -> None:
        with contextlib.suppress(ConnectionClosed, OSError):
            async for message in ws:
                if isinstance(message, bytes):
                    writer.write(message)
                    await writer.drain()
        with contextlib.suppress(OSError):
            writer.close()

    tasks = [asyncio.create_task(upstream()), asyncio.create_task(downstream(ws))]
    try:
        yield ours
    finally:
        ours.close()
        await ws.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        writer.close()


class VolumeCopier:
    """Runs ``copy_volume`` commands (see the module). ``progress`` reports a line now and then (the runner sends it
    as ``workload_progress`` of stage ``copying``)."""

    def __init__(
        self, volumes: VolumeStore, *, host_id: str, opening_keys: Callable[[], Sequence[ec.EllipticCurvePrivateKey]],
        ssl_context: Callable[[], ssl.SSLContext], progress: Progress | None = None,
        # Limits
        parallel_files: int = 8, read_chunk: int = 16 << 20, block_size: int = 256 << 10, max_requests: int = 64,
        # Timeouts
        progress_interval: float = 2.0,
    ) -> None:  # fmt: skip
        self.volumes, self.host_id, self.opening_keys = volumes, host_id, opening_keys
        self.ssl_context, self.progress = ssl_context, progress
        self.parallel_files, self.read_chunk = parallel_files, read_chunk
        self.block_size, self.max_requests = block_size, max_requests
        self.progress_interval = progress_interval

    async def copy(self, command: protocol.CopyVolume) -> protocol.VolumeCopied:
        """Pull the source's tree into the volume and compare both trees. Cancelling is safe: what is complete stays,
        a partial file stays under its partial name (the next run writes it again)."""
        login = open_login(command.sealed_login, self.host_id, command.copy_id, self.opening_keys())
        root = await asyncio.to_thread(self.volumes.path, command.volume_id)
        tree = LocalTree(root, self.volumes.owner)
        try:
            async with asyncio.timeout(command.timeout_s):
                return await self._copy(command, login, tree)
        except TimeoutError:
            raise VolumeCopyError(f"the copy did not finish in {command.timeout_s:g} s; run it again (it resumes)",
                                  code="volume_copy_failed") from None  # fmt: skip
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise VolumeCopyError("the destination volume is full: make it at least as large as what the source "
                                      "holds", code="volume_no_space") from None  # fmt: skip
            raise VolumeCopyError(f"the copy failed: {exc}", code="volume_copy_failed") from None
        except (asyncssh.Error, ConnectionClosed) as exc:
            raise VolumeCopyError(f"the source's session failed: {exc}; run the copy again (it resumes)",
                                  code="volume_copy_failed") from None  # fmt: skip

    async def _copy(
        self, command: protocol.CopyVolume, login: protocol.CopyLogin, tree: LocalTree
    ) -> protocol.VolumeCopied:
        key = asyncssh.import_private_key(login.private_key)
        known: tuple[list[asyncssh.SSHKey], list[asyncssh.SSHKey], list[asyncssh.SSHKey]] = (
            [asyncssh.import_public_key(command.source_host_key)],
            [],
            [],
        )
        async with (
            relay_socket(command.relay_url, login.token, self.ssl_context()) as sock,
            asyncssh.connect(sock=sock, host=f"{command.source_volume_id}.gpumarket", username=SSH_USER, known_hosts=known,
                             client_keys=[key], agent_path=None, config=None, preferred_auth="publickey",
                             encryption_algs=list(sshwire.CIPHERS), window=sshwire.WINDOW, max_pktsize=sshwire.MAX_PACKET) as conn,
            conn.start_sftp_client() as sftp,
        ):  # fmt: skip
            entries = await walk(sftp)
            files = [e for e in entries if e.kind == "f"]
            tally = Tally(len(files), sum(e.size for e in files), started=time.monotonic())
            for entry in entries:
                if entry.kind == "d":
                    await asyncio.to_thread(tree.mkdir, entry.path, entry.mode)
                elif entry.kind == "l":
                    await asyncio.to_thread(tree.symlink, entry.path, entry.target)
            reporter = asyncio.create_task(self._report(command, tally))
            try:
                limit = asyncio.Semaphore(self.parallel_files)

                async def one(entry: Entry) -> None:
                    async with limit:
                        await self._file(sftp, tree, entry, tally)

                async with asyncio.TaskGroup() as group:
                    for entry in files:
                        group.create_task(one(entry))
            except ExceptionGroup as group:
                raise group.exceptions[0] from None  # the first file's failure says why
            finally:
                reporter.cancel()
                await asyncio.gather(reporter, return_exceptions=True)
            await self._say(command, tally)
            ours, theirs = await asyncio.gather(
                asyncio.to_thread(tree_sha256, tree.root), conn.run(TREE_SHA256, check=False)
            )
        text = theirs.stdout if isinstance(theirs.stdout, str) else (theirs.stdout or b"").decode()
        if theirs.exit_status != 0 or len(text.split()) != 3:
            raise VolumeCopyError("the source's host did not compute its checksum", code="volume_copy_failed")
        if ours.line().strip() != text.strip():
            raise VolumeCopyError(f"the copy does not match: the source has sha256 tree {text.strip()}, this copy "
                                  f"{ours.line().strip()}; run the copy again (it resumes)", code="volume_copy_mismatch")  # fmt: skip
        log.info("copy %s of %s into %s: %d files, %d bytes, %d already there", command.copy_id,
                 command.source_volume_id, command.volume_id, tally.files, tally.bytes, tally.skipped)  # fmt: skip
        return protocol.VolumeCopied(copy_id=command.copy_id, files=tally.files, bytes=tally.bytes, skipped=tally.skipped,
                                     tree=text.strip())  # fmt: skip

    async def _file(self, sftp: asyncssh.SFTPClient, tree: LocalTree, entry: Entry, tally: Tally) -> None:
        if await asyncio.to_thread(tree.complete, entry):
            tally.skipped += 1
            return
        folder, fd, name = await asyncio.to_thread(tree.open_partial, entry.path)
        try:
            async with sftp.open(
                "/" + entry.path, "rb", block_size=self.block_size, max_requests=self.max_requests
            ) as reader:
                offset = 0
                while data := await reader.read(self.read_chunk, offset):
                    assert isinstance(data, bytes)  # opened "rb"
                    await asyncio.to_thread(_write_all, fd, data, offset)
                    offset += len(data)
                    tally.bytes += len(data)
        except BaseException:
            os.close(fd)
            os.close(folder)
            raise
        await asyncio.to_thread(tree.finish, folder, fd, name, entry)
        tally.files += 1

    async def _report(self, command: protocol.CopyVolume, tally: Tally) -> None:
        while True:
            await asyncio.sleep(self.progress_interval)
            await self._say(command, tally)

    async def _say(self, command: protocol.CopyVolume, tally: Tally) -> None:
        if self.progress is None:
            return
        text, percent = tally.line()
        try:
            await self.progress(command.volume_id, f"{command.copy_id} {text}", percent)
        except (GpumarketError, OSError) as exc:  # progress is a courtesy: the copy goes on
            log.warning("copy %s: progress not sent (%s)", command.copy_id, exc)


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
