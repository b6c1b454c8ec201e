"""Workload output logs: ``work_dir/<rental_id>/output.log``, capped by punching holes in its head.

stdout and stderr go to ``output.log``. Offsets into it are byte positions since the
file was created and never move; to keep it under ``max_log_bytes`` the manager's watcher
punches a hole in its head (``fallocate(PUNCH_HOLE)``: the old blocks are freed, the file
keeps its length), so the writer is never disturbed and no byte is lost between a copy and
a truncate. ``read`` skips the hole. Logs outlive the workload until the manager forgets it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Final

from shared.errors import GpumarketError, NotFound

log = logging.getLogger(__name__)

LOG_NAME: Final = "output.log"
_FALLOC_FL_KEEP_SIZE: Final = 0x01
_FALLOC_FL_PUNCH_HOLE: Final = 0x02


@functools.cache
def _fallocate() -> Callable[[int, int, int, int], int]:
    libc = ctypes.CDLL(None, use_errno=True)
    function = libc.fallocate
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    function.restype = ctypes.c_int
    return function


def punch_head(fd: int, start: int, end: int) -> None:
    """Free bytes ``[start, end)`` of the file; reading them gives zeros and the length stays."""
    if _fallocate()(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, start, end - start) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def first_data(fd: int, offset: int) -> int | None:
    """The first byte at or after ``offset`` that is not in a punched hole (``None``: none)."""
    try:
        return os.lseek(fd, offset, os.SEEK_DATA)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return None
        raise



class OutputLogs:
    """The output logs of the workloads under ``work_dir``: read in pages, appended to, capped."""

    def __init__(self, work_dir: Path, *, max_log_bytes: int) -> None:
        self.work_dir = work_dir
        self.max_log_bytes = max_log_bytes
        self._cap_failed = False

    def path(self, rental_id: str) -> Path:
        return self.work_dir / rental_id / LOG_NAME

    def read(self, rental_id: str, *, offset: int, limit: int, running: bool) -> tuple[bytes, int]:
        """Up to ``limit`` bytes from ``offset`` and the offset after them (see ``WorkloadManager.read_log``);
        a missing log is empty while the rental ``running`` or its folder exists, else ``NotFound``."""
        try:
            fd = os.open(self.path(rental_id), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if running or (self.work_dir / rental_id).is_dir():
                return b"", offset
            raise NotFound(f"no workload log for rental {rental_id} on this host", code="workload_log_not_found") from None
        except OSError as exc:
            raise GpumarketError(f"cannot read the log of rental {rental_id}: {exc.strerror}", code="workload_log_unreadable") from None
        try:
            size = os.fstat(fd).st_size
            if offset >= size:
                return b"", offset
            start = first_data(fd, offset)
            if start is None or start >= size:
                return b"", size
            data = os.pread(fd, min(limit, size - start), start)
            return data, start + len(data)
        except OSError as exc:
            raise GpumarketError(f"cannot read the log of rental {rental_id}: {exc.strerror}", code="workload_log_unreadable") from None
        finally:
            os.close(fd)

    def append(self, rental_id: str, line: str) -> None:
        """Add one line of the agent's own to the rental's log (on a line of its own)."""
        try:
            fd = os.open(self.path(rental_id), os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            log.warning("rental %s: cannot write to its log (%s)", rental_id, exc.strerror)
            return
        try:
            size = os.fstat(fd).st_size
            # The workload's own last line may lack its newline yet: do not glue ours to it.
            separate = size > 0 and os.pread(fd, 1, size - 1) not in (b"\n", b"")
            os.write(fd, (("\n" if separate else "") + line + "\n").encode())
        except OSError as exc:
            log.warning("rental %s: cannot write to its log (%s)", rental_id, exc.strerror)
        finally:
            os.close(fd)

    def cap(self, rental_id: str) -> None:
        """Free the head of ``output.log`` so at most ``max_log_bytes`` of it are kept (the newest)."""
        try:
            fd = os.open(self.path(rental_id), os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            size = os.fstat(fd).st_size
            block = os.fstatvfs(fd).f_bsize or 4096
            end = -(-(size - self.max_log_bytes) // block) * block  # whole blocks, so they are really freed
            start = first_data(fd, 0)
            if size > self.max_log_bytes and start is not None and start < end:
                punch_head(fd, start - start % block, end)
        except OSError as exc:
            if not self._cap_failed:
                self._cap_failed = True
                log.warning("cannot cap workload logs at %d bytes on this filesystem (%s); they grow unbounded", self.max_log_bytes, exc.strerror)
        finally:
            os.close(fd)
