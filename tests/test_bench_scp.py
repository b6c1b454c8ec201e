"""The scp benchmark still runs: ``--quick`` end to end in both layouts (the relay and the agent in processes of their
own over the Redis bus, or the embedded marketplace), a volume, ``gpumarket ssh-config``, the system's scp and rsync
through the relay, to the agent's SSH server and to a local sshd; prints every copy beside OpenSSH's and records its
figures. No timing is asserted: the goal's verdicts may read OK or MISSED."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "bench_scp.py"
NUMBER = r"[\d,]+\.\d"


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (loop-mounted volumes)")
@pytest.mark.parametrize("layout", ["processes", "one-process"])
def test_quick_run_prints_every_copy_beside_openssh(tmp_path: Path, layout: str) -> None:
    missing = [tool for tool, there in (("openssh-server", os.access("/usr/sbin/sshd", os.X_OK)),
                                        ("rsync", shutil.which("rsync") is not None)) if not there]  # fmt: skip
    assert not missing, f"`make docker` installs Debian's {' '.join(missing)} (the baseline's sshd, the copies' rsync)"
    results = tmp_path / "results.json"
    env = {**os.environ, "GPUMARKET_BENCH_RESULTS": str(results),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    # A hang guard: the marketplace's start and twelve copies of 20 MB, each ssh starting a ProxyCommand process.
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "--layout", layout], capture_output=True, text=True, timeout=600,
                            cwd=ROOT, env=env)  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert out.startswith("layout: ") and ("child process" in out.splitlines()[0]) == (layout == "processes"), out
    for label in ("relay (ssh-config)", "agent sshd, TCP", "OpenSSH sshd"):
        for op in ("scp up", "scp down", "rsync up", "rsync down"):
            assert re.search(rf"  {re.escape(label)}\s+{op}\s+{NUMBER} MB/s .*relay\+agent CPU \d+\.\d\d s", out), (label, op, out)
    for op in ("scp up", "scp down"):
        assert re.search(rf"  {op}\s+({NUMBER} MB/s\s+){{3}}\s*\d+\.\d\d×\s+goal ≥ 0.5×: (OK|MISSED)", out), (op, out)
    figures = json.loads(results.read_text(encoding="utf-8"))["figures"]
    assert len(figures) == 8 and {f["bench"] for f in figures} == {"scp"}
    assert all(f["value"] > 0 and f["baseline_value"] > 0 and f["unit"] == "MB/s" for f in figures)
    assert all(f"layout {layout}" in f["note"] for f in figures)
