"""SSH into rentals, served by the agent itself (asyncssh): no sshd in any image, no port on the host.

``RentalSshServer`` runs one SSH server connection per call of ``serve(rental_id, sock)`` over
an already-connected socket, or over a renter's stream on the relay link itself (a ``Channel``, in production:
``shared.streams.transport.ChannelTransport`` under asyncssh, no socket pair).
Each rental has its own ed25519 host key, made once by ``prepare`` and kept (0600) with the
renter's authorized keys under ``keys_dir/<rental_id>/`` until ``forget``: an agent restart
serves the same key, which the renter's client pins.

Access follows the account live: ``update_access`` replaces a rental's authorized keys (the master's
``update_access`` command, sent when the renter adds or deletes a key or the account is disabled).
Each list carries the account's access version; a list older than the one held is ignored, so
commands that arrive out of order or twice change nothing. A login is checked against the stored
list each time, so a removed key is refused at once, and every open connection that logged in
with a key no longer listed is disconnected (each connection remembers its key's fingerprint).

A connection: public-key authentication only, with the rental's authorized keys; any user
name (a session runs as the workload's user); the key's SHA256 fingerprint is logged. Then:

- sessions (``agent.reach.sessions``): a shell (PTY or not) or a command, in the rental's
  container (``docker exec``) or as its process rental's uid; refused with one line once the
  workload has exited, and for hold rentals;
- SFTP (and so ``scp``) in the rental's workspace (``agent.reach.sftp``), also after its workload
  exited, until the rental is released;
- ``-L`` forwarding (direct-tcpip) to a port of the rental's container (its address, or
  ``localhost``, which means it); nothing else: no ``-R``, agent or X11 forwarding.

Transport (``shared.sshwire``): AES-GCM offered first (asyncssh encrypts in Python; GCM is one call per packet),
ChaCha20 and AES-CTR still offered to clients without it; an 8 MiB window and 128 KiB packets per channel.

Logging: logins, refusals and client misbehaviour at INFO; our own failures at ERROR.
Cancellation: cancelling ``serve`` closes its connection; ``close_rental`` and ``close`` end
connections and wait for their sessions' tasks, which own the execs and processes they ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import socket
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import asyncssh

from agent.reach.sshconn import VOLUME, SshConnection
from agent.runtimes.base import WorkloadKind, check_rental_id
from agent.runtimes.containeropts import WORKSPACE
from agent.runtimes.manager import WorkloadManager
from agent.runtimes.users import TRUSTED_PATH
from agent.state import atomic_write
from agent.volumes import VolumeStore
from shared import protocol, sshwire
from shared.errors import BadRequest, ConfigError
from shared.streams.aio import Channel
from shared.streams.transport import StreamTunnel

__all__ = ["VOLUME", "RentalSshServer"]

log = logging.getLogger(__name__)

HOST_KEY: Final = "host_key"
RENTAL_FILE: Final = "rental.json"
MAX_LOGINS_KEPT: Final = 50  # fingerprints remembered per rental between two reports (an account has at most 50 keys)
NO_VERSION: Final = -1  # a list from before access versions (an older master or agent): any versioned list replaces it


class RentalSshServer:
    """Serves SSH for this host's rentals (see the module). ``workloads`` says what each runs."""

    def __init__(
        self,
        keys_dir: Path,
        workloads: WorkloadManager,
        *,
        volumes: VolumeStore | None = None,
        # Timeouts
        login_timeout: float = 30.0,
        keepalive_interval: float = 30.0,
        keepalive_count_max: int = 3,
        exit_timeout: float = 10.0,
        # Limits
        max_connections_per_rental: int = 16,
        max_sessions_per_connection: int = 10,
        max_channels_per_connection: int = 64,
        max_pending_access: int = 1024,
    ) -> None:
        ConfigError.check_bounds("SSH setting", (
            ("login_timeout", login_timeout, 0.1, 600.0),
            ("keepalive_interval", keepalive_interval, 0.1, 3600.0),
            ("keepalive_count_max", keepalive_count_max, 1, 100),
            ("exit_timeout", exit_timeout, 0.1, 600.0),
            ("max_connections_per_rental", max_connections_per_rental, 1, 1024),
            ("max_sessions_per_connection", max_sessions_per_connection, 1, 256),
            ("max_channels_per_connection", max_channels_per_connection, 1, 1024),
            ("max_pending_access", max_pending_access, 1, 1 << 16),
        ))
        self.keys_dir = keys_dir
        self.workloads = workloads
        self.volumes = volumes  # a volume's file-only session (``prepare(volume_id, ..., kind=VOLUME)``): SFTP and rsync
        self.login_timeout = login_timeout
        self.keepalive_interval = keepalive_interval
        self.keepalive_count_max = keepalive_count_max
        self.exit_timeout = exit_timeout
        self.max_connections_per_rental = max_connections_per_rental
        self.max_sessions_per_connection = max_sessions_per_connection
        self.max_channels_per_connection = max_channels_per_connection
        self.max_pending_access = max_pending_access
        # Lists for rentals with no SSH server here yet (their start still runs): ``prepare`` takes the newer one.
        self._pending_access: OrderedDict[str, tuple[int, list[str]]] = OrderedDict()
        self._host_keys: dict[str, asyncssh.SSHKey] = {}
        self.connections: dict[str, set[SshConnection]] = {}
        self._logins: dict[str, set[str]] = {}  # rental -> key fingerprints logged in since take_logins
        self._tasks: set[asyncio.Task[Any]] = set()  # sessions and forwards: cancelled by close_rental() and close()
        self._closed = False
        self.setsid = shutil.which("setsid", path=TRUSTED_PATH)

    # ---- rentals ------------------------------------------------------------------------

    def prepare(
        self, rental_id: str, authorized_keys: Sequence[str], *, kind: str | None = None, version: int | None = None
    ) -> str:
        """Idempotent. Makes (once) and keeps the rental's ed25519 host key (0600, under ``keys_dir``),
        stores the renter's authorized keys (OpenSSH one-line public keys) of access ``version`` — unless
        a newer list is held already (stored, or from an ``update_access`` that came while the start ran)
        — and the workload's kind (``kind``, else what runs now), and returns the host public key in
        OpenSSH one-line form. Raises ``BadRequest`` for a key that is not an OpenSSH public key."""
        check_rental_id(rental_id)
        keys = [_parse_key(line) for line in authorized_keys]
        version = NO_VERSION if version is None else version
        newest = max((self._held_version(rental_id), self._pending_access.get(rental_id, (NO_VERSION, []))), key=lambda held: held[0])
        if newest[0] > version:
            log.info("rental %s: start's SSH keys (version %d) ignored for the newer list held (version %d)", rental_id, version, newest[0])
            version, keys = newest[0], [_parse_key(line) for line in newest[1]]
        self._pending_access.pop(rental_id, None)
        folder = self.keys_dir / rental_id
        self.keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.mkdir(mode=0o700, exist_ok=True)
        key_file = folder / HOST_KEY
        host_key = self._host_keys.get(rental_id)
        if host_key is None and key_file.exists():
            host_key = asyncssh.read_private_key(key_file)
        if host_key is None:
            host_key = asyncssh.generate_private_key("ssh-ed25519", comment=f"gpumarket rental {rental_id}")
            atomic_write(key_file, host_key.export_private_key())
        self._host_keys[rental_id] = host_key
        if kind is None:
            access = self.workloads.access(rental_id)
            kind = access.kind if access is not None else self._record(rental_id).get("kind")
        record = {"kind": kind, "authorized_keys": [k.export_public_key().decode().strip() for k in keys], "access_version": version}
        atomic_write(folder / RENTAL_FILE, json.dumps(record).encode())
        self._close_unlisted(rental_id, {key.public_data for key in keys})  # a restarted agent's start may carry fewer keys
        public: bytes = host_key.export_public_key()
        return " ".join(public.decode().split()[:2])

    def update_access(
        self, rental_id: str, authorized_keys: Sequence[str], *, version: int, disabled: bool = False
    ) -> protocol.AccessUpdated:
        """Replace the rental's authorized keys with ``authorized_keys`` as of access ``version``, unless a newer
        list is held (then nothing changes). New logins see the new list at once; the open connections that
        logged in with a key no longer listed are disconnected now. For a rental with no SSH server here yet
        (its start still runs) the list is kept for its ``prepare``. Raises ``BadRequest`` for a key that is
        not an OpenSSH public key (nothing changes then)."""
        check_rental_id(rental_id)
        keys = [_parse_key(line) for line in authorized_keys]
        lines = [key.export_public_key().decode().strip() for key in keys]
        if not self.knows(rental_id):
            pending = self._pending_access.get(rental_id)
            if pending is not None and pending[0] > version:
                return protocol.AccessUpdated(applied=False, version=pending[0], known=False, closed=0)
            self._pending_access[rental_id] = (version, lines)
            self._pending_access.move_to_end(rental_id)
            while len(self._pending_access) > self.max_pending_access:
                self._pending_access.popitem(last=False)
            return protocol.AccessUpdated(applied=True, version=version, known=False, closed=0)
        held, _ = self._held_version(rental_id)
        if held > version:
            log.info("rental %s: SSH keys of version %d ignored: version %d is held", rental_id, version, held)
            return protocol.AccessUpdated(applied=False, version=held, known=True, closed=0)
        record = self._record(rental_id)
        record.update(authorized_keys=lines, access_version=version, access_disabled=disabled)
        atomic_write(self.keys_dir / rental_id / RENTAL_FILE, json.dumps(record).encode())
        closed = self._close_unlisted(rental_id, {key.public_data for key in keys})
        log.info("rental %s: SSH keys now %d (version %d); %d connection(s) closed", rental_id, len(keys), version, closed)
        return protocol.AccessUpdated(applied=True, version=version, known=True, closed=closed)

    def access_disabled(self, rental_id: str) -> bool:
        """Whether the rental's account is disabled (its last ``update_access`` said so): no stream may open."""
        return self.knows(rental_id) and self._record(rental_id).get("access_disabled") is True

    def _held_version(self, rental_id: str) -> tuple[int, list[str]]:
        """The access version and key lines stored for the rental (``NO_VERSION`` when none or from before versions)."""
        record = self._record(rental_id)
        version, lines = record.get("access_version"), record.get("authorized_keys")
        if not isinstance(version, int) or isinstance(version, bool) or not isinstance(lines, list):
            return NO_VERSION, []
        return version, [str(line) for line in lines]

    def _close_unlisted(self, rental_id: str, allowed: set[bytes]) -> int:
        """Disconnect the rental's connections whose login key (or key under check) is not in ``allowed``; how many."""
        closed = 0
        for connection in list(self.connections.get(rental_id, ())):
            if connection.key is not None and connection.key.public_data not in allowed:
                connection.revoke()
                closed += 1
        return closed

    @staticmethod
    def check_keys(authorized_keys: Sequence[str]) -> None:
        """Raise ``BadRequest`` (``bad_authorized_key``) unless every line is an OpenSSH public key."""
        for line in authorized_keys:
            _parse_key(line)

    def forget(self, rental_id: str) -> None:
        """The rental is released: drop its host key and authorized keys (its connections end with ``close_rental``)."""
        check_rental_id(rental_id)
        self._host_keys.pop(rental_id, None)
        self._pending_access.pop(rental_id, None)
        shutil.rmtree(self.keys_dir / rental_id, ignore_errors=True)
        for connection in list(self.connections.get(rental_id, ())):
            connection.close()

    def note_login(self, rental_id: str, fingerprint: str) -> None:
        """Remember that ``fingerprint`` logged into the rental, for ``take_logins`` (a few per rental)."""
        seen = self._logins.setdefault(rental_id, set())
        if len(seen) < MAX_LOGINS_KEPT:
            seen.add(fingerprint)

    def take_logins(self) -> dict[str, set[str]]:
        """The keys (SHA256 fingerprints) that logged into each rental since the last call; the master
        shows them as the keys' "last used"."""
        logins, self._logins = self._logins, {}
        return logins

    def logged_in(self, rental_id: str) -> set[str]:
        """The key fingerprints of the rental's open connections that have logged in."""
        return {c.fingerprint for c in self.connections.get(rental_id, ()) if c.fingerprint}

    def knows(self, rental_id: str) -> bool:
        check_rental_id(rental_id)
        return (self.keys_dir / rental_id / RENTAL_FILE).is_file() and (self.keys_dir / rental_id / HOST_KEY).is_file()

    def _record(self, rental_id: str) -> dict[str, Any]:
        try:
            data = json.loads((self.keys_dir / rental_id / RENTAL_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def authorized(self, rental_id: str) -> set[bytes]:
        """The public data of the rental's authorized keys (read each time: ``prepare`` may change them)."""
        found: set[bytes] = set()
        for line in self._record(rental_id).get("authorized_keys") or ():
            with contextlib.suppress(asyncssh.KeyImportError, ValueError):
                found.add(asyncssh.import_public_key(str(line)).public_data)
        return found

    def kind_of(self, rental_id: str) -> WorkloadKind | None:
        access = self.workloads.access(rental_id)
        if access is not None:
            return access.kind
        kind = self._record(rental_id).get("kind")
        return kind if kind in ("hold", "process", "container") else None

    def is_volume(self, rental_id: str) -> bool:
        """Whether the id is a volume's file-only session (docs/volumes.md): files only, no shell, no forwarding."""
        return self.volumes is not None and self._record(rental_id).get("kind") == VOLUME

    def _host_key(self, rental_id: str) -> asyncssh.SSHKey:
        key = self._host_keys.get(rental_id)
        if key is None:
            key = self._host_keys[rental_id] = asyncssh.read_private_key(self.keys_dir / rental_id / HOST_KEY)
        return key

    # ---- connections --------------------------------------------------------------------

    async def serve(self, rental_id: str, sock: socket.socket | Channel) -> None:
        """Run one SSH server connection over ``sock`` (an already connected socket, or a stream of the agent's
        link) until the client disconnects.

        Cancelling is safe: it closes the connection. Raises nothing for client misbehaviour
        (logged); an unknown rental's socket is closed (its stream reset) at once.
        """
        if self._closed or not self.knows(rental_id):
            log.info("rental %s: SSH connection refused: %s", rental_id, "the agent is closing" if self._closed else "no such rental here")
            _drop(sock)
            return
        if len(self.connections.get(rental_id, ())) >= self.max_connections_per_rental:
            log.info("rental %s: SSH connection refused: %d already open", rental_id, self.max_connections_per_rental)
            _drop(sock)
            return
        connection = SshConnection(self, rental_id)
        # asyncssh's own entry for a connection it does not open: a socket, or a ``tunnel`` whose create_connection
        # makes the transport (here over the stream itself).
        tunnel = StreamTunnel(sock) if isinstance(sock, Channel) else None
        try:
            conn = await asyncssh.run_server(
                None if isinstance(sock, Channel) else sock, **({"tunnel": tunnel} if tunnel else {}),
                server_factory=lambda: connection, server_host_keys=[self._host_key(rental_id)],
                public_key_auth=True, password_auth=False, kbdint_auth=False, gss_auth=False, host_based_auth=False,
                agent_forwarding=False, x11_forwarding=False, allow_pty=True, line_editor=False, encoding=None,
                login_timeout=self.login_timeout, connect_timeout=self.login_timeout,
                keepalive_interval=self.keepalive_interval, keepalive_count_max=self.keepalive_count_max,
                encryption_algs=list(sshwire.CIPHERS), window=sshwire.WINDOW, max_pktsize=sshwire.MAX_PACKET,
            )
            await conn.wait_closed()
        except (asyncssh.Error, OSError, TimeoutError) as exc:
            log.info("rental %s: SSH connection ended before login: %s", rental_id, exc)
        finally:
            if connection.conn is None:
                _drop(sock)
            else:
                connection.conn.abort()
            if tunnel is not None and tunnel.transport is not None:
                tunnel.transport.close()
                await tunnel.transport.wait_closed()  # the stream's last bytes sent, the peer's end awaited (bounded)

    async def close_rental(self, rental_id: str) -> None:
        """The rental's workload stopped: end its open SSH connections and their sessions now. Cancelling is safe."""
        connections = list(self.connections.get(rental_id, ()))
        tasks = {task for connection in connections for task in connection.tasks}
        for connection in connections:
            connection.close()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def close(self) -> None:
        """End every connection and wait for their sessions' tasks. Cancelling leaves them ending; call it again."""
        self._closed = True
        for connections in list(self.connections.values()):
            for connection in list(connections):
                connection.close()
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def own(self, connection: SshConnection) -> Callable[[], None]:
        """Track the current task (a session or forward asyncssh started) until the returned call."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        connection.tasks.add(task)

        def done() -> None:
            self._tasks.discard(task)
            connection.tasks.discard(task)

        return done

    # ---- what a session reaches ---------------------------------------------------------

    async def workspace(self, rental_id: str, kind: str) -> tuple[Path, str, tuple[int, int] | None]:
        """The rental's files on this host, how the rental names that folder, and the owner of what is made there
        (a volume's session: the volume, at ``/``)."""
        if kind == VOLUME and self.volumes is not None:
            try:
                return await asyncio.to_thread(self.volumes.path, rental_id), "", self.volumes.owner
            except BadRequest as exc:
                raise BadRequest(f"volume {rental_id} cannot be served: {exc.message}", code="ssh_refused") from None
        if kind == "container":
            path = await self.workloads.containers.workspace_path(rental_id)
            if path is None:
                raise BadRequest(f"rental {rental_id} has no /workspace on this host any more", code="ssh_refused")
            return path, WORKSPACE, _container_owner(self.workloads)
        users = self.workloads.processes.users
        user = None if users is None else users.lookup(rental_id)
        if user is None or not user.home.is_dir():
            raise BadRequest(f"rental {rental_id}'s home is gone: its workload has ended and the home went with it", code="ssh_refused")
        return user.home, str(user.home), (user.uid, user.gid)


def _container_owner(workloads: WorkloadManager) -> tuple[int, int] | None:
    """The numeric uid:gid containers run as (``ContainerOptions.user``), if numeric."""
    options = workloads.container_options
    user = "" if options is None else options.user
    uid, _, gid = user.partition(":")
    if uid.isdigit() and (not gid or gid.isdigit()):
        return int(uid), int(gid or uid)
    return None


def _parse_key(line: str) -> asyncssh.SSHKey:
    try:
        return asyncssh.import_public_key(line.strip())
    except (asyncssh.KeyImportError, ValueError) as exc:
        raise BadRequest(f"authorized key {line[:40]!r}… is not an OpenSSH public key ({exc}); give lines like 'ssh-ed25519 AAAA… comment'",
                         code="bad_authorized_key") from None


def _drop(sock: socket.socket | Channel) -> None:
    if isinstance(sock, Channel):
        sock.reset()
    else:
        sock.close()
