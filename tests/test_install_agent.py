"""The provider agent installer (``deploy/install-agent.sh``) and the master's downloads it uses.

``TestDownloads`` drives the master's app in process (SQLite; the downloads touch no database).
``TestInstaller`` runs ``gpumarket up`` as a process (no simulated hosts of its own) and the real
installer against it with ``--no-systemd`` into temporary prefixes: the package comes from the
master's ``GET /downloads/agent``, and pip installs its dependencies from this machine's index and
cache, which is most of this module's time.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
import zipfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from master.app import close_master, create_app, open_master
from master.context import Master
from master.services.hosts import enrollment
from master.services.hosts.agent_package import AgentPackages, copy_sources
from shared.bus import InProcessBus
from shared.errors import NotFound
from shared.registry import RelayRecord
from tests.factories import create_principal, master_settings
from tests.upprocess import gpumarket_up, wait_for_credentials

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
INSTALLER = ROOT / "deploy" / "install-agent.sh"
SHELLCHECK = Path(sys.executable).with_name("shellcheck")
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
WHEEL_NAME = re.compile(r"^gpumarket-[0-9][A-Za-z0-9_.+]*-py3-none-any\.whl$")
START_S = 60.0  # gpumarket up ready
ONLINE_S = 60.0  # an installed agent's host online
INSTALL_S = 300.0  # one installer run (pip installs every dependency on a first install)


def _driver_present() -> bool:
    if shutil.which("nvidia-smi"):
        return True
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        listing = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return False
    return "libnvidia-ml.so.1" in listing


def _clean_env() -> dict[str, str]:
    """This environment without GPUMARKET_* settings (a developer's database URL must not leak in)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("GPUMARKET_")}


# The installer's pip writes no byte code here: compiling every module of every dependency was half of each install's
# CPU (40 of 75 s on a loaded machine), and what these tests check is the installer, not pip's byte code. (A provider's
# install compiles as usual; the agent started here compiles what it imports, as root, into the venv.) And while the
# module's market runs, pip takes the dependencies from a folder of exactly their wheels (one built from an sdist too) (``market``): finding them in
# this machine's package index took ~14 s of CPU per install, on a provider's machine it is PyPI's.
INSTALLER_ENV = {"PIP_COMPILE": "false"}


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, env=_clean_env() | INSTALLER_ENV, timeout=INSTALL_S, stdin=subprocess.DEVNULL,
        check=False,
    )  # fmt: skip


def _run_installer(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """deploy/install-agent.sh from the checkout."""
    return _run(["sh", str(INSTALLER), *map(str, args)])


def _run_one_liner(command: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """The console's `curl … | sh -s -- …` command, with more options appended."""
    return _run(["sh", "-c", f"{command} {shlex.join(map(str, args))}"])


def _host_id(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"installer failed ({result.returncode}):\n{result.stdout}\n{result.stderr[-4000:]}"
    match = re.search(r"^host id: (\S+)$", result.stdout, re.MULTILINE)
    assert match, result.stdout
    return match.group(1)


# ---- the script itself ------------------------------------------------------------------


class TestScript:
    def test_passes_shellcheck_as_posix_sh(self) -> None:
        """shellcheck finds nothing in the installer, checked as POSIX sh."""
        assert SHELLCHECK.exists(), f"{SHELLCHECK} is missing: install the test extras (pip install -e '.[test]')"
        result = subprocess.run([str(SHELLCHECK), "-s", "sh", str(INSTALLER)], capture_output=True, text=True, check=False)
        assert result.returncode == 0 and not result.stdout, result.stdout + result.stderr

    def test_deploy_path_is_the_packaged_script(self) -> None:
        """deploy/install-agent.sh is the master's packaged script itself, so the two cannot drift apart."""
        packaged = ROOT / "master" / "data" / "install-agent.sh"
        assert INSTALLER.resolve() == packaged.resolve() and not packaged.is_symlink()

    @pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
    def test_rendered_unit_passes_systemd_analyze_verify(self, tmp_path: Path) -> None:
        """The unit the installer would write is valid for systemd and carries the hardening it promises."""
        prefix = tmp_path / "agent"
        (prefix / "bin").mkdir(parents=True)
        # systemd-analyze checks that ExecStart is executable: any program stands in for the wrapper.
        (prefix / "bin" / "gpumarket-agent").symlink_to("/bin/true")
        (prefix / "venv" / "bin").mkdir(parents=True)
        (prefix / "venv" / "bin" / "gpumarket").symlink_to("/bin/true")
        result = _run_installer("--print-unit", "--prefix", prefix, "--user", "gm-test")
        assert result.returncode == 0, result.stderr
        unit = result.stdout
        lines = set(unit.splitlines())
        assert {
            f"ExecStart={prefix}/bin/gpumarket-agent", "User=gm-test", "Restart=on-failure", "KillMode=process",
            "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
            "StateDirectory=gpumarket-agent", "WantedBy=multi-user.target",
            # the rentals' firewall with the agent's egress policy, as root before the (non-root) agent starts
            f"ExecStartPre=-+{prefix}/venv/bin/gpumarket agent netguard --config {prefix}/etc/agent.toml",
        } <= lines  # fmt: skip
        has_docker_group = subprocess.run(["getent", "group", "docker"], capture_output=True, check=False).returncode == 0
        assert ("SupplementaryGroups=docker" in lines) == has_docker_group
        unit_file = tmp_path / "gpumarket-agent.service"
        unit_file.write_text(unit)
        assert SYSTEMD_ANALYZE is not None
        verify = subprocess.run([SYSTEMD_ANALYZE, "verify", str(unit_file)], capture_output=True, text=True, check=False)
        assert verify.returncode == 0 and not verify.stdout.strip() and not verify.stderr.strip(), verify.stdout + verify.stderr

    def test_refuses_unknown_options_and_bad_values_before_touching_anything(self, tmp_path: Path) -> None:
        """Typos and bad values stop the installer with a message naming the option; nothing is created."""
        prefix = tmp_path / "agent"
        cases = {
            ("--master", "http://127.0.0.1:1", "--token", "t", "--frobnicate"): "unknown option '--frobnicate'",
            ("--token", "t"): "--master URL is required",
            ("--master", "ftp://x", "--token", "t"): "--master must be an http:// or https:// URL",
            ("--master", "http://127.0.0.1:1", "--token", "t", "--gpus", "cuda"): "--gpus must be nvml, sim:",
            ("--master", "http://127.0.0.1:1", "--token"): "--token needs a value",
            ("--master", "http://127.0.0.1:1", "--token", "--gpus", "sim:1xT4"): "--token needs a value, not the option '--gpus'",
            ("--master", "http://127.0.0.1:1", "--gpus", "sim:1xT4"): "--token TOKEN is required",
        }
        for args, message in cases.items():
            result = _run_installer("--prefix", prefix, "--no-systemd", *args)
            assert result.returncode != 0, args
            assert message in result.stderr, (args, result.stderr)
            assert not prefix.exists(), args

    @pytest.mark.skipif(_driver_present(), reason="this machine has an NVIDIA driver")
    def test_nvml_without_a_driver_says_how_to_fix_it(self, tmp_path: Path) -> None:
        """--gpus nvml (the default) on a host without the NVIDIA driver fails, saying to install it or simulate GPUs."""
        result = _run_installer("--master", "http://127.0.0.1:1", "--token", "t", "--prefix", tmp_path / "agent", "--no-systemd")
        assert result.returncode != 0
        assert "no NVIDIA driver found" in result.stderr and "install the NVIDIA driver" in result.stderr
        assert "--gpus sim:" in result.stderr
        assert not (tmp_path / "agent").exists()


# ---- GET /downloads/... in process ------------------------------------------------------

@dataclass(frozen=True)
class Served:
    master: Master
    client: TestClient[Any, Any]


Serve = Callable[..., Awaitable[Served]]


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Serve]:
    """Start a master app (SQLite, no background loops) with the given settings; closed at the end."""
    opened: list[Served] = []

    async def start(**settings: Any) -> Served:
        folder = tmp_path / f"master-{len(opened)}"
        master = await open_master(
            master_settings(folder, database_url=f"sqlite:///{folder / 'test.db'}", **settings), bus=InProcessBus()
        )
        client: TestClient[Any, Any] = TestClient(TestServer(create_app(master, background=False)))
        await client.start_server()
        opened.append(Served(master, client))
        return opened[-1]

    yield start
    for served in reversed(opened):
        await served.client.close()
        await close_master(served.master)


def _fake_wheel(path: Path, content: bytes, *, mtime: float | None = None) -> Path:
    path.write_bytes(content)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


class TestDownloads:
    async def test_checkout_master_builds_and_serves_a_valid_wheel(self, serve: Serve) -> None:
        """Unset agent_package on a source checkout: the wheel is built once and served with its name and sha256."""
        served = await serve()
        client = served.client
        async with client.get("/downloads/agent") as response:
            assert response.status == 200, await response.text()
            body = await response.read()
            headers = response.headers
        name = headers["X-Gpumarket-Package"]
        assert WHEEL_NAME.match(name), name
        assert headers["Content-Disposition"] == f'attachment; filename="{name}"'
        assert headers["X-Gpumarket-Sha256"] == hashlib.sha256(body).hexdigest()
        wheel = zipfile.ZipFile(io.BytesIO(body))
        names = set(wheel.namelist())
        assert {"gpumarket/cli.py", "agent/enroll.py", "agent/runner.py", "shared/settings.py", "master/app.py"} <= names
        assert wheel.read("master/data/install-agent.sh") == INSTALLER.read_bytes()
        [metadata] = [n for n in names if re.fullmatch(r"gpumarket-[^/]+\.dist-info/METADATA", n)]
        assert "\nName: gpumarket\n" in wheel.read(metadata).decode()

        async with client.head("/downloads/agent") as response:
            assert response.status == 200
            assert await response.read() == b""
            assert response.headers["X-Gpumarket-Sha256"] == headers["X-Gpumarket-Sha256"]
            assert int(response.headers["Content-Length"]) == len(body)
        async with client.get("/downloads/agent") as response:
            assert await response.read() == body  # the same build, not a new one
        assert len(list((served.master.settings.data_dir / "downloads").glob("agent-*"))) == 1

    async def test_configured_wheel_file_is_served_as_is(self, serve: Serve, tmp_path: Path) -> None:
        """agent_package naming a wheel file serves exactly that file, without an API key."""
        wheel = _fake_wheel(tmp_path / "gpumarket-9.9.9-py3-none-any.whl", b"PK wheel bytes")
        client = (await serve(agent_package=wheel)).client
        async with client.get("/downloads/agent") as response:
            assert response.status == 200
            assert await response.read() == b"PK wheel bytes"
            assert response.headers["X-Gpumarket-Package"] == wheel.name
            assert response.headers["X-Gpumarket-Sha256"] == hashlib.sha256(b"PK wheel bytes").hexdigest()

    async def test_configured_folder_serves_its_newest_gpumarket_wheel(self, serve: Serve, tmp_path: Path) -> None:
        """agent_package naming a folder serves its newest gpumarket-*.whl and ignores other files."""
        dist = tmp_path / "dist"
        dist.mkdir()
        now = time.time()
        _fake_wheel(dist / "gpumarket-0.1.0-py3-none-any.whl", b"old", mtime=now - 3600)
        _fake_wheel(dist / "gpumarket-0.2.0-py3-none-any.whl", b"new", mtime=now - 60)
        _fake_wheel(dist / "othertool-9.0-py3-none-any.whl", b"other", mtime=now)
        client = (await serve(agent_package=dist)).client
        async with client.get("/downloads/agent") as response:
            assert response.status == 200
            assert await response.read() == b"new"
            assert response.headers["X-Gpumarket-Package"] == "gpumarket-0.2.0-py3-none-any.whl"

    async def test_missing_package_is_404_agent_package_unavailable(self, serve: Serve, tmp_path: Path) -> None:
        """A missing file, an empty folder or a file that is no gpumarket wheel answer 404 with a stable code."""
        (tmp_path / "empty").mkdir()
        _fake_wheel(tmp_path / "notes.txt", b"x")
        for configured in (tmp_path / "gone.whl", tmp_path / "empty", tmp_path / "notes.txt"):
            client = (await serve(agent_package=configured)).client
            async with client.get("/downloads/agent") as response:
                assert response.status == 404
                body = await response.json()
            assert body["code"] == "agent_package_unavailable"
            assert "GPUMARKET_AGENT_PACKAGE" in body["message"] and str(configured) in body["message"]

    async def test_no_setting_and_no_checkout_says_to_set_the_setting(self, tmp_path: Path) -> None:
        """An installed master (no source checkout) with no agent_package has nothing to serve: 404, set the setting."""
        packages = AgentPackages(configured=None, build_dir=tmp_path / "downloads", source_root=None)
        with pytest.raises(NotFound) as caught:
            await packages.get()
        assert caught.value.code == "agent_package_unavailable"
        assert "GPUMARKET_AGENT_PACKAGE" in caught.value.message

    async def test_concurrent_first_requests_build_once_and_a_changed_checkout_rebuilds(self, tmp_path: Path) -> None:
        """Three simultaneous first requests share one build; editing a source builds anew and drops the old wheel."""
        checkout = tmp_path / "checkout"
        copy_sources(ROOT, checkout)
        packages = AgentPackages(configured=None, build_dir=tmp_path / "downloads", source_root=checkout)
        first = await asyncio.gather(*(packages.get() for _ in range(3)))
        assert len({(p.path, p.path.stat().st_ino, p.sha256) for p in first}) == 1
        assert len(list((tmp_path / "downloads").glob("agent-*"))) == 1

        marker = "# changed after the first build\n"
        with (checkout / "gpumarket" / "__init__.py").open("a") as f:
            f.write(marker)
        second = await packages.get()
        assert second.path.parent != first[0].path.parent and second.sha256 != first[0].sha256
        assert list((tmp_path / "downloads").glob("agent-*")) == [second.path.parent]
        assert zipfile.ZipFile(second.path).read("gpumarket/__init__.py").decode().endswith(marker)

    async def test_installer_script_is_served_without_a_key(self, serve: Serve) -> None:
        """GET (and HEAD) /downloads/install-agent.sh serve deploy/install-agent.sh as text."""
        client = (await serve()).client
        async with client.get("/downloads/install-agent.sh") as response:
            assert response.status == 200
            assert response.content_type == "text/plain"
            assert await response.read() == INSTALLER.read_bytes()
        async with client.head("/downloads/install-agent.sh") as response:
            assert response.status == 200
            assert int(response.headers["Content-Length"]) == INSTALLER.stat().st_size


class TestRegion:
    async def test_an_unknown_region_is_one_line_listing_the_masters_and_installs_nothing(
        self, serve: Serve, tmp_path: Path
    ) -> None:
        """--region is checked against GET /api/v1/regions (the live relays' regions, public) before anything is
        installed: an unknown one is one line naming the valid ones; a known one passes to the next step."""
        served = await serve()
        for relay_id, region in (("r1", "us-east"), ("r2", "eu-west"), ("r3", "eu-west")):
            await served.master.registry.put_relay(RelayRecord(
                relay_id=relay_id, region=region, url=f"wss://{relay_id}:8443/v1/agent", host=relay_id, port=8443,
                connections=0, capacity=100, draining=False, updated_at=time.time(),
            ), ttl=60)  # fmt: skip
        async with served.client.get("/api/v1/regions") as response:
            assert response.status == 200
            assert await response.json() == {"regions": ["eu-west", "us-east"]}
        base = str(served.client.make_url("")).rstrip("/")
        prefix = tmp_path / "agent"
        provider, _ = await create_principal(served.master, "provider", "provider")
        token, _ = await enrollment.create_token(served.master, provider.account_id)
        common = ("--master", base, "--token", token, "--prefix", prefix, "--no-systemd", "--gpus", "sim:1xT4")

        unknown = await asyncio.to_thread(_run_installer, *common, "--region", "mars")
        assert unknown.returncode != 0
        error, *rest = unknown.stderr.splitlines()
        assert error == "install-agent: error: unknown region 'mars'; the master's regions: eu-west, us-east"
        assert rest == ["install-agent: nothing was installed (status 1)"]  # as every failure before the install
        assert not prefix.exists()

        missing = tmp_path / "gpumarket-0-py3-none-any.whl"  # past the region and token checks, the package step fails on it
        known = await asyncio.to_thread(_run_installer, *common, "--region", "eu-west", "--package", missing)
        assert known.returncode != 0
        assert "unknown region" not in known.stderr and str(missing) in known.stderr, known.stderr
        assert "the master accepts the enrollment token" in known.stdout, known.stdout
        assert not prefix.exists()


# ---- end to end against `gpumarket up` --------------------------------------------------


@dataclass(frozen=True)
class Market:
    base: str  # http://127.0.0.1:PORT
    provider_key: str

    def call(self, method: str, path: str) -> Any:
        request = urllib.request.Request(
            f"{self.base}/api/v1{path}", method=method, headers={"Authorization": f"Bearer {self.provider_key}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def new_token(self) -> dict[str, Any]:
        """A fresh enrollment token with its one-liner (``enroll_command``)."""
        token: dict[str, Any] = self.call("POST", "/enrollment-tokens")
        return token

    def download_package(self, folder: Path) -> Path:
        """GET /downloads/agent, saved under the name the master gives it."""
        with urllib.request.urlopen(f"{self.base}/downloads/agent", timeout=60) as response:
            path = folder / str(response.headers["X-Gpumarket-Package"])
            path.write_bytes(response.read())
        return path

    def host(self, host_id: str) -> dict[str, Any] | None:
        hosts: list[dict[str, Any]] = self.call("GET", "/hosts?limit=500")["items"]
        return next((h for h in hosts if h["id"] == host_id), None)


@pytest.fixture(scope="module")
def market(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Market]:
    """`gpumarket up --agents 0` as a process on free ports, beats every second; SIGINT at the end."""
    folder = tmp_path_factory.mktemp("up")
    data_dir, log = folder / "data", folder / "up.log"
    env = _clean_env() | {"GPUMARKET_HEARTBEAT_INTERVAL": "1", "GPUMARKET_TELEMETRY_INTERVAL": "1",
                          "GPUMARKET_MISSED_HEARTBEATS_OFFLINE": "10", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    with gpumarket_up(data_dir, log, env, agents=0, strict_stop=False) as process:
        creds = wait_for_credentials(process, data_dir, log, role="provider", deadline=time.monotonic() + START_S,
                                     start_s=START_S)  # fmt: skip
        market = Market(base=creds["console_url"].rstrip("/"), provider_key=creds["provider"]["api_key"])
        wheelhouse = folder / "wheelhouse"
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheelhouse), str(market.download_package(folder))],
            capture_output=True, text=True, env=_clean_env(), timeout=INSTALL_S, check=False,
        )  # fmt: skip
        assert fetched.returncode == 0, f"pip wheel of the agent package's dependencies failed:\n{fetched.stderr[-3000:]}"
        INSTALLER_ENV.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheelhouse))
        try:
            yield market
        finally:
            del INSTALLER_ENV["PIP_NO_INDEX"], INSTALLER_ENV["PIP_FIND_LINKS"]


def _wait_for(check: Callable[[], Any], *, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {last!r}")


class RunningAgent:
    """PREFIX/bin/gpumarket-agent as a process, its output in a log file."""

    def __init__(self, prefix: Path, log: Path) -> None:
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [str(prefix / "bin" / "gpumarket-agent")], stdout=out, stderr=subprocess.STDOUT, env=_clean_env()
            )

    def check_alive(self) -> None:
        assert self.process.poll() is None, f"the agent exited with {self.process.returncode}:\n{self.log.read_text()[-4000:]}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _seen_since(market: Market, host_id: str, since: datetime, agent: RunningAgent) -> dict[str, Any] | None:
    agent.check_alive()
    host = market.host(host_id)
    if host and host["state"] == "online" and host["last_seen_at"] and datetime.fromisoformat(host["last_seen_at"]) > since:
        return host
    return None


def _rebuilt(wheel: Path, folder: Path, marker: str) -> Path:
    """``wheel`` with ``marker`` appended to gpumarket/__init__.py (and its RECORD line to match), saved under the same
    name in ``folder``: the same version with other code, as a rebuilt wheel is."""
    folder.mkdir(parents=True, exist_ok=True)
    rebuilt = folder / wheel.name
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(rebuilt, "w", zipfile.ZIP_DEFLATED) as target:
        init = source.read("gpumarket/__init__.py") + marker.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(init).digest()).rstrip(b"=").decode()
        for item in source.infolist():
            data = source.read(item)
            if item.filename == "gpumarket/__init__.py":
                data = init
            elif item.filename.endswith(".dist-info/RECORD"):
                data = re.sub(rb"(?m)^gpumarket/__init__\.py,.*$", f"gpumarket/__init__.py,sha256={digest},{len(init)}".encode(), data)
            target.writestr(item, data)
    return rebuilt


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class TestInstaller:
    def test_install_run_upgrade_and_uninstall(self, market: Market, tmp_path: Path) -> None:
        """The one-liner's install brings a new host online; a re-run upgrades in place with the same identity,
        needing no token (a used one does no harm), keeps the very same package and installs a rebuilt one;
        --uninstall removes the prefix."""
        prefix = tmp_path / "agent"
        token = market.new_token()
        installed = _run_one_liner(
            token["enroll_command"], "--prefix", prefix, "--no-systemd", "--gpus", "sim:2xRTX4090", "--zone", "relays.example.test"
        )  # fmt: skip
        host_id = _host_id(installed)
        assert "the master accepts the enrollment token" in installed.stdout and "installing gpumarket-" in installed.stdout
        config = tomllib.loads((prefix / "etc" / "agent.toml").read_text())
        assert config == {"agent": {"data_dir": str(prefix / "state"), "gpus": "sim:2xRTX4090", "zone": "relays.example.test"}}
        assert json.loads((prefix / "state" / "identity.json").read_text())["host_id"] == host_id
        assert os.access(prefix / "bin" / "gpumarket-agent", os.X_OK)

        started = datetime.now(UTC)
        agent = RunningAgent(prefix, tmp_path / "agent.log")
        try:
            host = _wait_for(lambda: _seen_since(market, host_id, started, agent), timeout=ONLINE_S, what="the new host online")
            assert host["gpu_count"] == 2 and host["gpu_backend"] == "sim"
        finally:
            agent.stop()

        upgrade = _run_one_liner(token["enroll_command"], "--prefix", prefix, "--no-systemd", "--gpus", "sim:2xRTX4090")
        assert _host_id(upgrade) == host_id  # the used token did no harm (an enrolled host's re-run does not check it)
        assert "keeping the enrollment" in upgrade.stdout and "upgrading" in upgrade.stdout
        assert "is installed already (the same sha256); keeping it" in upgrade.stdout  # the master's wheel again
        assert "installing" not in upgrade.stdout and "accepts the enrollment token" not in upgrade.stdout
        # No token, no master: as recorded. And a local wheel instead of the master's download: the same version
        # rebuilt with other code, which replaces the installed package.
        marker = f"# rebuilt {secrets.token_hex(8)}\n"
        wheel = _rebuilt(market.download_package(tmp_path), tmp_path / "rebuilt", marker)
        again = _run_installer("--prefix", prefix, "--no-systemd", "--package", wheel)
        assert _host_id(again) == host_id
        assert "downloading" not in again.stdout and f"installing {wheel.name}" in again.stdout
        [init] = (prefix / "venv").glob("lib/python3*/site-packages/gpumarket/__init__.py")
        assert init.read_text().endswith(marker)
        unreachable = _run_installer("--prefix", prefix, "--no-systemd", "--master", f"http://127.0.0.1:{_free_port()}")
        assert unreachable.returncode != 0 and "nothing was changed" in unreachable.stderr
        assert "cannot download" in unreachable.stderr and "reachable" in unreachable.stderr
        assert json.loads((prefix / "state" / "identity.json").read_text())["host_id"] == host_id
        assert tomllib.loads((prefix / "etc" / "agent.toml").read_text())["agent"]["zone"] == "relays.example.test"

        restarted = datetime.now(UTC)
        agent = RunningAgent(prefix, tmp_path / "agent.log")
        try:
            _wait_for(lambda: _seen_since(market, host_id, restarted, agent), timeout=ONLINE_S, what="the upgraded agent back")
        finally:
            agent.stop()

        removed = _run_installer("--uninstall", "--prefix", prefix)
        assert removed.returncode == 0, removed.stderr
        assert not prefix.exists()
        assert host_id in removed.stdout  # it says the host stays listed at the master
        repeated = _run_installer("--uninstall", "--prefix", prefix)
        assert repeated.returncode == 0 and "nothing installed" in repeated.stdout

    def test_unreachable_master_and_bad_token_fail_clearly_and_leave_nothing(self, market: Market, tmp_path: Path) -> None:
        """An unreachable master fails before anything is installed; so does a token the master refuses (asked before
        the download)."""
        prefix = tmp_path / "agent"
        unreachable = _run_installer(
            "--master", f"http://127.0.0.1:{_free_port()}", "--token", "gmt_x", "--prefix", prefix, "--no-systemd",
            "--gpus", "sim:1xT4",
        )  # fmt: skip
        assert unreachable.returncode != 0
        assert "cannot reach" in unreachable.stderr and "reachable from this host" in unreachable.stderr
        assert not prefix.exists()

        refused = _run_installer(
            "--master", market.base, "--token", "gmt_" + "x" * 43, "--prefix", prefix, "--no-systemd", "--gpus", "sim:1xT4"
        )
        assert refused.returncode != 0
        assert "the master refused enrollment" in refused.stderr, refused.stderr
        assert "create a new one in the console" in refused.stderr and "nothing was installed" in refused.stderr
        assert "downloading" not in refused.stdout and "installing" not in refused.stdout
        assert not prefix.exists()

    @pytest.mark.skipif(os.geteuid() != 0, reason="creating a system user needs root")
    def test_dedicated_user_owns_the_state_and_leaves_with_uninstall(self, market: Market, tmp_path: Path) -> None:
        """--user creates a system user that owns the agent's state, recorded so --uninstall removes it again."""
        user = f"gmtest{secrets.token_hex(4)}"
        prefix = tmp_path / "agent"
        wheel = market.download_package(tmp_path)
        try:
            installed = _run_installer(
                "--master", market.base, "--token", market.new_token()["token"], "--prefix", prefix, "--no-systemd",
                "--gpus", "sim:1xT4", "--user", user, "--package", wheel,
            )  # fmt: skip
            _host_id(installed)
            assert f"created system user {user}" in installed.stdout
            owner = pwd.getpwnam(user)
            assert all(p.stat().st_uid == owner.pw_uid for p in [prefix / "state", *(prefix / "state").iterdir()])
            assert stat.S_IMODE((prefix / "state").stat().st_mode) == 0o700
            assert stat.S_IMODE((prefix / "venv" / "bin" / "python").lstat().st_mode) & 0o005  # others may run it

            removed = _run_installer("--uninstall", "--prefix", prefix)
            assert removed.returncode == 0, removed.stderr
            assert f"removed user {user}" in removed.stdout
            with pytest.raises(KeyError):
                pwd.getpwnam(user)
            assert not prefix.exists()
        finally:
            subprocess.run(["userdel", user], capture_output=True, check=False)
