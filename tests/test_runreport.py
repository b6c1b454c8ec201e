"""Tests for the run report's folders (tests/runreport.py): a long run that ends after many short ones keeps its own."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests import runreport


def test_a_run_that_started_before_the_kept_ones_keeps_its_own_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUMARKET_TEST_REPORT_DIR", str(tmp_path))
    now = time.time()
    newer = [runreport._new_run_dir(now - 60 + n) for n in range(runreport.KEEP + 3)]  # short runs that ended meanwhile
    folder = runreport._new_run_dir(now - 600)  # a long run, started ten minutes ago, ends last

    assert folder.is_dir()
    kept = sorted(path for path in tmp_path.iterdir() if path.is_dir() and not path.is_symlink())
    assert len(kept) == runreport.KEEP and folder in kept
    assert kept[1:] == newer[-(runreport.KEEP - 1):]  # the oldest of the others went
    assert (tmp_path / "latest").resolve() == folder.resolve()
