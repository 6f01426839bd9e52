"""The text-environment protocol every environment follows (gymnasium / GEM semantics, text in and out).

Why a protocol of its own and not gymnasium's ``Env``: the policy is a language model, so an action is
the text it generated and an observation is the text it reads next; spaces, render modes and numpy
observations mean nothing to it. The semantics are gymnasium's, so anyone who wrote a gym env reads this
at once: ``reset(seed)`` starts an episode (deterministic for a seed: the same seed gives the same map,
level or question everywhere), ``step(action_text)`` returns ``(observation, reward, terminated,
truncated, info)``; ``terminated`` ends the episode by the task's own rules (goal reached, fell in a
hole, answered), ``truncated`` ends it from outside (turn limit).

``info`` keys the rest of rollhpc reads (all optional):
- ``instruction`` (reset only): the task description the policy sees once, before the first observation;
- ``success`` (final step): whether the episode solved the task (success rate in every report);
- ``state_key``: a hashable key of the state the observation shows; identical states of different
  episodes of one group share it (step-level advantages, GiGPO's anchor states);
- ``metrics``: a dict of floats averaged into the run's metrics (e.g. ``invalid_action``);
- ``use_tool``: this step ran a tool (tool-use environments), counted per episode.

An environment may also offer ``expert_action() -> str``: the best action from its current state
(BFS or optimal play), used by ``rollhpc env --policy expert`` and to build SFT warm starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["TextEnv", "ExpertEnv", "Step", "HELDOUT_SEED_BASE", "check_episode_running"]

# Reset seeds from here on are held out: training episodes and SFT warm starts draw theirs below it, so a
# held-out success rate is measured on maps / levels / questions the policy never trained on.
HELDOUT_SEED_BASE = 1_000_000_000


@runtime_checkable
class TextEnv(Protocol):
    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        """Start an episode; returns (first observation, info)."""
        ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Apply the policy's text; returns (observation, reward, terminated, truncated, info)."""
        ...

    def close(self) -> None:
        """Release what the environment holds (processes, files); called once per instance."""
        ...


@runtime_checkable
class ExpertEnv(TextEnv, Protocol):
    def expert_action(self) -> str:
        """The action an optimal policy takes from the current state."""
        ...


@dataclass
class Step:
    """One ``step`` result as a record (what the env role returns per episode)."""

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


def check_episode_running(over: bool) -> None:
    """RuntimeError when ``step`` is called while no episode runs (``over``: before ``reset`` or after the end)."""
    if over:
        raise RuntimeError("the episode is over: call reset(seed) first")
