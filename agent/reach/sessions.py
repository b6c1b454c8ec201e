"""What an SSH session runs in a rental: a shell or a command, in its container or as its user.

``run_in_container`` is ``docker exec`` through the engine (aiodocker): ``/bin/sh`` (or the
image's ``$SHELL``) in ``/workspace`` as the container's own user, with a TTY when the client
asked for a PTY (resized as the client's window changes), stdin attached; the exit code is
the exec's. ``run_as_rental_user`` runs the same under a process rental's uid: the agent's
``setsid --ctty`` (a PTY), the rental's cgroup, then ``users.session_argv`` (namespaces of its
own, ``setpriv``), in the rental's home. Both return the exit status for the client.

Cancelling either (the connection went away) ends what it started: the exec's connection is
closed (a shell on a TTY gets SIGHUP; a command without one sees its stdin end), the host
process is killed with everything in its PID namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import select
import signal
import struct
import termios
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import aiodocker
import asyncssh
from aiodocker.stream import Stream
from asyncssh.misc import SoftEOFReceived

from agent.runtimes.base import RentalAccess
from agent.runtimes.containeropts import WORKSPACE
from agent.runtimes.process import workload_environment
from agent.runtimes.procnet import netns_path
from agent.runtimes.users import TRUSTED_PATH, IsolationTools, RentalUser, session_argv

log = logging.getLogger(__name__)

SHELL: Final = "/bin/sh"
_TERM_RE = re.compile(r"^[A-Za-z0-9._+-]{1,64}$")
_CHUNK: Final = 32 << 10
# A root step before the namespaces: enter the rental's cgroups (each a folder given before "--").
_ENTER_CGROUPS: Final = 'while [ "$1" != -- ]; do echo $$ > "$1/cgroup.procs" || exit 125; shift; done; shift; exec "$@"'

Process = asyncssh.SSHServerProcess[bytes]


def terminal(process: Process) -> str | None:
    """The client's terminal type when it asked for a PTY (a safe ``TERM`` value), else ``None``."""
    term = process.term_type
    if term is None:
        return None
    return term if _TERM_RE.fullmatch(term) else "xterm"


def shell_argv(shell: str, command: str | None) -> list[str]:
    return [shell, "-l"] if command is None else [shell, "-c", command]


# ---- containers ------------------------------------------------------------------------------


async def container_shell(docker: aiodocker.Docker, container_id: str) -> str:
    """The image's ``$SHELL`` when it names an absolute path, else ``/bin/sh``."""
    info = await docker.containers.container(container_id).show()
    for item in (info.get("Config") or {}).get("Env") or ():
        name, _, value = str(item).partition("=")
        if name == "SHELL" and value.startswith("/") and "\n" not in value:
            return value
    return SHELL


async def run_in_container(process: Process, docker: aiodocker.Docker, container_id: str, *, exit_timeout: float = 10.0) -> int:
    """Run the session's shell or command in the container (see the module); returns its exit code."""
    term = terminal(process)
    shell = await container_shell(docker, container_id)
    env = {"TERM": term} if term else {}
    execution = await docker.containers.container(container_id).exec(
        shell_argv(shell, process.command), stdin=True, tty=term is not None, environment=env, workdir=WORKSPACE,
    )
    stream = execution.start(detach=False)
    async with stream:
        if term is not None:
            await _resize(execution, process.term_size)
        feeder = asyncio.create_task(_feed_exec(process, stream, execution, tty=term is not None))
        try:
            while (message := await stream.read_out()) is not None:
                (process.stderr if message.stream == 2 else process.stdout).write(message.data)
                await process.stdout.drain()
        finally:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feeder
    # The output ended with the process; the engine may say so a moment later.
    async with asyncio.timeout(exit_timeout):
        while True:
            info = await execution.inspect()
            if not info.get("Running"):
                code = info.get("ExitCode")
                return code if isinstance(code, int) else 255
            await asyncio.sleep(0.02)


async def _resize(execution: Any, size: tuple[int, int, int, int]) -> None:
    width, height = size[0], size[1]
    if width and height:
        with contextlib.suppress(aiodocker.DockerError):
            await execution.resize(h=height, w=width)


async def _feed_exec(process: Process, stream: Stream, execution: Any, *, tty: bool) -> None:
    """The client's input into the exec, its window changes as resizes; its EOF half-closes the exec's stdin."""
    while True:
        try:
            data = await process.stdin.read(_CHUNK)
        except asyncssh.TerminalSizeChanged as change:
            await _resize(execution, (change.width, change.height, 0, 0))
            continue
        except (asyncssh.BreakReceived, asyncssh.SignalReceived, SoftEOFReceived):
            continue
        if not data:
            break
        await stream.write_in(data)
    if not tty:
        # aiodocker has no half-close: the hijacked connection's write side, so the command sees EOF.
        response = stream._resp
        transport = None if response is None or response.connection is None else response.connection.transport
        if transport is not None and transport.can_write_eof():
            transport.write_eof()


# ---- process rentals ---------------------------------------------------------------------------


def session_environment(access: RentalAccess, user: RentalUser, term: str | None) -> dict[str, str]:
    env = workload_environment(access.rental_id, access.gpu_uuids, {}, home=user.home, share=None)
    env.update(USER=f"rental-{user.uid}", LOGNAME=f"rental-{user.uid}", SHELL=SHELL)
    if term:
        env["TERM"] = term
    return env


def host_argv(access: RentalAccess, user: RentalUser, tools: IsolationTools, setsid: str | None, argv: Sequence[str], env: dict[str, str]) -> list[str]:
    """The whole command: ``setsid --ctty`` (a PTY), the cgroups, the namespaces and the user."""
    netns = netns_path(user.uid)
    # A session shares its rental's network: its loopback, never the host's.
    command = session_argv(user, tools, argv, env, netns=netns if netns.exists() else None)
    if access.cgroup_dirs:
        command = ["/bin/sh", "-c", _ENTER_CGROUPS, "gpumarket-cgroup", *(str(d) for d in access.cgroup_dirs), "--", *command]
    if setsid is not None:
        command = [setsid, "--ctty", "--wait", *command]
    return command


async def run_as_rental_user(process: Process, access: RentalAccess, user: RentalUser, tools: IsolationTools, *, setsid: str) -> int:
    """Run the session's shell or command as the process rental's user (see the module); returns its exit status."""
    term = terminal(process)
    env = session_environment(access, user, term)
    argv = shell_argv(SHELL, process.command)
    if term is None:
        return await _run_piped(process, host_argv(access, user, tools, None, argv, env), user.home)
    return await _run_on_pty(process, host_argv(access, user, tools, setsid, argv, env), user.home)


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


async def _run_piped(process: Process, command: list[str], home: Path) -> int:
    child = await asyncio.create_subprocess_exec(
        *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        cwd=home, env={"PATH": TRUSTED_PATH}, start_new_session=True,
    )
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    stdin = child.stdin

    async def feed() -> None:
        with contextlib.suppress(ConnectionError, asyncssh.Error):
            while True:
                try:
                    data = await process.stdin.read(_CHUNK)
                except (asyncssh.BreakReceived, asyncssh.SignalReceived, SoftEOFReceived, asyncssh.TerminalSizeChanged):
                    continue
                if not data:
                    break
                stdin.write(data)
                await stdin.drain()
        stdin.close()

    async def copy(source: asyncio.StreamReader, sink: asyncssh.SSHWriter[bytes]) -> None:
        while data := await source.read(_CHUNK):
            sink.write(data)
            await sink.drain()

    feeder = asyncio.create_task(feed())
    try:
        await asyncio.gather(copy(child.stdout, process.stdout), copy(child.stderr, process.stderr))
        return _status(await child.wait())
    finally:
        feeder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feeder
        _kill(child)


async def _run_on_pty(process: Process, command: list[str], home: Path) -> int:
    master, slave = os.openpty()
    try:
        _set_size(master, process.term_size)
        child = await asyncio.create_subprocess_exec(
            *command, stdin=slave, stdout=slave, stderr=slave, cwd=home, env={"PATH": TRUSTED_PATH},
        )
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    loop = asyncio.get_running_loop()
    output: asyncio.Queue[bytes] = asyncio.Queue(maxsize=16)
    paused = False

    def readable() -> None:
        nonlocal paused
        try:
            data = os.read(master, _CHUNK)
        except BlockingIOError:
            return
        except OSError:  # EIO: every process holding the terminal has ended
            data = b""
        output.put_nowait(data)
        if not data or output.full():
            loop.remove_reader(master)  # the end, or back-pressure until the client took what is queued
            paused = bool(data)

    async def feed() -> None:
        with contextlib.suppress(ConnectionError, asyncssh.Error):
            while True:
                try:
                    data = await process.stdin.read(_CHUNK)
                except asyncssh.TerminalSizeChanged as change:
                    _set_size(master, (change.width, change.height, change.pixwidth, change.pixheight))
                    continue
                except (asyncssh.BreakReceived, asyncssh.SignalReceived, SoftEOFReceived):
                    continue
                if not data:
                    return
                await asyncio.to_thread(_write_all, master, data)

    os.set_blocking(master, False)
    loop.add_reader(master, readable)
    feeder = asyncio.create_task(feed())
    try:
        while data := await output.get():
            if paused:
                paused = False
                loop.add_reader(master, readable)
            process.stdout.write(data)
            await process.stdout.drain()
        return _status(await child.wait())
    finally:
        loop.remove_reader(master)
        feeder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feeder
        _kill(child)
        os.close(master)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            select.select([], [fd], [], 1.0)
            continue
        view = view[written:]


def _set_size(fd: int, size: tuple[int, int, int, int]) -> None:
    width, height, pixwidth, pixheight = size
    if width and height:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", height, width, pixwidth, pixheight))


def _kill(child: asyncio.subprocess.Process) -> None:
    """SIGKILL to the session's first process (``unshare --kill-child``: its namespace goes with it)."""
    if child.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGKILL)
