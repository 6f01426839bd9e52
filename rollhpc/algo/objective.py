"""What the trainer optimises: the knobs of the policy loss, chosen by the pipeline and sent with
every training call (so one trainer serves GRPO, RLOO, Reinforce++ and PPO actors alike)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

from rollhpc.algo.correction import CorrectionConfig

log = logging.getLogger(__name__)

# the policy-gradient term (rollhpc.algo.losses.pg_terms has the equations)
OBJECTIVES = ("ppo", "gspo", "gspo-token", "cispo")

AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


@dataclass(kw_only=True)
class LossConfig:
    # ppo: PPO-clip per token; gspo: the sequence's geometric-mean ratio, clipped per sequence (GSPO, the
    # Qwen3 MoE recipe: its clips are ~1e-3, e.g. clip_low 3e-4, clip_high 4e-4); gspo-token: GSPO's token
    # variant (per-token advantages); cispo: clipped, stop-gradient ratios as weights of every token's
    # log-prob gradient (CISPO: no token loses its gradient to the clip)
    objective: Literal["ppo", "gspo", "gspo-token", "cispo"] = "ppo"
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
    # training-inference mismatch correction (rollhpc.algo.correction): weights / rejections of the ratio of the
    # trainer's old log-probs to the generator's
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(
                f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}"
            )
        if self.dual_clip is not None and self.objective != "ppo":
            raise ValueError("dual_clip is PPO-clip's: it needs objective ppo")
        if self.objective.startswith("gspo") and max(self.clip_low, self.clip_high) > 0.01:
            log.warning(
                "loss.objective=%s with clip_low=%s, clip_high=%s: GSPO clips a sequence's geometric-mean "
                "ratio, which stays within ~1e-3 of 1, so clips this wide never act (GSPO's own: 3e-4, 4e-4)",
                self.objective,
                self.clip_low,
                self.clip_high,
            )
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
