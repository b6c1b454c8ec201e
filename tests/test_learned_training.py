"""Training the learned placer: the Gymnasium environment, the torch actors and their numpy export, a smoke run.

Needs the ``learn`` extra (gymnasium, stable-baselines3, sb3-contrib, torch), which CI installs. torch and the
modules built on it are imported by the tests that use them, not at collection: every pytest-xdist worker collects
this module, and importing them costs ~1.5 s of CPU each, for the one worker that runs these tests.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from gpumarket.learn.env import PlacementEnv
from master.scheduler import Fleet, Workload
from master.scheduler.hetero import hetero_episode, place_in_order
from master.scheduler.learned.features import FEATURE_COUNT
from master.scheduler.learned.policy import load_policy
from master.scheduler.placers.fgd import Fgd
from master.scheduler.placers.learned import LearnedPlacer

TRACE = Path(__file__).parent / "fixtures" / "trace"
CANDIDATES = 32


@pytest.fixture
def th() -> ModuleType:
    """torch, on one thread (the suite runs several workers on few cores)."""
    import torch

    torch.set_num_threads(1)
    return torch


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    """The test slice of the trace under the names the environment reads."""
    shutil.copy(TRACE / "nodes.csv", tmp_path / "openb_node_list_gpu_node.csv")
    shutil.copy(TRACE / "pods.csv", tmp_path / "openb_pod_list_default.csv")
    return tmp_path


def rows(observation: np.ndarray, candidates: int = CANDIDATES) -> tuple[np.ndarray, np.ndarray]:
    width = candidates * FEATURE_COUNT
    return observation[:width].reshape(candidates, FEATURE_COUNT), observation[width : width + candidates] > 0.5


class TestEnvironment:
    @pytest.mark.parametrize("action", ["discrete", "box"])
    def test_passes_gymnasiums_checker(self, action: str) -> None:
        check_env(PlacementEnv("hetero", action=action, max_candidates=CANDIDATES), skip_render_check=True)  # type: ignore[arg-type]

    def test_the_return_is_the_count_placed_and_masks_name_feasible_nodes(self) -> None:
        """Random masked choices over three episodes: every task is placed or failed once, the return is the count
        placed, and every masked row is a node that fits (its features are non-zero)."""
        env = PlacementEnv("hetero", max_candidates=CANDIDATES)
        rng = np.random.default_rng(0)
        observation, info = env.reset(seed=0)
        for _ in range(3):
            total, done = 0.0, False
            while not done:
                features, mask = rows(observation)
                assert mask.any() and np.array_equal(mask, env.action_masks())
                assert not features[~mask].any()
                observation, reward, done, _, info = env.step(int(rng.choice(np.flatnonzero(mask))))
                total += reward
            assert total == info["placed"] and info["placed"] + info["failed"] == 100
            observation, info = env.reset()

    def test_with_a_failure_penalty_the_return_is_placed_minus_failed(self) -> None:
        """Training's reward: each task failing after a decision costs 1, so the return is placed − failed (those
        failing before the first decision, which no choice caused, aside)."""
        env = PlacementEnv("hetero", max_candidates=CANDIDATES, failure_penalty=1.0)
        _, info = env.reset(seed=4)
        before = info["failed"]
        total, done = 0.0, False
        while not done:
            _, reward, done, _, info = env.step(int(np.flatnonzero(env.action_masks())[-1]))
            total += reward
        assert info["failed"] > before
        assert total == info["placed"] - (info["failed"] - before)

    def test_an_infeasible_action_never_places(self) -> None:
        """A discrete action outside the mask fails the task; a box action's best masked score wins."""
        env = PlacementEnv("hetero", max_candidates=CANDIDATES)
        observation, _ = env.reset(seed=1)
        _, mask = rows(observation)
        invalid = np.flatnonzero(~mask)
        assert invalid.size
        _, reward, _, _, info = env.step(int(invalid[0]))
        assert reward == 0.0 and info["placed"] == 0 and info["failed"] >= 1

        box = PlacementEnv("hetero", action="box", max_candidates=CANDIDATES)
        observation, _ = box.reset(seed=1)
        _, mask = rows(observation)
        scores = np.where(mask, -0.5, 1.0).astype(np.float32)  # infeasible rows score highest
        _, reward, _, _, info = box.step(scores)
        assert reward == 1.0 and info["placed"] == 1

    def test_the_trace_setting_rewards_gpus_placed(self, trace_dir: Path) -> None:
        env = PlacementEnv("trace", max_candidates=CANDIDATES, trace_dir=trace_dir, trace_nodes=(6, 10))
        _, info = env.reset(seed=2)
        total, done = 0.0, False
        while not done:
            _, reward, done, _, info = env.step(int(np.flatnonzero(env.action_masks())[0]))
            total += reward
        assert total == pytest.approx(info["milli_placed"] / 1000) and info["placed"] > 0


class TestExport:
    def test_the_numpy_policy_scores_as_the_ppo_actor(self, th: ModuleType) -> None:
        """MaskablePPO's per-candidate logits equal the exported numpy policy's scores on every feasible row."""
        from sb3_contrib import MaskablePPO

        from gpumarket.learn.policies import CandidatePpoPolicy

        env = PlacementEnv("hetero", max_candidates=CANDIDATES)
        scorer = {"candidates": CANDIDATES, "hidden": (16, 16), "activation": "tanh",
                  "mean": list(np.linspace(0, 1, FEATURE_COUNT)), "std": list(np.linspace(0.5, 2, FEATURE_COUNT))}  # fmt: skip
        model = MaskablePPO(CandidatePpoPolicy, env, n_steps=64, seed=3, device="cpu", policy_kwargs={"scorer": scorer})
        policy = model.policy
        assert isinstance(policy, CandidatePpoPolicy)
        last = policy.scorer.net[-1]
        assert isinstance(last, th.nn.Linear)
        th.nn.init.normal_(last.weight)  # a trained-looking last layer, not SB3's near-zero one
        observation, _ = env.reset(seed=3)
        features, mask = rows(observation)
        with th.no_grad():
            logits = policy.mlp_extractor.forward_actor(th.as_tensor(observation[None]))[0].numpy()
        exported = policy.scorer.export("p", {"algorithm": "ppo", "setting": "hetero"})
        np.testing.assert_allclose(exported.scores(features[mask].astype(np.float64)), logits[mask], rtol=1e-5, atol=1e-5)

    def test_the_numpy_policy_scores_as_the_ddpg_actor(self, th: ModuleType) -> None:
        from stable_baselines3 import DDPG

        from gpumarket.learn.policies import CandidateDdpgPolicy, CandidateScorer

        env = PlacementEnv("hetero", action="box", max_candidates=CANDIDATES)
        scorer = {"candidates": CANDIDATES, "hidden": (16,), "activation": "tanh", "mean": [0.1] * FEATURE_COUNT,
                  "std": [0.7] * FEATURE_COUNT}  # fmt: skip
        model = DDPG(CandidateDdpgPolicy, env, seed=4, device="cpu", buffer_size=1000,
                     policy_kwargs={"scorer": scorer, "net_arch": {"pi": [16], "qf": [32]}})  # fmt: skip
        observation, _ = env.reset(seed=4)
        features, mask = rows(observation)
        with th.no_grad():
            actions = model.actor(th.as_tensor(observation[None]))[0].numpy()
        actor = model.actor.mu
        assert isinstance(actor, CandidateScorer)
        exported = actor.export("d", {"algorithm": "ddpg", "setting": "hetero"})
        assert exported.output == "tanh"
        np.testing.assert_allclose(exported.scores(features[mask].astype(np.float64)), actions[mask], rtol=1e-5, atol=1e-5)


class TestStartFromFgd:
    def test_a_scorer_started_like_fgd_places_as_fgd(self, th: ModuleType) -> None:
        """The start ``--start-from-fgd`` gives scores increasing in FGD's and equal where it is equal, so the
        learned placer with it places a held-out hetero episode exactly as ``fgd`` does."""
        from gpumarket.learn.policies import CandidateScorer
        from gpumarket.learn.train import start_like_fgd

        scorer = CandidateScorer(CANDIDATES, (32, 32), "tanh", [0.5] * FEATURE_COUNT, [0.2] * FEATURE_COUNT)
        start_like_fgd(scorer)
        policy = scorer.export("start", {"algorithm": "ppo", "setting": "hetero"})
        nodes, requests = hetero_episode(9)
        workload = Workload.from_requests(requests)
        fleets = {name: Fleet(hetero_episode(9)[0]) for name in ("fgd", "learned")}
        placers = {"fgd": Fgd(seed=9, workload=workload), "learned": LearnedPlacer(seed=9, workload=workload, policy=policy)}
        for request in requests:
            chosen = {}
            for name, placer in placers.items():
                placement = placer.place(request, fleets[name])
                if placement is not None:
                    fleets[name].apply(placement)
                chosen[name] = None if placement is None else (placement.node_id, placement.gpu_indices)
            assert chosen["learned"] == chosen["fgd"]
        assert nodes  # the episode is not empty


class TestTraining:
    @pytest.mark.parametrize(("algorithm", "steps"), [("ppo", 300), ("ddpg", 1_200)])
    def test_a_short_run_saves_a_policy_the_placer_loads(self, algorithm: str, steps: int, tmp_path: Path, th: ModuleType) -> None:
        """A few hundred steps (DDPG: past its 1,000 warm-up steps) give a policy file that places an episode."""
        from gpumarket.learn.train import train_placer

        lines: list[str] = []
        result = train_placer(algorithm, "hetero", steps=steps, seed=5, name="smoke", directory=tmp_path,  # type: ignore[arg-type]
                              max_candidates=CANDIDATES, normalisation_steps=200, report=lines.append)  # fmt: skip
        assert result.path == tmp_path / "smoke.npz" and result.path.exists()
        assert lines and "steps" in lines[-1]
        policy = load_policy("smoke", directory=tmp_path)
        assert policy.meta["algorithm"] == algorithm and policy.meta["steps"] == result.steps >= steps
        nodes, requests = hetero_episode(2)
        placer = LearnedPlacer(policy=policy, workload=Workload.from_requests(requests))
        assert place_in_order(placer, nodes, requests) > 20
