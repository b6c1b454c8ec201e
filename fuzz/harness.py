"""What every atheris harness in this folder shares: seed empty corpora, then fuzz."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import atheris


def seed_empty_corpora(argv: list[str], inputs: list[bytes]) -> None:
    """Write ``inputs`` into each corpus directory on the command line that exists and is empty."""
    for arg in argv[1:]:
        corpus = Path(arg)
        if not arg.startswith("-") and corpus.is_dir() and not any(corpus.iterdir()):
            for number, data in enumerate(inputs):
                (corpus / f"seed-{number:02}").write_bytes(data)


def fuzz(seeds: Callable[[], list[bytes]], test_one_input: Callable[[bytes], None]) -> None:
    """The harness's ``main``: libFuzzer's options come from the command line (see README.md)."""
    seed_empty_corpora(sys.argv, seeds())
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
