"""Every test's outcome and duration, kept as the run's artifact (``tests/conftest.py`` loads this plugin).

A flaky test is a bug with an owner: to find it one needs what failed, on which worker, after how long, and what else
was slow in the same run. The controlling process (pytest-xdist's, or the only one) writes, when the session ends:

* ``<dir>/tests.jsonl``: one line per test, ``{"nodeid", "outcome", "duration_s", "setup_s", "call_s", "teardown_s",
  "cpu_s", "worker", "started"}`` (``outcome``: passed, failed, error, skipped; ``started`` in UTC; ``cpu_s``: the
  CPU time of the pytest process running it and of the child processes it waited for — not the servers', so a
  test that mostly waits on PostgreSQL or a `gpumarket up` shows less than it costs);
* ``<dir>/summary.json``: the run's totals, its wall time, the slowest 30 tests and the modules by summed duration.

``<dir>`` is a folder of its own per run, ``<root>/<UTC start>-<pid>``, with ``<root>/latest`` linking to the last
one; ``<root>`` is ``GPUMARKET_TEST_REPORT_DIR``, else ``.gpumarket/test-report`` under the checkout, and keeps the
last ``KEEP`` runs. ``python -m tests.runreport [DIR]`` prints a saved summary again (default: the latest run's).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

CPU_PROPERTY = "gpumarket_cpu_s"
SLOWEST = 30
KEEP = 20


def report_root() -> Path:
    configured = os.environ.get("GPUMARKET_TEST_REPORT_DIR")
    return Path(configured) if configured else Path(__file__).resolve().parent.parent / ".gpumarket" / "test-report"


def _new_run_dir(started: float) -> Path:
    """A folder for this run's files; ``latest`` then links to it, and all but the last ``KEEP`` runs are removed."""
    root = report_root()
    stamp = datetime.fromtimestamp(started, UTC).strftime("%Y-%m-%dT%H-%M-%SZ")
    folder = root / f"{stamp}-{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    link = root / "latest"
    temporary = root / f".latest-{os.getpid()}"
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(folder.name)
    temporary.replace(link)
    # Never this run's own folder: its name is its start, older than those of the short runs that ended meanwhile.
    # Another run may be pruning the same folders at once.
    runs = sorted(path for path in root.iterdir() if path.is_dir() and not path.is_symlink() and path != folder)
    for old in runs[: max(len(runs) - (KEEP - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)
    return folder


@dataclass
class _Test:
    nodeid: str
    worker: str = "main"
    started: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    outcome: str = "passed"

    cpu_s: float = 0.0

    def record(self, report: pytest.TestReport) -> None:
        for name, value in report.user_properties:
            if name == CPU_PROPERTY and isinstance(value, float | int):
                self.cpu_s += value
        self.phases[report.when] = round(self.phases.get(report.when, 0.0) + report.duration, 3)
        if self.started is None:
            self.started = getattr(report, "start", None)
        if report.failed:
            self.outcome = "failed" if report.when == "call" else "error"
        elif report.skipped and self.outcome == "passed":
            self.outcome = "skipped"

    def as_json(self) -> dict[str, Any]:
        started = datetime.fromtimestamp(self.started, UTC).isoformat(timespec="seconds") if self.started else None
        return {
            "nodeid": self.nodeid, "outcome": self.outcome, "duration_s": round(sum(self.phases.values()), 3),
            **{f"{when}_s": self.phases.get(when, 0.0) for when in ("setup", "call", "teardown")},
            "cpu_s": round(self.cpu_s, 3), "worker": self.worker, "started": started,
        }  # fmt: skip


class RunReport:
    def __init__(self) -> None:
        self.tests: dict[str, _Test] = {}
        self.started = time.time()

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        test = self.tests.setdefault(report.nodeid, _Test(report.nodeid))
        node = getattr(report, "node", None)
        if node is not None and hasattr(node, "gateway"):
            test.worker = node.gateway.id
        test.record(report)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not self.tests:
            return
        folder = _new_run_dir(self.started)
        rows = [test.as_json() for test in self.tests.values()]
        with (folder / "tests.jsonl").open("w") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")
        (folder / "summary.json").write_text(json.dumps(summarize(rows, time.time() - self.started, int(exitstatus)), indent=1) + "\n")
        session.config._gpumarket_report_dir = folder  # type: ignore[attr-defined]

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        folder = getattr(terminalreporter.config, "_gpumarket_report_dir", None)
        if folder is not None:
            terminalreporter.write_line(f"each test's outcome and duration: {folder}/tests.jsonl (summary: {folder}/summary.json)")


def summarize(rows: list[dict[str, Any]], wall_s: float, exitstatus: int) -> dict[str, Any]:
    """Totals, the slowest tests, and the modules by the sum of their tests' durations."""
    outcomes: dict[str, int] = defaultdict(int)
    modules: dict[str, float] = defaultdict(float)
    cpu: dict[str, float] = defaultdict(float)
    for row in rows:
        outcomes[row["outcome"]] += 1
        modules[row["nodeid"].split("::", 1)[0]] += row["duration_s"]
        cpu[row["nodeid"].split("::", 1)[0]] += row.get("cpu_s", 0.0)
    slowest = sorted(rows, key=lambda row: row["duration_s"], reverse=True)[:SLOWEST]
    return {
        "finished": datetime.now(UTC).isoformat(timespec="seconds"), "exitstatus": exitstatus,
        "wall_s": round(wall_s, 1), "tests": len(rows), "outcomes": dict(outcomes),
        "sum_of_durations_s": round(sum(row["duration_s"] for row in rows), 1),
        "failed": [row["nodeid"] for row in rows if row["outcome"] in ("failed", "error")],
        "slowest": [{"nodeid": row["nodeid"], "duration_s": row["duration_s"], "worker": row["worker"]} for row in slowest],
        "sum_of_cpu_s": round(sum(cpu.values()), 1),
        "modules": {name: round(total, 1) for name, total in sorted(modules.items(), key=lambda item: -item[1])},
        "modules_cpu_s": {name: round(total, 1) for name, total in sorted(cpu.items(), key=lambda item: -item[1])},
    }  # fmt: skip


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class CpuMeter:
    """In the process that runs the tests: each test's CPU seconds, handed to the controller with its teardown report
    (``user_properties`` travel with pytest-xdist's reports)."""

    def __init__(self) -> None:
        self.started: dict[str, float] = {}

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.started[nodeid] = _cpu_seconds()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        if call.when == "teardown" and item.nodeid in self.started:
            item.user_properties.append((CPU_PROPERTY, round(_cpu_seconds() - self.started.pop(item.nodeid), 3)))
        return (yield)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(CpuMeter(), "gpumarket-cpu-meter")
    if not hasattr(config, "workerinput"):  # the controlling process sees every worker's reports
        config.pluginmanager.register(RunReport(), "gpumarket-run-report")


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else report_root() / "latest"
    summary = json.loads((folder / "summary.json").read_text())
    print(f"{summary['tests']} tests in {summary['wall_s'] / 60:.1f} min ({summary['outcomes']}); sum of durations {summary['sum_of_durations_s']:.0f} s")
    for name in summary["failed"]:
        print(f"FAILED {name}")
    cpu = summary.get("modules_cpu_s", {})
    print(f"{'duration':>9} {'cpu':>8}  module (by duration; cpu: the test processes' own and their children's)")
    for name, total in list(summary["modules"].items())[:SLOWEST]:
        print(f"{total:8.1f}s {cpu.get(name, 0.0):7.1f}s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
