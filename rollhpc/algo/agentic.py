"""Advantages for multi-turn episodes (numpy): trajectory-wise (StarPO-style) and step-wise (GiGPO-style).

Inputs are per-episode lists of per-turn values (episodes of a group have different numbers of turns, so a
ragged list reads better than a padded array): ``turn_rewards[e][k]`` is the env reward of episode e's turn k,
``state_keys[e][k]`` the state that turn acted from (``Turn.state_key``).

Trajectory-wise: one row per episode (``rollhpc.rollout.rows.trajectory_row``).
- GRPO / RLOO: ``trajectory_advantages`` on the episodes' returns, one advantage per episode, spread over its
  generated tokens (``advantage[:, None] * loss_mask``).
- REINFORCE++ / PPO: run ``rollhpc.algo.advantages.reinforce_pp_advantages`` or ``gae_advantages`` on the rows'
  ``token_rewards`` and ``loss_mask`` as they are. Their recursions skip masked positions, so the observation
  tokens between two turns are not time steps: the return (or bootstrap value) of a turn's last token is the
  one of the next turn's first token.

Step-wise (GiGPO, Feng et al. 2025): one row per turn (``step_rows``) and one advantage per turn,
``w_episode * A_episode + w_step * A_step``: the episode's return against its group (as GRPO), plus the turn's
discounted return-to-go against the other turns of the group that acted from the same state (anchor state).
The second term is what tells a good move from a bad one inside an episode that succeeded or failed as a whole.
``spread_turn_advantages`` puts per-turn advantages on the tokens of either kind of row.

Either formulation takes a fixed number of optimizer steps per RL step: the trainer splits whatever rows it
gets into ``mini_batches`` (step-wise batches vary in rows with the episodes' lengths); ``minibatch_order``
shuffles them first so each mini-batch mixes turns of many episodes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from typing import Literal

import numpy as np

from rollhpc.algo.advantages import grpo_advantages, rloo_advantages

__all__ = [
    "discounted_returns",
    "episode_returns",
    "trajectory_advantages",
    "episode_level_advantages",
    "step_level_advantages",
    "gigpo_advantages",
    "spread_turn_advantages",
    "minibatch_order",
]


def _check_gamma(gamma: float) -> None:
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")


def discounted_returns(rewards: Sequence[float] | np.ndarray, gamma: float = 1.0) -> np.ndarray:
    """Return-to-go of each turn: G_k = r_k + gamma * G_{k+1}, G after the last turn = 0.

    rewards: [K] -> [K] float64. A truncated episode is not bootstrapped: without a critic there is no value
    to bootstrap from, and the turn limit is part of the task the policy is trained on.
    """
    _check_gamma(gamma)
    r = np.asarray(rewards, dtype=np.float64)
    out = np.zeros_like(r)
    running = 0.0
    for k in reversed(range(len(r))):
        running = r[k] + gamma * running
        out[k] = running
    return out


def episode_returns(turn_rewards: Sequence[Sequence[float]], gamma: float = 1.0) -> np.ndarray:
    """[E]: each episode's return from its first turn (the plain sum of its rewards with gamma=1)."""
    return np.array(
        [discounted_returns(r, gamma)[0] if len(r) else 0.0 for r in turn_rewards], dtype=np.float64
    )


def trajectory_advantages(
    returns: np.ndarray,
    estimator: Literal["grpo", "rloo"] = "grpo",
    scale: bool = True,
    eps: float = 1e-6,
) -> np.ndarray:
    """Trajectory-wise group advantages: an episode's return against its group's (same reset seed).

    returns: [n_groups, group_size] -> same shape, the RLVR estimators applied to episodes instead of
    single responses (``scale=False``: GRPO without the std division, Dr. GRPO).
    """
    if estimator == "grpo":
        return grpo_advantages(np.asarray(returns, dtype=np.float64), eps=eps, scale=scale)
    if estimator == "rloo":
        return rloo_advantages(np.asarray(returns, dtype=np.float64))
    raise ValueError(f"estimator must be 'grpo' or 'rloo', got {estimator!r}")


def episode_level_advantages(
    returns: Sequence[float] | np.ndarray, scale: bool = True, eps: float = 1e-6
) -> np.ndarray:
    """GiGPO's episode term for one group: [E] returns -> [E] (r - mean) / (std + eps), or r - mean unscaled."""
    r = np.asarray(returns, dtype=np.float64)
    if r.ndim != 1 or not len(r):
        raise ValueError(f"returns must be a non-empty [E] array of one group, got shape {r.shape}")
    return grpo_advantages(r[None, :], eps=eps, scale=scale)[0]


def _check_ragged(
    turn_rewards: Sequence[Sequence[float]], state_keys: Sequence[Sequence[Hashable | None]]
) -> None:
    if not turn_rewards:
        raise ValueError("a group needs at least one episode")
    if len(state_keys) != len(turn_rewards):
        raise ValueError(
            f"{len(turn_rewards)} episodes of rewards but {len(state_keys)} of state keys"
        )
    for e, (r, s) in enumerate(zip(turn_rewards, state_keys)):
        if len(r) != len(s):
            raise ValueError(f"episode {e} has {len(r)} turn rewards but {len(s)} state keys")


def step_level_advantages(
    turn_rewards: Sequence[Sequence[float]],
    state_keys: Sequence[Sequence[Hashable | None]],
    gamma: float = 0.95,
    scale: bool = True,
    eps: float = 1e-6,
) -> list[np.ndarray]:
    """GiGPO's step term for one group: each turn's return-to-go against the other turns from the same state.

    Turns of all the group's episodes with equal ``state_key`` form an anchor group; within it the advantage
    is (G - mean) / (std + eps), or G - mean unscaled. A turn whose state no other turn visited (an anchor
    group of one, or a None key, which matches nothing) gets 0: there is nothing to compare it with.
    Returns one [K_e] array per episode.
    """
    _check_ragged(turn_rewards, state_keys)
    returns = [discounted_returns(r, gamma) for r in turn_rewards]
    # state key -> (episode, turn) visits
    anchors: dict[Hashable, list[tuple[int, int]]] = defaultdict(list)
    for e, keys in enumerate(state_keys):
        for k, key in enumerate(keys):
            if key is not None:
                anchors[key].append((e, k))
    out = [np.zeros(len(r), dtype=np.float64) for r in turn_rewards]
    for visits in anchors.values():
        if len(visits) < 2:
            continue
        g = np.array([returns[e][k] for e, k in visits])
        a = grpo_advantages(g[None, :], eps=eps, scale=scale)[0]
        for (e, k), v in zip(visits, a):
            out[e][k] = v
    return out


def gigpo_advantages(
    turn_rewards: Sequence[Sequence[float]],
    state_keys: Sequence[Sequence[Hashable | None]],
    *,
    gamma: float = 0.95,
    w_episode: float = 1.0,
    w_step: float = 1.0,
    scale: bool = True,
    eps: float = 1e-6,
) -> list[np.ndarray]:
    """Per-turn advantages of one group (episodes from one reset seed): w_episode * A_E + w_step * A_S.

    A_E is ``episode_level_advantages`` of the undiscounted episode returns (the same for every turn of an
    episode), A_S is ``step_level_advantages`` with discount ``gamma``; ``scale`` applies to both. GiGPO's
    paper uses gamma=0.95 and equal weights. Returns one [K_e] array per episode.
    """
    a_step = step_level_advantages(turn_rewards, state_keys, gamma=gamma, scale=scale, eps=eps)
    a_episode = episode_level_advantages(episode_returns(turn_rewards), scale=scale, eps=eps)
    return [w_episode * a_e + w_step * a_s for a_e, a_s in zip(a_episode, a_step)]


def spread_turn_advantages(
    turn_advantages: Sequence[Sequence[float] | np.ndarray], turn_ids: np.ndarray
) -> np.ndarray:
    """Token advantages [B, T-1] from per-turn ones: each generated token gets its turn's advantage.

    turn_ids: [B, T-1] from ``pad_rows`` (-1 where no generated token is predicted, which gets 0);
    turn_advantages[b]: the advantages of the turns of row b's episode, indexed by turn. A step row only
    holds one turn's tokens, so every step row of an episode takes that episode's whole list.
    """
    if turn_ids.ndim != 2 or len(turn_advantages) != turn_ids.shape[0]:
        raise ValueError(
            f"turn_ids must be [B, T-1] with B = {len(turn_advantages)} rows, "
            f"got shape {turn_ids.shape}"
        )
    out = np.zeros(turn_ids.shape, dtype=np.float64)
    for b, adv in enumerate(turn_advantages):
        ids = turn_ids[b]
        valid = ids >= 0
        a = np.asarray(adv, dtype=np.float64)
        if valid.any() and ids[valid].max() >= len(a):
            raise ValueError(
                f"row {b} has tokens of turn {ids[valid].max()} but {len(a)} turn advantages"
            )
        out[b, valid] = a[ids[valid]]
    return out


def minibatch_order(n_rows: int, n_minibatches: int, seed: int) -> np.ndarray:
    """A seeded permutation of the batch's rows; reorder the batch with it before the train step.

    The trainer takes exactly ``n_minibatches`` optimizer steps on contiguous ``np.array_split`` chunks,
    so after this reorder each chunk is a uniform draw of rows instead of the turns of a few episodes.
    Fewer rows than mini-batches would leave an optimizer step without data, which is refused.
    """
    if n_minibatches < 1:
        raise ValueError(f"n_minibatches must be >= 1, got {n_minibatches}")
    if n_rows < n_minibatches:
        raise ValueError(
            f"{n_rows} rows cannot fill {n_minibatches} mini-batches: an optimizer step would "
            "see no data; collect more episodes or take fewer mini-batches"
        )
    return np.random.default_rng(seed).permutation(n_rows)
