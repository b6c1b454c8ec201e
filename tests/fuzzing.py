"""Running the libFuzzer harnesses in ``fuzz/`` (atheris) from the test suite, for a bounded number of inputs."""

from __future__ import annotations

import os
import signal
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
    # Through a shell that forks it: a process spawned straight from the test's worker starts with the worker's peak
    # resident size as its own (Linux keeps ru_maxrss across exec), which libFuzzer's -rss_limit_mb reads as the
    # harness's: a worker grown past 2 GiB by earlier tests failed the harness at its first input ("out-of-memory (used:
    # 11271Mb)"). The shell's child starts from the shell's few MiB.
    wrapped = ["/bin/sh", "-c", '"$0" "$@"; exit $?', *command]
    with subprocess.Popen(wrapped, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True) as process:
        try:
            _, stderr = process.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the shell and the harness
            raise
    result = subprocess.CompletedProcess(wrapped, process.returncode, "", stderr)
    assert result.returncode == 0, result.stderr[-6000:]
    assert f"Done {runs} runs" in result.stderr
    assert not [path.name for path in tmp_path.iterdir() if path.name != "corpus"]  # no crash-*, timeout-*, oom-*
