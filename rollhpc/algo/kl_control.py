"""How strongly the policy is held to the reference: a fixed KL coefficient, or one that adapts.

The adaptive controller (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", the
one PPO-RLHF systems use) scales the configured coefficients so the measured KL drifts toward a target:

    error = clip(kl / target - 1, -max_error, +max_error)
    scale <- scale * (1 + error * n_samples / horizon)

A KL above target strengthens the penalty, below it weakens it, by at most max_error * n / horizon per
step. The scale multiplies both ``loss.kl_coef`` and ``kl_in_reward``; it is run state (a checkpoint keeps
it), so a resumed run continues with the coefficient it had, not the configured start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(kw_only=True)
class KlControlConfig:
    kind: Literal["fixed", "adaptive"] = "fixed"
    target: float = 0.01  # adaptive: the per-token KL(policy || reference) to steer toward
    horizon: int = 10000  # adaptive: samples over which a relative error is corrected
    max_error: float = 0.2  # adaptive: clip of the relative error per update

    def __post_init__(self) -> None:
        if self.target <= 0 or self.horizon < 1 or self.max_error <= 0:
            raise ValueError(
                f"kl_control needs target > 0, horizon >= 1, max_error > 0 (got {self.target}, "
                f"{self.horizon}, {self.max_error})"
            )


class KlController:
    def __init__(self, config: KlControlConfig):
        self.config = config
        self.scale = 1.0

    def update(self, kl: float, n_samples: int) -> float:
        """After a step whose batch of ``n_samples`` measured per-token KL ``kl``; returns the new scale."""
        c = self.config
        if c.kind == "adaptive":
            error = min(max(kl / c.target - 1.0, -c.max_error), c.max_error)
            self.scale *= 1.0 + error * n_samples / c.horizon
        return self.scale

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
