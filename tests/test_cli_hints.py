"""Every next step the renter CLI prints is a command that works in the state it is printed in (issue 39).

Against a real master on loopback (``tests/test_renter_cli.py``'s ``Cli``, the agents' side played by applying their
results as the ingestor would, a relay put in the registry as ``tests/test_connect.py`` does), each test drives a
rental or cluster into a state — a hold, a container with a port and SSH, a failed start with and without output, a
hold cluster — collects every ``gpumarket …`` the CLI printed there (``hints``), and runs each through ``main`` as a
user would, expecting exit status 0. How each kind is run:

* ``logs RENTAL -f`` follows until the rental ends: it is started, the rental stopped (by the ``stop`` hint, run
  last), and then it must exit 0 with the output;
* ``ssh`` and ``cp`` would exec OpenSSH to a relay this test does not run (``tests/test_renter_tunnel.py`` and
  ``tests/test_tunnels.py`` run them through real ones): they run in their dry form, ``--dry-run``, which asks the
  API for the ticket and pins the host key as the real run does, then prints the ssh/scp command line;
* a placeholder in capitals (``FILE``) is replaced by a real one.

* ``login --api URL --browser`` waits for an approval in the console: run, it must start a new sign-in.

Also here: ``ssh-config`` skipping what it cannot log into, ``open``, and how ``ssh`` and ``cp`` take options.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import stat
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncssh
import pytest
from sqlalchemy import select

from gpumarket.renter.sshcmds import SCP_OPTIONS_WITH_VALUE, split_options
from master.models import Command, DeviceCode
from shared.registry import RelayRecord
from tests.apiclient import Api
from tests.helpers import eventually
from tests.test_renter_cli import (
    Cli,
    _async,
    cli,
    database_url,
    fast_polls,
    one_line,
    ship_logs,
    start_commands,
)

__all__ = ["cli", "database_url", "fast_polls"]  # the fixtures, shared with test_renter_cli

ROOT = Path(__file__).resolve().parents[1]
HOST_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
# A command the CLI names: after "gpumarket ", up to the end of its clause (`;`, a backtick, `,`, `)` or the line's end).
HINT_RE = re.compile(r"\bgpumarket ([a-z][^;`,)\n]*)")



@pytest.fixture
def openssh() -> None:
    """The hints run ssh and scp (in their --dry-run form, which still reads the client's version): a missing client
    is a failure of the machine's set-up, never a skip."""
    missing = [tool for tool in ("ssh", "scp") if shutil.which(tool) is None]
    assert not missing, f"install OpenSSH's client ({' '.join(missing)} missing): make docker does, as root"


needs_openssh = pytest.mark.usefixtures("openssh")


@pytest.fixture
async def renter_ssh_key(cli: Cli, tmp_path: Path) -> Path:
    """An SSH key registered on the renter's account with `gpumarket ssh-key add` (``ssh`` and ``cp`` refuse without
    one): its public key file."""
    public = tmp_path / "renter_ed25519.pub"
    public.write_text(asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode())
    code, _, err = await cli("ssh-key", "add", str(public))
    assert code == 0, err
    return public


with_ssh_key = pytest.mark.usefixtures("renter_ssh_key")


def hints(*texts: str) -> list[list[str]]:
    """Each ``gpumarket …`` command in ``texts``, as argv after ``gpumarket``, once each, in order."""
    found: list[list[str]] = []
    for text in texts:
        for match in HINT_RE.finditer(text):
            argv = shlex.split(match[1].strip())
            if argv not in found:
                found.append(argv)
    return found


async def relay_up(api: Api, *, ports_url: str | None = "https://{label}.ports.example:8444/") -> None:
    """A live relay in the registry that the test's hosts are connected through: ``connect`` then answers."""
    await api.master.registry.put_relay(RelayRecord(
        relay_id="relay-t", region="local", url="wss://relay.example:8443/v1/agent", host="relay.example", port=8443,
        connections=1, capacity=100, draining=False, updated_at=datetime.now(UTC).timestamp(), ports_url=ports_url,
    ), ttl=60)  # fmt: skip


async def started(api: Api, rental_id: str, *, ssh: bool = True) -> None:
    """The agent reports the rental's workload started, with its SSH host key (``ssh``) as a real agent does."""
    [command] = await api.commands(rental_id, "start_workload")
    await api.agent_answers(command, data={"kind": "container", "ssh_host_key": HOST_KEY} if ssh else None)


async def rent(cli: Cli, api: Api, *argv: str, ok: bool = True, detail: str = "", logs: str = "") -> tuple[int, str, str, str]:
    """``gpumarket rent ARGV`` until the agent answers its start (``ok``, ``detail``), having shipped ``logs`` first:
    the exit status, stdout, stderr and the rental's id."""
    before = {c.id for c in await start_commands(api)}
    task = cli.start("rent", *argv)
    command = await eventually(lambda: _new_start(api, before), what="the start_workload command")
    assert command.rental_id is not None
    await eventually(lambda: _async(f"{command.rental_id}: starting" in cli.peek()[1]), what="the first progress line")
    if logs:
        await ship_logs(api, command.host_id, command.rental_id, 0, logs, seq=1)
    if ok:
        await started(api, command.rental_id, ssh=argv[:1] != ("--hold",))
    else:
        await api.agent_answers(command, ok=False, detail=detail)
    code = await task
    out, err = cli.take()
    return code, out, err, command.rental_id


async def _new_start(api: Api, before: set[str]) -> Command | None:
    return next((c for c in await start_commands(api) if c.id not in before), None)


async def rented(cli: Cli, *argv: str) -> str:
    """``gpumarket rent ARGV --no-wait --json``: the new rental's id."""
    code, out, err = await cli("rent", *argv, "--no-wait", "--json")
    assert code == 0, err
    return str(json.loads(out)["id"])


async def run_hint(cli: Cli, argv: list[str], *, local_file: Path) -> tuple[int, str, str]:
    """One hint as the user runs it: placeholders filled, ssh and cp in their dry form (see the module's docstring)."""
    argv = [str(local_file) if word == "FILE" else word for word in argv]
    if argv[0] in ("ssh", "cp") or argv[:2] == ["cluster", "ssh"]:
        at = 2 if argv[0] == "cluster" else 1
        argv = [*argv[:at], "--dry-run", *argv[at:]]
    return await cli(*argv)


async def run_all(cli: Cli, api: Api, found: list[list[str]], tmp_path: Path, *, stop: tuple[str, str] | None = None) -> dict[str, tuple[int, str, str]]:
    """Run every hint (``logs -f`` in the background, the stop last, the agent confirming ``stop``: (rental, kind));
    each must exit 0. Their results by command line."""
    local_file = tmp_path / "data.txt"
    local_file.write_text("data\n")
    follows = [argv for argv in found if argv[0] == "logs" and "-f" in argv]
    stops = [argv for argv in found if argv[0] == "stop" or argv[:2] == ["cluster", "stop"]]
    following = [(argv, cli.start(*argv)) for argv in follows]
    results: dict[str, tuple[int, str, str]] = {}
    for argv in [a for a in found if a not in follows and a not in stops] + stops:
        results[shlex.join(argv)] = code, out, err = await run_hint(cli, argv, local_file=local_file)
        assert code == 0, (argv, out, err)
    if stop is not None:
        await api.agent_reports(*stop)
    for argv, task in following:
        assert await task == 0, (argv, cli.take())
    return results


# ---- the states -----------------------------------------------------------------------------------


@with_ssh_key
@needs_openssh
async def test_a_running_container_with_a_port_prints_its_web_address_and_every_hint_works(cli: Cli, api: Api, tmp_path: Path) -> None:
    await api.host(1)
    await relay_up(api)
    code, out, err, rid = await rent(cli, api, "--image", "python:3.12", "--command", "python -m http.server 8000", "--port", "8000")
    assert code == 0, err
    [_, port_line] = out.splitlines()
    assert port_line.startswith(f"port 8000  https://{rid}-8000.ports.example:8444/?gm_token=gmc1."), out
    found = hints(out, err)
    assert found == [["ssh", rid], ["cp", "FILE", f"{rid}:"], ["open", rid, "8000"], ["logs", rid, "-f"], ["stop", rid]], err
    results = await run_all(cli, api, found, tmp_path, stop=(rid, "stop_workload"))
    ssh_line = shlex.split(results[f"ssh {rid}"][1])
    assert Path(ssh_line[0]).name == "ssh" and ssh_line[-1] == f"{rid}.gpumarket" and "StrictHostKeyChecking=yes" in ssh_line
    scp_line = shlex.split(results[f"cp FILE {rid}:"][1])
    assert Path(scp_line[0]).name == "scp" and scp_line[-2:] == [str(tmp_path / "data.txt"), f"{rid}.gpumarket:"]
    assert results[f"open {rid} 8000"][1].startswith(f"https://{rid}-8000.ports.example:8444/?gm_token=gmc1.")


async def test_a_held_rental_offers_no_shell_logs_or_files_and_its_hints_work(cli: Cli, api: Api, tmp_path: Path) -> None:
    """A hold runs nothing: no ssh (the API answers nothing_to_log_into), no cp, no logs to follow; stopping it works."""
    await api.host(1)
    await relay_up(api)
    code, out, err, rid = await rent(cli, api, "--hold")
    assert code == 0, err
    assert out.splitlines()[0].startswith(f"{rid} running") and len(out.splitlines()) == 1
    assert hints(out, err) == [["stop", rid]], err
    code, _, ssh_err = await cli("ssh", "--dry-run", rid)  # what the hint would have been
    assert code == 1 and "(nothing_to_log_into)" in one_line(ssh_err)
    await run_all(cli, api, hints(out, err), tmp_path)


async def test_a_failed_start_names_its_code_and_owner_and_hints_logs_only_when_there_are_some(cli: Cli, api: Api, tmp_path: Path) -> None:
    await api.host(1)
    code, out, err, rid = await rent(cli, api, "--template", "base", ok=False, detail="image_not_found: no such image ubuntu:99")
    assert code == 1 and out == f"{rid} failed\n"
    _, view = await api.as_renter("GET", f"/rentals/{rid}")
    assert (view["failure_code"], view["failure_owner"]) == ("image_not_found", "renter")
    line = one_line(err.splitlines()[-1] + "\n")
    assert f"rental {rid} failed: " in line and "(image_not_found, renter's failure)" in line and "fix it" in line
    assert ["logs", rid] not in hints(err)  # the workload never started: `logs` would print nothing
    await run_all(cli, api, hints(out, err), tmp_path)

    # The host fails it after the workload wrote something: its output is named, and `logs` prints it.
    code, out, err, other = await rent(cli, api, "--template", "base", ok=False, detail="the container engine went away", logs="pulling...\n")
    assert code == 1, err
    found = hints(err.splitlines()[-1])
    assert ["logs", other] in found, err
    results = await run_all(cli, api, found, tmp_path)
    assert results[f"logs {other}"][1] == "pulling...\n"


async def test_a_hold_cluster_offers_no_shell_and_its_hints_work(cli: Cli, api: Api, tmp_path: Path) -> None:
    for _ in range(2):
        await api.host(1)
    await relay_up(api)
    task = cli.start("cluster", "create", "--nodes", "2")
    cluster_id = await eventually(lambda: _cluster_id(api), what="the cluster")
    _, view = await api.as_renter("GET", f"/clusters/{cluster_id}")
    for member in view["members"]:
        await started(api, member["rental_id"], ssh=False)
    assert await task == 0
    out, err = cli.take()
    found = hints(out, err)
    assert found == [["cluster", "show", cluster_id], ["cluster", "stop", cluster_id]], err
    code, _, err = await cli("cluster", "ssh", "--dry-run", cluster_id, "node-0")  # what the hint would have been
    assert code == 1 and "(nothing_to_log_into)" in one_line(err)
    await run_all(cli, api, found, tmp_path)


@with_ssh_key
@needs_openssh
async def test_a_container_cluster_offers_a_shell_that_works(cli: Cli, api: Api, tmp_path: Path) -> None:
    for _ in range(2):
        await api.host(1)
    await relay_up(api)
    task = cli.start("cluster", "create", "--nodes", "2", "--image", "ubuntu:24.04", "--command", "sleep infinity")
    cluster_id = await eventually(lambda: _cluster_id(api), what="the cluster")
    _, view = await api.as_renter("GET", f"/clusters/{cluster_id}")
    for member in view["members"]:
        await started(api, member["rental_id"])
    assert await task == 0
    out, err = cli.take()
    found = hints(out, err)
    assert ["cluster", "ssh", cluster_id, "node-0"] in found, err
    results = await run_all(cli, api, found, tmp_path)
    node_0 = next(m["rental_id"] for m in view["members"] if m["node_rank"] == 0)
    assert shlex.split(results[f"cluster ssh {cluster_id} node-0"][1])[-1] == f"{node_0}.gpumarket"


async def _cluster_id(api: Api) -> str | None:
    _, body = await api.as_renter("GET", "/clusters")
    return str(body["items"][0]["id"]) if body["items"] else None


# ---- ssh-config -----------------------------------------------------------------------------------


@with_ssh_key
async def test_ssh_config_skips_a_hold_with_a_note_and_writes_the_others(cli: Cli, api: Api, tmp_path: Path) -> None:
    """Regression test for issue 39: one running hold made `ssh-config` (and `--write`) exit 1 with nothing_to_log_into."""
    await api.host(2)
    await relay_up(api)
    hold = await rented(cli, "--hold")
    await started(api, hold, ssh=False)
    box = await rented(cli, "--image", "ubuntu:24.04")
    await started(api, box)

    code, out, err = await cli("ssh-config")
    assert code == 0, err
    assert [line.split()[1:] for line in out.splitlines() if line.startswith("Host ")] == [[f"{box}.gpumarket", box]]
    assert f"# {hold}: skipped, " in err and "(nothing_to_log_into)" in err
    code, out, err = await cli("ssh-config", "--write")
    assert code == 0 and f"# {hold}: skipped" in err
    written = tmp_path / "home" / "gpumarket" / "ssh_config"
    assert f"Host {box}.gpumarket {box}" in written.read_text() and hold not in written.read_text()
    assert f"wrote 1 host to {written}: {box}.gpumarket" in out

    await cli("stop", box)
    code, out, err = await cli("ssh-config", "--write")
    assert code == 0 and "wrote 0 hosts" in out and "none serves SSH" in out, out


# ---- open ---------------------------------------------------------------------------------------


async def test_open_prints_a_declared_ports_address_and_says_why_when_it_has_none(cli: Cli, api: Api) -> None:
    await api.host(1)
    await relay_up(api)
    rid = await rented(cli, "--image", "python:3.12", "--port", "8888")
    code, _, err = await cli("open", rid, "8888")
    assert code == 1 and "(rental_not_running)" in one_line(err)
    await started(api, rid)
    code, out, err = await cli("open", rid, "8888")
    assert code == 0, err
    assert out.startswith(f"https://{rid}-8888.ports.example:8444/?gm_token=gmc1.") and out.count("\n") == 1
    code, _, err = await cli("open", rid, "9999")
    assert code == 1 and "(port_not_declared)" in one_line(err) and "its ports: 8888" in err
    await relay_up(api, ports_url=None)  # a relay without web ports
    code, _, err = await cli("open", rid, "8888")
    assert code == 1 and f"`gpumarket tunnel {rid} --port 8888`" in one_line(err)
    code, _, _ = await cli("open", rid, "http")
    assert code == 2


async def test_open_browser_hands_the_address_to_the_browser(cli: Cli, api: Api, tmp_path: Path) -> None:
    """``--browser`` opens the address with ``webbrowser``, which runs $BROWSER: here a script that writes it down
    (in a process of its own: ``webbrowser`` reads $BROWSER once per process)."""
    await api.host(1)
    await relay_up(api)
    rid = await rented(cli, "--image", "python:3.12", "--port", "8888")
    await started(api, rid)
    opened, browser = tmp_path / "opened.txt", tmp_path / "browser.sh"
    browser.write_text(f'#!/bin/sh\necho "$1" > {shlex.quote(str(opened))}\n')
    browser.chmod(browser.stat().st_mode | stat.S_IXUSR)
    environ = {**os.environ, "BROWSER": str(browser), "PYTHONPATH": str(ROOT)}
    process = await asyncio.create_subprocess_exec(sys.executable, "-m", "gpumarket", "open", rid, "8888", "--browser", env=environ,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)  # fmt: skip
    async with asyncio.timeout(30):
        out_bytes, err_bytes = await process.communicate()
    assert process.returncode == 0, err_bytes.decode()
    address = out_bytes.decode().strip()
    assert address.startswith(f"https://{rid}-8888.ports.example:8444/?gm_token=")
    assert opened.read_text().strip() == address


def test_open_has_help_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    from gpumarket.cli import main

    with pytest.raises(SystemExit) as done:
        main(["open", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "usage: gpumarket open" in out and "--browser" in out and "examples:" in out and ".gpumarket/ca/ca.crt" in out


# ---- how ssh and cp take options ----------------------------------------------------------------


@with_ssh_key
@needs_openssh
async def test_ssh_and_cp_take_the_same_options_before_their_target_and_their_programs_after_dashes(cli: Cli, api: Api, tmp_path: Path) -> None:
    await api.host(1)
    await relay_up(api)
    rid = await rented(cli, "--image", "ubuntu:24.04")
    await started(api, rid)
    key = tmp_path / "id_ed25519"
    ours = ["-i", str(key), "-o", "IdentitiesOnly=yes", "-q", "-vv"]

    code, out, err = await cli("ssh", "--dry-run", *ours, rid, "--", "-L", "8888:localhost:8888", "nvidia-smi", "-L")
    assert code == 0, err
    argv = shlex.split(out)
    handed = argv[argv.index("-i") :]
    assert handed == ["-i", str(key), "-q", "-vv", "-o", "IdentitiesOnly=yes", "-L", "8888:localhost:8888", "-o", "User=gpumarket",
                      f"{rid}.gpumarket", "nvidia-smi", "-L"]  # fmt: skip
    # ssh's options right after RENTAL still pass through, as before.
    code, out, err = await cli("ssh", "--dry-run", rid, "-i", str(key), "true")
    assert code == 0 and shlex.split(out)[-6:] == ["-i", str(key), "-o", "User=gpumarket", f"{rid}.gpumarket", "true"], err

    code, out, err = await cli("cp", "--dry-run", *ours, "data", f"{rid}:in/", "--", "-l", "8000")
    assert code == 0, err
    argv = shlex.split(out)
    assert argv[argv.index("-i") :] == ["-i", str(key), "-q", "-vv", "-o", "IdentitiesOnly=yes", "-l", "8000", "-o", "User=gpumarket",
                                        "data", f"{rid}.gpumarket:in/"]  # fmt: skip
    code, _, err = await cli("cp", "data", f"{rid}:in/", "more")
    assert code == 2 and "one SRC and one DST" in one_line(err)
    code, _, err = await cli("cp", "data", f"{rid}:in/", "--", "-l")
    assert code == 2 and "-l needs a value" in one_line(err)


def test_scp_options_split_from_the_rest() -> None:
    assert split_options(["-l", "100", "-C", "-P22"], SCP_OPTIONS_WITH_VALUE, "scp") == (["-l", "100", "-C", "-P22"], [])
    assert split_options(["-C", "x"], SCP_OPTIONS_WITH_VALUE, "scp") == (["-C"], ["x"])


def test_the_cp_and_ssh_help_show_the_same_options(capsys: pytest.CaptureFixture[str]) -> None:
    from gpumarket.cli import main

    for command in ("ssh", "cp"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        for option in ("-i KEY", "-o OPTION", "-q", "-v", "--dry-run"):
            assert option in out, (command, option)


def test_hints_are_found_in_backticks_and_after_labels() -> None:
    text = "shell: gpumarket ssh r-1; files: gpumarket cp FILE r-1:\nsee `gpumarket cluster show c-1`, or (`gpumarket offers` lists)"
    assert hints(text) == [["ssh", "r-1"], ["cp", "FILE", "r-1:"], ["cluster", "show", "c-1"], ["offers"]]
    assert hints("gpumarket: rental r-1 failed") == []


# ---- login --browser ----------------------------------------------------------------------------


async def test_an_expired_browser_sign_in_names_the_login_command_with_its_url(cli: Cli, api: Api) -> None:
    """The API's hint, `gpumarket login --browser`, fails without a saved login ("which API?"): the CLI names the URL.
    Run again, the hint starts a new sign-in (the second code), which would save a key once approved in the console."""
    cli.env(url=None, key=None)

    async def expire_codes(count: int) -> None:
        async with api.master.db.session() as session:
            rows = (await session.scalars(select(DeviceCode))).all()
            assert len(rows) == count
            for row in rows:
                row.expires_at = datetime.now(UTC) - timedelta(minutes=1)

    task = cli.start("login", "--api", cli.url, "--browser")
    await eventually(lambda: _async("approve the code" in cli.peek()[1]), what="the sign-in's link and code")
    await expire_codes(1)
    assert await task == 1
    _, err = cli.take()
    [hint] = hints(err.splitlines()[-1])
    assert hint == ["login", "--api", cli.url, "--browser"] and "(expired_token)" in err
    again = cli.start(*hint)
    await eventually(lambda: _async("approve the code" in cli.peek()[1]), what="the new sign-in's link and code")
    await expire_codes(2)
    assert await again == 1
