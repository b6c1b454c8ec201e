"""`gpumarket tunnel | ssh | ssh-config | cp` as a user runs them: real processes, the system's
OpenSSH client, a real TLS websocket relay and a real SSH/SFTP server (tests/tunnelharness.py).

Each command runs as ``python -m gpumarket`` from an empty folder with the checkout on
PYTHONPATH, as ssh runs the ProxyCommand: nothing is mocked between ssh and the SSH server.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import socket
import stat
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from gpumarket.cli import main
from gpumarket.renter.api import ApiError
from gpumarket.renter.connect import BadAnswer, parse_ticket
from gpumarket.renter.sshcmds import Location, split_ssh_args
from gpumarket.renter.sshfiles import update_known_hosts
from gpumarket.renter.stdio import loop_kind
from shared.crypto import CertificateAuthority
from tests.tunnelharness import (
    API_KEY,
    CLOSING_PORT,
    ECHO_PORT,
    NO_SSH_RENTAL,
    RELAY_CLOSE,
    SPEAKER_PORT,
    SPOKEN,
    SSH_RENTAL,
    STOPPED_RENTAL,
    UNKNOWN_TICKET_PORT,
    WRONG_KEY_RENTAL,
    Market,
    alias,
    running_market,
)

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ["ssh", "ssh-config", "cp", "tunnel"]
SSH = shutil.which("ssh")
# Only a guard against a hang: each command starts two or three Python processes (the CLI, ssh's ProxyCommand),
# which took longer than 15 s together on a loaded 2-core CI machine (fresh run 39).
HANG_S = 120


def test_openssh_is_installed() -> None:
    assert SSH and shutil.which("scp"), "install OpenSSH's client: apt-get install -y openssh-client (make docker does)"


@pytest.fixture
def client_key(tmp_path: Path) -> tuple[Path, str]:
    """The renter's SSH key: a private key file for ssh -i, and its public line for the server."""
    key = asyncssh.generate_private_key("ssh-ed25519")
    path = tmp_path / "id_ed25519"
    key.write_private_key(str(path))
    path.chmod(0o600)
    return path, key.export_public_key().decode()


@pytest.fixture
async def market(tmp_path: Path, client_key: tuple[Path, str]) -> AsyncIterator[Market]:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca")
    async with running_market(tmp_path, ca, client_key[1]) as market:
        yield market


class Gm:
    """Runs ``python -m gpumarket ...`` as a process, logged in to the market through the environment."""

    def __init__(self, market: Market, tmp: Path, key: Path) -> None:
        self.market, self.key = market, key
        self.home, self.config = tmp / "home", tmp / "config"
        self.cwd = tmp / "cwd"
        for folder in (self.home, self.cwd):
            folder.mkdir()
        self.environ = {k: v for k, v in os.environ.items() if not k.startswith("GPUMARKET_")}
        self.environ.update(
            GPUMARKET_API_URL=market.api_url, GPUMARKET_API_KEY=API_KEY, XDG_CONFIG_HOME=str(self.config),
            HOME=str(self.home), PYTHONPATH=str(ROOT),
        )  # fmt: skip
        # Only this key, no agent, no prompts: the tests' ssh depends on nothing of this machine's user.
        self.login = ["-i", str(key), "-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none", "-o", "BatchMode=yes"]

    @property
    def known_hosts(self) -> Path:
        return self.config / "gpumarket" / "known_hosts"

    async def start(self, *argv: str, program: str | None = None, stdout: Any = asyncio.subprocess.PIPE) -> asyncio.subprocess.Process:
        command = [program] if program else [sys.executable, "-m", "gpumarket"]
        return await asyncio.create_subprocess_exec(
            *command, *argv, stdin=asyncio.subprocess.PIPE, stdout=stdout,
            stderr=asyncio.subprocess.PIPE, env=self.environ, cwd=self.cwd,
        )  # fmt: skip

    async def __call__(self, *argv: str, stdin: bytes = b"", program: str | None = None) -> tuple[int, bytes, str]:
        process = await self.start(*argv, program=program)
        async with asyncio.timeout(HANG_S):
            out, err = await process.communicate(stdin)
        assert process.returncode is not None
        return process.returncode, out, err.decode(errors="replace")


@pytest.fixture
def gm(market: Market, tmp_path: Path, client_key: tuple[Path, str]) -> Gm:
    return Gm(market, tmp_path, client_key[0])


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("gpumarket: "), err
    return err


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_examples(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: gpumarket {command}" in out and "examples:" in out


# ---- tunnel ---------------------------------------------------------------------------------------


async def test_the_tunnel_carries_5_mb_both_ways_binary_safe(gm: Gm, market: Market) -> None:
    data = os.urandom(5 * 2**20)
    process = await gm.start("tunnel", SSH_RENTAL, "--port", str(ECHO_PORT))
    assert process.stdin and process.stdout and process.stderr

    async def feed() -> None:
        assert process.stdin
        process.stdin.write(data)
        await process.stdin.drain()

    async with asyncio.timeout(HANG_S):
        feeding = asyncio.create_task(feed())
        echoed = await process.stdout.readexactly(len(data))
        await feeding
        # Bytes come back as they go, not at EOF: one more byte is echoed while stdin is still open.
        process.stdin.write(b"\x00")
        assert await process.stdout.readexactly(1) == b"\x00"
        process.stdin.close()  # EOF: the tunnel closes the websocket normally and exits
        assert await process.wait() == 0, await process.stderr.read()
    assert hashlib.sha256(echoed).hexdigest() == hashlib.sha256(data).hexdigest()
    assert await process.stdout.read() == b""
    assert market.relay_closes == [1000]


async def test_the_far_end_finishing_ends_the_tunnel_with_all_its_bytes(gm: Gm) -> None:
    process = await gm.start("tunnel", SSH_RENTAL, "--port", str(SPEAKER_PORT))
    assert process.stdout and process.stderr
    async with asyncio.timeout(HANG_S):
        out = await process.stdout.read()  # stdin stays open: the relay's 1000 alone ends it
        assert await process.wait() == 0, await process.stderr.read()
    assert out == SPOKEN


async def test_stdout_may_be_a_regular_file(gm: Gm, tmp_path: Path) -> None:
    with (tmp_path / "out.bin").open("wb") as out:
        process = await gm.start("tunnel", SSH_RENTAL, "--port", str(SPEAKER_PORT), stdout=out)
        async with asyncio.timeout(HANG_S):
            assert await process.wait() == 0
    assert (tmp_path / "out.bin").read_bytes() == SPOKEN


class TestLoopKind:
    def test_pipes_and_sockets_run_on_uvloop(self) -> None:
        """ssh gives its ProxyCommand pipes (or a socket): the tunnel may run on uvloop (issue 42)."""
        read_end, write_end = os.pipe()
        ours, theirs = socket.socketpair()
        try:
            assert loop_kind(stdin_fd=read_end, stdout_fd=write_end) == "auto"
            assert loop_kind(stdin_fd=ours.fileno(), stdout_fd=theirs.fileno()) == "auto"
            assert loop_kind(stdin_fd=ours.fileno(), stdout_fd=write_end) == "auto"
        finally:
            for fd in (read_end, write_end):
                os.close(fd)
            ours.close()
            theirs.close()

    def test_a_regular_file_or_dev_null_keeps_asyncio(self, tmp_path: Path) -> None:
        """uvloop aborts writing a regular file from a thread: either end being one keeps asyncio's loop."""
        read_end, write_end = os.pipe()
        try:
            with (tmp_path / "out.bin").open("wb") as out, open(os.devnull, "rb") as null:
                assert loop_kind(stdin_fd=read_end, stdout_fd=out.fileno()) == "asyncio"
                assert loop_kind(stdin_fd=null.fileno(), stdout_fd=write_end) == "asyncio"
            assert loop_kind(stdin_fd=read_end, stdout_fd=9999) == "asyncio"  # not open
        finally:
            for fd in (read_end, write_end):
                os.close(fd)


async def test_sighup_from_ssh_closes_the_websocket_normally(gm: Gm, market: Market) -> None:
    process = await gm.start("tunnel", SSH_RENTAL, "--port", str(ECHO_PORT))
    assert process.stdin and process.stdout
    process.stdin.write(b"ping")
    async with asyncio.timeout(HANG_S):
        assert await process.stdout.readexactly(4) == b"ping"
        process.send_signal(signal.SIGHUP)  # what ssh sends its ProxyCommand as it exits
        assert await process.wait() == 0
    assert market.relay_closes == [1000]


async def test_a_relay_close_code_is_one_line_with_its_reason(gm: Gm) -> None:
    process = await gm.start("tunnel", SSH_RENTAL, "--port", str(CLOSING_PORT))
    assert process.stdout and process.stderr
    async with asyncio.timeout(HANG_S):  # stdin stays open, as ssh keeps it: the relay's close alone ends it
        code, out, err = await process.wait(), await process.stdout.read(), (await process.stderr.read()).decode()
    assert code == 255 and out == b""
    assert f"{RELAY_CLOSE[1]} ({RELAY_CLOSE[0]})" in one_line(err)


async def test_a_refused_handshake_is_the_relays_line(gm: Gm) -> None:
    code, _, err = await gm("tunnel", SSH_RENTAL, "--port", str(UNKNOWN_TICKET_PORT))
    assert code == 255
    assert "the relay refused the tunnel: ticket unknown or expired: ask the API for a new one (HTTP 403)" in one_line(err)


@pytest.mark.parametrize(
    ("rental", "port", "error"),
    [
        (STOPPED_RENTAL, "ssh", "(rental_not_running); `gpumarket rentals`"),
        (SSH_RENTAL, "9999", "(port_not_declared)"),
        ("r-0000000000000404", "ssh", "(rental_not_found)"),
        (NO_SSH_RENTAL, "ssh", "(no_ssh_host_key)"),
    ],
)
async def test_api_refusals_are_one_line_exit_255(gm: Gm, rental: str, port: str, error: str) -> None:
    code, _, err = await gm("tunnel", rental, "--port", port)
    assert code == 255 and error in one_line(err)


async def test_a_relay_certificate_from_another_ca_is_refused(gm: Gm, market: Market, tmp_path: Path) -> None:
    market.ca_pem = CertificateAuthority.load_or_create(tmp_path / "other-ca").cert_pem.decode()
    code, _, err = await gm("tunnel", SSH_RENTAL, "--port", str(ECHO_PORT))
    assert code == 255 and "certificate" in one_line(err) and "not connecting" in err


# ---- ssh ------------------------------------------------------------------------------------------


async def test_ssh_runs_a_command_on_the_rental_with_its_pinned_key(gm: Gm, market: Market) -> None:
    for _ in range(2):
        code, out, err = await gm("ssh", SSH_RENTAL, "-F", "/dev/null", *gm.login, "--", "nvidia-smi", "-L")
        assert code == 0, err
        assert out.decode() == "hello gpumarket, you ran: nvidia-smi -L\n"
    assert market.ssh_users == ["gpumarket", "gpumarket"]
    lines = gm.known_hosts.read_text().splitlines()  # replaced, not duplicated
    assert lines == [f"{alias(SSH_RENTAL)} {market.host_key_line} rental={SSH_RENTAL}"]
    assert stat.S_IMODE(gm.known_hosts.stat().st_mode) == 0o600


async def test_ssh_refuses_a_host_key_other_than_the_pinned_one(gm: Gm, market: Market) -> None:
    code, out, err = await gm("ssh", WRONG_KEY_RENTAL, "-F", "/dev/null", *gm.login, "true")
    assert code == 255 and out == b""
    assert "Host key verification failed" in err
    assert market.ssh_users == []


async def test_ssh_without_openssh_says_what_to_install(gm: Gm) -> None:
    gm.environ["PATH"] = str(gm.cwd)
    code, _, err = await gm("ssh", SSH_RENTAL)
    assert code == 2 and "apt install openssh-client" in one_line(err)


async def test_ssh_with_a_stopped_rental_fails_before_ssh_runs(gm: Gm) -> None:
    code, _, err = await gm("ssh", STOPPED_RENTAL)
    assert code == 1 and "(rental_not_running)" in one_line(err)


# ---- ssh-config -----------------------------------------------------------------------------------


async def test_ssh_config_entries_work_with_plain_ssh(gm: Gm, market: Market, tmp_path: Path) -> None:
    gm.known_hosts.parent.mkdir(parents=True)
    gm.known_hosts.write_text(f"old.gpumarket ssh-ed25519 AAAA rental={STOPPED_RENTAL}\nmine.example ssh-ed25519 BBBB\n")
    code, out, err = await gm("ssh-config")
    assert code == 0, err
    assert f"# {NO_SSH_RENTAL}: skipped" in err
    text = out.decode()
    hosts = [line.split()[1:] for line in text.splitlines() if line.startswith("Host ")]
    assert hosts == [[alias(SSH_RENTAL), SSH_RENTAL], [alias(WRONG_KEY_RENTAL), WRONG_KEY_RENTAL]]
    assert "StrictHostKeyChecking yes" in text and f"UserKnownHostsFile {gm.known_hosts}" in text
    # The stopped rental's line is pruned, the user's own line kept, the running ones pinned.
    assert sorted(line.split()[0] for line in gm.known_hosts.read_text().splitlines()) == sorted(
        [alias(SSH_RENTAL), alias(WRONG_KEY_RENTAL), "mine.example"]
    )

    config = tmp_path / "ssh_config"
    config.write_text(text)
    code, out, err = await gm("-F", str(config), *gm.login, SSH_RENTAL, "uname", program=SSH)
    assert code == 0 and out == b"hello gpumarket, you ran: uname\n", err
    code, out, err = await gm("-F", str(config), *gm.login, alias(WRONG_KEY_RENTAL), "uname", program=SSH)
    assert code == 255 and "Host key verification failed" in err

    code, out, err = await gm("ssh-config", "--write")
    assert code == 0, err
    written = gm.config / "gpumarket" / "ssh_config"
    assert text in written.read_text() and stat.S_IMODE(written.stat().st_mode) == 0o600
    assert "Include ~/.config/gpumarket/ssh_config" not in out.decode()  # XDG_CONFIG_HOME is elsewhere here
    assert f"Include {written}" in out.decode()
    assert not (gm.home / ".ssh").exists()  # never touched


# ---- cp -------------------------------------------------------------------------------------------


async def test_cp_copies_folders_both_ways_relative_to_the_workspace(gm: Gm, market: Market, tmp_path: Path) -> None:
    folder = gm.cwd / "data"
    (folder / "sub").mkdir(parents=True)
    blob = os.urandom(300_000)
    (folder / "sub" / "blob.bin").write_bytes(blob)
    (folder / "a.txt").write_text("a\n")
    options = ["-q", "-i", str(gm.key), "-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none", "-o", "BatchMode=yes"]
    code, _, err = await gm("cp", *options, "data", f"{SSH_RENTAL}:")
    assert code == 0, err
    assert (market.workspace / "data" / "sub" / "blob.bin").read_bytes() == blob

    code, _, err = await gm("cp", *options, f"{SSH_RENTAL}:data/sub/blob.bin", "back.bin")
    assert code == 0, err
    assert (gm.cwd / "back.bin").read_bytes() == blob
    code, _, err = await gm("cp", *options, f"{SSH_RENTAL}:data", "copy")
    assert code == 0, err
    assert (gm.cwd / "copy" / "a.txt").read_text() == "a\n"

    code, _, err = await gm("cp", "a", "b")
    assert code == 2 and "RENTAL:path" in one_line(err)


# ---- pieces -------------------------------------------------------------------------------------


def test_ssh_args_split_into_options_and_command() -> None:
    assert split_ssh_args(["-i", "k", "-vL", "8:h:8", "-p22", "ls", "-la"]) == (["-i", "k", "-vL", "8:h:8", "-p22"], ["ls", "-la"])
    assert split_ssh_args(["-A", "--", "-x"]) == (["-A"], ["-x"])
    assert split_ssh_args([]) == ([], [])


def test_cp_locations() -> None:
    assert Location.parse("r-1:out/x") == Location("out/x", "r-1")
    assert Location.parse("/tmp/a:b") == Location("/tmp/a:b")
    assert Location.parse("./r-1:x").for_scp("h") == "./r-1:x"
    assert Location.parse("r-1:").for_scp("r-1.gpumarket") == "r-1.gpumarket:"


@pytest.mark.parametrize(
    "ssh",
    [
        {"host_key": "ssh-ed25519 AAAA\nHost *", "host_alias": "r-1.gpumarket", "user": "gpumarket"},
        {"host_key": "ssh-ed25519 AAAA", "host_alias": "r-1.gpumarket\n  ProxyCommand evil", "user": "gpumarket"},
        {"host_key": "ssh-ed25519 AAAA", "host_alias": "r-1.gpumarket", "user": "-oProxyCommand=evil"},
        None,
    ],
)
def test_a_ticket_that_would_inject_into_ssh_config_is_refused(ssh: dict[str, str] | None) -> None:
    body = {"rental_id": "r-1", "kind": "ssh", "port": 22, "relay_url": "wss://relay:1/v1/connect", "token": "t",
            "expires_at": "2026-11-26T05:40:00Z", "ca_pem": "-----BEGIN CERTIFICATE-----", "ssh": ssh}  # fmt: skip
    with pytest.raises(BadAnswer):
        parse_ticket(body, want_ssh=True)


def test_a_plain_ws_relay_url_is_refused() -> None:
    body = {"rental_id": "r-1", "kind": "tcp", "port": 80, "relay_url": "ws://relay:1/v1/connect", "token": "t",
            "expires_at": "x", "ca_pem": "-----BEGIN CERTIFICATE-----"}  # fmt: skip
    with pytest.raises(BadAnswer, match="not wss://"):
        parse_ticket(body, want_ssh=False)


def test_known_hosts_lines_are_replaced_not_duplicated(tmp_path: Path) -> None:
    path = tmp_path / "gm" / "known_hosts"
    update_known_hosts(path, {"a.gm": "a.gm ssh-ed25519 K1 rental=r-a"})
    update_known_hosts(path, {"b.gm": "b.gm ssh-ed25519 K2 rental=r-b"})
    update_known_hosts(path, {"a.gm": "a.gm ssh-ed25519 K3 rental=r-a"}, drop=lambda rid: rid == "r-b")
    assert path.read_text() == "a.gm ssh-ed25519 K3 rental=r-a\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_connect_errors_say_what_to_do_next() -> None:
    exc = ApiError(409, "host_offline", "The host is offline.")
    assert "try again in a minute" in exc.message
