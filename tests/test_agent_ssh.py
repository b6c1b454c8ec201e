"""SSH into rentals, served by the agent (``agent.reach.sshd``), driven by Debian's real ``ssh``, ``scp`` and ``sftp``.

A TCP listener on 127.0.0.1 port 0 hands each accepted socket to ``RentalSshServer.serve``
(in production a relay stream does). The clients pin the rental's host key in a
``known_hosts`` file of their own, with ``StrictHostKeyChecking=yes`` and ``BatchMode=yes``.
Containers run on this machine's engine from the locally built busybox image (see
``tests/test_container_runtime.py``); each test shares one container across its checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import shlex
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from agent.commands import CommandExecutor
from agent.gpu.sim import SimulatedBackend
from agent.logship import LogShipper
from agent.reach.forward import EXITED
from agent.reach.sshd import RentalSshServer
from agent.runtimes.cgroups import CgroupLimiter
from agent.runtimes.containeropts import ContainerOptions, resource_name
from agent.runtimes.isolation import isolation_facts, process_isolation
from agent.runtimes.manager import WorkloadManager
from agent.runtimes.procnet import netns_path
from agent.runtimes.users import IsolationTools, RentalUsers
from shared import protocol
from shared.errors import ConfigError
from shared.protocol import ContainerWorkload, HoldWorkload, ProcessWorkload
from tests import dockerengine
from tests.helpers import eventually
from tests.workloadfixtures import Exits

SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")
# Prints "reached" when the host's PostgreSQL on 127.0.0.1:5432 answers, else "refused".
LOOPBACK_PROBE = "import socket\ns = socket.socket()\ns.settimeout(2)\nprint('reached' if s.connect_ex(('127.0.0.1', 5432)) == 0 else 'refused')"

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="needs Debian's openssh-client (make docker installs it)")
WAIT = 30.0
TOOLS = IsolationTools.find()


def keygen(path: Path) -> str:
    """A fresh ed25519 key pair at ``path``; returns the public key line."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "renter@test", "-f", str(path)], check=True)
    return path.with_suffix(".pub").read_text().strip()


class Site:
    """A listener for one rental on 127.0.0.1, and clients that pin its host key."""

    def __init__(self, tmp: Path, server: RentalSshServer, rental_id: str, host_key: str, key: Path) -> None:
        self.tmp = tmp
        self.server = server
        self.rental_id = rental_id
        self.key = key
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.known_hosts = tmp / f"known_hosts-{rental_id}"
        self.pin(host_key)
        self.tasks: set[asyncio.Task[None]] = set()
        self.accepting = asyncio.get_running_loop().create_task(self._accept())

    def pin(self, host_key: str) -> None:
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {host_key}\n")

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self.listener)
            task = loop.create_task(self.server.serve(self.rental_id, sock))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        self.accepting.cancel()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(self.accepting, *self.tasks, return_exceptions=True)
        self.listener.close()

    def options(self, key: Path | None = None) -> list[str]:
        return [
            "-i", str(key or self.key), "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={self.known_hosts}",
            "-o", "GlobalKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
            "-o", "ConnectTimeout=20", "-F", "/dev/null",
        ]  # fmt: skip

    async def run(self, program: str, *args: str, stdin: bytes = b"", timeout: float = WAIT) -> tuple[int, str, str]:
        child = await asyncio.create_subprocess_exec(
            program, *args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        try:
            async with asyncio.timeout(timeout):
                out, err = await child.communicate(stdin)
        except TimeoutError:
            child.kill()
            await child.wait()
            raise
        assert child.returncode is not None
        return child.returncode, out.decode(errors="replace"), err.decode(errors="replace")

    async def ssh(self, *command: str, key: Path | None = None, extra: tuple[str, ...] = (), stdin: bytes = b"") -> tuple[int, str, str]:
        return await self.run("ssh", *self.options(key), "-p", str(self.port), *extra, "renter@127.0.0.1", *command, stdin=stdin)

    async def scp(self, source: str, target: str) -> tuple[int, str, str]:
        return await self.run("scp", *self.options(), "-P", str(self.port), "-q", source, target)

    async def sftp(self, batch: str) -> tuple[int, str, str]:
        return await self.run("sftp", *self.options(), "-P", str(self.port), "-b", "-", "renter@127.0.0.1", stdin=batch.encode())

    def remote(self, path: str) -> str:
        return f"renter@127.0.0.1:{path}"


@pytest.fixture
def client_keys(tmp_path: Path) -> tuple[Path, str, Path]:
    """The renter's key (path, public line) and a stranger's key."""
    renter, stranger = tmp_path / "renter_key", tmp_path / "stranger_key"
    line = keygen(renter)
    keygen(stranger)
    return renter, line, stranger


@pytest.fixture
def owner() -> str:
    return f"test-{secrets.token_hex(4)}"


@pytest.fixture
async def manager(tmp_path: Path, owner: str, docker_image: str) -> AsyncIterator[WorkloadManager]:
    made = WorkloadManager(
        tmp_path / "work", SimulatedBackend("sim:2xRTX4090", seed="s"), on_exit=Exits(), container=ContainerOptions(owner=owner),
        stop_timeout=1.0, kill_timeout=5.0, check_interval=0.05,
    )
    yield made
    with contextlib.suppress(Exception):
        await made.close(stop_workloads=True)
    dockerengine.remove_owned(owner)


@pytest.fixture
async def sshd(tmp_path: Path, manager: WorkloadManager) -> AsyncIterator[RentalSshServer]:
    server = RentalSshServer(tmp_path / "ssh", manager, login_timeout=20.0)
    yield server
    await server.close()


@pytest.fixture
async def sites(tmp_path: Path, sshd: RentalSshServer, client_keys: tuple[Path, str, Path]) -> AsyncIterator[Callable[[str, str], Site]]:
    made: list[Site] = []

    def make(rental_id: str, host_key: str) -> Site:
        site = Site(tmp_path, sshd, rental_id, host_key, client_keys[0])
        made.append(site)
        return site

    yield make
    for site in made:
        await site.close()


def container_spec(image: str, script: str, **fields: Any) -> ContainerWorkload:
    return ContainerWorkload.model_validate({"image": image, "command": ["sh", "-c", script], **fields})


async def exec_in(manager: WorkloadManager, container: str, *argv: str) -> str:
    """``argv``'s output in the container, run through the engine rather than SSH."""
    execution = await manager.containers.docker().containers.container(container).exec(list(argv))
    async with execution.start(detach=False) as stream:
        output = b""
        while (message := await stream.read_out()) is not None:
            output += message.data
    return output.decode(errors="replace")


class TestContainerSessions:
    """Commands, terminals, logins and forwarding into a running container rental."""

    async def test_commands_terminals_logins_and_forwarding(
        self, manager: WorkloadManager, sshd: RentalSshServer, sites: Callable[[str, str], Site],
        client_keys: tuple[Path, str, Path], docker_image: str, tmp_path: Path,
    ) -> None:
        """A command's output and exit status come back, ``-tt`` gets a terminal, a stranger's key and a wrong
        host key are refused, and ``-L`` reaches busybox httpd in the container."""
        rental = f"s{secrets.token_hex(3)}"
        spec = container_spec(docker_image, "echo hello-from-httpd > /workspace/index.html; exec busybox httpd -f -p 8080 -h /workspace")
        result = await manager.start(rental, [], spec)
        assert result["kind"] == "container"
        host_key = sshd.prepare(rental, [client_keys[1]])
        assert host_key.startswith("ssh-ed25519 ") and len(host_key.split()) == 2
        assert sshd.prepare(rental, [client_keys[1]]) == host_key  # idempotent: the same key
        site = sites(rental, host_key)

        code, out, err = await site.ssh("echo out; echo err >&2; id -u; pwd; exit 7")
        assert code == 7, err
        assert out.split() == ["out", "1000", "/workspace"] and "err" in err

        code, out, _ = await site.ssh("cat", stdin=b"piped through\n")
        assert (code, out) == (0, "piped through\n")  # stdin reaches the command, and its end too

        code, out, err = await site.ssh("busybox tty; exit 3", extra=("-tt",))
        assert code == 3, err
        assert out.strip().startswith("/dev/pts/")

        code, out, err = await site.ssh("true", key=client_keys[2])
        assert code == 255 and "Permission denied" in err

        other = tmp_path / "other_host_key"
        wrong = keygen(other)
        site.pin(wrong)
        code, _, err = await site.ssh("true")
        assert code == 255 and "Host key verification failed" in err
        site.pin(host_key)

        local_port = _free_port()
        forward = await asyncio.create_subprocess_exec(
            "ssh", *site.options(), "-p", str(site.port), "-N", "-o", "ExitOnForwardFailure=yes",
            "-L", f"127.0.0.1:{local_port}:localhost:8080", "renter@127.0.0.1", stderr=subprocess.PIPE,
        )
        try:
            body = await _http_get(local_port)
            assert "hello-from-httpd" in body
        finally:
            forward.terminate()
            await forward.wait()
        code, _, err = await site.ssh(extra=("-W", "192.0.2.1:80"))
        assert code == 255 and "only the rental's container" in err  # nothing but the container is reached
        code, _, err = await site.ssh(extra=("-R", "0:127.0.0.1:22", "-o", "ExitOnForwardFailure=yes", "-N"))
        assert code == 255 and "forwarding failed" in err

    async def test_files_by_scp_and_sftp_also_after_the_workload_exited(
        self, manager: WorkloadManager, sshd: RentalSshServer, sites: Callable[[str, str], Site],
        client_keys: tuple[Path, str, Path], docker_image: str, tmp_path: Path,
    ) -> None:
        """scp round-trips a few MB owned by uid 1000 in the container; a link to /etc/shadow does not leave
        /workspace; after the workload exited, sftp still reaches the files and a shell is refused."""
        rental = f"f{secrets.token_hex(3)}"
        await manager.start(rental, [], container_spec(docker_image, "busybox ln -s /etc/shadow /workspace/escape; busybox ln -s ../../../../../etc /workspace/up; exec sleep 600"))
        site = sites(rental, sshd.prepare(rental, [client_keys[1]]))
        container = resource_name(rental, manager.containers.options.owner)
        payload = os.urandom(3 << 20)
        local = tmp_path / "payload.bin"
        local.write_bytes(payload)

        code, _, err = await site.scp(str(local), site.remote("payload.bin"))
        assert code == 0, err
        assert (await exec_in(manager, container, "stat", "-c", "%u:%g", "/workspace/payload.bin")).strip() == "1000:1000"
        volume = await manager.containers.workspace_path(rental)
        assert volume is not None and (volume / "payload.bin").stat().st_uid == 1000
        code, _, err = await site.scp(site.remote("/workspace/payload.bin"), str(tmp_path / "back.bin"))
        assert code == 0, err
        assert hashlib.sha256((tmp_path / "back.bin").read_bytes()).digest() == hashlib.sha256(payload).digest()
        code, out, _ = await site.ssh("busybox sha256sum payload.bin")
        assert code == 0 and out.split()[0] == hashlib.sha256(payload).hexdigest()

        code, _, err = await site.ssh("busybox ln -s /workspace/payload.bin inside")
        assert code == 0, err
        code, _, err = await site.scp(site.remote("inside"), str(tmp_path / "inside.bin"))
        assert code == 0 and (tmp_path / "inside.bin").read_bytes() == payload, err  # a link inside /workspace is followed
        for hostile in ("escape", "up/shadow", "/workspace/up/passwd", "../../etc/passwd"):
            code, _, err = await site.scp(site.remote(hostile), str(tmp_path / "stolen"))
            assert code != 0, f"{hostile} was read: {err}"
        assert not (tmp_path / "stolen").exists()

        await manager.stop(rental, timeout=0)
        code, out, err = await site.sftp("ls /workspace\nget payload.bin " + str(tmp_path / "after.bin") + "\nmkdir made\n")
        assert code == 0, err
        assert "payload.bin" in out and (tmp_path / "after.bin").read_bytes() == payload
        code, _, err = await site.ssh("true")
        assert code == 1 and EXITED in err
        await sshd.close_rental(rental)

    async def test_a_hold_rental_and_an_unknown_rental_are_refused(
        self, manager: WorkloadManager, sshd: RentalSshServer, sites: Callable[[str, str], Site], client_keys: tuple[Path, str, Path],
    ) -> None:
        """A hold rental's login works but its session is refused with one line; an unknown rental's socket is closed."""
        rental = f"h{secrets.token_hex(3)}"
        await manager.start(rental, [], HoldWorkload())
        site = sites(rental, sshd.prepare(rental, [client_keys[1]]))
        code, _, err = await site.ssh("true")
        assert code == 255 and f"rental {rental} runs nothing to log into (a hold rental)" in err
        assert not sshd.knows("nobody-here")
        stranger = sites("nobody-here", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl")
        code, _, err = await stranger.ssh("true")
        assert code == 255

    async def test_the_host_key_survives_a_restart_and_forget_drops_it(
        self, tmp_path: Path, manager: WorkloadManager, client_keys: tuple[Path, str, Path],
    ) -> None:
        """A new server over the same folder serves the same host key and keys; ``forget`` removes both."""
        first = RentalSshServer(tmp_path / "keys", manager)
        host_key = first.prepare("r-1", [client_keys[1]], kind="container")
        key_file = tmp_path / "keys" / "r-1" / "host_key"
        assert key_file.stat().st_mode & 0o777 == 0o600
        second = RentalSshServer(tmp_path / "keys", manager)
        assert second.knows("r-1") and second.prepare("r-1", [client_keys[1]]) == host_key
        assert second.kind_of("r-1") == "container" and len(second.authorized("r-1")) == 1
        second.forget("r-1")
        assert not second.knows("r-1") and not key_file.exists()


class TestLiveAccess:
    """Access follows the account live (issue 35): ``update_access`` replaces a running rental's keys."""

    async def test_a_removed_key_is_refused_and_its_open_session_closed_while_other_keys_work(
        self, manager: WorkloadManager, sshd: RentalSshServer, sites: Callable[[str, str], Site],
        client_keys: tuple[Path, str, Path], docker_image: str, tmp_path: Path,
    ) -> None:
        """Regression for "a deleted SSH key keeps working": after an update without key A, A's open shell is
        disconnected and A's new logins are refused, the renter's other key B still logs in, a key C added while the
        rental runs logs in, and an older list (A again, version 2 after 3) arriving late changes nothing."""
        rental = f"a{secrets.token_hex(3)}"
        assert (await manager.start(rental, [], container_spec(docker_image, "exec sleep 3600")))["kind"] == "container"
        key_a, line_a, _ = client_keys
        key_b, key_c = tmp_path / "second_key", tmp_path / "added_key"
        line_b, line_c = keygen(key_b), keygen(key_c)
        site = sites(rental, sshd.prepare(rental, [line_a, line_b], version=1))

        shell = await asyncio.create_subprocess_exec(
            "ssh", *site.options(key_a), "-p", str(site.port), "renter@127.0.0.1", "echo logged-in; exec sleep 600",
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            assert shell.stdout is not None and shell.stderr is not None
            async with asyncio.timeout(WAIT):
                assert (await shell.stdout.readline()).strip() == b"logged-in"
            # B logs in too, and holds a connection with no session (ssh -N) through the change.
            code, out, err = await site.ssh("echo b-works", key=key_b)
            assert (code, out.strip()) == (0, "b-works"), err

            updated = sshd.update_access(rental, [line_b], version=2)
            assert (updated.applied, updated.version, updated.closed) == (True, 2, 1)
            async with asyncio.timeout(WAIT):  # the shell ends: the agent disconnected it (the reason is best effort)
                assert await shell.wait() == 255
        finally:
            if shell.returncode is None:
                shell.kill()
                await shell.wait()
        code, _, err = await site.ssh("true", key=key_a)
        assert code == 255 and "Permission denied" in err, err
        code, out, err = await site.ssh("echo b-works", key=key_b)
        assert (code, out.strip()) == (0, "b-works"), err

        code, _, err = await site.ssh("true", key=key_c)
        assert code == 255 and "Permission denied" in err, err
        added = sshd.update_access(rental, [line_b, line_c], version=3)
        assert (added.applied, added.closed) == (True, 0)
        code, out, err = await site.ssh("echo c-works", key=key_c)
        assert (code, out.strip()) == (0, "c-works"), err

        late = sshd.update_access(rental, [line_a], version=2)
        assert (late.applied, late.version) == (False, 3)
        code, _, err = await site.ssh("true", key=key_a)
        assert code == 255 and "Permission denied" in err, err
        code, out, err = await site.ssh("echo c-works", key=key_c)
        assert (code, out.strip()) == (0, "c-works"), err

    async def test_an_empty_list_closes_a_connection_without_a_session(
        self, manager: WorkloadManager, sshd: RentalSshServer, sites: Callable[[str, str], Site], client_keys: tuple[Path, str, Path],
    ) -> None:
        """A disabled account's empty list disconnects even ``ssh -N`` (a login that holds forwards, no session)."""
        rental = f"n{secrets.token_hex(3)}"
        await manager.start(rental, [], HoldWorkload())
        site = sites(rental, sshd.prepare(rental, [client_keys[1]], version=4))
        held = await asyncio.create_subprocess_exec(
            "ssh", *site.options(), "-N", "-p", str(site.port), "renter@127.0.0.1",
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            await eventually(lambda: _logged_in(sshd, rental), timeout=WAIT, what="the ssh -N login")
            assert len(sshd.logged_in(rental)) == 1
            assert sshd.update_access(rental, [], version=5).closed == 1
            async with asyncio.timeout(WAIT):
                assert await held.wait() == 255
        finally:
            if held.returncode is None:
                held.kill()
                await held.wait()
        assert sshd.authorized(rental) == set()
        code, _, err = await site.ssh("true")
        assert code == 255 and "Permission denied" in err, err


async def _logged_in(server: RentalSshServer, rental_id: str) -> bool:
    return bool(server.logged_in(rental_id))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def _http_get(port: int) -> str:
    """GET / through the forward, retried while ssh sets the forward up."""
    deadline = asyncio.get_running_loop().time() + WAIT
    while True:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /index.html HTTP/1.0\r\nHost: x\r\n\r\n")
            await writer.drain()
            data = await asyncio.wait_for(reader.read(), WAIT)
            writer.close()
            if data:
                return data.decode(errors="replace")
        except (OSError, TimeoutError):
            pass
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"nothing answered through the forward on port {port}")
        await asyncio.sleep(0.1)


def ssh_executor(tmp_path: Path, manager: WorkloadManager, server: RentalSshServer) -> CommandExecutor:
    """The agent's command executor over ``manager`` and ``server``, with nothing else it could be asked to do."""

    async def send(body: protocol.WorkloadLogsBody) -> None:
        pass

    async def unused(*args: Any) -> Any:
        raise AssertionError("not called")

    return CommandExecutor(
        workloads=manager, backend=manager.backend, logs=LogShipper(tmp_path, manager, send), measure=unused, install_certificate=unused, ssh=server,
    )


class TestCommands:
    """The agent's commands carry SSH: a start returns the rental's host key, a bad key fails it first."""

    async def test_a_start_returns_the_host_key_and_a_bad_key_fails_the_start(self, tmp_path: Path, client_keys: tuple[Path, str, Path]) -> None:
        """``start_workload`` with the renter's keys answers ``ssh_host_key`` (the same on a resend); a key that is
        not an OpenSSH public key fails the start before the workload runs; a stop and a release end SSH."""
        backend = SimulatedBackend("sim:1xRTX4090", seed="k")
        manager = WorkloadManager(tmp_path / "work", backend)
        server = RentalSshServer(tmp_path / "ssh", manager)
        executor = ssh_executor(tmp_path, manager, server)
        try:
            start = protocol.StartWorkload(rental_id="r-cmd", gpu_uuids=[], workload=HoldWorkload(), authorized_keys=[client_keys[1]])
            result = await executor.execute(protocol.CommandBody.of("c-1", start))
            assert result.ok, result.detail
            host_key = result.data["ssh_host_key"]
            assert host_key.startswith("ssh-ed25519 ") and server.knows("r-cmd") and server.kind_of("r-cmd") == "hold"
            again = await executor.execute(protocol.CommandBody.of("c-2", start))
            assert again.ok and again.data["ssh_host_key"] == host_key

            bad = protocol.StartWorkload(rental_id="r-bad", gpu_uuids=[], workload=HoldWorkload(), authorized_keys=["ssh-ed25519 not-base64"])
            refused = await executor.execute(protocol.CommandBody.of("c-3", bad))
            assert not refused.ok and refused.data["code"] == "bad_authorized_key" and "r-bad" not in manager.running()

            stopped = await executor.execute(protocol.CommandBody.of("c-4", protocol.StopWorkload(rental_id="r-cmd")))
            assert stopped.ok and not server.knows("r-cmd")  # a stop releases the rental: no more SSH
        finally:
            await server.close()
            await manager.close()


    async def test_update_access_is_ordered_idempotent_and_kept_for_a_start_still_running(
        self, tmp_path: Path, client_keys: tuple[Path, str, Path]
    ) -> None:
        """``update_access`` older than the held version changes nothing, a resent id is answered again without
        running, and a list that comes while the rental's start still runs wins over the start's older list."""
        backend = SimulatedBackend("sim:1xRTX4090", seed="k")
        manager = WorkloadManager(tmp_path / "work", backend)
        server = RentalSshServer(tmp_path / "ssh", manager)
        line_a, line_b = client_keys[1], keygen(tmp_path / "second_key")
        blob_a, blob_b = (asyncssh.import_public_key(line).public_data for line in (line_a, line_b))
        executor = ssh_executor(tmp_path, manager, server)
        try:
            start = protocol.StartWorkload(rental_id="r-acc", gpu_uuids=[], authorized_keys=[line_a], access_version=5)
            assert (await executor.result_for(protocol.CommandBody.of("c-1", start))).ok
            older = protocol.UpdateAccess(rental_id="r-acc", authorized_keys=[line_b], version=4)
            result = await executor.result_for(protocol.CommandBody.of("u-1", older))
            assert result.ok and result.data == {"applied": False, "version": 5, "known": True, "closed": 0}
            assert server.authorized("r-acc") == {blob_a}
            newer = protocol.CommandBody.of("u-2", protocol.UpdateAccess(rental_id="r-acc", authorized_keys=[line_b], version=6))
            assert (await executor.result_for(newer)).data["applied"] and server.authorized("r-acc") == {blob_b}
            server.update_access("r-acc", [line_a], version=7)
            again = await executor.result_for(newer)  # the same id resent: its result, not a second run
            assert again.data["applied"] and server.authorized("r-acc") == {blob_a}

            early = protocol.UpdateAccess(rental_id="r-late", authorized_keys=[line_b], version=8)
            kept = await executor.result_for(protocol.CommandBody.of("u-3", early))
            assert kept.ok and kept.data["known"] is False
            late_start = protocol.StartWorkload(rental_id="r-late", gpu_uuids=[], authorized_keys=[line_a], access_version=7)
            assert (await executor.result_for(protocol.CommandBody.of("c-2", late_start))).ok
            assert server.authorized("r-late") == {blob_b}

            bad = protocol.UpdateAccess(rental_id="r-acc", authorized_keys=["ssh-ed25519 not-base64"], version=9)
            refused = await executor.result_for(protocol.CommandBody.of("u-4", bad))
            assert not refused.ok and refused.data["code"] == "bad_authorized_key" and server.authorized("r-acc") == {blob_a}
        finally:
            await server.close()
            await manager.close()


class TestProcessSessions:
    """A process rental's sessions run under its own uid, in its home, in namespaces of their own."""

    @pytest.mark.skipif(os.geteuid() != 0 or isinstance(TOOLS, str), reason="per-rental users need root, unshare and setpriv")
    async def test_a_shell_and_files_as_the_rentals_user(
        self, tmp_path: Path, cgroups: CgroupLimiter, client_keys: tuple[Path, str, Path], sites: Callable[[str, str], Site],
    ) -> None:
        """A command and a PTY run as the rental's uid in its home; scp'd files belong to it; once the workload
        is stopped a shell is refused."""
        assert not isinstance(TOOLS, str)
        base = Path(f"/tmp/gpumarket-ssh-{secrets.token_hex(4)}")
        base.mkdir(mode=0o755)
        try:
            users = RentalUsers(base / "rentals", TOOLS, uid_min=(first := 3_500_000 + secrets.randbelow(1000) * 100), uid_max=first + 99)
            users.prepare()
            facts = isolation_facts(process_isolation(euid=0, tools=TOOLS), container_engine=None, allow_unisolated=False)
            manager = WorkloadManager(
                base / "work", SimulatedBackend("sim:1xRTX4090", seed="p"), cgroups=cgroups, rental_users=users, isolation=facts,
                stop_timeout=1.0, kill_timeout=2.0, check_interval=0.02,
            )
            server = RentalSshServer(base / "ssh", manager)
            try:
                rental = f"p{secrets.token_hex(3)}"
                await manager.start(rental, [], ProcessWorkload(argv=["/bin/sh", "-c", "echo hi > from-workload; exec sleep 600"], memory_mib=256))
                user = users.lookup(rental)
                assert user is not None
                site = Site(tmp_path, server, rental, server.prepare(rental, [client_keys[1]]), client_keys[0])
                try:
                    access = manager.access(rental)
                    assert access is not None and access.running and access.uid == user.uid
                    code, out, err = await site.ssh("id -u; pwd; cat from-workload; echo $HOME; exit 4")
                    assert code == 4, err
                    assert out.split() == [str(user.uid), str(user.home), "hi", str(user.home)]
                    if access.cgroup_dirs:  # the session is held to the workload's limits
                        code, out, err = await site.ssh("cat /proc/self/cgroup")
                        assert code == 0 and access.cgroup_dirs[0].name in out, err
                    # The session shares its rental's network namespace: its own loopback, never the host's PostgreSQL.
                    code, out, err = await site.ssh(f"readlink /proc/self/ns/net; {SYSTEM_PYTHON} -c {shlex.quote(LOOPBACK_PROBE)}")
                    assert code == 0, err
                    namespace, answer = out.split()
                    assert namespace == f"net:[{os.stat(netns_path(user.uid)).st_ino}]" != os.readlink("/proc/self/ns/net")
                    assert answer == "refused", out
                    code, out, err = await site.ssh("tty; exit 2", extra=("-tt",))
                    assert code == 2 and out.strip().startswith("/dev/pts/"), err
                    (tmp_path / "up.txt").write_bytes(b"uploaded\n")
                    code, _, err = await site.scp(str(tmp_path / "up.txt"), site.remote("up.txt"))
                    assert code == 0, err
                    assert (user.home / "up.txt").stat().st_uid == user.uid
                    code, out, _ = await site.ssh("cat up.txt; cat", stdin=b"piped\n")
                    assert (code, out) == (0, "uploaded\npiped\n")
                    await manager.stop(rental, timeout=0)
                    await server.close_rental(rental)
                    code, _, err = await site.ssh("true")
                    assert code == 1 and EXITED in err
                    code, _, err = await site.sftp("ls\n")
                    assert code != 0 and "home is gone" in err  # a process rental's home goes with its workload
                finally:
                    await site.close()
            finally:
                await server.close()
                await manager.close(stop_workloads=True)
        finally:
            shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize(("name", "value"), [("login_timeout", 0.0), ("max_connections_per_rental", 2000), ("keepalive_count_max", 0)])
def test_an_ssh_setting_out_of_bounds_is_refused_by_name(tmp_path: Path, name: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"SSH setting {name}={value!r} must lie between"):
        RentalSshServer(tmp_path / "ssh", workloads=None, **{name: value})  # type: ignore[arg-type]
