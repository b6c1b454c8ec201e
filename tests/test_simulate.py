"""The trace reader, the simulator and `gpumarket simulate`, on a slice of the Alibaba v2023 trace.

The slice (``tests/fixtures/trace``, see its README) has 12 nodes with 63 GPUs and 42 pods
asking for 46 GPUs, so at ``inflate`` 1.3 the simulator tops it up to ≥ 81.9 GPUs of demand.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from gpumarket.cli import main
from master.scheduler import MILLI, PLACERS, Request
from master.scheduler.simulate import arrivals, simulate
from master.scheduler.trace import TraceError, TraceNode, load_nodes, load_pods

TRACE = Path(__file__).parent / "fixtures" / "trace"
NODES = TRACE / "nodes.csv"
PODS = TRACE / "pods.csv"


@pytest.fixture(scope="module")
def nodes() -> list[TraceNode]:
    return load_nodes(NODES)


@pytest.fixture(scope="module")
def pods() -> list[Request]:
    return [pod.request for pod in load_pods(PODS)]


class TestTrace:
    def test_reads_the_node_and_pod_lists(self, nodes: list[TraceNode], pods: list[Request]) -> None:
        """12 nodes and 63 GPUs; 42 pods, among them CPU-only, shared, 8-GPU and model-constrained ones."""
        assert len(nodes) == 12 and sum(node.gpus for node in nodes) == 63
        assert nodes[0] == TraceNode("openb-node-0000", 64_000, 262_144, 2, "P100")
        assert len(pods) == 42
        assert sum(pod.gpu_milli_total for pod in pods) == 46_080
        assert any(pod.num_gpu == 0 and pod.gpu_milli == 0 for pod in pods)
        assert any(pod.num_gpu == 8 for pod in pods)
        assert Request(gpu_milli=440, cpu_milli=8_000, memory_mib=30_517,
                       gpu_models=frozenset({"G2", "P100", "T4", "V100M16", "V100M32"})) in pods  # fmt: skip

    def test_a_missing_file_says_so(self, tmp_path: Path) -> None:
        with pytest.raises(TraceError, match="no such file"):
            load_nodes(tmp_path / "nope.csv")

    def test_a_missing_column_is_named(self, tmp_path: Path) -> None:
        """A pod list without ``num_gpu`` fails on line 1 and lists what is missing and what was found."""
        path = tmp_path / "pods.csv"
        path.write_text("name,cpu_milli,memory_mib,gpu_milli\np,1000,1024,0\n")
        with pytest.raises(TraceError, match=r"line 1 .* missing num_gpu \(found: name, cpu_milli"):
            load_pods(path)

    def test_a_bad_cell_names_file_line_and_column(self, tmp_path: Path) -> None:
        """``abc`` as CPU on the third line is reported as ``pods.csv:3`` and ``cpu_milli``."""
        path = tmp_path / "pods.csv"
        path.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1000,1,1,500\nb,abc,1,1,500\n")
        with pytest.raises(TraceError, match=r"pods.csv:3: column 'cpu_milli' is 'abc', not a number"):
            load_pods(path)

    def test_a_gpu_pod_without_gpu_milli_is_refused(self, tmp_path: Path) -> None:
        path = tmp_path / "pods.csv"
        path.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1000,1,1,0\n")
        with pytest.raises(TraceError, match=r"gpu_milli must be 1\.\.1000"):
            load_pods(path)

    def test_a_gpu_node_needs_a_model(self, tmp_path: Path) -> None:
        path = tmp_path / "nodes.csv"
        path.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,32000,1024,0,nan\nn2,32000,1024,2,\n")
        with pytest.raises(TraceError, match=r"nodes\.csv:3: node 'n2' has 2 GPUs but no model"):
            load_nodes(path)


class TestArrivals:
    def test_tops_the_trace_up_to_the_target_and_shuffles_it(self, pods: list[Request]) -> None:
        """Copies of trace pods are added until demand reaches 1.3 × 63 GPUs; the same seed gives the same order."""
        queue = arrivals(pods, 63 * MILLI, inflate=1.3, seed=42)
        demand = sum(pod.gpu_milli_total for pod in queue)
        assert demand >= 1.3 * 63 * MILLI and demand - max(p.gpu_milli_total for p in queue) < 1.3 * 63 * MILLI
        assert len(queue) > len(pods) and set(queue) <= set(pods)
        assert queue == arrivals(pods, 63 * MILLI, inflate=1.3, seed=42)
        assert queue != arrivals(pods, 63 * MILLI, inflate=1.3, seed=43)

    def test_cuts_a_trace_already_above_the_target(self, pods: list[Request]) -> None:
        """At inflate 0.5 the shuffled trace is cut right after demand reaches 31.5 GPUs."""
        queue = arrivals(pods, 63 * MILLI, inflate=0.5, seed=42)
        demand = sum(pod.gpu_milli_total for pod in queue)
        assert demand >= 31_500 and demand - queue[-1].gpu_milli_total < 31_500


class TestSimulate:
    def test_pinned_result_on_the_slice(self, nodes: list[TraceNode], pods: list[Request]) -> None:
        """Regression pin: seed 42 on the slice (69 arriving pods). A change here changes every published figure."""
        fgd = simulate(nodes, pods, algorithm="fgd", seed=42)
        assert (fgd.pods, fgd.placed, fgd.failed, fgd.nodes, fgd.gpus) == (69, 60, 9, 12, 63)
        assert (fgd.allocated_at(100), fgd.fragmented_at(100)) == (76.0159, 6.1742)
        assert (fgd.allocated_at(131), fgd.fragmented_at(131)) == (96.0317, 2.8571)
        best = simulate(nodes, pods, algorithm="best_fit", seed=42)
        assert (best.placed, best.failed, best.allocated_at(100), best.fragmented_at(100)) == (45, 24, 94.3333, 3.2123)

    def test_one_point_per_whole_percent_of_arrived_demand(self, nodes: list[TraceNode], pods: list[Request]) -> None:
        """Points 1, 2, … up to the demand that arrived, allocation never falling, within 0..100 %."""
        result = simulate(nodes, pods, algorithm="first_fit", seed=1)
        assert [p.arrived_pct for p in result.curve] == list(range(1, len(result.curve) + 1))
        assert len(result.curve) >= 130
        allocated = [p.allocated_pct for p in result.curve]
        assert allocated == sorted(allocated) and 0 < allocated[-1] <= 100
        assert all(0 <= p.fragmented_pct <= 100 - p.allocated_pct for p in result.curve)

    def test_every_algorithm_runs(self, nodes: list[TraceNode], pods: list[Request]) -> None:
        """All placers replay the slice, every pod placed or failed."""
        results = {name: simulate(nodes, pods, algorithm=name, seed=7) for name in PLACERS}
        assert all(r.placed + r.failed == r.pods for r in results.values())

    def test_fgd_net_is_fgd_without_model_constraints_or_network_data(
        self, nodes: list[TraceNode], pods: list[Request]
    ) -> None:
        """With the slice's model constraints dropped, and no network figures, fgd_net places exactly as fgd."""
        free = [replace(pod, gpu_models=frozenset()) for pod in pods]
        assert simulate(nodes, free, algorithm="fgd_net", seed=7).curve == simulate(nodes, free, algorithm="fgd", seed=7).curve

    def test_stop_at_ends_the_run_early(self, nodes: list[TraceNode], pods: list[Request]) -> None:
        """With ``stop_at_pct=100`` the last point is 100 % arrived, and the points match the full run's."""
        full = simulate(nodes, pods, algorithm="best_fit", seed=3)
        early = simulate(nodes, pods, algorithm="best_fit", seed=3, stop_at_pct=100)
        assert early.curve[-1].arrived_pct >= 100 and early.curve == full.curve[: len(early.curve)]

    def test_progress_is_reported(self, nodes: list[TraceNode], pods: list[Request]) -> None:
        calls: list[tuple[int, int]] = []
        simulate(nodes, pods, algorithm="fgd", seed=1, progress=lambda done, total: calls.append((done, total)),
                 progress_every=10)  # fmt: skip
        assert calls[-1][0] == calls[-1][1] and len(calls) >= 6


class TestCli:
    def test_help(self, capsys: pytest.CaptureFixture[str]) -> None:
        """`gpumarket simulate --help` exits 0 and lists the algorithms."""
        with pytest.raises(SystemExit) as done:
            main(["simulate", "--help"])
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert "usage: gpumarket simulate" in out and "fgd_net" in out and "first_fit" in out

    def test_json_run(self, capsys: pytest.CaptureFixture[str]) -> None:
        """A run with --json prints one JSON object with the documented keys, and a progress bar on stderr."""
        main(["simulate", "--nodes", str(NODES), "--pods", str(PODS), "--algorithm", "fgd", "--seed", "42", "--json"])
        captured = capsys.readouterr()
        result = json.loads(captured.out)
        assert {"algorithm", "seed", "nodes", "gpus", "placed", "failed", "curve"} <= set(result)
        assert (result["algorithm"], result["seed"], result["placed"], result["failed"]) == ("fgd", 42, 60, 9)
        point = result["curve"][99]
        assert {k: point[k] for k in ("arrived_pct", "allocated_pct", "fragmented_pct")} == {
            "arrived_pct": 100, "allocated_pct": 76.0159, "fragmented_pct": 6.1742,
        }  # fmt: skip
        assert point["power_w"] > 0  # the datacenter's watts (tests/test_power_placement.py)
        assert "simulate fgd seed 42 [" in captured.err and "100%" in captured.err

    def test_text_summary(self, capsys: pytest.CaptureFixture[str]) -> None:
        main(["simulate", "--nodes", str(NODES), "--pods", str(PODS), "--algorithm", "best_fit", "--quiet"])
        captured = capsys.readouterr()
        assert "best_fit (seed 42): 12 nodes, 63 GPUs" in captured.out and captured.err == ""

    def test_a_bad_trace_is_one_line_on_stderr(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A malformed pod list exits 2 with one line naming the file and the line."""
        bad = tmp_path / "pods.csv"
        bad.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1000,1024,1,-5\n")
        with pytest.raises(SystemExit) as done:
            main(["simulate", "--nodes", str(NODES), "--pods", str(bad), "--quiet"])
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "pods.csv:2" in err and "Traceback" not in err
