"""SFTP (and so OpenSSH's ``scp``) into a rental's workspace on this host, jailed in it.

The workspace is a folder the renter's code writes into: a container's ``/workspace`` volume
(its ``Mountpoint``), a process rental's home. The agent serves it as root, so every path is
resolved by ``Jail`` the way the kernel's ``openat2(RESOLVE_IN_ROOT)`` would: one component at
a time from a descriptor of the root, never following a link by the kernel (``O_NOFOLLOW``),
reading each link and interpreting it inside the root (an absolute target starts over at the
root, ``..`` never climbs above it). No link, ``..`` or rename race planted by the renter leads
out: a link to ``/etc/shadow`` reads the workspace's own ``etc/shadow``, if any.

Paths as the client sees them: the root is ``/``, and the workspace's path inside the rental
(``alias``: ``/workspace`` in a container, the home of a process rental) names the root too,
so links the renter made inside the rental resolve here as they do there, and ``realpath``
answers with that path (``scp`` and ``sftp`` land in ``/workspace``).

What the server refuses: hard links; opening anything but a regular file or a folder; giving
a file to another owner; setuid/setgid bits. Files and folders it makes belong to ``owner``
(the workload's uid and gid) when the agent runs as root. File I/O that may wait for the disk runs in
threads; writes go on behind the session (``agent.reach.openfile``: asyncssh serves one request at a time).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import posixpath
import stat
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import asyncssh
from asyncssh import SFTPAttrs, SFTPName

from agent.reach.openfile import OpenFile

_O_PATH: Final = getattr(os, "O_PATH", 0)
_WALK: Final = _O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(slots=True)
class Resolved:
    """A name in a folder of the jail: ``dir_fd`` (owned: ``close`` it) and ``name`` (``.``: that folder)."""

    dir_fd: int
    name: str
    path: str  # inside the jail, from "/"

    def close(self) -> None:
        os.close(self.dir_fd)

    def __enter__(self) -> Resolved:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Jail:
    """Resolves client paths inside ``root`` (see the module); ``close`` releases the root's descriptor."""

    def __init__(self, root: Path, *, alias: str = "", max_links: int = 40) -> None:
        self.root_fd = os.open(root, os.O_DIRECTORY | _WALK)
        self.alias = posixpath.normpath(alias) if alias and alias != "/" else ""
        self.max_links = max_links

    def close(self) -> None:
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1

    def components(self, path: str) -> list[str]:
        """An absolute path's components inside the jail (lexically normalised, the alias taken off)."""
        normal = posixpath.normpath("/" + path).lstrip("/")
        normal = "/" + normal
        if self.alias and (normal == self.alias or normal.startswith(self.alias + "/")):
            normal = normal[len(self.alias):] or "/"
        return [part for part in normal.split("/") if part]

    def shown(self, path: str) -> str:
        """How the client sees a path inside the jail."""
        return (self.alias + path).rstrip("/") or "/" if self.alias else path

    def resolve(self, client_path: str, *, follow: bool) -> Resolved:
        """``client_path`` (relative ones start at the root) as a folder and a name in it; ``follow``
        resolves a link in the last place too. Raises ``OSError`` (``ENOENT``, ``ENOTDIR``, ``ELOOP``)."""
        pending = deque(self.components(client_path))
        stack: list[tuple[int, str]] = [(os.dup(self.root_fd), "")]
        links = 0
        try:
            while pending:
                part = pending.popleft()
                if part in ("", "."):
                    continue
                if part == "..":
                    if len(stack) > 1:
                        os.close(stack.pop()[0])
                    continue
                last = not pending
                parent = stack[-1][0]
                if last and not follow:
                    return self._result(stack, part)
                try:
                    fd = os.open(part, _WALK, dir_fd=parent)
                except FileNotFoundError:
                    if last:
                        return self._result(stack, part)
                    raise
                mode = os.fstat(fd).st_mode
                if stat.S_ISLNK(mode):
                    os.close(fd)
                    links += 1
                    if links > self.max_links:
                        raise OSError(errno.ELOOP, "too many levels of symbolic links")
                    target = os.readlink(part, dir_fd=parent)
                    if target.startswith("/"):
                        while len(stack) > 1:
                            os.close(stack.pop()[0])
                        parts = self.components(target)
                    else:
                        parts = target.split("/")
                    pending.extendleft(reversed(parts))
                    continue
                if last or not stat.S_ISDIR(mode):
                    os.close(fd)
                    if not last:
                        raise OSError(errno.ENOTDIR, "not a directory")
                    return self._result(stack, part)
                stack.append((fd, part))
            return self._result(stack, ".")
        finally:
            for fd, _ in stack:
                os.close(fd)

    @staticmethod
    def _result(stack: list[tuple[int, str]], name: str) -> Resolved:
        names = [n for _, n in stack[1:]] + ([] if name == "." else [name])
        return Resolved(os.dup(stack[-1][0]), name, "/" + "/".join(names))


class WorkspaceSFTPServer(asyncssh.SFTPServer):
    """One SFTP session in a rental's workspace (``root``, shown at ``alias`` too); what it makes
    belongs to ``owner`` (uid, gid) when the agent is root. Ends with its channel."""

    def __init__(self, chan: asyncssh.SSHServerChannel[bytes], root: Path, *, alias: str, owner: tuple[int, int] | None) -> None:
        super().__init__(chan)
        self.jail = Jail(root, alias=alias)
        self.owner = owner if owner is not None and os.geteuid() == 0 else None
        self.files: set[OpenFile] = set()  # open, in this session

    async def _settle(self) -> None:
        """Let every open file's queued writes land (``agent.reach.openfile``) before a path shows a file's size
        or bytes, or changes them."""
        for file in [f for f in self.files if f.writing]:
            await file.settled()

    # ---- paths --------------------------------------------------------------------------

    def _resolve(self, path: bytes, *, follow: bool) -> Resolved:
        return self.jail.resolve(os.fsdecode(path), follow=follow)

    def _give(self, resolved: Resolved) -> None:
        if self.owner is not None:
            os.chown(resolved.name, *self.owner, dir_fd=resolved.dir_fd, follow_symlinks=False)

    def realpath(self, path: bytes) -> bytes:
        with self._resolve(path, follow=True) as resolved:
            return os.fsencode(self.jail.shown(resolved.path))

    async def stat(self, path: bytes) -> os.stat_result:
        await self._settle()
        with self._resolve(path, follow=True) as resolved:
            return os.stat(resolved.name, dir_fd=resolved.dir_fd, follow_symlinks=False)

    async def lstat(self, path: bytes) -> os.stat_result:
        await self._settle()
        with self._resolve(path, follow=False) as resolved:
            return os.stat(resolved.name, dir_fd=resolved.dir_fd, follow_symlinks=False)

    async def scandir(self, path: bytes) -> AsyncIterator[SFTPName]:
        await self._settle()
        for name in await asyncio.to_thread(self._list, path):
            yield name

    def _list(self, path: bytes) -> list[SFTPName]:
        with self._resolve(path, follow=True) as resolved:
            fd = os.open(resolved.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=resolved.dir_fd)
        try:
            here = SFTPAttrs.from_local(os.fstat(fd))
            names = [SFTPName(b".", attrs=here), SFTPName(b"..", attrs=here)]
            with os.scandir(fd) as entries:
                for entry in entries:
                    try:
                        attrs = SFTPAttrs.from_local(entry.stat(follow_symlinks=False))
                    except OSError:
                        continue  # gone meanwhile
                    names.append(SFTPName(os.fsencode(entry.name), attrs=attrs))
            return names
        finally:
            os.close(fd)

    def mkdir(self, path: bytes, attrs: SFTPAttrs) -> None:
        mode = 0o755 if attrs.permissions is None else attrs.permissions & 0o1777
        with self._resolve(path, follow=False) as resolved:
            os.mkdir(resolved.name, mode, dir_fd=resolved.dir_fd)
            self._give(resolved)

    def rmdir(self, path: bytes) -> None:
        with self._resolve(path, follow=False) as resolved:
            os.rmdir(resolved.name, dir_fd=resolved.dir_fd)

    def remove(self, path: bytes) -> None:
        with self._resolve(path, follow=False) as resolved:
            os.unlink(resolved.name, dir_fd=resolved.dir_fd)

    def rename(self, oldpath: bytes, newpath: bytes) -> None:
        self._rename(oldpath, newpath, replace=False)

    def posix_rename(self, oldpath: bytes, newpath: bytes) -> None:
        self._rename(oldpath, newpath, replace=True)

    def _rename(self, oldpath: bytes, newpath: bytes, *, replace: bool) -> None:
        with self._resolve(oldpath, follow=False) as old, self._resolve(newpath, follow=False) as new:
            if not replace:
                try:
                    os.stat(new.name, dir_fd=new.dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    pass
                else:
                    raise asyncssh.SFTPFailure(f"{self.jail.shown(new.path)} exists")
            os.rename(old.name, new.name, src_dir_fd=old.dir_fd, dst_dir_fd=new.dir_fd)

    def readlink(self, path: bytes) -> bytes:
        with self._resolve(path, follow=False) as resolved:
            return os.fsencode(os.readlink(resolved.name, dir_fd=resolved.dir_fd))

    def symlink(self, oldpath: bytes, newpath: bytes) -> None:
        # The target is stored as given: the jail interprets it inside the workspace, the rental inside itself.
        with self._resolve(newpath, follow=False) as resolved:
            os.symlink(os.fsdecode(oldpath), resolved.name, dir_fd=resolved.dir_fd)
            self._give(resolved)

    def link(self, oldpath: bytes, newpath: bytes) -> None:
        raise asyncssh.SFTPOpUnsupported("hard links are not supported here; copy the file or make a symbolic link")

    def statvfs(self, path: bytes) -> os.statvfs_result:
        with self._resolve(path, follow=True) as resolved:
            fd = os.open(resolved.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=resolved.dir_fd)
        try:
            return os.fstatvfs(fd)
        finally:
            os.close(fd)

    # ---- attributes ---------------------------------------------------------------------

    async def setstat(self, path: bytes, attrs: SFTPAttrs) -> None:
        await self._settle()
        self._setstat_path(path, attrs, follow=True)

    async def lsetstat(self, path: bytes, attrs: SFTPAttrs) -> None:
        await self._settle()
        self._setstat_path(path, attrs, follow=False)

    def _setstat_path(self, path: bytes, attrs: SFTPAttrs, *, follow: bool) -> None:
        access = os.O_WRONLY if attrs.size is not None else os.O_RDONLY
        with self._resolve(path, follow=follow) as resolved:
            try:
                fd = os.open(resolved.name, access | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=resolved.dir_fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise asyncssh.SFTPOpUnsupported("the attributes of a symbolic link cannot be changed") from None
                raise
        try:
            self._apply(fd, attrs)
        finally:
            os.close(fd)

    async def fsetstat(self, file_obj: object, attrs: SFTPAttrs) -> None:
        assert isinstance(file_obj, OpenFile)
        await file_obj.flush()
        self._apply(file_obj.fd, attrs)

    def _apply(self, fd: int, attrs: SFTPAttrs) -> None:
        if attrs.uid is not None or attrs.gid is not None:
            current = os.fstat(fd)
            wanted = (current.st_uid if attrs.uid is None else attrs.uid, current.st_gid if attrs.gid is None else attrs.gid)
            if wanted != (current.st_uid, current.st_gid) and wanted != self.owner:
                raise asyncssh.SFTPPermissionDenied("files here belong to the workload's user; they cannot be given to another")
        if attrs.permissions is not None:
            os.fchmod(fd, attrs.permissions & 0o1777)  # never setuid or setgid
        if attrs.size is not None:
            os.ftruncate(fd, attrs.size)
        if attrs.atime is not None and attrs.mtime is not None:
            os.utime(fd, (attrs.atime, attrs.mtime))

    # ---- files --------------------------------------------------------------------------

    async def open(self, path: bytes, pflags: int, attrs: SFTPAttrs) -> object:
        await self._settle()
        file = OpenFile(await asyncio.to_thread(self._open, path, pflags, attrs))
        self.files.add(file)
        return file

    def _open(self, path: bytes, pflags: int, attrs: SFTPAttrs) -> int:
        if pflags & asyncssh.FXF_READ and pflags & asyncssh.FXF_WRITE:
            flags = os.O_RDWR
        elif pflags & (asyncssh.FXF_WRITE | asyncssh.FXF_APPEND):
            flags = os.O_WRONLY
        else:
            flags = os.O_RDONLY
        for bit, flag in ((asyncssh.FXF_APPEND, os.O_APPEND), (asyncssh.FXF_TRUNC, os.O_TRUNC), (asyncssh.FXF_EXCL, os.O_EXCL)):
            if pflags & bit:
                flags |= flag
        flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # non-blocking: a FIFO must not hang the thread
        mode = 0o644 if attrs.permissions is None else attrs.permissions & 0o777
        created = False
        with self._resolve(path, follow=True) as resolved:
            if pflags & asyncssh.FXF_CREAT:
                try:
                    fd = os.open(resolved.name, flags | os.O_CREAT | os.O_EXCL, mode, dir_fd=resolved.dir_fd)
                    created = True
                except FileExistsError:
                    if pflags & asyncssh.FXF_EXCL:
                        raise
                    fd = os.open(resolved.name, flags, dir_fd=resolved.dir_fd)
            else:
                fd = os.open(resolved.name, flags, dir_fd=resolved.dir_fd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise asyncssh.SFTPFailure("only regular files can be opened here")
            if created and self.owner is not None:
                os.fchown(fd, *self.owner)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except BaseException:
            os.close(fd)
            raise
        return fd

    async def read(self, file_obj: object, offset: int, size: int) -> bytes:
        assert isinstance(file_obj, OpenFile)
        return await file_obj.read(offset, size)

    async def write(self, file_obj: object, offset: int, data: bytes) -> int:
        assert isinstance(file_obj, OpenFile)
        await file_obj.write(offset, data)  # done behind the session's back: a failure comes with a later request
        return len(data)

    async def fstat(self, file_obj: object) -> os.stat_result:
        assert isinstance(file_obj, OpenFile)
        await file_obj.flush()
        return os.fstat(file_obj.fd)

    def fstatvfs(self, file_obj: object) -> os.statvfs_result:
        assert isinstance(file_obj, OpenFile)
        return os.fstatvfs(file_obj.fd)

    async def fsync(self, file_obj: object) -> None:
        assert isinstance(file_obj, OpenFile)
        await file_obj.flush()
        await asyncio.to_thread(os.fsync, file_obj.fd)

    async def close(self, file_obj: object) -> None:
        assert isinstance(file_obj, OpenFile)
        self.files.discard(file_obj)
        try:
            await file_obj.close()
        except OSError:
            if not self.channel.is_closing():
                raise
            # The session ends with the file open (asyncssh closes what is left): no client to tell, and exit() must run.

    def exit(self) -> None:
        self.jail.close()
        # OpenSSH's scp fails a transfer whose channel closes without an exit status.
        with contextlib.suppress(OSError, asyncssh.Error):
            self.channel.exit(0)
