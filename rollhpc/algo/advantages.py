"""Advantage estimators (numpy). Shapes: [n_prompts, group] for group baselines, [B, T] for token-level ones.

Token-level arrays carry a mask (1 on response tokens, 0 elsewhere). Masked positions are not actions:
their rewards are ignored, recursions skip over them, and every result is 0 there.
"""

from __future__ import annotations

import numpy as np

# Estimators whose baseline is made of the other samples of a prompt's group, and why one sample is not enough.
GROUP_BASELINES = {
    "grpo": "GRPO's advantage is a sample's reward minus its group's mean, always 0 in a group of one (nothing "
    "is learned)",
    "rloo": "RLOO's baseline is the mean reward of the group's other samples (leave one out), and a group of one "
    "has none",
}


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


def rloo_advantages(rewards: np.ndarray) -> np.ndarray:
    """RLOO (Ahmadian et al. 2024): baseline = mean reward of the *other* k-1 samples of the prompt.

    rewards: [n_prompts, k], k >= 2. Unbiased (the baseline does not depend on the sample itself) and
    not scaled by the group std; pick it over GRPO when you want the plain REINFORCE gradient.
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [n_prompts, k], got shape {rewards.shape}")
    k = rewards.shape[1]
    if k < 2:
        raise ValueError(f"RLOO needs k >= 2 samples per prompt to leave one out, got k={k}")
    others_mean = (rewards.sum(axis=1, keepdims=True) - rewards) / (k - 1)
    return rewards - others_mean


def whiten(x: np.ndarray, mask: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """(x - mean) / (std + eps) with mean and std over the valid (mask=1) entries; 0 where masked."""
    valid = mask.astype(bool)
    out = np.zeros_like(x, dtype=np.float64)
    if valid.any():
        vals = x[valid]
        out[valid] = (vals - vals.mean()) / (vals.std() + eps)
    return out


def _check_bt(mask: np.ndarray, **arrays: np.ndarray) -> None:
    if mask.ndim != 2:
        raise ValueError(f"mask must be [B, T], got shape {mask.shape}")
    for name, a in arrays.items():
        if a.shape != mask.shape:
            raise ValueError(f"{name} shape {a.shape} != mask shape {mask.shape}")


def reinforce_pp_advantages(
    token_rewards: np.ndarray, mask: np.ndarray, gamma: float = 1.0, eps: float = 1e-8
) -> np.ndarray:
    """REINFORCE++ (Hu 2025): discounted return-to-go per token, whitened over the whole batch.

    G_t = sum_{t' >= t} gamma^(t'-t) r_t' within each row, counted over valid tokens only. Whitening
    over all valid tokens of the batch (not per prompt group) is what distinguishes it from GRPO: no
    critic and no group sampling needed, and the KL penalty usually enters through the token rewards.
    """
    _check_bt(mask, token_rewards=token_rewards)
    valid = mask.astype(bool)
    returns = np.zeros(mask.shape, dtype=np.float64)
    running = np.zeros(mask.shape[0], dtype=np.float64)
    for t in reversed(range(mask.shape[1])):
        running = np.where(valid[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = np.where(valid[:, t], running, 0.0)
    return whiten(returns, mask, eps)


def gae_advantages(
    token_rewards: np.ndarray,
    values: np.ndarray,
    mask: np.ndarray,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalized advantage estimation (Schulman et al. 2016), for PPO with a critic.

    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1}; the value after the
    last valid token is 0 (the episode ends there). lam=1 gives return - value (unbiased, high variance),
    lam<1 trades bias for variance. Returns (advantages, returns = advantages + values), 0 where masked.
    Whiten the advantages (``whiten``) before the PPO loss; the returns are the critic's targets.
    """
    _check_bt(mask, token_rewards=token_rewards, values=values)
    valid = mask.astype(bool)
    adv = np.zeros(mask.shape, dtype=np.float64)
    next_value = np.zeros(mask.shape[0], dtype=np.float64)
    next_adv = np.zeros(mask.shape[0], dtype=np.float64)
    for t in reversed(range(mask.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = np.where(valid[:, t], a, 0.0)
        next_value = np.where(valid[:, t], values[:, t], next_value)
        next_adv = np.where(valid[:, t], a, next_adv)
    returns = np.where(valid, adv + values, 0.0)
    return adv, returns


def token_level_rewards(
    seq_rewards: np.ndarray, mask: np.ndarray, kl: np.ndarray | None = None, kl_coef: float = 0.0
) -> np.ndarray:
    """Spread sequence rewards over tokens: reward on the last valid token of each row, and, with ``kl``,
    -kl_coef * kl on every valid token ("KL in reward", as in InstructGPT-style PPO and REINFORCE++).

    seq_rewards: [B]; mask, kl: [B, T]. Rows without valid tokens stay all zero.
    """
    _check_bt(mask)
    if seq_rewards.shape != (mask.shape[0],):
        raise ValueError(f"seq_rewards must be [B={mask.shape[0]}], got shape {seq_rewards.shape}")
    valid = mask.astype(bool)
    out = np.zeros(mask.shape, dtype=np.float64)
    if kl is not None:
        _check_bt(mask, kl=kl)
        out = np.where(valid, -kl_coef * kl, 0.0)
    rows = np.flatnonzero(valid.any(axis=1))
    last = mask.shape[1] - 1 - np.argmax(valid[rows, ::-1], axis=1)
    out[rows, last] += seq_rewards[rows]
    return out


def group_advantages(algorithm: str, rewards: np.ndarray, scale: bool = True) -> np.ndarray:
    """The group baseline ``algorithm`` names ("rloo", else GRPO's, scaled by the group's std unless ``scale`` is
    False) over rewards [n_prompts, group]."""
    return (
        rloo_advantages(rewards) if algorithm == "rloo" else grpo_advantages(rewards, scale=scale)
    )


def outcome_advantages(
    algorithm: str,
    rewards: np.ndarray,
    mask: np.ndarray,
    kl: np.ndarray | None = None,
    kl_coef: float = 0.0,
    scale: bool = True,
) -> np.ndarray:
    """Advantages of a batch scored by outcome rewards [n_prompts, group], for GRPO, RLOO and REINFORCE++ (PPO's
    need a critic's values). Without a KL term in the reward, GRPO and RLOO give one value per sample [B];
    REINFORCE++, and any of them with ``kl_coef > 0`` (``-kl_coef * kl`` on every generated token, ``kl`` and
    ``mask`` [B, T]), one value per token [B, T], 0 where ``mask`` is."""
    if algorithm == "reinforce_pp" or kl_coef > 0:
        token_rewards = token_level_rewards(
            rewards.reshape(-1), mask, kl if kl_coef else None, kl_coef
        )
        if algorithm == "reinforce_pp":
            return reinforce_pp_advantages(token_rewards, mask)
        return (
            group_advantages(algorithm, token_rewards.sum(1).reshape(rewards.shape), scale).reshape(
                -1, 1
            )
            * mask
        )
    return group_advantages(algorithm, rewards, scale).reshape(-1)
