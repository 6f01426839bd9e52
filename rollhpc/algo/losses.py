"""Policy-gradient losses (torch)."""

from __future__ import annotations

import torch


def clipped_pg_loss(logprob: torch.Tensor, old_logprob: torch.Tensor, advantage: torch.Tensor,
                    clip_low: float = 0.2, clip_high: float = 0.2) -> torch.Tensor:
    """PPO's clipped surrogate, per element (aggregate outside). Asymmetric when clip_high != clip_low.

    loss = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A), ratio = exp(logp - old_logp).
    """
    ratio = torch.exp(logprob - old_logprob)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return -torch.minimum(ratio * advantage, clipped * advantage)
