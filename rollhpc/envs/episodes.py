"""Play episodes of a text environment with a policy and summarise them (``rollhpc env``).

Why outside the RL pipeline: before training on an environment one wants its numbers (does the expert
solve it, how often does chance, how long are episodes, what does a transcript look like) and after
training the same numbers for a checkpoint; this is that loop, on one process, with the environment's
own ``reset``/``step`` and nothing else.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from rollhpc.envs import make_env
from rollhpc.envs.base import TextEnv
from rollhpc.envs.policies import Policy, make_policy
from rollhpc.rollout.episode import Episode, Turn

__all__ = ["EpisodeStats", "run_episode", "run_episodes"]

TURN_GUARD = 10_000  # an environment that never ends its episodes is cut here (truncated)


@dataclass
class EpisodeStats:
    env: str
    policy: str
    played: list[Episode]

    @property
    def episodes(self) -> int:
        return len(self.played)

    @property
    def success_rate(self) -> float:
        return sum(e.success for e in self.played) / max(self.episodes, 1)

    @property
    def mean_turns(self) -> float:
        return sum(len(e.turns) for e in self.played) / max(self.episodes, 1)

    @property
    def mean_return(self) -> float:
        return sum(e.episode_return for e in self.played) / max(self.episodes, 1)

    @property
    def metrics(self) -> dict[str, float]:
        """Each metric's per-episode sum, averaged over episodes (invalid_action: invalid turns per episode)."""
        totals: dict[str, float] = defaultdict(float)
        for e in self.played:
            for k, v in e.metrics.items():
                totals[k] += v
        return {k: v / max(self.episodes, 1) for k, v in sorted(totals.items())}

    def summary(self) -> str:
        extra = "".join(f", {k} {v:.3f}" for k, v in self.metrics.items())
        return (
            f"{self.env} ({self.policy}, {self.episodes} episodes): success rate {self.success_rate:.3f}, "
            f"mean turns {self.mean_turns:.2f}, mean return {self.mean_return:.3f}{extra}"
        )


def run_episode(env: TextEnv, policy: Policy, seed: int, max_turns: int = TURN_GUARD) -> Episode:
    """One episode from ``env.reset(seed)`` until the environment ends it, the policy cannot go on or it has had
    ``max_turns`` turns (then it ends truncated). The record holds the policy's token ids where it has any."""
    observation, info = env.reset(seed)
    episode = Episode(
        seed=seed, instruction=str(info.get("instruction", "")), observation=observation
    )
    episode.prompt = policy.begin(episode.instruction, observation, seed)
    metrics: dict[str, float] = defaultdict(float)
    while True:
        act = policy.act() if len(episode.turns) < max_turns else None
        if act is None:
            episode.finish = "truncated"
            break
        observation, reward, terminated, truncated, info = env.step(act.text)
        episode.turns.append(
            Turn(
                response=act.ids,
                action=act.text,
                observation_text=observation,
                reward=float(reward),
                finish_reason=act.finish_reason,
            )
        )
        for k, v in (info.get("metrics") or {}).items():
            metrics[k] += float(v)
        if terminated or truncated:
            episode.success = bool(info.get("success", False))
            episode.finish = "truncated" if truncated else "terminated"
            break
        episode.turns[-1].observation = policy.observe(observation)
    episode.metrics = dict(metrics)
    return episode


def run_episodes(
    env_name: str,
    options: dict[str, Any] | None,
    policy: str,
    episodes: int,
    seed0: int = 0,
    max_new_tokens: int = 32,
) -> EpisodeStats:
    """``episodes`` episodes of ``env_name`` (built with ``options``) with seeds seed0, seed0 + 1, ...

    ``policy``: ``random`` (the environment's ACTIONS, seeded by the episode's seed), ``expert`` (its
    expert_action) or a model directory (greedy, ``max_new_tokens`` per turn). Raises ValueError for an
    unknown environment, bad options or a policy that is none of these.
    """
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    env = make_env(env_name, options)
    try:
        player = make_policy(policy, env, max_new_tokens)
        played = [run_episode(env, player, seed0 + i) for i in range(episodes)]
    finally:
        env.close()
    return EpisodeStats(env=env_name, policy=policy, played=played)
