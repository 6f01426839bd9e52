"""Rewards scaled by running moments over the whole run, before advantages are computed.

Verifiable rewards are 0/1 and group baselines (GRPO, RLOO) normalise them per prompt anyway; for PPO and
REINFORCE++, whose baselines are a critic or a batch, the reward scale sets the step size, and a reward
model's or judge's scale is arbitrary. ``running`` keeps the mean and variance of every reward seen so far
(Chan et al.'s parallel update of Welford's moments, batch by batch) and maps r -> (r - mean) / std, then
clips to +-clip. The moments are run state: a checkpoint keeps them, so a resumed run normalises as the
uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np


@dataclass(kw_only=True)
class RewardNormConfig:
    kind: Literal["none", "running"] = "none"
    clip: float = 5.0  # |normalised reward| <= clip (0: no clip)
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.clip < 0 or self.eps <= 0:
            raise ValueError(
                f"reward_norm needs clip >= 0 and eps > 0 (got {self.clip}, {self.eps})"
            )


class RunningMoments:
    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean

    @property
    def std(self) -> float:
        return float(np.sqrt(self.m2 / self.count)) if self.count else 1.0

    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        if x.size == 0:
            return
        n, mean, m2 = x.size, float(x.mean()), float(((x - x.mean()) ** 2).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count, self.mean, self.m2 = (
            int(state["count"]),
            float(state["mean"]),
            float(state["m2"]),
        )


class RewardNormalizer:
    def __init__(self, config: RewardNormConfig):
        self.config = config
        self.moments = RunningMoments()

    def __call__(self, rewards: np.ndarray) -> np.ndarray:
        """Update the moments with this batch, then normalise it (``none``: returned unchanged)."""
        c = self.config
        if c.kind == "none":
            return rewards
        self.moments.update(rewards)
        out = (np.asarray(rewards, dtype=np.float64) - self.moments.mean) / (
            self.moments.std + c.eps
        )
        return np.clip(out, -c.clip, c.clip) if c.clip else out

    def state_dict(self) -> dict[str, Any]:
        return self.moments.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.moments.load_state_dict(state)
