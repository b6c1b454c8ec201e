"""Fixtures of the fault suite: one bench for the whole package, a healthy start for every scenario.

Starting the topology takes most of the suite's time, so all scenarios share one ``FaultCluster``
(package scope). None leaves it broken on purpose, and each begins from a checked healthy state:
servers up, links healed, every process running (a casualty of the previous scenario is restarted
with its own command), every host online and no rental active. The reports of the session are
listed at the end of the run.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.faults.harness import ARTIFACTS, FaultCluster, Report, Scenario, artifacts_logs

_reports: list[Path] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[_outcome] = report.outcome
    return report


_outcome = pytest.StashKey[str]()


@pytest.fixture(scope="package")
def fault_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    bench = FaultCluster.create(tmp_path_factory.mktemp("faults"))
    try:
        yield bench
    finally:
        bench.destroy()


@pytest.fixture
async def scenario(request: pytest.FixtureRequest, fault_cluster: FaultCluster) -> AsyncIterator[Scenario]:
    """The bench, restored to health, and this scenario's report (named by the test's ``scenario`` marker)."""
    marker = request.node.get_closest_marker("scenario")
    assert marker is not None, "a fault test names its scenario: @pytest.mark.scenario(name, title)"
    report = Report(*marker.args)
    await fault_cluster.restore()
    async with aiohttp.ClientSession() as http:
        handle = Scenario(fault_cluster, http, report)
        stopped = await handle.stop_all_rentals()
        if stopped:
            report.note(f"{stopped} rental(s) left by an earlier scenario stopped first")
        await fault_cluster.wire.refresh()
        handle.since = fault_cluster.wire.mark()
        try:
            yield handle
        finally:
            outcome = request.node.stash.get(_outcome, "error")
            if outcome != "passed":
                report.note(f"process logs: {artifacts_logs(fault_cluster, report.scenario)}")
            _reports.append(report.write(outcome))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "scenario(name, title): a fault scenario; its report is test-artifacts/faults/<name>.json")
    config.stash[_started] = time.time()


_started = pytest.StashKey[float]()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The reports this run wrote: by this process, or (under pytest-xdist) by the worker that ran the scenarios."""
    started = terminalreporter.config.stash.get(_started, 0.0)
    written = sorted(ARTIFACTS.glob("*.json"), key=lambda p: p.stat().st_mtime) if ARTIFACTS.is_dir() else []
    reports = _reports or [path for path in written if path.stat().st_mtime >= started]
    if not reports:
        return
    terminalreporter.section("fault scenarios")
    for path in reports:
        data = json.loads(path.read_text())
        injected = "; ".join(i["what"] for i in data["injected"]) or "nothing"
        terminalreporter.write_line(f"{data['scenario']}: {data['outcome']} in {data['runtime_s']} s — injected: {injected}")
        for what, figures in data["verified"].items():
            terminalreporter.write_line(f"    {what}: {json.dumps(figures, default=str)[:300]}")
    terminalreporter.write_line(f"reports: {ARTIFACTS}")
