"""The event loop a process runs on (``shared.eventloop``): uvloop where it imports, asyncio's own when asked."""

from __future__ import annotations

import asyncio

import pytest

from shared import eventloop
from shared.errors import ConfigError


async def running_loop_name() -> str:
    await asyncio.sleep(0)
    return eventloop.loop_name()


class TestRun:
    def test_auto_runs_on_uvloop_where_it_imports(self) -> None:
        """The default is uvloop, a dependency of the project (installed here)."""
        pytest.importorskip("uvloop")
        assert eventloop.run(running_loop_name(), kind="auto") == "uvloop"

    def test_asyncio_runs_on_the_standard_loop(self) -> None:
        """``asyncio`` is asyncio's own loop, whatever is installed."""
        assert eventloop.run(running_loop_name(), kind="asyncio") == "asyncio"

    def test_the_environment_picks_the_loop_when_the_caller_does_not(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """``GPUMARKET_EVENT_LOOP`` decides for ``kind=None`` (the relay's and the agent's CLI commands)."""
        monkeypatch.setenv(eventloop.LOOP_ENV, "asyncio")
        assert eventloop.run(running_loop_name()) == "asyncio"

    def test_an_unknown_kind_is_a_config_error_naming_the_setting(self) -> None:
        """A typo in the setting fails at start with the choices, not with a loop that is not the one asked for."""
        with pytest.raises(ConfigError, match="GPUMARKET_EVENT_LOOP must be one of auto, uvloop, asyncio"):
            eventloop.loop_factory("uv")
