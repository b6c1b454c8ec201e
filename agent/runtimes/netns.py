"""Connecting to a port inside a container's own network namespace.

A renter's app often listens on the container's loopback only (VS Code's server, a notebook
started with its defaults, a debug server): the container's address does not reach it. The
agent, when it may (``CAP_SYS_ADMIN``: root), opens the connection from *inside* the
container's network namespace, to ``127.0.0.1:port`` there, which reaches listeners on the
loopback and on every address alike — and nothing but the container's own.

How: a short-lived thread of its own (never a pooled one) enters the namespace with
``setns(2)`` (it changes the calling thread only), connects, and goes back; the socket keeps
the namespace it was made in. If going back ever failed, the thread ends with the error
rather than living on in the wrong namespace. Without the privilege (``EPERM``) callers fall
back to the container's address.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import socket
import threading
from collections.abc import Callable
from typing import Final

CLONE_NEWNET: Final = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class NamespaceUnavailable(OSError):
    """This process may not enter the namespace (not root), or it is gone: use the container's address."""


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        raise NamespaceUnavailable(code, f"setns: {os.strerror(code)}")


def _inside(pid: int, make: Callable[[], socket.socket]) -> socket.socket:
    try:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise NamespaceUnavailable(exc.errno or errno.ENOENT, f"the container's network namespace: {exc.strerror}") from None
    try:
        _setns(target)
        try:
            return make()
        finally:
            _setns(own)  # raises (and the thread ends with it) rather than staying inside
    finally:
        os.close(own)
        os.close(target)


async def socket_in_namespace(pid: int, make: Callable[[], socket.socket], *, name: str = "netns") -> socket.socket:
    """The socket ``make()`` returns, made (bound, connected) inside the network namespace of process ``pid``;
    non-blocking. Raises ``NamespaceUnavailable`` or whatever ``make`` raises. Cancelling is safe: a socket made
    after it is closed."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[socket.socket] = loop.create_future()

    def work() -> None:
        try:
            sock = _inside(pid, make)
        except BaseException as exc:  # handed to the waiting coroutine
            loop.call_soon_threadsafe(_settle, done, None, exc)
            return
        loop.call_soon_threadsafe(_settle, done, sock, None)

    threading.Thread(target=work, name=f"{name}-{pid}", daemon=True).start()
    sock = await done
    sock.setblocking(False)
    return sock


async def connect_in_namespace(pid: int, port: int, *, timeout: float = 5.0, host: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Streams to ``host:port`` (default the loopback) inside the network namespace of process ``pid``.

    Raises ``NamespaceUnavailable`` (fall back to the container's address), ``OSError`` or
    ``TimeoutError`` (nothing listens). Cancelling is safe: a socket made after it is closed."""
    sock = await socket_in_namespace(pid, lambda: socket.create_connection((host, port), timeout=timeout), name=f"netns-connect-{port}")
    try:
        return await asyncio.open_connection(sock=sock)
    except BaseException:
        sock.close()
        raise


def _settle(future: asyncio.Future[socket.socket], sock: socket.socket | None, exc: BaseException | None) -> None:
    if future.cancelled():
        if sock is not None:
            sock.close()
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        assert sock is not None
        future.set_result(sock)
