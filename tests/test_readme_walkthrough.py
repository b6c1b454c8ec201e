"""The README's "Try it" and "Renter CLI" sections, run as written against a real `gpumarket up`.

Every curl and `gpumarket` command answers what the README says.

The commands are read from README.md, so a changed README changes this test. Each runs in bash with real
curl (and jq), from a folder whose ``.gpumarket`` is the demo's data dir, so the README's ``KEY=...`` line
works as written. Only three things are adapted: ``localhost:8080`` becomes the port this `up` listens on,
``curl -s`` also prints the status code (``-w``), and ``$HOME`` is a folder of the test's own holding a
fresh ``~/.ssh/id_ed25519.pub``. A command this test does not know how to check fails it: add its
expectation in ``_check`` with the README.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from tests.upprocess import check_alive, gpumarket_up, log_tail, wait_for_credentials

README = Path(__file__).resolve().parents[1] / "README.md"
START_S = 60.0  # `up` answering with its hosts online, speed-tested and the share host listed
COMMAND_S = 30.0  # one README command
RUNNING_S = 30.0  # a hold rental to be confirmed running by its agent
STATUS_MARK = "\n@@status="
DEMO_PORT = "localhost:8080"


def try_it_commands(readme: str) -> list[str]:
    """The shell commands of the first ``sh`` block under "## Try it", each whole (continuation lines and quoted
    newlines joined as bash reads them), comment-only lines left out."""
    section = readme.split("\n## Try it\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match is not None, "README's Try it section has no ```sh block"
    commands: list[str] = []
    pending = ""
    for line in match.group(1).splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        if pending.rstrip().endswith("\\"):
            continue
        if words:
            commands.append(pending)
        pending = ""
    assert not pending, f"README's Try it block ends inside a command: {pending!r}"
    return commands


@dataclass
class Demo:
    folder: Path  # holds .gpumarket (the data dir) and home/
    api_url: str
    renter_key: str
    env: dict[str, str]
    rentals: list[dict[str, Any]] = field(default_factory=list)

    def api(self, path: str) -> Any:
        request = urllib.request.Request(self.api_url + path, headers={"Authorization": f"Bearer {self.renter_key}"})
        with urllib.request.urlopen(request, timeout=COMMAND_S) as response:
            return json.loads(response.read())

    def run(self, command: str) -> tuple[int, Any]:
        """Run one README command as bash would; the HTTP status of its (last) curl and the JSON it printed."""
        port = self.api_url.split("://", 1)[1].split("/", 1)[0]
        adapted = command.replace(DEMO_PORT, port).replace("curl -s ", f"curl -s --max-time {COMMAND_S:g} -w '{STATUS_MARK}%{{http_code}}' ")
        done = subprocess.run(["bash", "-o", "pipefail", "-c", adapted], cwd=self.folder, env=self.env, capture_output=True,
                              text=True, timeout=COMMAND_S + 5)  # fmt: skip
        assert done.returncode == 0, f"{command}\nexited {done.returncode}: {done.stderr}"
        body, _, status = done.stdout.rpartition(STATUS_MARK)
        assert status.strip().isdigit(), f"{command}\nprinted no status: {done.stdout!r} {done.stderr!r}"
        return int(status), json.loads(body)


def _tools() -> None:
    missing = [tool for tool in ("bash", "curl", "jq", "ssh-keygen") if shutil.which(tool) is None]
    assert not missing, f"the README walkthrough needs {', '.join(missing)} (make docker installs them, as root)"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    """`gpumarket up` (3 hosts, as `make up`) as a real process, once its hosts are online, speed-tested and listed."""
    _tools()
    folder = tmp_path_factory.mktemp("walkthrough")
    data_dir, log = folder / ".gpumarket", folder / "up.log"
    home = folder / "home"
    (home / ".ssh").mkdir(parents=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "walkthrough", "-f", str(home / ".ssh" / "id_ed25519")],
                   check=True)  # fmt: skip
    # Only the settings chosen here: a GPUMARKET_DATABASE_URL or REDIS_URL of the environment must not leak in.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMARKET_")}
    env.update(PYTHONUNBUFFERED="1", HOME=str(home))
    with gpumarket_up(data_dir, log, env, agents=3, strict_stop=True) as process:
        deadline = time.monotonic() + START_S
        creds = wait_for_credentials(process, data_dir, log, role="renter", deadline=deadline, start_s=START_S)
        demo = Demo(folder, creds["api_url"], creds["renter"]["api_key"], env)
        while not _ready(demo):
            check_alive(process, log, deadline, START_S)
            time.sleep(0.5)
        yield demo
        assert process.poll() is None, f"gpumarket up exited during the walkthrough:\n{log_tail(log)}"


def _ready(demo: Demo) -> bool:
    """Three hosts offered, each with a measured download speed and a score, the RTX 4090 host listed for shares."""
    try:
        offers = demo.api("/offers")["items"]
    except OSError:
        return False
    units = {o["gpu_name"]: o["smallest_unit"] for o in offers}
    return (len(offers) == 3 and all(o["download_mbps"] and o["reliability"] is not None for o in offers)
            and units.get("NVIDIA GeForce RTX 4090") == "milli:250")  # fmt: skip


def _query(command: str) -> str:
    match = re.search(r"--data-urlencode '(q=[^']*)'", command)
    return match.group(1)[2:] if match else ""


def _check(demo: Demo, command: str, status: int, body: Any, container_hosts: bool) -> None:
    """What the README promises for ``command``'s answer."""
    path_match = re.search(re.escape(DEMO_PORT) + r"(/api/v1/[\w/-]*)(\?\S*)?", command)
    assert path_match is not None, f"a README command without a demo URL: {command}"
    path, params = path_match.group(1), path_match.group(2) or ""
    posts = " -d " in command and " -G " not in command
    where = f"{command}\n-> {status} {json.dumps(body)[:1000]}"
    if path == "/api/v1/offers" and not posts:
        assert status == 200 and body["items"], where
        for offer in body["items"]:
            assert offer["reliability"] is not None and offer["reliability_seeded"] is True, where
            assert offer["download_mbps"] and offer["upload_mbps"], where
        if "gpu_model=A100" in params:
            assert all("A100" in o["gpu_name"] for o in body["items"]), where
        if query := _query(command):
            assert body["query"], where
            if "reliability>0.98" in query:
                assert all(o["reliability"] > 0.98 for o in body["items"]), where
            if "vram>=24" in query:
                assert all(o["vram_mib"] >= 23.5 * 1024 and float(o["price_per_gpu_hour"]) <= 0.5 for o in body["items"]), where
    elif path == "/api/v1/rentals" and posts:
        asked = json.loads(re.search(r"-d '(\{.*\})'", command, re.S).group(1))  # type: ignore[union-attr]
        if ("workload" in asked or "template" in asked) and not container_hosts:
            # No container engine answers on this machine: no demo host runs containers, and the API says so.
            assert status == 409 and body["code"] == "insufficient_capacity" and "container" in body["message"], where
            return
        assert status in (200, 201) and body["id"] and body["state"] in ("pending", "starting", "running"), where
        if asked.get("queue") and body.get("queued"):
            assert body["state"] == "pending", where
        elif "mig_profile" in asked:
            assert body["mig_profile"] == asked["mig_profile"] and [u[:4] for u in body["gpu_uuids"]] == ["MIG-"], where
        elif "gpu_milli" in asked:
            assert body["gpu_milli"] == asked["gpu_milli"] and len(body["gpu_uuids"]) == 1, where
        else:
            assert len(body["gpu_uuids"]) == asked.get("gpu_count", 1), where
        demo.rentals.append({"request": asked, **body})
    elif path == "/api/v1/rentals":
        assert status == 200 and {r["id"] for r in body["items"]} == {r["id"] for r in demo.rentals}, where
    elif path == "/api/v1/templates":
        templates = {t["name"]: t for t in body["templates"]}
        assert status == 200 and {"demo", "base", "pytorch", "jupyter", "vllm"} <= set(templates), where
        # `up` built the demo image where an engine answers, and points the template at it; else it says why.
        assert templates["demo"]["image"].startswith("gpumarket/demo:"), where
        assert container_hosts != templates["demo"]["description"].startswith("Not available"), where
    elif path == "/api/v1/account":
        assert status == 200 and body["credit"]["balance"], where
    elif path == "/api/v1/account/credit" and posts:
        asked = json.loads(re.search(r"-d '(\{.*\})'", command, re.S).group(1))  # type: ignore[union-attr]
        assert status == 201 and body["provider"] == "demo" and body["amount"] == asked["amount"], where
        assert Decimal(body["balance"]) >= Decimal(asked["amount"]), where
    elif path == "/api/v1/account/ssh-keys" and posts:
        printed = subprocess.run(["ssh-keygen", "-lf", str(Path(demo.env["HOME"]) / ".ssh" / "id_ed25519.pub")], check=True,
                                 capture_output=True, text=True).stdout.split()[1]  # fmt: skip
        assert status == 201 and body["fingerprint"] == printed, where
    else:
        pytest.fail(f"the walkthrough does not know what this README command should answer: {command}")


def test_the_readme_try_it_block_parses_into_every_curl_command() -> None:
    """Each curl of the block is in one parsed command, the KEY line first: nothing of the README is skipped."""
    readme = README.read_text()
    commands = try_it_commands(readme)
    block = readme.split("\n## Try it\n", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    assert commands[0].startswith("KEY=$(python3 ")
    assert sum(c.count("curl ") for c in commands) == block.count("curl ") >= 10


def test_every_curl_command_of_the_readme_answers_a_success(demo: Demo) -> None:
    """Run in order, each command answers what the README says (offers for every query, rentals created, ...),
    and the hold rentals it made run on their agents: a MIG slice and a share included."""
    commands = try_it_commands(README.read_text())
    key_line, curls = commands[0], commands[1:]
    hosts = demo.api("/hosts")["items"]
    container_hosts = any("container" in ((h["isolation"] or {}).get("kinds") or []) for h in hosts)
    for command in curls:
        status, body = demo.run(f"{key_line}\n{command}")
        _check(demo, command, status, body, container_hosts)
    assert any("mig_profile" in r["request"] for r in demo.rentals) and any("gpu_milli" in r["request"] for r in demo.rentals)

    holds = [r for r in demo.rentals if "workload" not in r["request"] and "template" not in r["request"] and not r.get("queued")]
    deadline = time.monotonic() + RUNNING_S
    waiting = {r["id"] for r in holds}
    while waiting and time.monotonic() < deadline:
        waiting = {rid for rid in waiting if demo.api(f"/rentals/{rid}")["state"] != "running"}
        time.sleep(0.3)
    assert not waiting, f"hold rentals not running within {RUNNING_S:g} s: {[demo.api(f'/rentals/{rid}') for rid in waiting]}"


# ---- the Renter CLI block ----------------------------------------------------------------------

RENTAL_ID = re.compile(r"\br-[0-9a-f]{16}\b")
ACTIVE = ("pending", "starting", "running", "stopping")  # GET /rentals lists ended rentals too


def cli_commands(readme: str) -> list[str]:
    """The lines of the first ``sh`` block under "### Renter CLI": one `gpumarket` command each."""
    section = readme.split("\n### Renter CLI\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match is not None, "README's Renter CLI section has no ```sh block"
    return [line for line in match.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _stop_everything(demo: Demo) -> None:
    """End the rentals an earlier test left running, so the CLI's rentals find free GPUs whatever the order."""
    def active() -> list[dict[str, Any]]:
        return [r for r in demo.api("/rentals")["items"] if r["state"] in ACTIVE]

    for rental in active():
        request = urllib.request.Request(f"{demo.api_url}/rentals/{rental['id']}", method="DELETE",
                                         headers={"Authorization": f"Bearer {demo.renter_key}"})  # fmt: skip
        urllib.request.urlopen(request, timeout=COMMAND_S).close()
    deadline = time.monotonic() + RUNNING_S
    while (left := active()) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not left, f"rentals still active {RUNNING_S:g} s after they were stopped: {left}"


def _home_public_key(demo: Demo) -> list[str]:
    """The type and key of this test's ``~/.ssh/id_ed25519.pub`` (the comment aside: the API keeps it as the name)."""
    return (Path(demo.env["HOME"]) / ".ssh" / "id_ed25519.pub").read_text().split()[:2]


def test_the_readme_cli_block_is_what_the_cli_test_runs() -> None:
    """Every line of the block is a `gpumarket` command with a subcommand this test knows how to check."""
    commands = cli_commands(README.read_text())
    assert [c.split()[0] for c in commands] == ["gpumarket"] * len(commands)
    assert {c.split()[1] for c in commands} <= {"login", "ssh-key", "offers", "rent", "rentals", "logs", "stop", "account", "credit"}
    assert len(commands) >= 9


def test_every_cli_command_of_the_readme_answers_as_it_says(demo: Demo) -> None:
    """The Renter CLI block run in order with the real `gpumarket`: login, the offers query, rentals (a hold runs;
    container ones run or say why not), the list, `logs -f` following until `stop --wait` ends the rental, the
    account and a demo credit."""
    _stop_everything(demo)
    key_line = try_it_commands(README.read_text())[0]
    port = demo.api_url.split("://", 1)[1].split("/", 1)[0]
    env = {**demo.env, "PATH": f"{Path(sys.executable).parent}:{demo.env.get('PATH', '')}"}
    hosts = demo.api("/hosts")["items"]
    container_hosts = any("container" in ((h["isolation"] or {}).get("kinds") or []) for h in hosts)
    held: str | None = None
    follower: subprocess.Popen[str] | None = None
    try:
        for command in cli_commands(README.read_text()):
            verb = command.split()[1]
            adapted = re.sub(r"\[(--[\w-]+)\]", r"\1", command).replace("127.0.0.1:8080", port)
            if "RENTAL" in adapted:
                assert held is not None, f"{command}: no rental of an earlier README command to use"
                adapted = adapted.replace("RENTAL", held)
            script = f"{key_line}\n{adapted}"
            if verb == "logs":
                follower = subprocess.Popen(["bash", "-c", script], cwd=demo.folder, env=env, text=True,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
                continue
            done = subprocess.run(["bash", "-c", script], cwd=demo.folder, env=env, capture_output=True, text=True,
                                  timeout=COMMAND_S + RUNNING_S)  # fmt: skip
            where = f"{command}\n-> exit {done.returncode}\n{done.stdout}\n{done.stderr}"
            if verb == "rent" and ("--template" in command or "--image" in command):
                if container_hosts:  # the demo image, which `up` built here: it runs, no registry asked
                    assert done.returncode == 0, where
                    [made] = set(RENTAL_ID.findall(done.stdout)) or [None]
                    assert made is not None and demo.api(f"/rentals/{made}")["state"] == "running", where
                else:
                    assert done.returncode == 1 and "container" in done.stderr, where
                continue
            assert done.returncode == 0, where
            if verb == "offers":
                assert "RTX 4090" in done.stdout, where
            elif verb == "rent":
                [held] = set(RENTAL_ID.findall(done.stdout)) or [None]
                assert held is not None and demo.api(f"/rentals/{held}")["state"] == "running", where
            elif verb == "rentals":
                assert held is not None and held in done.stdout, where
            elif verb == "stop":
                assert demo.api(f"/rentals/{held}")["state"] == "stopped", where
                assert follower is not None, "README's `logs -f` comes before `stop`"
                assert follower.wait(timeout=COMMAND_S) == 0, follower.communicate()
            elif verb == "account":
                assert "$" in done.stdout, where
            elif verb == "credit":
                assert "demo" in done.stdout.lower() and "$" in done.stdout, where
            elif verb == "ssh-key":  # this home's key; the Try it block's curl may have registered it already
                assert "ssh-ed25519" in done.stdout or "already on your account" in done.stdout, where
                assert any(k["public_key"].split()[:2] == _home_public_key(demo) for k in demo.api("/account/ssh-keys")["ssh_keys"]), where
    finally:
        if follower is not None and follower.poll() is None:
            follower.kill()
            follower.wait()
