"""What `gpumarket up` says on the terminal: one line per step, then the box; logs in a file; a busy port in one line."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

STEPS = ("mail sink", "database", "relay", "geo DNS", "API", "demo image", "challenge", "agents")
STOP_WITHIN_S = 20
START_WITHIN_S = 90


def _up(data_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gpumarket", "up", "--data-dir", str(data_dir), "--agents", "1", *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "GPUMARKET_RATE_LIMITS_ENABLED": "false"}


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A TCP port that something else listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


@contextlib.contextmanager
def _held_port_after_a_free_one() -> Iterator[int]:
    """A port held here whose predecessor was free a moment ago (the suite's other workers bind ports too: a CI run
    once found the predecessor of a random held port taken)."""
    for _ in range(50):
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            port = int(holder.getsockname()[1])
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port - 1))
                except OSError:
                    continue
            yield port
            return
    raise AssertionError("no free port right below a held one in 50 tries")


def _run_until_ready(data_dir: Path, *extra: str, while_up: Callable[[str], None] = lambda box: None) -> tuple[str, str]:
    """Start `up` on free ports, read its terminal until the box closes, call ``while_up`` with what it said, Ctrl-C
    it; its stdout and stderr."""
    process = subprocess.Popen(
        _up(data_dir, "--http-port", "0", "--relay-port", "0", *extra),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    assert process.stdout is not None
    lines: list[str] = []
    try:
        for line in process.stdout:
            lines.append(line)
            if "Press Ctrl-C to stop." in line:
                lines.append(process.stdout.readline())  # the box's bottom edge
                break
        else:
            raise AssertionError(f"gpumarket up exited early ({process.wait()}):\n{''.join(lines)}")
        while_up("".join(lines))
        process.send_signal(signal.SIGINT)
        rest, err = process.communicate(timeout=STOP_WITHIN_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    return "".join(lines) + rest, err


def _docs_answer(box: str) -> None:
    """The API docs line of the box names a page that the running `up` serves."""
    [docs] = [line.split()[3] for line in box.splitlines() if "API docs" in line]
    assert docs.endswith("/api/docs"), docs
    with urllib.request.urlopen(docs, timeout=10) as page:
        assert page.status == 200 and b"swagger-ui" in page.read()


def _metrics_answer(box: str, credentials: Path) -> None:
    """The metrics line of the box names /metrics and its token, as credentials.json does; the token opens it, and
    nothing else does (issue 39: /metrics answered anyone)."""
    [line] = [line for line in box.splitlines() if "metrics   " in line]
    found = re.search(r"metrics\s+(\S+) \(Authorization: Bearer (\S+)\)", line)
    assert found is not None, line
    url, token = found.groups()
    assert json.loads(credentials.read_text())["metrics"] == {"url": url, "token": token}
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=10)
    assert refused.value.code == 401
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"}), timeout=10) as page:
        assert page.status == 200 and b"gpumarket_" in page.read()


class TestTerminal:
    def test_one_line_per_step_then_the_box_and_logs_only_in_the_file(self, tmp_path: Path) -> None:
        """Steps are one line each in order, the box shows the console, the three keys, where mail lands, API, docs,
        /metrics with its token and Ctrl-C, the reference and the metrics the box points at are served by the running
        `up`, and the INFO logs are in DATA_DIR/up.log, not on the terminal. (One `up` for all of it: each start costs
        seconds of CPU.)"""
        data_dir = tmp_path / "up"

        def while_up(box: str) -> None:
            _docs_answer(box)
            _metrics_answer(box, data_dir / "credentials.json")

        out, err = _run_until_ready(data_dir, while_up=while_up)
        creds = json.loads((data_dir / "credentials.json").read_text())
        step_lines = [line for line in out.splitlines() if line.startswith("  ok  ")]
        assert [line[6:].split("  ")[0].strip() for line in step_lines] == list(STEPS)
        box = out[out.index("gpumarket is up"):]
        assert creds["console_url"] in box and creds["api_url"] in box
        assert creds["api_url"].removesuffix("/v1") + "/docs" in box
        for role in ("renter", "provider", "admin"):
            assert re.search(rf"{role}\s+{re.escape(creds[role]['api_key'])}", box), role
        assert f"its mail lands in {data_dir.resolve() / 'mail'}/" in box  # sign-up's links, offline (docs/accounts.md)
        assert re.search(r"CLI\s+\S*gpumarket", box)  # how to run the CLI: on the PATH, or .venv's
        assert out.rstrip().splitlines()[-1] == "stopped cleanly"
        log = (data_dir / "up.log").read_text()
        assert " INFO " in log and " master." in log  # the master logs what it starts…
        assert " INFO " not in out + err  # …there, not here
        assert (data_dir / "up.log").stat().st_mode & 0o077 == 0

    def test_verbose_brings_the_logs_to_the_terminal(self, tmp_path: Path) -> None:
        """With --verbose the same log lines also reach stderr."""
        _, err = _run_until_ready(tmp_path / "up", "--verbose")
        assert " INFO " in err and " master." in err


class TestBusyPort:
    @pytest.mark.parametrize("flag", ["--http-port", "--relay-port", "--dns-port"])
    def test_a_busy_port_is_one_line_naming_it_and_its_flag(self, tmp_path: Path, taken_port: int, flag: str) -> None:
        """A port in use: exit 2, one line on stderr naming the port and the flag, nothing else, no traceback."""
        ports = {"--http-port": "0", "--relay-port": "0", "--dns-port": "0", flag: str(taken_port)}
        args = [part for item in ports.items() for part in item]
        result = subprocess.run(_up(tmp_path / "up", *args), capture_output=True, text=True, env=_env(), timeout=60)
        assert result.returncode == 2
        assert result.stdout == ""
        assert result.stderr == f"gpumarket: error: port {taken_port} is in use; choose another with {flag}\n"

    def test_the_relays_web_port_is_the_one_after_the_relay_port(self, tmp_path: Path) -> None:
        """The web ports listen on relay port + 1: that one taken names it, and --relay-port as the way out."""
        with _held_port_after_a_free_one() as taken_port:
            args = ["--http-port", "0", "--relay-port", str(taken_port - 1)]
            result = subprocess.run(_up(tmp_path / "up", *args), capture_output=True, text=True, env=_env(), timeout=60)
        assert result.returncode == 2
        assert result.stderr.startswith(f"gpumarket: error: port {taken_port} is in use (the relay's web ports")
        assert result.stderr.endswith("choose another with --relay-port\n")
        assert result.stderr.count("\n") == 1
