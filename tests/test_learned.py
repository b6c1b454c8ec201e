"""The learned placer's numpy side: its features, the policy files, the placer, and the hetero experiment.

Needs numpy only (no torch): what the marketplace runs. Training is tested in ``test_learned_training.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from gpumarket.cli import main
from master.scheduler import (
    MILLI,
    PLACERS,
    Fleet,
    Gpu,
    LinkStats,
    NetworkLimits,
    Node,
    Request,
    Workload,
    get_placer,
)
from master.scheduler.hetero import (
    EVALUATION_SEEDS,
    TRAINING_SEED_BASE,
    hetero_episode,
    place_all,
    run_hetero,
)
from master.scheduler.learned.features import FEATURE_COUNT, FEATURES, FeatureContext, node_features
from master.scheduler.learned.policy import FORMAT, Policy, PolicyError, load_policy
from master.scheduler.placers.learned import FeaturePlacer, LearnedPlacer
from shared.errors import ConfigError

LEARNED = tuple(name for name in PLACERS if name.startswith("learned_"))
COLUMN = {name: index for index, name in enumerate(FEATURES)}


def gpu_node(node_id: str, free: tuple[int, ...], *, links: dict[str, LinkStats] | None = None) -> Node:
    gpus = [Gpu(i, uuid=f"{node_id}-{i}", milli_free=milli) for i, milli in enumerate(free)]
    return Node(node_id, "G2", gpus, cpu_milli=32_000, memory_mib=131_072, links=links)


def features_of(node: Node, request: Request, fleet: Fleet) -> dict[str, float]:
    placer = FeaturePlacer(workload=Workload.from_requests([request]))
    found = placer.candidate(node, request, fleet)
    assert found is not None
    return dict(zip(FEATURES, (float(x) for x in found[0]), strict=True))


def linear_policy(feature: str, weight: float, *, name: str = "test") -> Policy:
    """A one-layer policy scoring ``weight × feature``."""
    row = np.zeros((1, FEATURE_COUNT))
    row[0, COLUMN[feature]] = weight
    meta = {"format": FORMAT, "features": list(FEATURES), "activation": "tanh", "output": "identity"}
    return Policy(name, (row,), (np.zeros(1),), np.zeros(FEATURE_COUNT), np.ones(FEATURE_COUNT), meta)


class TestFeatures:
    def test_an_empty_node_and_a_nearly_full_one(self) -> None:
        """A 1-GPU task on an idle 4-GPU node leaves 3/4 free and the node counts as empty; on a node with one
        idle GPU left it leaves nothing free, and the node is not empty."""
        empty, full = gpu_node("empty", (MILLI,) * 4), gpu_node("full", (MILLI, 0, 0, 0))
        fleet = Fleet([empty, full])
        request = Request(cpu_milli=4_000)
        on_empty, on_full = features_of(empty, request, fleet), features_of(full, request, fleet)
        assert on_empty["node_empty"] == 1.0 and on_full["node_empty"] == 0.0
        assert on_empty["gpu_free_after"] == 0.75 and on_full["gpu_free_after"] == 0.0
        assert on_empty["free_share"] == 1.0 and on_full["free_share"] == pytest.approx(0.5 * 1 + 0.5 * 0.25)
        assert on_empty["cpu_free_after"] == pytest.approx(28 / 32)
        assert on_empty["request_gpus"] == 1 / 8 and on_empty["request_milli"] == 1.0

    def test_a_share_sees_the_best_fitting_gpu_leftover(self) -> None:
        """A 300-milli share on GPUs with 1000 and 400 free: the best fit leaves 100 milli."""
        node = gpu_node("a", (MILLI, 400))
        assert features_of(node, Request(gpu_milli=300), Fleet([node]))["best_fit_leftover"] == pytest.approx(0.1)

    def test_network_slack_to_the_renters_limits(self) -> None:
        """50 ms against a 100 ms limit is half the slack; no jitter limit is full slack; no network: no latency."""
        link = LinkStats(latency_ms=50.0, jitter_ms=5.0, loss_pct=0.5)
        node = gpu_node("a", (MILLI,), links={"eu": link})
        fleet = Fleet([node])
        limited = Request(network=NetworkLimits("eu", max_latency_ms=100.0, max_loss_pct=2.0))
        seen = features_of(node, limited, fleet)
        assert seen["latency_slack"] == pytest.approx(0.5) and seen["jitter_slack"] == 1.0
        assert seen["loss_slack"] == pytest.approx(0.75) and seen["latency"] == pytest.approx(0.05)
        free = features_of(node, Request(), fleet)
        assert (free["latency_slack"], free["latency"]) == (1.0, 0.0)

    def test_fgd_delta_is_the_fgd_placers(self) -> None:
        """The features' fragmentation change and score are FGD's own (``Fgd.frag_delta``)."""
        node = gpu_node("a", (MILLI, 700))
        request = Request(gpu_milli=250)
        placer = FeaturePlacer(workload=Workload.from_requests([Request(gpu_milli=500)]))
        fleet = Fleet([node])
        delta = placer.frag_delta(node, request)
        assert delta is not None
        vector = node_features(FeatureContext(fleet, placer.frag_model), node, request, delta[0])
        assert vector[COLUMN["frag_delta"]] == pytest.approx(delta[0] / MILLI)
        assert vector[COLUMN["fgd_score"]] * 100 == pytest.approx(placer.fgd(node, request)[0])  # type: ignore[index]


class TestPolicyFiles:
    def test_every_shipped_policy_loads_and_says_how_it_was_trained(self) -> None:
        """Each learned placer's policy is shipped, of this feature set, with its algorithm and setting."""
        for name in LEARNED:
            policy = load_policy(name)
            assert policy.meta["algorithm"] in ("ppo", "ddpg") and policy.meta["setting"] in ("hetero", "trace")
            assert policy.meta["features"] == list(FEATURES)
            assert sum(w.size + b.size for w, b in zip(policy.weights, policy.biases, strict=True)) < 10_000

    def test_save_and_load_give_the_same_scores(self, tmp_path: Path) -> None:
        rng = np.random.default_rng(1)
        weights = (rng.normal(size=(8, FEATURE_COUNT)), rng.normal(size=(1, 8)))
        meta = {"format": FORMAT, "features": list(FEATURES), "activation": "relu", "output": "tanh"}
        policy = Policy("p", weights, (rng.normal(size=8), rng.normal(size=1)), rng.normal(size=FEATURE_COUNT),
                        rng.uniform(0.5, 2, size=FEATURE_COUNT), meta)  # fmt: skip
        policy.save(tmp_path / "p.npz")
        rows = rng.normal(size=(5, FEATURE_COUNT))
        np.testing.assert_allclose(load_policy("p", directory=tmp_path).scores(rows), policy.scores(rows))

    def test_a_missing_policy_is_a_one_line_config_error(self, tmp_path: Path) -> None:
        with pytest.raises(PolicyError) as raised:
            load_policy("nope", directory=tmp_path)
        assert isinstance(raised.value, ConfigError) and raised.value.code == "bad_policy"
        assert "does not exist" in raised.value.message and "gpumarket train-placer" in raised.value.message
        assert "\n" not in raised.value.message

    def test_a_corrupt_file_is_refused(self, tmp_path: Path) -> None:
        (tmp_path / "broken.npz").write_bytes(b"not a zip file at all")
        with pytest.raises(PolicyError, match="is not a usable policy"):
            load_policy("broken", directory=tmp_path)

    def test_a_policy_of_other_features_is_refused(self, tmp_path: Path) -> None:
        policy = linear_policy("fgd_score", 1.0)
        policy.meta["features"] = ["something", "else"]
        policy.save(tmp_path / "old.npz")
        with pytest.raises(PolicyError, match="other features"):
            load_policy("old", directory=tmp_path)

    def test_a_name_that_is_a_path_is_refused(self) -> None:
        with pytest.raises(PolicyError, match="not valid"):
            load_policy("../../etc/passwd")


class TestLearnedPlacer:
    def test_a_policy_scoring_minus_the_free_gpu_left_places_as_best_fit(self) -> None:
        """Scoring −gpu_free_after, the 1-GPU task goes to the node left with the least free GPU."""
        nodes = [gpu_node("idle", (MILLI,) * 4), gpu_node("half", (MILLI, MILLI, 0, 0)), gpu_node("none", (0,) * 4)]
        placer = LearnedPlacer(policy=linear_policy("gpu_free_after", -1.0))
        placement = placer.place(Request(), nodes)
        assert placement is not None and placement.node_id == "half"
        placer = LearnedPlacer(policy=linear_policy("gpu_free_after", 1.0))
        placement = placer.place(Request(), nodes)
        assert placement is not None and placement.node_id == "idle"

    def test_network_limits_are_kept_whatever_the_policy_prefers(self) -> None:
        """A policy preferring high latency still never takes the host over the renter's limit."""
        near = gpu_node("near", (MILLI,), links={"eu": LinkStats(20.0)})
        far = gpu_node("far", (MILLI,), links={"eu": LinkStats(400.0)})
        placer = LearnedPlacer(policy=linear_policy("latency", 1.0))
        placement = placer.place(Request(network=NetworkLimits("eu", max_latency_ms=100.0)), [near, far])
        assert placement is not None and placement.node_id == "near"

    @pytest.mark.parametrize("name", LEARNED)
    def test_shipped_placers_place_a_hetero_episode(self, name: str) -> None:
        """Every shipped learned placer places a good share of a held-out episode, each placement feasible."""
        nodes, requests = hetero_episode(1)
        assert place_all(name, nodes, requests, seed=1) >= 30


class TestHetero:
    def test_an_episode_is_three_clusters_of_different_models_with_links_to_every_region(self) -> None:
        nodes, requests = hetero_episode(7)
        assert {node.model for node in nodes} == {"RTX2080Ti", "GTX1660S", "RTX3090"}
        assert {node.region for node in nodes} == {"eu", "us", "asia"}
        assert all(set(node.links) == {"eu", "us", "asia"} for node in nodes)
        assert len(requests) == 100 and any(r.network is not None and r.network.limited for r in requests)
        assert any(r.gpu_milli < MILLI for r in requests) and any(r.num_gpu > 1 for r in requests)

    def test_episodes_and_results_repeat_for_a_seed(self) -> None:
        first, second = hetero_episode(3), hetero_episode(3)
        assert first[1] == second[1]
        assert [(n.node_id, dict(n.links), len(n.gpus)) for n in first[0]] == [
            (n.node_id, dict(n.links), len(n.gpus)) for n in second[0]
        ]
        assert hetero_episode(4)[1] != first[1]
        runs = [[r.to_json() for r in run_hetero(("random", "fgd"), (1, 2))] for _ in range(2)]
        assert runs[0] == runs[1]

    def test_training_never_sees_an_evaluation_seed(self) -> None:
        assert max(EVALUATION_SEEDS) < TRAINING_SEED_BASE

    def test_the_algorithms_differ_and_place_tens_of_tasks(self) -> None:
        """The experiment's point: tens of tasks placed, not the same count for every algorithm."""
        results = {r.algorithm: r.mean for r in run_hetero(("first_fit", "random", "utilization"), range(1, 6))}
        assert all(30 <= mean <= 80 for mean in results.values())
        assert len(set(results.values())) > 1


class TestCommands:
    def test_simulate_hetero_prints_json(self, capsys: pytest.CaptureFixture[str]) -> None:
        main(["simulate", "--hetero", "--seeds", "1-2", "--algorithms", "first_fit,learned_ppo", "--json", "--quiet"])
        out = json.loads(capsys.readouterr().out)
        assert [r["algorithm"] for r in out["results"]] == ["first_fit", "learned_ppo"]
        assert out["seeds"] == [1, 2] and all(len(r["placed"]) == 2 for r in out["results"])

    def test_simulate_without_a_trace_or_hetero_says_what_to_pass(self, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit) as done:
            main(["simulate"])
        assert done.value.code == 2 and "--hetero" in capsys.readouterr().err

    def test_train_placer_without_the_learn_extra_says_how_to_install_it(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """With stable-baselines3 missing (a None in sys.modules makes its import fail), one line names the extra."""
        monkeypatch.setitem(sys.modules, "stable_baselines3", None)
        monkeypatch.delitem(sys.modules, "gpumarket.learn.train", raising=False)
        with pytest.raises(SystemExit) as done:
            main(["train-placer", "--algorithm", "ppo"])
        err = capsys.readouterr().err
        assert done.value.code == 2 and "pip install 'gpumarket[learn]'" in err and err.count("\n") == 1

    def test_train_placer_on_the_trace_needs_its_folder(self, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit) as done:
            main(["train-placer", "--algorithm", "ppo", "--setting", "trace"])
        assert done.value.code == 2 and "--trace-dir" in capsys.readouterr().err

    def test_a_missing_policy_fails_the_placer_setting_at_once(self, tmp_path: Path) -> None:
        """A learned placer built without its file raises PolicyError when built, not at its first decision."""

        class Missing(LearnedPlacer):
            name = "missing"
            policy_name = "no_such_policy"

        with pytest.raises(PolicyError):
            Missing()
        assert get_placer("learned_ppo").name == "learned_ppo"
