"""The benchmark report: ``_common.record`` writes the results file and ``bench/report.py`` turns it into
docs/performance.md. No benchmark runs and no timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


report = _load("report")
common = _load("_common")


def figure(bench: str, name: str, value: float, unit: str, baseline: str | None = None,
           baseline_value: float | None = None, **extra: Any) -> dict[str, Any]:  # fmt: skip
    return {
        "bench": bench, "component": bench, "figure": name, "value": value, "unit": unit, "baseline": baseline,
        "baseline_value": baseline_value, "note": "", "date": "2026-11-26T09:00:00Z",
        "machine": "machine: AMD EPYC 7B13, 2 cores (2 usable); CPython 3.11.7", "cores": 2, "load": 0.5,
        "args": "", **extra,
    }  # fmt: skip


SAMPLE = [
    figure("bus", "RedisBus.publish", 4650.0, "msgs/s", "redis-py XADD", 5110.0),
    figure("protocol", "relay: decode_agent_frame", 56.2, "µs/msg", "json.loads", 28.1, args="--quick"),
    figure("placement", "fgd_net worst single decision", 12.34, "ms", note="its CPU time 9.8 ms", load=7.5,
           date="2026-11-26T09:30:00Z"),
    figure("bus", "InProcessBus publish/read/ack", 170_000.0, "msgs/s", "redis-py XADD/XREADGROUP/XACK", 0.0),
]

EXPECTED = """\
- Machine: AMD EPYC 7B13, 2 cores (2 usable); CPython 3.11.7; 2 usable cores
- Runs from 2026-11-26T09:00:00Z to 2026-11-26T09:30:00Z (UTC)

Measured on a busy machine (load above the usable cores): placement. Their absolute figures are pessimistic \
(rates low, latencies high); ratios to a baseline from the same run are steadier.

## protocol

| figure | value | baseline | baseline value | ratio | note |
|---|---:|---|---:|---:|---|
| relay: decode_agent_frame | 56.2 µs/msg | json.loads | 28.1 µs/msg | 2.00× |  |

## bus

| figure | value | baseline | baseline value | ratio | note |
|---|---:|---|---:|---:|---|
| RedisBus.publish | 4,650 msgs/s | redis-py XADD | 5,110 msgs/s | 0.91× |  |
| InProcessBus publish/read/ack | 170,000 msgs/s | redis-py XADD/XREADGROUP/XACK | 0 msgs/s | — |  |

## placement

| figure | value | baseline | baseline value | ratio | note |
|---|---:|---|---:|---:|---|
| fgd_net worst single decision | 12.3 ms | — | — | — | its CPU time 9.8 ms |

## Runs

| bench | date (UTC) | load (1 min) / cores | arguments |
|---|---|---|---|
| bus | 2026-11-26T09:00:00Z | 0.5 / 2 | defaults |
| placement | 2026-11-26T09:30:00Z | 7.5 / 2 (busy) | defaults |
| protocol | 2026-11-26T09:00:00Z | 0.5 / 2 | `--quick` |
"""


class TestReport:
    def test_renders_a_table_per_component_with_ratios_and_dashes_for_missing_baselines(self) -> None:
        """Components in the platform's order, value / baseline as the ratio, — where there is no baseline
        (or a zero one), busy runs named, and one row per bench run."""
        assert report.render(SAMPLE) == EXPECTED

    def test_keeps_the_hand_written_part_above_the_marker(self, tmp_path: Path) -> None:
        """A second report replaces the generated part only; the header someone wrote stays."""
        results, out = tmp_path / "results.json", tmp_path / "performance.md"
        results.write_text(json.dumps({"figures": SAMPLE}), encoding="utf-8")
        out.write_text(f"# Performance\n\nHand-written words.\n\n{report.MARKER}\n\nold table\n", encoding="utf-8")
        report.report(results, out)
        page = out.read_text(encoding="utf-8")
        assert page == f"# Performance\n\nHand-written words.\n\n{report.MARKER}\n\n{EXPECTED}"

    def test_a_hand_written_page_without_the_marker_is_kept_whole_above_the_first_tables(self, tmp_path: Path) -> None:
        """Regression: the first report replaced a hand-written page that had no marker yet with the default header."""
        results, out = tmp_path / "results.json", tmp_path / "performance.md"
        results.write_text(json.dumps({"figures": SAMPLE}), encoding="utf-8")
        out.write_text("# Performance\n\nHand-written words.\n", encoding="utf-8")
        assert report.report(results, out) == f"# Performance\n\nHand-written words.\n\n{report.MARKER}\n\n{EXPECTED}"

    def test_a_missing_results_file_gives_a_page_that_says_so(self, tmp_path: Path) -> None:
        page = report.report(tmp_path / "absent.json", tmp_path / "performance.md")
        assert page.startswith(report.DEFAULT_HEADER) and "No results yet: run `make bench`." in page

    @pytest.mark.parametrize(("value", "text"), [
        (0.01234, "0.0123"), (0.5, "0.50"), (0.9998, "1.00"), (1.234, "1.23"), (12.34, "12.3"), (123.4, "123"), (1234.5, "1,234"), (0.0, "0"),
    ])  # fmt: skip
    def test_numbers_keep_about_three_significant_figures(self, value: float, text: str) -> None:
        assert report.number(value) == text


class TestRecord:
    def test_appends_figures_and_a_new_run_of_a_bench_replaces_its_old_ones(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The first figure a bench records in a process drops what its earlier runs left; other benches' stay."""
        results = tmp_path / "results.json"
        monkeypatch.setenv(common.RESULTS_ENV, str(results))
        stale = figure("protocol", "an old figure", 1.0, "µs")
        other = figure("bus", "RedisBus.publish", 4650.0, "msgs/s")
        results.write_text(json.dumps({"figures": [stale, other]}), encoding="utf-8")
        monkeypatch.setattr(common, "_recorded", set())
        common.record("protocol", "decode", 56.2, "µs/msg", "json.loads", 28.1, "a note")
        common.record("protocol", "encode", 40.0, "µs/msg")
        common.record("protocol", "decode", 50.0, "µs/msg", "json.loads", 25.0)  # the same figure again: replaced
        figures = json.loads(results.read_text(encoding="utf-8"))["figures"]
        assert [(f["bench"], f["figure"], f["value"]) for f in figures] == [
            ("bus", "RedisBus.publish", 4650.0), ("protocol", "encode", 40.0), ("protocol", "decode", 50.0),
        ]  # fmt: skip
        decode = figures[-1]
        assert decode["baseline"] == "json.loads" and decode["baseline_value"] == 25.0
        assert decode["component"] == "protocol" and decode["machine"].startswith("machine: ")
        assert decode["cores"] >= 1 and decode["date"].endswith("Z")
        assert report.ratio(decode) == "2.00×"


# Tiny runs of the quick, self-contained benches (no server, no Docker): each must still record its headline
# figures, beside their baselines where it has one. Their values are not looked at.
TINY_RUNS = {
    "protocol": (["--messages", "20", "--rounds", "1"], "protocol", True),
    "streams": (["--mb", "1", "--rounds", "1"], "streams", True),
    "jsonbody": (["--rounds", "1"], "jsonbody", True),
    "placement": (["--skip-quality", "--algorithms", "fgd_net", "--scale-algorithms", ""], "placement", False),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TINY_RUNS))
def test_a_tiny_run_of_a_bench_records_its_figures(name: str, tmp_path: Path) -> None:
    arguments, bench, with_baselines = TINY_RUNS[name]
    if name == "placement" and not (BENCH.parent.parent / "shared" / "alibaba-gpu-v2023" / "csv").is_dir():
        pytest.skip("the Alibaba trace is not beside the checkout (../shared/alibaba-gpu-v2023)")
    results = tmp_path / "results.json"
    env = {**os.environ, common.RESULTS_ENV: str(results),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH.parent), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    done = subprocess.run([sys.executable, str(BENCH / f"bench_{name}.py"), *arguments], capture_output=True,
                          text=True, timeout=300, cwd=BENCH.parent, env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(results.read_text(encoding="utf-8"))["figures"]
    assert figures and {f["bench"] for f in figures} == {bench}
    assert all(f["value"] >= 0 and f["unit"] and f["machine"].startswith("machine: ") for f in figures)
    if with_baselines:
        assert all(f["baseline"] and f["baseline_value"] > 0 for f in figures if f["unit"] != "frames")
    page = report.render(figures)
    assert f"## {bench}" in page and page.count("\n| ") > len(figures)
