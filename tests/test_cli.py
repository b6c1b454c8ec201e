"""The `gpumarket` command line: help everywhere, and errors that say what to do next."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumarket.cli import main

COMMANDS = [[], ["up"], ["master"], ["access"], ["dns"], ["agent"], ["agent", "run"], ["agent", "enroll"], ["agent", "record-nvml"], ["simulate"], ["worker"], ["admin"],
            ["admin", "create-account"], ["admin", "issue-relay-cert"]]


class TestHelp:
    @pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "gpumarket")
    def test_every_command_has_help(self, command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
        """`--help` exits 0 and prints a usage line for every command."""
        with pytest.raises(SystemExit) as done:
            main([*command, "--help"])
        assert done.value.code == 0
        assert "usage: gpumarket" in capsys.readouterr().out

    def test_service_help_lists_environment_variables(self, capsys: pytest.CaptureFixture[str]) -> None:
        """The master's help names its GPUMARKET_* settings."""
        with pytest.raises(SystemExit):
            main(["master", "--help"])
        out = capsys.readouterr().out
        assert "GPUMARKET_DATABASE_URL" in out and "GPUMARKET_REDIS_URL" in out


class TestErrors:
    def test_running_an_unenrolled_agent_says_how_to_enroll(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """An agent without an identity exits 2 and names the enroll command."""
        with pytest.raises(SystemExit) as done:
            main(["agent", "run", "--data-dir", str(tmp_path), "--gpus", "sim:RTX4090"])
        assert done.value.code == 2
        assert "gpumarket agent enroll" in capsys.readouterr().err

    def test_the_nvml_backend_without_a_driver_is_one_clear_line(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """On this driverless machine, `agent run --gpus nvml` exits 2 with one line naming the driver and the other backends."""
        with pytest.raises(SystemExit) as done:
            main(["agent", "run", "--data-dir", str(tmp_path), "--gpus", "nvml"])
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert "NVIDIA driver" in err and "sim:" in err

    def test_recording_without_a_driver_says_so(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """`agent record-nvml` on a driverless host fails clearly and writes nothing."""
        with pytest.raises(SystemExit) as done:
            main(["agent", "record-nvml", "--out", str(tmp_path / "r.json"), "--seconds", "0.1"])
        assert done.value.code == 2
        assert "NVIDIA driver" in capsys.readouterr().err
        assert not (tmp_path / "r.json").exists()

    def test_a_standalone_master_needs_the_bus(self, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
        """Without GPUMARKET_REDIS_URL the master refuses to start and says which setting is missing."""
        monkeypatch.delenv("GPUMARKET_REDIS_URL", raising=False)
        monkeypatch.setenv("GPUMARKET_DATA_DIR", str(tmp_path))
        with pytest.raises(SystemExit) as done:
            main(["master", "--http-port", "0"])
        assert done.value.code == 2
        assert "GPUMARKET_REDIS_URL" in capsys.readouterr().err

    def test_enrolling_against_an_unreachable_master_is_explained(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A master URL nobody answers at gives an error naming --master, not a traceback."""
        with pytest.raises(SystemExit) as done:
            main(["agent", "enroll", "--master", "http://127.0.0.1:9", "--token", "gmt_x", "--data-dir", str(tmp_path)])
        assert done.value.code == 2
        assert "--master" in capsys.readouterr().err
        assert not (tmp_path / "key.pem").exists()

    def test_a_relay_without_certificates_says_how_to_get_them(self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
        """The relay names the missing TLS settings and the command that issues them."""
        monkeypatch.setenv("GPUMARKET_REDIS_URL", "redis://127.0.0.1:6379/0")
        for name in ("CERT_FILE", "KEY_FILE", "CA_FILE"):
            monkeypatch.delenv(f"GPUMARKET_{name}", raising=False)
        with pytest.raises(SystemExit) as done:
            main(["access", "--port", "0"])
        assert done.value.code == 2
        assert "issue-relay-cert" in capsys.readouterr().err
