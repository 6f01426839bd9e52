"""What the trainer optimises: the knobs of the policy loss, chosen by the pipeline and sent with
every training call (so one trainer serves GRPO, RLOO, Reinforce++ and PPO actors alike)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


@dataclass(kw_only=True)
class LossConfig:
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.28  # > clip_low: "clip-higher" (DAPO) keeps exploration alive
    # cap on the loss of negative-advantage tokens (dual-clip PPO), e.g. 3.0
    dual_clip: float | None = None
    agg: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    # KL to the reference in the loss (0: off; set kl_in_reward in the pipeline instead)
    kl_coef: float = 0.0
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            raise ValueError(
                f"clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, {self.clip_high}"
            )
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(
                f"dual_clip must be > 1 (a multiple of the advantage), got {self.dual_clip}"
            )
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("kl_coef and entropy_coef must be >= 0")
