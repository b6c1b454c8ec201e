"""``train_placer``: train the learned placer's scorer with Stable-Baselines3 and save it as a shipped policy.

1. Measure the features' mean and σ on a rollout of random feasible choices (``normalisation_steps``);
   they are baked into the scorer, so the numpy policy needs nothing else.
2. Train: ``ppo`` — sb3-contrib's MaskablePPO over ``Discrete(K)`` with the env's action masks;
   ``ddpg`` — SB3's DDPG over ``Box(K)`` (the env takes the argmax over feasible candidates), the
   design's baseline. Both actors are the shared per-candidate MLP (``gpumarket.learn.policies``).
3. Export the actor to numpy (``Policy``) with its metadata and save it as ``DIR/NAME.npz``.

One CPU thread (``torch.set_num_threads(1)``); deterministic in the seed up to torch's own kernels.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch as th
from sb3_contrib import MaskablePPO
from stable_baselines3 import DDPG
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.noise import NormalActionNoise

from gpumarket.learn.env import DEFAULT_CANDIDATES, ActionKind, PlacementEnv, Setting
from gpumarket.learn.policies import CandidateDdpgPolicy, CandidatePpoPolicy, CandidateScorer
from master.scheduler.learned.features import FEATURE_COUNT, FEATURES
from master.scheduler.learned.policy import Policy, policy_path

Algorithm = Literal["ppo", "ddpg"]
HIDDEN = (32, 32)
NORMALISATION_STEPS = 2_000
FAILURE_PENALTY = 1.0  # the return is placed − failed (see gpumarket.learn.env)
MIN_STD = 1e-2  # features nearly constant in the rollout are left unscaled rather than blown up


@dataclass(frozen=True, slots=True)
class TrainResult:
    policy: Policy
    path: Path
    steps: int  # env steps taken (PPO: whole rollouts, so at least those asked for)
    seconds: float
    episodes: int
    mean_return: float  # over the last episodes of training (up to 100)


def feature_normalisation(env: PlacementEnv, steps: int, *, seed: int) -> tuple[list[float], list[float]]:
    """Mean and σ of every feature over the feasible candidates of ``steps`` random feasible choices."""
    rng = np.random.default_rng(seed)
    rows: list[np.ndarray[Any, Any]] = []
    observation, _ = env.reset(seed=seed)
    width = env.max_candidates * FEATURE_COUNT
    for _ in range(steps):
        mask = observation[width : width + env.max_candidates] > 0.5
        rows.append(observation[:width].reshape(env.max_candidates, FEATURE_COUNT)[mask])
        action = int(rng.choice(np.flatnonzero(mask)))
        if env.action_kind == "box":
            scores = np.zeros(env.max_candidates, dtype=np.float32)
            scores[action] = 1.0
            observation, _, done, _, _ = env.step(scores)
        else:
            observation, _, done, _, _ = env.step(action)
        if done:
            observation, _ = env.reset()
    data = np.concatenate(rows).astype(np.float64)
    std = np.maximum(data.std(axis=0), MIN_STD)
    return [float(x) for x in data.mean(axis=0)], [float(x) for x in std]


class _Progress(BaseCallback):
    def __init__(self, total: int, report: Callable[[str], None], label: str, every: int) -> None:
        super().__init__()
        self.total, self.report, self.label, self.every = total, report, label, every
        self.started = time.monotonic()
        self.episodes = 0
        self.reported = -1

    def _on_step(self) -> bool:
        for info in self.locals.get("infos", ()):
            if "episode" in info:
                self.episodes += 1
        if self.num_timesteps % self.every == 0:
            self._line()
        return True

    def _on_training_end(self) -> None:
        if self.num_timesteps != self.reported:
            self._line()

    def _line(self) -> None:
        self.reported = self.num_timesteps
        done = self.num_timesteps  # PPO collects whole rollouts: it may end past the total asked for
        self.report(
            f"{self.label}: {done:,}/{self.total:,} steps ({min(100, round(100 * done / self.total))}%), "
            f"{time.monotonic() - self.started:.0f} s, {self.episodes:,} episodes, "
            f"mean return {_mean_return(self.model):.2f} (last 100)"
        )


def _mean_return(model: BaseAlgorithm) -> float:
    buffer = model.ep_info_buffer
    return float(np.mean([info["r"] for info in buffer])) if buffer else float("nan")


def train_placer(
    algorithm: Algorithm,
    setting: Setting,
    *,
    steps: int,
    seed: int = 0,
    name: str | None = None,
    directory: Path | None = None,
    trace_dir: Path | None = None,
    max_candidates: int = DEFAULT_CANDIDATES,
    normalisation_steps: int = NORMALISATION_STEPS,
    report: Callable[[str], None] = print,
    report_every: int = 5_000,
    save: bool = True,
    start_from_fgd: bool = False,
) -> TrainResult:
    """Train ``algorithm`` on ``setting`` for ``steps`` env steps; save the policy as ``NAME.npz`` (see the module).

    ``start_from_fgd``: the actor starts as FGD — its score a steep increasing function of the ``fgd_score``
    feature (``start_like_fgd``) — so training refines FGD rather than starting from a near-uniform choice.
    """
    th.set_num_threads(1)
    th.manual_seed(seed)
    name = name or (f"learned_{algorithm}" if setting == "hetero" else f"learned_{algorithm}_trace")
    path = policy_path(name, directory)
    action: ActionKind = "discrete" if algorithm == "ppo" else "box"
    env = PlacementEnv(setting, action=action, max_candidates=max_candidates, trace_dir=trace_dir,
                       failure_penalty=FAILURE_PENALTY)
    started = time.monotonic()
    mean, std = feature_normalisation(env, min(normalisation_steps, max(steps, 100)), seed=seed)
    scorer = {"candidates": max_candidates, "hidden": HIDDEN, "activation": "tanh", "mean": mean, "std": std}
    # Episodes end (tens to hundreds of decisions): no discount needed, and a discounted return makes the
    # policy myopic — it learns to keep room for the next task (packing) rather than for the most tasks.
    gamma, gae_lambda = (1.0, 1.0) if setting == "hetero" else (0.999, 0.98)
    config: dict[str, Any] = {"setting": setting, "candidates": max_candidates, "hidden": list(HIDDEN), "gamma": gamma,
                              "normalisation_steps": normalisation_steps, "failure_penalty": FAILURE_PENALTY}  # fmt: skip
    monitored = Monitor(env)
    model: BaseAlgorithm
    if algorithm == "ppo":
        hyper: dict[str, Any] = {"n_steps": 2048, "batch_size": 256, "n_epochs": 5, "learning_rate": 3e-4, "ent_coef": 0.0,
                 "gae_lambda": gae_lambda, "clip_range": 0.2}  # fmt: skip
        model = MaskablePPO(CandidatePpoPolicy, monitored, gamma=gamma, seed=seed, device="cpu", verbose=0,
                            policy_kwargs={"scorer": scorer}, **hyper)  # fmt: skip
    else:
        hyper = {"learning_rate": 1e-3, "buffer_size": 100_000, "learning_starts": 1_000, "batch_size": 128,
                 "tau": 0.005, "train_freq": 4, "gradient_steps": 1, "noise_sigma": 0.2}  # fmt: skip
        noise = NormalActionNoise(np.zeros(max_candidates), np.full(max_candidates, hyper["noise_sigma"]))
        model = DDPG(
            CandidateDdpgPolicy, monitored, gamma=gamma, seed=seed, device="cpu", verbose=0, action_noise=noise,
            policy_kwargs={"scorer": scorer, "net_arch": {"pi": list(HIDDEN), "qf": [256, 256]}},
            **{k: v for k, v in hyper.items() if k != "noise_sigma"},
        )  # fmt: skip
    config["hyperparameters"] = hyper
    config["start_from_fgd"] = start_from_fgd
    if start_from_fgd:
        start_like_fgd(_actor(model))
    progress = _Progress(steps, report, f"train-placer {algorithm} {setting}", report_every)
    model.learn(total_timesteps=steps, callback=progress)
    seconds = time.monotonic() - started
    actor = _actor(model)
    versions = {package: metadata.version(package) for package in ("torch", "stable-baselines3", "sb3-contrib")}
    done = int(model.num_timesteps)
    policy = actor.export(name, {"algorithm": algorithm, "setting": setting, "config": config, "seed": seed,
                                 "steps": done, "seconds": round(seconds, 1), "versions": versions})  # fmt: skip
    if save:
        policy.save(path)
    return TrainResult(policy, path, done, seconds, progress.episodes, _mean_return(model))


FGD_LOGIT_SCALE = 4.0  # logit difference per σ of FGD's score: the start picks FGD's choice mostly, not always
_LINEAR = 0.01  # a tanh unit this small is linear to within 0.01 %


def start_like_fgd(scorer: CandidateScorer) -> None:
    """Make the scorer's first hidden unit of each layer carry FGD's (normalised) score through, nearly linearly,
    and its output read it at ``FGD_LOGIT_SCALE``; the other units keep their initialisation, the output ignores them.

    ``tanh(ε·z)/ε ≈ z`` for small ε, so the score is ``≈ FGD_LOGIT_SCALE · (fgd_score − mean)/σ``: increasing in
    FGD's integer score, equal where it is equal (ties then go to the fullest node, as FGD's do).
    """
    linears = [module for module in scorer.net if isinstance(module, th.nn.Linear)]
    column = FEATURES.index("fgd_score")
    with th.no_grad():
        first = linears[0]
        first.weight[0].zero_()
        first.weight[0, column] = _LINEAR
        first.bias[0] = 0.0
        for layer in linears[1:-1]:
            layer.weight[0].zero_()
            layer.weight[0, 0] = 1.0
            layer.bias[0] = 0.0
        last = linears[-1]
        last.weight.zero_()
        last.weight[0, 0] = FGD_LOGIT_SCALE / _LINEAR
        last.bias.zero_()


def _actor(model: BaseAlgorithm) -> CandidateScorer:
    policy = model.policy
    if isinstance(policy, CandidatePpoPolicy):
        return policy.scorer
    actor = getattr(policy, "actor", None)
    scorer = getattr(actor, "mu", None)
    if not isinstance(scorer, CandidateScorer):
        raise TypeError("the model's actor is not the per-candidate scorer")
    return scorer


__all__ = ["HIDDEN", "Algorithm", "TrainResult", "feature_normalisation", "train_placer"]
