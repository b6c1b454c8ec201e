"""One renter's SSH connection to one rental (``agent.reach.sshd``'s ``RentalSshServer.serve`` makes one each): its login
with the rental's authorized keys, its sessions (a shell or command, SFTP and scp, a volume's file-only commands) and
its ``-L`` forwards, within the server's limits. The server's module docstring says what each is allowed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final, Protocol

import asyncssh
from asyncssh.stream import SSHTCPStreamSession

from agent.reach.forward import EXITED, open_container_port, pump
from agent.reach.sessions import run_as_rental_user, run_in_container
from agent.reach.sftp import WorkspaceSFTPServer
from agent.reach.volumefiles import run_volume_command
from agent.runtimes.base import WorkloadKind
from agent.runtimes.manager import WorkloadManager
from agent.volumes import VolumeStore
from shared.errors import BadRequest

log = logging.getLogger("agent.reach.sshd")  # the SSH server's one log, as before the split

VOLUME: Final = "volume"  # the kind of a volume's file-only session (agent.reach.volumefiles)
KEY_REMOVED: Final = "your SSH key was removed from this rental's account (or the account was disabled); ask its owner"
_PROHIBITED: Final = asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED


class ConnectionHost(Protocol):
    """What a connection asks of its server (``agent.reach.sshd.RentalSshServer``): the rental's keys, kind and
    files, the limits, and where it registers itself and its tasks."""

    workloads: WorkloadManager
    volumes: VolumeStore | None
    connections: dict[str, set[SshConnection]]  # rental -> its open connections
    setsid: str | None
    login_timeout: float
    exit_timeout: float
    max_sessions_per_connection: int
    max_channels_per_connection: int

    def authorized(self, rental_id: str) -> set[bytes]: ...
    def note_login(self, rental_id: str, fingerprint: str) -> None: ...
    def kind_of(self, rental_id: str) -> WorkloadKind | None: ...
    def is_volume(self, rental_id: str) -> bool: ...
    def own(self, connection: SshConnection) -> Callable[[], None]: ...
    async def workspace(self, rental_id: str, kind: str) -> tuple[Path, str, tuple[int, int] | None]: ...


class SshConnection(asyncssh.SSHServer):
    """One client's connection to one rental: its login, sessions and forwards, within the server's limits."""

    def __init__(self, server: ConnectionHost, rental_id: str) -> None:
        self.server = server
        self.rental_id = rental_id
        self.conn: asyncssh.SSHServerConnection | None = None
        self.tasks: set[asyncio.Task[Any]] = set()
        self.username = ""
        self.key: asyncssh.SSHKey | None = None  # the last key accepted for this login: the one it logged in with
        self.fingerprint = ""  # the login key's SHA256 fingerprint, once logged in
        self.sessions = 0
        self.channels = 0

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self.conn = conn
        self.server.connections.setdefault(self.rental_id, set()).add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        connections = self.server.connections.get(self.rental_id)
        if connections is not None:
            connections.discard(self)
            if not connections:
                del self.server.connections[self.rental_id]
        for task in list(self.tasks):
            task.cancel()
        if exc is not None:
            log.info("rental %s: SSH connection lost: %s", self.rental_id, exc)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()

    def revoke(self) -> None:
        """Its key no longer opens the rental: disconnect, telling the client why; its sessions end with it."""
        log.info("rental %s: SSH connection with key %s closed: the key is no longer authorized", self.rental_id,
                 self.fingerprint or (self.key.get_fingerprint("sha256") if self.key is not None else "?"))  # fmt: skip
        if self.conn is not None:
            self.conn.disconnect(asyncssh.DISC_BY_APPLICATION, KEY_REMOVED)

    # ---- login --------------------------------------------------------------------------

    def begin_auth(self, username: str) -> bool:
        self.username = username
        return True

    def password_auth_supported(self) -> bool:
        return False

    def kbdint_auth_supported(self) -> bool:
        return False

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        if key.public_data in self.server.authorized(self.rental_id):
            self.key = key
            return True
        log.info("rental %s: SSH key %s refused", self.rental_id, key.get_fingerprint("sha256"))
        return False

    def auth_completed(self) -> None:
        fingerprint = "?" if self.key is None else self.key.get_fingerprint("sha256")
        self.fingerprint = fingerprint
        log.info("rental %s: SSH login as %r with key %s", self.rental_id, self.username, fingerprint)
        if self.key is not None:
            self.server.note_login(self.rental_id, fingerprint)

    # ---- sessions -----------------------------------------------------------------------

    def session_requested(self) -> asyncssh.SSHServerSession[bytes]:
        kind: str | None = VOLUME if self.server.is_volume(self.rental_id) else self.server.kind_of(self.rental_id)
        if kind is None or kind == "hold":
            what = "a hold rental" if kind == "hold" else "it is not known here"
            raise asyncssh.ChannelOpenError(_PROHIBITED, f"rental {self.rental_id} runs nothing to log into ({what})")
        if self.sessions >= self.server.max_sessions_per_connection or self.channels >= self.server.max_channels_per_connection:
            raise asyncssh.ChannelOpenError(
                asyncssh.OPEN_RESOURCE_SHORTAGE,
                f"at most {self.server.max_sessions_per_connection} sessions per connection; close one or connect again",
            )
        self.sessions += 1
        self.channels += 1
        return _Session(self, kind)

    def session_ended(self) -> None:
        self.sessions -= 1
        self.channels -= 1

    async def run(self, process: asyncssh.SSHServerProcess[bytes]) -> None:
        """A shell or command (SFTP and scp never come here): run it where the rental's workload runs."""
        done = self.server.own(self)
        try:
            process.exit(await self._run(process))
        except _Refused as refusal:
            process.stderr.write(f"{refusal}\r\n".encode() if process.term_type else f"{refusal}\n".encode())
            process.exit(1)
        except (asyncssh.Error, ConnectionError, BrokenPipeError) as exc:
            log.info("rental %s: SSH session ended: %s", self.rental_id, exc)
        except Exception:
            log.exception("rental %s: SSH session failed", self.rental_id)
            with contextlib.suppress(Exception):
                process.stderr.write(b"the agent failed to run this session; see the host's agent log\n")
                process.exit(255)
        finally:
            done()

    async def _run(self, process: asyncssh.SSHServerProcess[bytes]) -> int:
        if self.server.is_volume(self.rental_id):
            root, _, owner = await self.server.workspace(self.rental_id, VOLUME)
            assert self.server.volumes is not None and owner is not None
            return await run_volume_command(process, root, owner, self.server.volumes.root / ".jail")
        access = self.server.workloads.access(self.rental_id)
        if access is None or not access.running:
            raise _Refused(EXITED)
        what = process.command if process.command is not None else "a shell"
        log.info("rental %s: SSH session runs %s%s", self.rental_id, what[:200], " on a PTY" if process.term_type else "")
        if access.kind == "container" and access.container_id:
            return await run_in_container(process, self.server.workloads.containers.docker(), access.container_id, exit_timeout=self.server.exit_timeout)
        if access.kind == "process":
            users = self.server.workloads.processes.users
            user = None if users is None else users.lookup(self.rental_id)
            if users is None or user is None or access.uid is None:
                raise _Refused(
                    f"rental {self.rental_id} runs as the agent's own user on this host; SSH reaches only process rentals "
                    "with a uid of their own (the provider runs the agent as root)"
                )
            if self._setsid is None and process.term_type:
                raise _Refused("this host lacks util-linux's setsid for a terminal; run a command without -t")
            return await run_as_rental_user(process, access, user, users.tools, setsid=self._setsid or "setsid")
        raise _Refused(f"rental {self.rental_id} runs nothing to log into (a hold rental)")

    @property
    def _setsid(self) -> str | None:
        return self.server.setsid

    async def sftp(self, chan: asyncssh.SSHServerChannel[bytes], kind: str) -> asyncssh.SFTPServer:
        try:
            root, alias, owner = await self.server.workspace(self.rental_id, kind)
        except BadRequest as exc:
            log.info("rental %s: SFTP refused: %s", self.rental_id, exc.message)
            with contextlib.suppress(OSError, asyncssh.Error):
                chan.write_stderr(f"{exc.message}\n".encode())
                chan.exit(1)
            # The channel is closed: end asyncssh's task for it quietly, before any SFTP server exists.
            raise asyncio.CancelledError from None
        log.info("rental %s: SFTP session in %s", self.rental_id, root)
        return WorkspaceSFTPServer(chan, root, alias=alias, owner=owner)

    # ---- forwarding ---------------------------------------------------------------------

    def connection_requested(self, dest_host: str, dest_port: int, orig_host: str, orig_port: int) -> Any:
        # asyncssh awaits what this returns (channel._finish_open_request): the refusal may come after a look-up.
        return self._forward(dest_host, dest_port)

    async def _forward(self, dest_host: str, dest_port: int) -> asyncssh.SSHTCPSession[bytes]:
        if self.server.kind_of(self.rental_id) != "container":
            raise asyncssh.ChannelOpenError(
                _PROHIBITED, f"rental {self.rental_id} declares no ports: only a container rental's ports can be forwarded (ssh -L)"
            )
        if self.channels >= self.server.max_channels_per_connection:
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_RESOURCE_SHORTAGE, f"at most {self.server.max_channels_per_connection} channels per connection")
        reader, writer = await open_container_port(
            self.server.workloads.containers, self.rental_id, dest_host, dest_port, timeout=self.server.login_timeout
        )
        self.channels += 1
        log.info("rental %s: SSH forward to port %d of its container", self.rental_id, dest_port)
        return SSHTCPStreamSession[bytes](lambda chan_reader, chan_writer: self._pump(reader, writer, chan_reader, chan_writer))

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
        chan_reader: asyncssh.SSHReader[bytes], chan_writer: asyncssh.SSHWriter[bytes],
    ) -> None:
        done = self.server.own(self)
        try:
            await pump(reader, writer, chan_reader, chan_writer)
        except (OSError, asyncssh.Error) as exc:
            log.info("rental %s: SSH forward ended: %s", self.rental_id, exc)
        finally:
            self.channels -= 1
            writer.close()
            chan_writer.close()
            done()

    def server_requested(self, listen_host: str, listen_port: int) -> bool:
        log.info("rental %s: remote forwarding (ssh -R) refused", self.rental_id)
        return False


class _Refused(Exception):
    """A session this rental cannot run, and the line that tells the client why."""


class _Session(asyncssh.SSHServerProcess[bytes]):
    """A session channel: a shell or command (``SshConnection.run``), or SFTP/scp in the workspace."""

    def __init__(self, connection: SshConnection, kind: str) -> None:
        def sftp(chan: asyncssh.SSHServerChannel[bytes]) -> Awaitable[asyncssh.SFTPServer]:
            return connection.sftp(chan, kind)

        super().__init__(connection.run, sftp, 3, True)  # type: ignore[arg-type]
        self._connection = connection

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._connection.session_ended()
