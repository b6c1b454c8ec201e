"""Running the libFuzzer harnesses in ``fuzz/`` (atheris) from the test suite, for a bounded number of inputs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FUZZ_DIR = ROOT / "fuzz"


def run_atheris_harness(harness: str, tmp_path: Path, *, runs: int, options: tuple[str, ...] = ()) -> None:
    """Run ``fuzz/<harness>`` for ``runs`` inputs from its seeds; fail on a crash, a hang (10 s) or 2 GiB of memory."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    command = [
        sys.executable, str(FUZZ_DIR / harness), f"-runs={runs}", "-seed=1", "-timeout=10", "-rss_limit_mb=2048",
        "-keep_seed=1", f"-artifact_prefix={tmp_path}/", *options, str(corpus),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-6000:]
    assert f"Done {runs} runs" in result.stderr
    assert not [path.name for path in tmp_path.iterdir() if path.name != "corpus"]  # no crash-*, timeout-*, oom-*
