"""Pulling a rental's image from a private registry with the renter's login, through the real container runtime.

A real registry (Debian's ``docker-registry``, the Distribution registry) on loopback with htpasswd (bcrypt) auth,
started per module from a ``config.yml`` under a temporary folder; the locally built busybox test image is pushed into
it and removed from the engine, so each start pulls. The engine allows plain HTTP to 127.0.0.0/8 registries.
"""

from __future__ import annotations

import base64
import contextlib
import json
import secrets
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from agent.gpu.sim import SimulatedBackend
from agent.runtimes.containeropts import ContainerOptions
from agent.runtimes.manager import WorkloadManager
from agent.runtimes.registry_login import SealedLogin
from agent.state import AgentState
from master.services.market import Owner, owner_of
from shared.crypto import generate_private_key, sealed_to, write_private_key
from shared.errors import BadRequest
from shared.protocol import ContainerWorkload, RegistryAuth, registry_auth_context
from tests import dockerengine
from tests.workloadfixtures import Exits

USER, PASSWORD = "robot", "right-password-" + secrets.token_hex(4)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``127.0.0.1:<port>`` of a running registry that wants ``USER``/``PASSWORD``; fails, never skips, without one."""
    binary, htpasswd = shutil.which("docker-registry"), shutil.which("htpasswd")
    if binary is None or htpasswd is None:
        pytest.fail(
            "docker-registry or htpasswd is missing: install Debian's docker-registry and apache2-utils (make docker)"
        )
    folder = tmp_path_factory.mktemp("registry")
    (folder / "htpasswd").write_text(
        subprocess.run([htpasswd, "-Bbn", USER, PASSWORD], check=True, capture_output=True, text=True).stdout
    )
    port = _free_port()
    (folder / "config.yml").write_text(
        "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: " + str(folder / "data") + "\n"
        "http:\n  addr: 127.0.0.1:" + str(port) + "\n"
        "auth:\n  htpasswd:\n    realm: gpumarket-test\n    path: " + str(folder / "htpasswd") + "\n"
    )  # fmt: skip
    with open(folder / "registry.log", "wb") as log:
        process = subprocess.Popen(
            [binary, "serve", str(folder / "config.yml")], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1)
            except urllib.error.HTTPError as exc:
                if exc.code == 401:
                    break  # up, and asking for a login
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"docker-registry did not start: {(folder / 'registry.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)


def _auth_header(server: str) -> dict[str, str]:
    login = json.dumps({"username": USER, "password": PASSWORD, "serveraddress": server}).encode()
    return {"X-Registry-Auth": base64.urlsafe_b64encode(login).decode()}


@pytest.fixture(scope="module")
def private_image(registry: str, docker_image: str) -> Iterator[str]:
    """The busybox test image pushed to the registry as ``<registry>/private/busybox:<tag>``, gone from the engine."""
    repo, tag = f"{registry}/private/busybox", secrets.token_hex(4)
    status, body = dockerengine.request(
        "POST", f"/images/{quote(docker_image, safe='')}/tag?repo={quote(repo, safe='')}&tag={tag}"
    )
    assert status == 201, body
    status, body = dockerengine.request(
        "POST", f"/images/{quote(repo, safe='')}/push?tag={tag}", headers=_auth_header(registry), timeout=120
    )
    assert status == 200 and b'"error"' not in body, body
    yield f"{repo}:{tag}"
    dockerengine.request("DELETE", f"/images/{quote(f'{repo}:{tag}', safe='')}")


def _forget(image: str) -> None:
    dockerengine.request("DELETE", f"/images/{quote(image, safe='')}")


@pytest.fixture
async def manager(tmp_path: Path, docker_image: str) -> AsyncIterator[WorkloadManager]:
    owner = f"test-{secrets.token_hex(4)}"
    made = WorkloadManager(tmp_path / "work", SimulatedBackend("sim:2xRTX4090", seed="r"), on_exit=Exits(),
                           container=ContainerOptions(owner=owner), stop_timeout=2.0, kill_timeout=5.0, check_interval=0.05)  # fmt: skip
    yield made
    with contextlib.suppress(Exception):
        await made.close(stop_workloads=True)
    dockerengine.remove_owned(owner)


HOST_ID = "h-registry-test"


@pytest.fixture
def host_keys(tmp_path: Path) -> AgentState:
    """An agent's data dir holding the host's key, as enrollment leaves it."""
    state = AgentState(tmp_path / "agent")
    write_private_key(state.key_file, generate_private_key())
    return state


def _sealed(auth: RegistryAuth, state: AgentState, command_id: str, *, to: AgentState | None = None) -> SealedLogin:
    """``auth`` as the master sends it: sealed to the key of ``to`` (default: this host), for ``command_id``."""
    recipient = (to or state).opening_keys()[0].public_key()
    token = sealed_to.seal_to(recipient, auth.model_dump_json().encode(), registry_auth_context(HOST_ID, command_id))
    return SealedLogin(token, HOST_ID, command_id, state.opening_keys)


def _gpu(manager: WorkloadManager) -> list[str]:
    return [manager.backend.gpus()[0].uuid]


class TestPrivatePull:
    async def test_the_right_login_pulls_and_starts_and_nothing_keeps_it(
        self, manager: WorkloadManager, private_image: str, registry: str, tmp_path: Path, host_keys: AgentState
    ) -> None:
        """The login sealed to the host's key opens there, at pull time, and the pull with it succeeds."""
        _forget(private_image)
        auth = RegistryAuth(server=registry, username=USER, password=PASSWORD)
        result = await manager.start(
            "rpriv1",
            _gpu(manager),
            ContainerWorkload(image=private_image, command=["sleep", "30"]),
            registry_auth=_sealed(auth, host_keys, "cmd-1"),
        )
        assert result["kind"] == "container" and result["image"] == private_image
        assert manager.running() == ["rpriv1"]
        for path in (tmp_path / "work").rglob(
            "*"
        ):  # the agent's files: the registry, logs, the rental's folder
            if path.is_file():
                assert PASSWORD.encode() not in path.read_bytes(), path
        status, body = dockerengine.request("GET", f"/containers/{result['container']}/json")
        assert status == 200 and PASSWORD.encode() not in body

    @pytest.mark.parametrize("password", ["wrong-password", None])
    async def test_a_wrong_or_missing_login_fails_as_the_renters_with_the_registrys_reason(
        self, manager: WorkloadManager, private_image: str, registry: str, password: str | None, host_keys: AgentState
    ) -> None:
        _forget(private_image)
        login = RegistryAuth(server=registry, username=USER, password=password or "unused")
        auth = None if password is None else _sealed(login, host_keys, "cmd-2")
        with pytest.raises(BadRequest) as refused:
            await manager.start(
                "rpriv2", _gpu(manager), ContainerWorkload(image=private_image), registry_auth=auth
            )
        assert refused.value.code == "registry_auth_failed", refused.value.message
        assert private_image in refused.value.message and (
            "unauthorized" in refused.value.message.lower() or "auth" in refused.value.message.lower()
        )
        assert "wrong-password" not in refused.value.message and manager.running() == []
        assert owner_of(refused.value.code) == Owner.RENTER

    async def test_a_login_sealed_to_another_key_fails_as_the_platforms_before_the_registry_is_asked(
        self, manager: WorkloadManager, private_image: str, registry: str, tmp_path: Path, host_keys: AgentState
    ) -> None:
        """A token this host cannot open (another host's key) is ``registry_auth_unreadable``: not the renter's."""
        _forget(private_image)
        other = AgentState(tmp_path / "other")
        write_private_key(other.key_file, generate_private_key())
        auth = _sealed(RegistryAuth(server=registry, username=USER, password=PASSWORD), host_keys, "cmd-3", to=other)
        with pytest.raises(BadRequest) as refused:
            await manager.start("rpriv3", _gpu(manager), ContainerWorkload(image=private_image), registry_auth=auth)
        assert refused.value.code == "registry_auth_unreadable" and PASSWORD not in refused.value.message
        assert owner_of(refused.value.code) == Owner.PLATFORM and manager.running() == []


class TestSealedLogin:
    """The agent's side of a sealed login, without an engine: which keys open it, and what it never says."""

    LOGIN = RegistryAuth(server="registry.example.com:5000", username=USER, password=PASSWORD)

    def test_it_opens_with_the_hosts_key_for_its_own_command_only(self, host_keys: AgentState) -> None:
        login = _sealed(self.LOGIN, host_keys, "cmd-1")
        assert login.open() == self.LOGIN and PASSWORD not in repr(login) and login.token not in repr(login)
        moved = SealedLogin(login.token, HOST_ID, "cmd-2", host_keys.opening_keys)
        with pytest.raises(BadRequest) as refused:
            moved.open()
        assert refused.value.code == "registry_auth_unreadable"
        elsewhere = SealedLogin(login.token, "h-other", "cmd-1", host_keys.opening_keys)
        with pytest.raises(BadRequest):
            elsewhere.open()

    def test_a_renewal_in_flight_keeps_it_opening(self, host_keys: AgentState) -> None:
        """Sealed to a renewed certificate's key before the agent installed it (``key.next.pem``), or to the key the
        last renewal replaced (``key.prev.pem``), it still opens."""
        pending = AgentState(host_keys.dir / "pending")
        write_private_key(pending.key_file, generate_private_key())
        to_next = _sealed(self.LOGIN, host_keys, "cmd-1", to=pending)
        with pytest.raises(BadRequest):
            to_next.open()
        host_keys.next_key_file.write_bytes(pending.key_file.read_bytes())
        assert to_next.open() == self.LOGIN
        host_keys.next_key_file.unlink()
        host_keys.previous_key_file.write_bytes(pending.key_file.read_bytes())
        assert to_next.open() == self.LOGIN

    def test_an_altered_token_does_not_open(self, host_keys: AgentState) -> None:
        login = _sealed(self.LOGIN, host_keys, "cmd-1")
        flipped = login.token[:-2] + ("A" if login.token[-2] != "A" else "B") + login.token[-1]
        with pytest.raises(BadRequest) as refused:
            SealedLogin(flipped, HOST_ID, "cmd-1", host_keys.opening_keys).open()
        assert refused.value.code == "registry_auth_unreadable" and PASSWORD not in str(refused.value)
