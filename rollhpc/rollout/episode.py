"""The episode record: one played episode of a text environment, turn by turn (token ids are plain ints).

One record for every place an episode is played: the rollout scheduler's episodes in training and in
evaluation (``episode_of`` reads one off a finished sample), ``rollhpc env`` (``envs.episodes``: random,
expert or model policies) and the agentic warm start's expert and model play (``warm_start.agentic_prep``).
Training rows are made from it (``rollout.rows``), and summaries (success rate, turns, returns) read the same
fields wherever it came from.

What a record holds depends on who played: a model leaves its token ids (the prompt, each turn's response
exactly as generated, the observation ids appended after it), a generator also its log-probs and policy
version; a policy that acts in text (random, expert) leaves the text only. The text (instruction, actions,
observations) is there whenever the environment was played through rollhpc's turn formatting.

While an episode runs in the scheduler its place there (env rank, generator, the flat row and its generated
mask, the watchdog's clock) is ``rollout.types.EpisodeState``: bookkeeping of a running sample, not a record.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from rollhpc.rollout.types import Sample

__all__ = ["FINISHES", "Turn", "Episode", "episode_of"]

# How an episode ended. Also "error: <what happened>" (the env raised or timed out; the run goes on).
FINISHES = ("terminated", "truncated", "abandoned")


@dataclass
class Turn:
    """One policy turn: what it generated (or chose, in text) and what the environment made of it."""

    # [R] generated ids, as generated (EOS included when it
    response: list[int] = field(default_factory=list)
    #   stopped); empty when the policy acts in text
    # [R] sampled-token log-probs from the generator; empty
    logprobs: list[float] = field(default_factory=list)
    #   when no generator sampled them
    # oldest policy version that produced any of its tokens (a resumed partial mixes versions)
    version: int = -1
    # [O] ids appended after the response (the formatted
    observation: list[int] = field(default_factory=list)
    #   next observation); empty for the last turn, unless that observation overflowed the row
    reward: float = 0.0  # the env reward of this turn's action
    # the state the policy acted from (the observation it answered); turns of
    state_key: Hashable | None = None
    #   one group with equal keys are GiGPO's anchor states. None: matches nothing
    finish_reason: str = ""  # the generator's: "stop" (EOS) or "length" (hit the turn budget)
    # the text the environment was given (formatter.action of the decoded response)
    action: str = ""
    observation_text: str = ""  # the environment's answer to it

    def __post_init__(self) -> None:
        if self.logprobs and len(self.logprobs) != len(self.response):
            raise ValueError(
                f"a turn has {len(self.response)} response ids but {len(self.logprobs)} logprobs"
            )


@dataclass
class Episode:
    """One episode from its reset to its end (or, while ``finish`` is "", so far)."""

    # [P] ids of the formatted first prompt (instruction and first
    prompt: list[int] = field(default_factory=list)
    #   observation); empty when the policy reads text
    turns: list[Turn] = field(default_factory=list)
    # episodes of one group share the reset seed (the group baseline of GRPO and GiGPO)
    group: int = 0
    index: int = 0  # position in its group, 0 .. group_size-1
    seed: int = 0  # the environment's reset seed
    finish: str = ""  # FINISHES or "error: ..."; "" while the episode is running
    success: bool = False  # the env's info["success"] at the end
    # the env's info["metrics"], summed over its steps
    metrics: dict[str, float] = field(default_factory=dict)
    instruction: str = ""
    observation: str = ""  # the first observation's text

    def __post_init__(self) -> None:
        if self.finish and self.finish not in FINISHES and not self.finish.startswith("error: "):
            raise ValueError(
                f"finish must be one of {', '.join(FINISHES)} or 'error: ...', got {self.finish!r}"
            )

    @property
    def episode_return(self) -> float:
        """Undiscounted sum of the turn rewards (what success rates and GRPO's group baseline compare)."""
        return float(sum(t.reward for t in self.turns))

    @property
    def version(self) -> int:
        """The oldest policy version that produced any of its turns (-1 before the first turn)."""
        return min((t.version for t in self.turns), default=-1)

    @property
    def length(self) -> int:
        """Tokens the policy's context holds now: prompt, responses and every appended observation."""
        return len(self.prompt) + sum(len(t.response) + len(t.observation) for t in self.turns)

    @property
    def truncated(self) -> bool:
        """Cut before the environment ended it (its own limit, a turn cap, a full row)."""
        return self.finish == "truncated"

    @property
    def turns_cut(self) -> int:
        """Turns that ran into their token budget instead of ending (a policy writing on past its action)."""
        return sum(t.finish_reason == "length" for t in self.turns)

    @property
    def actions(self) -> list[str]:
        return [t.action for t in self.turns]

    @property
    def observations(self) -> list[str]:
        """The first observation, then the environment's answer to each turn (one more than ``actions``)."""
        return [self.observation] + [t.observation_text for t in self.turns]

    def render(self) -> str:
        """Human-readable, in the order the policy met it."""
        lines = [f"--- episode seed {self.seed}"]
        if self.instruction:
            lines.append(self.instruction)
        lines.append(self.observation)
        for turn in self.turns:
            lines += [f"> {turn.action}    (reward {turn.reward:g})", turn.observation_text]
        end = "success" if self.success else "truncated" if self.truncated else "failed"
        tokens = f", row {self.length} tokens" if self.prompt else ""
        lines.append(
            f"--- {end} after {len(self.turns)} turns, return {self.episode_return:g}{tokens}"
        )
        return "\n".join(lines)


def episode_of(sample: Sample) -> Episode:
    """The record of a multi-turn sample the scheduler finished: its flat response r1 || o2 || r2 ... cut into
    turns at the generated/observation boundaries the episode's state marked (nothing is re-encoded)."""
    ep = sample.episode
    if ep is None:
        raise ValueError(f"sample {sample.request_id} is single-turn: it has no episode")
    turns: list[Turn] = []
    start = 0
    for k, end in enumerate(ep.turn_ends):
        while ep.generated[start] == 0:  # skip the observation before this turn
            start += 1
        nxt = ep.turn_ends[k + 1] if k + 1 < len(ep.turn_ends) else len(sample.response) - 1
        obs_end = end + 1
        while obs_end <= nxt and obs_end < len(ep.generated) and ep.generated[obs_end] == 0:
            obs_end += 1
        turns.append(
            Turn(
                response=sample.response[start : end + 1],
                logprobs=sample.logprobs[start : end + 1],
                version=sample.version,
                observation=sample.response[end + 1 : obs_end],
                reward=ep.turn_rewards[k] if k < len(ep.turn_rewards) else 0.0,
                state_key=ep.state_keys[k],
                finish_reason=ep.turn_finishes[k],
                action=ep.actions[k] if k < len(ep.actions) else "",
                observation_text=ep.observations[k] if k < len(ep.observations) else "",
            )
        )
        start = obs_end
    finish = {"row_full": "truncated"}.get(ep.finish, ep.finish)
    if finish and finish not in FINISHES and not finish.startswith("error: "):
        finish = f"error: {finish}"
    return Episode(
        prompt=list(ep.prompt_ids),
        turns=turns,
        group=sample.prompt.uid,
        index=sample.index,
        seed=sample.prompt.example.seed,
        finish=finish,
        success=ep.success,
        metrics=dict(ep.metrics),
        instruction=ep.instruction,
        observation=ep.observation,
    )
