"""Assertion rewriting once per run, before pytest-xdist's workers start.

pytest rewrites each test module's asserts (an AST pass in Python) on import and caches the result in
``__pycache__/*.pyc`` beside it. On a fresh clone, as in CI, there is no cache yet and every xdist worker imports
every module at the same moment, so each of them rewrites all of them: about 13 s of CPU per worker for the suite's
~48k lines (2026-11-29), four times over. ``rewrite_test_modules`` writes those caches first, on as many processes as
there are cores, in pytest's own format (``_pytest.assertion.rewrite``: the cache of a module is valid for its source
hash only, so a stale or foreign file is never used), and the workers then load them. Anything that keeps it from
working leaves the rewriting to the workers, as before: it is only a cache.
"""

from __future__ import annotations

import contextlib
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest


def _rewrite(path: str) -> None:
    """Write ``path``'s rewritten byte code where pytest looks for it, unless a current one is there."""
    from _pytest.assertion import rewrite

    source = Path(path)
    pyc = rewrite.get_cache_dir(source) / (source.name[:-3] + rewrite.PYC_TAIL)
    if rewrite._read_pyc(source, pyc) is not None:
        return
    source_hash, code = rewrite._rewrite_test(source, None)  # type: ignore[arg-type]  # None: no pass hook
    if not rewrite.try_makedirs(pyc.parent):
        return
    partial = f"{pyc}.{os.getpid()}"
    with open(partial, "wb") as out:
        rewrite._write_pyc_fp(out, source_hash, code)
    os.replace(partial, pyc)


def rewrite_test_modules(config: pytest.Config, folder: Path) -> None:
    """Rewrite the test modules under ``folder`` as pytest would, in parallel, when pytest would cache them."""
    if (
        sys.dont_write_bytecode
        or config.getoption("assertmode") != "rewrite"
        or config.getini("enable_assertion_pass_hook")
        or config.getini("python_files") != ["test_*.py", "*_test.py"]
    ):
        return
    paths = sorted(str(path) for path in folder.rglob("test_*.py") if "__pycache__" not in path.parts)
    with contextlib.suppress(Exception), ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(_rewrite, paths, chunksize=4))
