"""The demo image that `gpumarket up` builds (``gpumarket/images.py``: ``DEMO_IMAGE``) and its ``demo`` template.

``TestImage`` builds the image with the engine here (nothing pulled) and runs its default command: the sample server
answers a page at ``GET /`` and chat completions on port 8000, and the image has a shell with everyday tools.
``TestTemplate`` registers the template on SQLite and PostgreSQL as `up` does, built or not. ``TestUp`` runs the
whole marketplace with the demo image: the ``demo`` template rents, ``gpumarket ssh`` runs a command in it, and its
port 8000 answers through the relay's web port. ``TestReadme`` checks that the README's commands name only what the
demo has.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import pytest

from agent.runtimes.containeropts import OWNER_LABEL
from examples import openai_client
from gpumarket import demo, images
from gpumarket.up import Marketplace, cli_hint, start_marketplace, try_rows
from master.context import Master
from master.services import rentals
from tests import dockerengine
from tests.factories import MS
from tests.helpers import eventually

README = Path(__file__).resolve().parents[1] / "README.md"
TICK = 100 * MS
MISSED = 30  # beats before "offline": as tests/test_e2e_up.py


@pytest.fixture(scope="module")
def demo_image(docker_image: str) -> str:
    """The demo image, built unless the engine has it (``docker_image``: an engine answers)."""
    try:
        return images.demo_image()
    except images.ImageBuildError as exc:
        pytest.fail(str(exc))


engine = dockerengine.engine_json


def run_in(image: str, owner: str, command: list[str] | None = None, *, user: str = "65534") -> str:
    """A started container of ``image`` (as a rental runs: a non-root user), labelled with ``owner``; its id."""
    spec: dict[str, Any] = {"Image": image, "User": user, "Labels": {OWNER_LABEL: owner}}
    if command is not None:
        spec["Cmd"] = command
    container: str = engine("POST", f"/containers/create?name={quote(f'{owner}-{secrets.token_hex(2)}')}", spec)["Id"]
    engine("POST", f"/containers/{container}/start")
    return container


def output(container: str) -> str:
    """A finished container's stdout and stderr (the engine's 8-byte frame headers taken off)."""
    engine("POST", f"/containers/{container}/wait")
    status, body = dockerengine.request("GET", f"/containers/{container}/logs?stdout=1&stderr=1")
    assert status == 200, body
    text = bytearray()
    while len(body) >= 8:
        size = int.from_bytes(body[4:8], "big")
        text += body[8 : 8 + size]
        body = body[8 + size :]
    return text.decode()


class TestImage:
    def test_it_is_tagged_by_its_content_and_as_latest(self, demo_image: str) -> None:
        """Built again, nothing changes: the same name, found; ``latest`` is the same image."""
        assert demo_image.startswith(f"{images.DEMO_REPO}:") and images.demo_image() == demo_image
        ids = {engine("GET", f"/images/{quote(name, safe='')}/json")["Id"] for name in (demo_image, images.DEMO_LATEST)}
        assert len(ids) == 1

    def test_its_shell_has_the_everyday_tools_and_python(self, demo_image: str) -> None:
        owner = f"test-demo-{secrets.token_hex(4)}"
        try:
            script = "echo hi; ls /opt/gpumarket; id -u; python3 -c 'print(6 * 7)'; for tool in grep ps wget vi rsync; do command -v $tool; done"
            text = output(run_in(demo_image, owner, ["sh", "-c", script]))
            assert text.splitlines()[:4] == ["hi", "openai_cpu_server.py", "65534", "42"], text
            assert len(text.splitlines()) == 9 and text.splitlines()[-1] == "/usr/bin/rsync", text
        finally:
            dockerengine.remove_owned(owner)

    @pytest.mark.timeout(120)
    def test_its_default_command_serves_a_page_and_chat_completions_on_port_8000(self, demo_image: str) -> None:
        owner = f"test-demo-{secrets.token_hex(4)}"
        try:
            container = run_in(demo_image, owner)
            address = engine("GET", f"/containers/{container}/json")["NetworkSettings"]["IPAddress"]
            endpoint = f"http://{address}:{images.DEMO_PORT}/"

            def page() -> str | None:
                try:
                    with urllib.request.urlopen(endpoint, timeout=5) as response:
                        body: bytes = response.read()
                        return f"{response.headers['Content-Type']}\n{body.decode()}"
                except OSError:  # not listening yet
                    return None

            deadline = time.monotonic() + 60
            while (text := page()) is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert text is not None and text.startswith("text/html") and "gpumarket-echo" in text, text
            assert "".join(openai_client.chat(endpoint, "any", "hello demo")) == "echo: hello demo"
        finally:
            dockerengine.remove_owned(owner)


class TestTemplate:
    async def test_up_points_the_demo_template_at_the_image_built_at_each_start(self, master: Master) -> None:
        for tag in ("gpumarket/demo:0123456789abcdef", "gpumarket/demo:fedcba9876543210"):
            await demo.register_demo_template(master, demo.DemoImage(tag))
            async with master.db.session() as session:
                template = rentals.template_view(await rentals.get_template(session, demo.DEMO_TEMPLATE))
                workload = await rentals.workload_of(session, demo.DEMO_TEMPLATE)
            assert (template["image"], template["ports"], template["description"]) == (tag, [8000], demo.DEMO_DESCRIPTION)
            assert workload == {"kind": "container", "image": tag, "env": {}, "ports": [8000]}

    async def test_without_an_image_the_template_says_why(self, master: Master) -> None:
        built = await demo.build_demo_image(None, "connecting to /var/run/docker.sock failed")
        assert built.image is None
        await demo.register_demo_template(master, built)
        async with master.db.session() as session:
            template = rentals.template_view(await rentals.get_template(session, demo.DEMO_TEMPLATE))
        assert template["image"] == images.DEMO_LATEST
        assert template["description"].startswith("Not available on this demo: no container engine answers (connecting to")

    async def test_an_engine_over_tcp_is_not_built_through(self) -> None:
        built = await demo.build_demo_image("docker 26.1.5", "", docker_url="tcp://10.0.0.1:2375")
        assert built.image is None and "not a unix socket" in built.why
        assert demo.engine_socket("unix:///run/user/1000/docker.sock") == "/run/user/1000/docker.sock"


def test_the_cli_hint_is_plain_when_the_path_finds_this_gpumarket(tmp_path: Path) -> None:
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "gpumarket").write_text("#!/bin/sh\n")
    (bin_dir / "gpumarket").chmod(0o755)
    python = str(bin_dir / "python")
    assert cli_hint(python, path=str(bin_dir)) == "gpumarket (on your PATH)"
    assert cli_hint(python, path="/nonexistent") == f"{bin_dir}/gpumarket, or `. {bin_dir}/activate` first to type gpumarket"


# ---- the whole marketplace -----------------------------------------------------------------------


@pytest.fixture
async def market(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, demo_image: str) -> AsyncIterator[Marketplace]:
    monkeypatch.setenv("GPUMARKET_RATE_LIMITS_ENABLED", "false")
    said: list[str] = []
    m = await start_marketplace(tmp_path / "data", agents=1, http_port=0, relay_port=0, heartbeat_interval=TICK,
                                telemetry_interval=TICK, missed_heartbeats_offline=MISSED, demo_image=True,
                                progress=said.append)  # fmt: skip
    try:
        assert m.demo_image == demo_image and any(line.startswith(f"demo image  {demo_image}") for line in said), said
        yield m
    finally:
        await m.stop()


async def run(*argv: str, env: dict[str, str], stdin: str | None = None) -> tuple[int, str, str]:
    """A command run without blocking the event loop the marketplace runs on (``stdin``: what it reads)."""
    process = await asyncio.create_subprocess_exec(*argv, env=env, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(stdin.encode() if stdin is not None else None), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


class TestUp:
    @pytest.mark.timeout(240)
    async def test_what_the_box_says_to_try_works_then_scp_and_rsync(self, market: Marketplace, tmp_path: Path) -> None:
        """What the box tells a newcomer to try works as printed, in a fresh home with no login and no SSH key: log in
        as the demo renter; `gpumarket ssh` refuses in one line until a key is registered (not ssh's "Permission
        denied"); `ssh-key add` registers ~/.ssh/id_ed25519.pub; `rent --template demo` runs; `gpumarket ssh RENTAL --
        echo hi; whoami` says hi, as `rental`, from inside (a shell through the agent, no sshd in the image); `scp` and
        `rsync -e ssh` through `ssh-config` copy a file in (the image has rsync); its port 8000 answers the sample
        server's page at its web URL."""
        missing = [tool for tool in ("ssh", "ssh-keygen", "scp", "rsync", "curl") if shutil.which(tool) is None]
        assert not missing, f"install {' '.join(missing)} (make docker does, as root)"
        login, add_key, rent_then_ssh = try_rows(market)
        home = tmp_path / "home"
        (home / ".ssh").mkdir(parents=True)
        env = {name: value for name, value in os.environ.items() if not name.startswith("GPUMARKET_")}
        env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"))
        cli = (sys.executable, "-m", "gpumarket.cli")

        command, key = login.removeprefix("try").strip().split(" <<< ")
        assert command.split()[:2] == ["gpumarket", "login"]
        said = await run(*cli, *command.split()[1:], env=env, stdin=key + "\n")
        assert said[0] == 0 and "logged in" in said[1], said
        assert f"--template {demo.DEMO_TEMPLATE}" in rent_then_ssh and "gpumarket ssh RENTAL -- echo hi" in rent_then_ssh

        key = market.credentials["renter"]["api_key"]
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
            async def online() -> bool:
                async with http.get(market.api_url + "/hosts") as response:
                    hosts = await response.json()
                return any(h["state"] == "online" and "container" in (h["isolation"] or {}).get("kinds", []) for h in hosts["items"])

            await eventually(online, timeout=60, what="the demo host online, running containers")
        said = await run(*cli, "rent", "--template", demo.DEMO_TEMPLATE, "--json", env=env)
        assert said[0] == 0, said
        rental = json.loads(said[1])
        assert rental["state"] == "running", rental

        refused = await run(*cli, "ssh", rental["id"], "--", "echo hi", env=env)
        assert refused[0] == 1 and "no SSH key" in refused[2] and "ssh-keygen -t ed25519" in refused[2], refused
        assert len(refused[2].strip().splitlines()) == 1, refused  # one line, before ssh runs

        assert "gpumarket ssh-key add" in add_key and "ssh-keygen -t ed25519" in add_key
        identity = home / ".ssh" / "id_ed25519"
        assert (await run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(identity), env=env))[0] == 0
        said = await run(*cli, "ssh-key", "add", env=env)
        assert said[0] == 0 and "ssh-ed25519" in said[1], said

        async def logged_in() -> tuple[int, str, str] | None:  # a running rental accepts a new key within seconds
            said = await run(*cli, "ssh", "-i", str(identity), rental["id"], "--", "echo hi; whoami", env=env)
            return said if said[0] != 255 or "Permission denied" not in said[2] else None

        said = await eventually(logged_in, timeout=60, what="the rental accepting the key just added")
        assert said[:2] == (0, "hi\nrental\n"), said  # the image knows the user a rental runs as (uid 1000)

        payload = tmp_path / "payload.bin"
        payload.write_bytes(os.urandom(300_000))
        config = home / "ssh_config"
        said = await run(*cli, "ssh-config", env=env)
        assert said[0] == 0, said
        config.write_text(said[1])
        alias = f"{rental['id']}.gpumarket"
        # ssh finds its default key through the password database, not $HOME: name this home's
        ssh = ("-F", str(config), "-i", str(identity))
        assert (await run("scp", "-q", *ssh, str(payload), f"{alias}:/workspace/by-scp", env=env))[0] == 0
        said = await run("rsync", "-e", shlex.join(["ssh", *ssh]), str(payload), f"{alias}:/workspace/by-rsync", env=env)
        assert said[0] == 0, said
        said = await run(*cli, "ssh", "-i", str(identity), rental["id"], "--", "sha256sum /workspace/by-scp /workspace/by-rsync", env=env)
        digest = hashlib.sha256(payload.read_bytes()).hexdigest()
        assert said[0] == 0 and [line.split()[0] for line in said[1].splitlines()] == [digest, digest], said

        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
            async with http.post(market.api_url + f"/rentals/{rental['id']}/connect", json={"port": 8000}) as response:
                ticket = await response.json()
                assert response.status == 200 and ticket["web_url"], ticket
        where = urlsplit(ticket["web_url"])

        async def page() -> str | None:
            done = await run("curl", "-sk", "-L", "-c", str(tmp_path / "jar"), "-b", str(tmp_path / "jar"), "--max-time", "10",
                             "--resolve", f"{where.hostname}:{where.port}:127.0.0.1", ticket["web_url"], env=env)  # fmt: skip
            return done[1] if "gpumarket-echo" in done[1] else None

        assert "sample server" in await eventually(page, timeout=60, what="the rental's port 8000 through the relay")


# ---- the README --------------------------------------------------------------------------------

TEMPLATE_NAMED = re.compile(r"""--template[ =](\S+)|"template": "([^"]+)\"""")
IMAGE_NAMED = re.compile(r"""--image[ =](\S+)|"image": "([^"]+)\"""")


def readme_commands() -> list[str]:
    """The lines of every ``sh`` block of the README (the commands a newcomer copies)."""
    return [line for block in re.findall(r"```sh\n(.*?)```", README.read_text(), re.S) for line in block.splitlines()]


class TestReadme:
    def test_its_commands_name_only_the_demo_template_and_image(self) -> None:
        """Offline, only what `up` builds runs: every template and image a README command names is the demo's."""
        lines = readme_commands()
        templates = {a or b for line in lines for a, b in TEMPLATE_NAMED.findall(line)}
        named_images = {a or b for line in lines for a, b in IMAGE_NAMED.findall(line)}
        assert templates == {demo.DEMO_TEMPLATE}, templates
        assert named_images <= {images.DEMO_LATEST, "REF"}, named_images
        assert "gpumarket/demo:latest" in named_images

    def test_it_says_real_images_need_a_registry_and_how_to_reach_the_cli(self) -> None:
        text = " ".join(README.read_text().split())
        assert "need a registry" in text
        assert ". .venv/bin/activate" in text and ".venv/bin/gpumarket" in text
