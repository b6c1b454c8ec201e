"""The per-candidate scorer in torch, as the actor of MaskablePPO and of DDPG, and its export to numpy.

Both actors are one small MLP applied to every candidate row of the observation (``K × F`` features,
then the ``K``-long mask; see ``gpumarket.learn.env``): MaskablePPO reads its outputs as one logit per
candidate (the mask zeroes the infeasible ones' probability), DDPG as one tanh score per candidate (the
env takes the argmax over the feasible ones). The features are normalised inside the module with the
mean and σ measured before training, so ``export`` gives exactly the numpy ``Policy`` the placer runs.
The critics (PPO's value function, DDPG's Q) are trained alongside and not shipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch as th
from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
from stable_baselines3.td3.policies import Actor, TD3Policy
from torch import nn

from gpumarket.learn.env import GLOBALS
from master.scheduler.learned.features import FEATURE_COUNT, FEATURES
from master.scheduler.learned.policy import FORMAT, Policy

ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU}


def _mlp(inputs: int, hidden: Sequence[int], outputs: int, activation: str) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = inputs
    for size in hidden:
        layers += [nn.Linear(width, size), ACTIVATIONS[activation]()]
        width = size
    layers.append(nn.Linear(width, outputs))
    return nn.Sequential(*layers)


class CandidateScorer(nn.Module):
    """``mlp((features − mean) / std)`` for every candidate row of a flat observation: (B, K·F + K) → (B, K)."""

    def __init__(
        self, candidates: int, hidden: Sequence[int], activation: str, mean: Sequence[float], std: Sequence[float],
        *, squash: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.candidates = candidates
        self.activation = activation
        self.squash = squash
        self.net = _mlp(FEATURE_COUNT, hidden, 1, activation)
        self.mean: th.Tensor
        self.std: th.Tensor
        self.register_buffer("mean", th.as_tensor(np.asarray(mean, dtype=np.float32)))
        self.register_buffer("std", th.as_tensor(np.asarray(std, dtype=np.float32)))

    def score(self, features: th.Tensor) -> th.Tensor:
        """Scores of candidate features (..., F) → (...)."""
        out = self.net((features - self.mean) / self.std).squeeze(-1)
        return th.tanh(out) if self.squash else out

    def rows(self, observation: th.Tensor) -> th.Tensor:
        return observation[:, : self.candidates * FEATURE_COUNT].reshape(-1, self.candidates, FEATURE_COUNT)

    def forward(self, observation: th.Tensor) -> th.Tensor:
        return self.score(self.rows(observation))

    def export(self, name: str, meta: dict[str, Any]) -> Policy:
        """The numpy ``Policy`` computing exactly these scores."""
        linears = [module for module in self.net if isinstance(module, nn.Linear)]
        weights = tuple(layer.weight.detach().cpu().double().numpy().copy() for layer in linears)
        biases = tuple(layer.bias.detach().cpu().double().numpy().copy() for layer in linears)
        full = {**meta, "format": FORMAT, "features": list(FEATURES), "activation": self.activation,
                "output": "tanh" if self.squash else "identity"}  # fmt: skip
        return Policy(name, weights, biases, self.mean.detach().cpu().double().numpy().copy(),
                      self.std.detach().cpu().double().numpy().copy(), full)  # fmt: skip


class CandidateExtractor(nn.Module):
    """MaskablePPO's ``mlp_extractor``: the actor's latent is one logit per candidate (the action net is the
    identity); the critic's is a masked mean and max over candidates of a per-candidate embedding, and the
    observation's globals (``gpumarket.learn.env.GLOBALS``)."""

    def __init__(self, scorer: CandidateScorer, critic_hidden: int) -> None:
        super().__init__()
        self.scorer = scorer
        self.embed = nn.Sequential(
            nn.Linear(FEATURE_COUNT, critic_hidden), nn.Tanh(), nn.Linear(critic_hidden, critic_hidden), nn.Tanh()
        )
        self.latent_dim_pi = scorer.candidates
        self.latent_dim_vf = 2 * critic_hidden + GLOBALS

    def forward(self, features: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        return self.forward_actor(features), self.forward_critic(features)

    def forward_actor(self, features: th.Tensor) -> th.Tensor:
        scores: th.Tensor = self.scorer(features)
        return scores

    def forward_critic(self, features: th.Tensor) -> th.Tensor:
        scorer = self.scorer
        rows = (scorer.rows(features) - scorer.mean) / scorer.std
        start = scorer.candidates * FEATURE_COUNT
        mask = features[:, start : start + scorer.candidates].unsqueeze(-1)
        globals_ = features[:, start + scorer.candidates :]
        embedded = self.embed(rows)
        count = mask.sum(dim=1).clamp(min=1.0)
        mean = (embedded * mask).sum(dim=1) / count
        peak = (embedded * mask - 2.0 * (1.0 - mask)).max(dim=1).values  # tanh > −1 > masked rows
        return th.cat([mean, peak, globals_], dim=1)


class CandidatePpoPolicy(MaskableActorCriticPolicy):
    """MaskablePPO's policy whose actor is the per-candidate scorer (``scorer``: CandidateScorer's arguments)."""

    def __init__(self, observation_space: gym.spaces.Space[Any], action_space: gym.spaces.Space[Any], lr_schedule: Any,
                 *, scorer: dict[str, Any], critic_hidden: int = 64, **kwargs: Any) -> None:  # fmt: skip
        self.scorer_config = scorer
        self.critic_hidden = critic_hidden
        super().__init__(observation_space, action_space, lr_schedule, **kwargs)

    def _build_mlp_extractor(self) -> None:
        self.mlp_extractor = CandidateExtractor(CandidateScorer(**self.scorer_config), self.critic_hidden)  # type: ignore[assignment]

    def _build(self, lr_schedule: Any) -> None:
        super()._build(lr_schedule)
        self.action_net = nn.Identity()  # the scorer already gives one logit per candidate
        last = self.scorer.net[-1]
        assert isinstance(last, nn.Linear)
        nn.init.orthogonal_(last.weight, gain=0.01)  # near-uniform choices at first, as SB3 does for its action net
        nn.init.zeros_(last.bias)
        self.optimizer = self.optimizer_class(self.parameters(), lr=lr_schedule(1), **self.optimizer_kwargs)  # type: ignore[call-arg]

    @property
    def scorer(self) -> CandidateScorer:
        extractor = self.mlp_extractor
        assert isinstance(extractor, CandidateExtractor)
        return extractor.scorer


class CandidateActor(Actor):
    """DDPG's actor: one tanh score per candidate from the shared scorer."""

    def __init__(self, *args: Any, scorer: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mu = CandidateScorer(**{**scorer, "squash": True})  # type: ignore[assignment]

    @property
    def scorer(self) -> CandidateScorer:
        assert isinstance(self.mu, CandidateScorer)
        return self.mu


class CandidateDdpgPolicy(TD3Policy):
    """DDPG's (TD3's) policy whose actor is ``CandidateActor``; the critics stay SB3's MLPs over (obs, action)."""

    def __init__(self, *args: Any, scorer: dict[str, Any], **kwargs: Any) -> None:
        self.scorer_config = scorer
        super().__init__(*args, **kwargs)

    def make_actor(self, features_extractor: BaseFeaturesExtractor | None = None) -> Actor:
        actor_kwargs = self._update_features_extractor(self.actor_kwargs, features_extractor)
        return CandidateActor(**actor_kwargs, scorer=self.scorer_config).to(self.device)


__all__ = ["CandidateActor", "CandidateDdpgPolicy", "CandidateExtractor", "CandidatePpoPolicy", "CandidateScorer"]
