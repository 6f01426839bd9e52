"""Play episodes of a text environment with a policy and summarise them (``rollhpc env``).

Why outside the RL pipeline: before training on an environment one wants its numbers (does the expert
solve it, how often does chance, how long are episodes, what does a transcript look like) and after
training the same numbers for a checkpoint; this is that loop, on one process, with the environment's
own ``reset``/``step`` and nothing else.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from rollhpc.envs import make_env
from rollhpc.envs.base import TextEnv
from rollhpc.envs.policies import Policy, make_policy

__all__ = ["Turn", "Transcript", "EpisodeStats", "run_episode", "run_episodes"]

TURN_GUARD = 10_000  # an environment that never ends its episodes is cut here (truncated)


@dataclass
class Turn:
    action: str
    observation: str
    reward: float


@dataclass
class Transcript:
    """One episode: what the policy saw and did, and how it ended."""

    seed: int
    instruction: str
    observation: str  # the first one
    turns: list[Turn] = field(default_factory=list)
    success: bool = False
    truncated: bool = False
    metrics: dict[str, float] = field(default_factory=dict)  # the steps' metrics, summed over the episode
    row_tokens: int | None = None  # a model policy's row length at the end

    @property
    def episode_return(self) -> float:
        return sum(t.reward for t in self.turns)

    def render(self) -> str:
        """Human-readable, in the order the policy met it."""
        lines = [f"--- episode seed {self.seed}"]
        if self.instruction:
            lines.append(self.instruction)
        lines.append(self.observation)
        for turn in self.turns:
            lines += [f"> {turn.action}    (reward {turn.reward:g})", turn.observation]
        end = "success" if self.success else "truncated" if self.truncated else "failed"
        tokens = f", row {self.row_tokens} tokens" if self.row_tokens is not None else ""
        lines.append(f"--- {end} after {len(self.turns)} turns, return {self.episode_return:g}{tokens}")
        return "\n".join(lines)


@dataclass
class EpisodeStats:
    env: str
    policy: str
    transcripts: list[Transcript]

    @property
    def episodes(self) -> int:
        return len(self.transcripts)

    @property
    def success_rate(self) -> float:
        return sum(t.success for t in self.transcripts) / max(self.episodes, 1)

    @property
    def mean_turns(self) -> float:
        return sum(len(t.turns) for t in self.transcripts) / max(self.episodes, 1)

    @property
    def mean_return(self) -> float:
        return sum(t.episode_return for t in self.transcripts) / max(self.episodes, 1)

    @property
    def metrics(self) -> dict[str, float]:
        """Each metric's per-episode sum, averaged over episodes (invalid_action: invalid turns per episode)."""
        totals: dict[str, float] = defaultdict(float)
        for t in self.transcripts:
            for k, v in t.metrics.items():
                totals[k] += v
        return {k: v / max(self.episodes, 1) for k, v in sorted(totals.items())}

    def summary(self) -> str:
        extra = "".join(f", {k} {v:.3f}" for k, v in self.metrics.items())
        return (f"{self.env} ({self.policy}, {self.episodes} episodes): success rate {self.success_rate:.3f}, "
                f"mean turns {self.mean_turns:.2f}, mean return {self.mean_return:.3f}{extra}")


def run_episode(env: TextEnv, policy: Policy, seed: int) -> Transcript:
    """One episode from ``env.reset(seed)`` until the environment ends it or the policy cannot go on."""
    observation, info = env.reset(seed)
    transcript = Transcript(seed=seed, instruction=str(info.get("instruction", "")), observation=observation)
    policy.begin(transcript.instruction, observation, seed)
    metrics: dict[str, float] = defaultdict(float)
    while True:
        action = policy.act() if len(transcript.turns) < TURN_GUARD else None
        if action is None:
            transcript.truncated = True
            break
        observation, reward, terminated, truncated, info = env.step(action)
        transcript.turns.append(Turn(action, observation, float(reward)))
        for k, v in (info.get("metrics") or {}).items():
            metrics[k] += float(v)
        if terminated or truncated:
            transcript.success, transcript.truncated = bool(info.get("success", False)), bool(truncated)
            break
        policy.observe(observation)
    transcript.metrics = dict(metrics)
    row = getattr(policy, "row", None)
    transcript.row_tokens = len(row) if isinstance(row, list) else None
    return transcript


def run_episodes(env_name: str, options: dict[str, Any] | None, policy: str, episodes: int, seed0: int = 0,
                 max_new_tokens: int = 32) -> EpisodeStats:
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
        transcripts = [run_episode(env, player, seed0 + i) for i in range(episodes)]
    finally:
        env.close()
    return EpisodeStats(env=env_name, policy=policy, transcripts=transcripts)
