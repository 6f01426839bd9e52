"""Advantage estimators that need no critic."""

from __future__ import annotations

import numpy as np


def grpo_advantages(rewards: np.ndarray, eps: float = 1e-6, scale: bool = True) -> np.ndarray:
    """GRPO: each sample's reward relative to its prompt group.

    rewards: [n_prompts, group_size]. Returns the same shape: (r - mean_group) / (std_group + eps),
    or just r - mean_group with ``scale=False`` (Dr. GRPO's unbiased variant). A group whose
    rewards are all equal gets zero advantage: it carries no learning signal.
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [n_prompts, group_size], got shape {rewards.shape}")
    centered = rewards - rewards.mean(axis=1, keepdims=True)
    if not scale:
        return centered
    return centered / (rewards.std(axis=1, keepdims=True) + eps)
