"""``--help`` of every ``gpumarket`` command and subcommand: it answers, and it shows no internal name."""

from __future__ import annotations

import argparse
import re

import pytest

from gpumarket.cli import build_parser, main

# What leaks when a default or a type is printed as Python sees it rather than as a user should.
INTERNAL = re.compile(r"PydanticUndefined|Undefined|<function |<class |object at 0x|%\(default\)|lambda")


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path under ``parser`` (``()`` for ``gpumarket`` itself), from its subparsers."""
    found = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, (*prefix, name))
    return found


COMMANDS = _commands(build_parser())


def test_the_walk_finds_every_level_of_commands() -> None:
    """The walk reaches the top, the commands and their actions (so the test below covers them all)."""
    assert () in COMMANDS
    assert {("up",), ("master",), ("agent", "enroll"), ("admin", "create-account"), ("offers",)} <= set(COMMANDS)
    assert len(COMMANDS) > 25


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c) or "gpumarket" for c in COMMANDS])
def test_help_answers_without_internal_names(command: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    """``gpumarket … --help`` exits 0 with a usage line and no Python-internal name (``PydanticUndefined`` and the like)."""
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gpumarket")
    leaked = INTERNAL.findall(out)
    assert not leaked, f"gpumarket {' '.join(command)} --help shows {leaked}"
