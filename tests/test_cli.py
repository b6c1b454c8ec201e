"""The `gpumarket` command line: help everywhere, and errors that say what to do next."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumarket.cli import main
from shared.crypto import CertificateAuthority

COMMANDS = [[], ["up"], ["master"], ["access"], ["dns"], ["agent"], ["agent", "run"], ["agent", "enroll"], ["agent", "record-nvml"], ["simulate"], ["worker"], ["admin"],
            ["admin", "create-account"], ["admin", "disable-account"], ["admin", "enable-account"], ["admin", "issue-relay-cert"]]


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

    @pytest.mark.timeout(30)  # the bug: the command waited for a signal after its agent had stopped
    def test_a_revoked_agent_exits_with_one_line_saying_to_enroll_again(
        self, tmp_path: Path, ca: CertificateAuthority, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Regression (issue 21): `agent run` kept waiting after its agent stopped. Refused as revoked by a real
        relay, the command exits 2, its last line the reason and what to do."""
        from access.relay import Relay
        from shared.bus import InProcessBus
        from shared.crypto import load_certificate
        from shared.registry import MemoryRegistry
        from tests.agents import enrolled_state
        from tests.loopthread import LoopThread
        from tests.pki import relay_server_context

        state = enrolled_state(ca, tmp_path / "agent", "h-cli-revoked")
        registry = MemoryRegistry()
        with LoopThread() as loop:
            loop.run(registry.revoke(format(load_certificate(state.cert_file.read_bytes()).serial_number, "040x"), until=4e9))

            async def start() -> Relay:
                relay = Relay(relay_id="relay-cli", bus=InProcessBus(), ssl_context=relay_server_context(ca, tmp_path / "relay"),
                              host="127.0.0.1", port=0, registry=registry)
                await relay.start()
                return relay

            relay = loop.run(start())
            try:
                with pytest.raises(SystemExit) as done:
                    main(["agent", "run", "--data-dir", str(state.dir), "--gpus", "sim:RTX4090", "--relay-url", relay.url])
            finally:
                loop.run(relay.close())
        assert done.value.code == 2
        last = capsys.readouterr().err.rstrip("\n").rsplit("\n", 1)[-1]
        assert last.startswith("gpumarket: error: this host's certificate was revoked") and "enroll again" in last

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
