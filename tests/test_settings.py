"""Typed settings: TOML file, GPUMARKET_* environment, overrides, in that order of strength."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.errors import ConfigError
from shared.settings import AccessSettings, AgentSettings, MasterSettings


class TestSettings:
    def test_precedence_is_override_then_env_then_file_then_default(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A flag beats the environment, which beats the file, which beats the default."""
        config = tmp_path / "gpumarket.toml"
        config.write_text('log_level = "DEBUG"\n[master]\nhttp_port = 9001\nheartbeat_interval = 5.0\n')
        monkeypatch.setenv("GPUMARKET_HTTP_PORT", "9002")
        from_env = MasterSettings.load(config)
        assert (from_env.http_port, from_env.heartbeat_interval, from_env.log_level) == (9002, 5.0, "DEBUG")
        assert MasterSettings.load(config, http_port=9003).http_port == 9003
        assert MasterSettings.load(config, http_port=None).http_port == 9002  # unset flag falls through
        assert MasterSettings.load().telemetry_interval == 10.0

    def test_each_service_reads_its_own_table(self, tmp_path: Path) -> None:
        """[access] values do not leak into the agent's settings."""
        config = tmp_path / "c.toml"
        config.write_text('[access]\nrelay_id = "eu-1"\nport = 9443\n[agent]\ngpus = "sim:2xRTX4090"\n')
        assert AccessSettings.load(config).relay_id == "eu-1"
        assert AgentSettings.load(config).gpus == "sim:2xRTX4090"

    def test_unknown_keys_and_bad_values_name_the_setting(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """Errors say which setting is wrong."""
        config = tmp_path / "c.toml"
        config.write_text("[master]\nhttp_prot = 1\n")
        with pytest.raises(ConfigError, match="http_prot"):
            MasterSettings.load(config)
        monkeypatch.setenv("GPUMARKET_HEARTBEAT_INTERVAL", "-1")
        with pytest.raises(ConfigError, match="GPUMARKET_HEARTBEAT_INTERVAL"):
            MasterSettings.load()

    def test_missing_or_broken_file_is_a_clear_error(self, tmp_path: Path) -> None:
        """A config path that does not exist, or is not TOML, is refused with its path."""
        with pytest.raises(ConfigError, match="does not exist"):
            MasterSettings.load(tmp_path / "nope.toml")
        broken = tmp_path / "broken.toml"
        broken.write_text("[master\n")
        with pytest.raises(ConfigError, match="not valid TOML"):
            MasterSettings.load(broken)

    def test_describe_lists_every_environment_variable(self) -> None:
        """--help text names each GPUMARKET_ variable."""
        text = AccessSettings.describe()
        for name in AccessSettings.model_fields:
            assert f"GPUMARKET_{name.upper()}" in text
