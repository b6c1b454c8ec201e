"""Power-aware placement (issue 43, point 2): the power model, ``pwr_fgd`` on worked examples, and the simulator's
``power_w``. The figures and their sources: docs/power.md, "Power-aware placement"."""

from __future__ import annotations

from itertools import pairwise

import pytest

from master.scheduler import MILLI, Gpu, Node, Request, TaskType, Workload, get_placer
from master.scheduler.placers.pwr_fgd import PwrFgd
from master.scheduler.power import (
    OFF_PEAK_IDLE_FACTOR,
    TRACE_CPU,
    TRACE_GPUS,
    TRACE_POWER,
    CpuPower,
    GpuPower,
    PowerModel,
)
from master.scheduler.simulate import simulate
from master.scheduler.trace import TraceNode
from shared.errors import ValidationFailed

TRACE_MODELS = ("V100M16", "V100M32", "P100", "T4", "A10", "G2", "G3")


def node(
    node_id: str, model: str, free: tuple[int, ...], *, cpu: int = 32_000, cpu_free: int | None = None
) -> Node:
    gpus = [Gpu(i, uuid=f"{node_id}-{i}", milli_free=milli) for i, milli in enumerate(free)]
    return Node(node_id, model, gpus, cpu_milli=cpu, memory_mib=65_536, cpu_milli_free=cpu_free)


def workload(*tasks: tuple[int, int, int, float]) -> Workload:
    return Workload(tuple(TaskType(cpu, num, milli, frozenset(), p) for cpu, num, milli, p in tasks))


class TestPowerModel:
    def test_the_table_covers_the_trace_with_its_datasheet_figures(self) -> None:
        """Board power from the datasheets (V100 SXM2 300 W, P100 PCIe 250 W, T4 70 W, A10 150 W); idle measured or
        stated; the step 10 % of the board power."""
        assert set(TRACE_MODELS) <= set(TRACE_GPUS)
        assert {m: TRACE_GPUS[m].max_w for m in ("V100M16", "P100", "T4", "A10")} == {
            "V100M16": 300.0, "P100": 250.0, "T4": 70.0, "A10": 150.0,
        }  # fmt: skip
        assert (TRACE_GPUS["V100M32"].idle_w, TRACE_GPUS["P100"].idle_w) == (27.3, 28.5)
        assert TRACE_GPUS["T4"].active_w == pytest.approx(7.0)
        assert TRACE_GPUS["G3"].active_w == pytest.approx(40.0)

    def test_a_gpu_is_idle_at_zero_then_steps_and_rises_linearly_to_its_board_power(self) -> None:
        v100 = TRACE_GPUS["V100M16"]
        assert v100.at(0) == 27.3 and v100.at(1) == pytest.approx(300.0)
        assert v100.at(0.5) == pytest.approx(27.3 + 30.0 + 0.5 * (300.0 - 27.3 - 30.0))
        assert v100.linear().at(0.5) == pytest.approx((27.3 + 300.0) / 2)

    @pytest.mark.parametrize("model", TRACE_MODELS)
    def test_power_never_falls_as_utilisation_grows(self, model: str) -> None:
        curve = TRACE_GPUS[model]
        watts = [curve.at(u / 100) for u in range(101)]
        assert all(a < b for a, b in pairwise(watts))
        assert watts[0] == curve.idle_w and watts[-1] == pytest.approx(curve.max_w)

    def test_bad_figures_are_refused(self) -> None:
        with pytest.raises(ValidationFailed):
            GpuPower("x", 50.0, 40.0)
        with pytest.raises(ValidationFailed):
            GpuPower("x", 10.0, 40.0, 35.0)
        with pytest.raises(ValidationFailed):
            TRACE_GPUS["T4"].at(1.5)
        with pytest.raises(ValidationFailed):
            PowerModel(idle_cap_factor=0)
        with pytest.raises(ValidationFailed):
            CpuPower(2.0, 1.0)

    def test_a_node_draws_its_gpus_and_its_cpus(self) -> None:
        """Two T4s, one idle (10 W) and one at 250 milli (10 + 7 + 53 · 0.25), and 8 of 32 vCPUs allocated."""
        host = node("n", "T4", (MILLI, 750), cpu=32_000, cpu_free=24_000)
        cpu = 32 * TRACE_CPU.idle_w + 8 * (TRACE_CPU.max_w - TRACE_CPU.idle_w)
        assert TRACE_POWER.node_w(host) == pytest.approx(10.0 + (10.0 + 7.0 + 53.0 * 0.25) + cpu)

    def test_off_peak_caps_lower_only_the_idle_gpus(self) -> None:
        host = node("n", "V100M16", (MILLI, 0))
        capped = TRACE_POWER.capped()
        assert OFF_PEAK_IDLE_FACTOR == pytest.approx(0.88)
        assert TRACE_POWER.node_w(host) - capped.node_w(host) == pytest.approx(27.3 * (1 - 0.88))

    @pytest.mark.parametrize(
        ("free", "request_"),
        [
            ((MILLI, MILLI), Request(num_gpu=2, cpu_milli=4_000)),
            ((MILLI, 600), Request(gpu_milli=500, cpu_milli=2_000)),
            ((MILLI, 400), Request(gpu_milli=500)),
            ((MILLI, 600, 300), Request(num_gpu=2, gpu_milli=250)),
            ((MILLI,), Request(num_gpu=0, cpu_milli=8_000)),
        ],
    )
    @pytest.mark.parametrize("model", [TRACE_POWER, TRACE_POWER.capped(), TRACE_POWER.linear()])
    def test_delta_is_what_the_placement_adds(
        self, free: tuple[int, ...], request_: Request, model: PowerModel
    ) -> None:
        """``delta_w`` equals the node's watts after the placement less before, for the GPUs the placement takes."""
        host = node("n", "V100M32", free)
        before = model.node_w(host)
        placement = get_placer("pwr_fgd", workload=workload((0, 1, 500, 1.0))).place(request_, [host])
        assert placement is not None
        taken = tuple(host.gpus[i].milli_free for i in placement.gpu_indices)
        host.allocate(placement)
        assert model.node_w(host) - before == pytest.approx(
            model.delta_w(node("n", "V100M32", free), request_, taken)
        )


class TestPwrFgd:
    def test_among_placements_fgd_rates_alike_the_lower_power_one_wins(self) -> None:
        """Whole-GPU tasks only. A whole GPU on v (V100, free 1000/0) or on t (T4, idle) leaves no fragment either
        way: FGD scores both 50 and its tie goes to the fuller node, v. pwr_fgd adds 272.7 W on v against 60 W on t,
        and takes t."""
        wl = workload((0, 1, MILLI, 1.0))
        nodes = [node("v", "V100M16", (MILLI, 0)), node("t", "T4", (MILLI, MILLI))]
        fgd = get_placer("fgd", seed=7, workload=wl).place(Request(), nodes)
        pwr = get_placer("pwr_fgd", seed=7, workload=wl).place(Request(), nodes)
        assert fgd is not None and pwr is not None
        assert (fgd.node_id, pwr.node_id) == ("v", "t")

    def test_a_small_power_difference_does_not_override_a_fragmentation_difference(self) -> None:
        """500-milli tasks only; a 250-milli share. On v (V100, idle 1000/1000) it leaves 750: no fragment, score 50,
        and adds the step and a quarter of the slope, 30 + 242.7/4 = 90.7 W. On p (P100, one GPU at 700) it leaves 450,
        a fragment to every task: score 38, and adds 196.5/4 = 49.1 W. At the default weight (20) the 41.5 W
        difference is worth 8.3 points against FGD's 12: pwr_fgd keeps FGD's choice, v. At 50 (20.8 points) power
        wins: p."""
        wl = workload((0, 1, 500, 1.0))
        share = Request(gpu_milli=250)
        nodes = [node("v", "V100M16", (MILLI, MILLI)), node("p", "P100", (700,))]
        assert TRACE_POWER.delta_w(nodes[0], share) == pytest.approx(30.0 + 242.7 / 4)
        assert TRACE_POWER.delta_w(nodes[1], share) == pytest.approx(196.5 / 4)
        fgd = get_placer("fgd", seed=7, workload=wl).place(share, nodes)
        assert fgd is not None and fgd.node_id == "v"
        assert PwrFgd.default_alpha == 20.0
        default = get_placer("pwr_fgd", seed=7, workload=wl).place(share, nodes)
        assert default is not None and default.node_id == "v"
        heavy = PwrFgd(seed=7, workload=wl, alpha=50.0).place(share, nodes)
        assert heavy is not None and heavy.node_id == "p"

    def test_a_model_constrained_tasks_need_loses_its_power_advantage(self) -> None:
        """An empty T4 host and an empty V100 host, 2 GPUs each; a whole GPU, alpha 10. With no constrained tasks the T4
        adds 60 W against 272.7 W: 6.0 points against 27.3, the T4 wins. When T4-only tasks are half the demand (T4
        pressure 0.5 · 4 / 2 = 1), fgd_net's scarcity costs the T4 10 points and pwr_fgd prices its GPUs at the fleet's
        highest slope: 7 + 242.7 = 249.7 W, 25.0 points; 35.0 against 27.3, the V100 wins."""
        nodes = [node("t", "T4", (MILLI, MILLI)), node("v", "V100M16", (MILLI, MILLI))]
        free = Workload((TaskType(0, 1, MILLI, frozenset(), 1.0),))
        placed = PwrFgd(seed=7, workload=free, alpha=10.0).place(Request(), nodes)
        assert placed is not None and placed.node_id == "t"
        constrained = Workload((TaskType(0, 1, MILLI, frozenset(), 1.0),), ((frozenset({"T4"}), 0.5),))
        placer = PwrFgd(seed=7, workload=constrained, alpha=10.0)
        placed = placer.place(Request(), nodes)
        assert placed is not None and placed.node_id == "v"
        assert placer.delta_w(nodes[0], Request(), ()) == pytest.approx(7.0 + 242.7)

    def test_waking_an_idle_gpu_costs_its_step(self) -> None:
        """A 200 share adds 30 W more on an idle V100 than on one already at work (its step), and a capped idle GPU
        also gives back its cap (12 % of 27.3 W)."""
        share = Request(gpu_milli=200)
        busy, idle = node("a", "V100M16", (800,)), node("b", "V100M16", (MILLI,))
        assert TRACE_POWER.delta_w(idle, share) - TRACE_POWER.delta_w(busy, share) == pytest.approx(30.0)
        capped = TRACE_POWER.capped()
        assert capped.delta_w(idle, share) - capped.delta_w(busy, share) == pytest.approx(30.0 + 27.3 * 0.12)


class TestSimulatedPower:
    NODES = [TraceNode(f"n{i}", 16_000, 65_536, gpus, model) for i, (gpus, model) in
             enumerate([(2, "T4"), (4, "V100M16"), (8, "G2"), (1, "P100")])]  # fmt: skip
    PODS = [Request(gpu_milli=300, cpu_milli=1_000), Request(num_gpu=2, cpu_milli=4_000), Request(gpu_milli=700),
            Request(num_gpu=0, cpu_milli=2_000), Request(num_gpu=1, cpu_milli=2_000)]  # fmt: skip

    def test_power_is_on_every_point_and_in_the_json(self) -> None:
        result = simulate(self.NODES, self.PODS, algorithm="pwr_fgd", seed=3)
        idle = TRACE_POWER.fleet_w(n.to_node() for n in self.NODES)
        watts = [point.power_w for point in result.curve]
        assert watts and watts[0] >= idle and watts == sorted(watts)  # nothing is released: power never falls
        assert result.to_json()["curve"][0]["power_w"] == watts[0] and result.power_at(1) == watts[0]

    def test_power_is_the_models_sum_over_the_fleet(self) -> None:
        """With one model (G2) and no step, the fleet's watts are the idle sum plus the slope times what is allocated
        plus the CPUs': every point of the curve checks it, from its allocated %."""
        linear = TRACE_POWER.linear()
        nodes = [TraceNode(f"g{i}", 16_000, 65_536, 4, "G2") for i in range(3)]
        pods = [Request(gpu_milli=milli, cpu_milli=0) for milli in (300, 1000, 500, 700, 1000, 250)]
        result = simulate(nodes, pods, algorithm="pwr_fgd", seed=5, power=linear)
        capacity = 12 * MILLI
        idle = 12 * 27.3 + 3 * 16 * TRACE_CPU.idle_w
        for point in result.curve:
            expected = idle + (300.0 - 27.3) * point.allocated_pct / 100 * capacity / MILLI
            assert point.power_w == pytest.approx(expected, abs=0.2)

    def test_caps_lower_the_curve_and_placements_stay_the_same(self) -> None:
        plain = simulate(self.NODES, self.PODS, algorithm="fgd", seed=3)
        capped = simulate(self.NODES, self.PODS, algorithm="fgd", seed=3, power=TRACE_POWER.capped())
        assert [p.allocated_pct for p in plain.curve] == [p.allocated_pct for p in capped.curve]
        # Lower while any GPU is idle (the first point); equal once none is (the fleet fills up).
        assert all(c.power_w <= p.power_w for p, c in zip(plain.curve, capped.curve, strict=True))
        assert capped.curve[0].power_w < plain.curve[0].power_w
