"""Multi-turn episodes and the training rows made from them (shapes in comments; token ids are plain ints).

An episode's row is ``prompt || r1 || o2 || r2 || ... || rK``: the first prompt, then each response exactly as
the generator produced it, each followed by the ids of the text the turn formatter appends (the next
observation). Generated tokens are never re-encoded: decoding and encoding again can split the same text into
other tokens (BPE is not a bijection), and the policy would then be trained on a sequence it never sampled,
with log-probs that belong to different tokens. So a row only ever grows by concatenating id lists.

Masks and per-token arrays follow RLVR's training batch (``RlvrPipeline._training_batch``): they are over the
T-1 *predicted positions*; position i predicts ``tokens[i + 1]``. A generated token at row index j is therefore
masked in at position j-1, which is also where its generator log-prob goes. Prompt and observation tokens are
context only (mask 0): the policy did not choose them.

Two formulations read the same ``Trajectory``:
- trajectory-wise (StarPO-style): ``trajectory_row`` gives one row per episode, every turn's response masked
  in, each turn's env reward on that turn's last generated token (``token_rewards``), ready for GRPO on episode
  returns or for REINFORCE++ / GAE over the token rewards (``rollhpc.algo.advantages``; their recursions skip
  masked positions, so observation tokens between turns do not count as time steps);
- step-wise (GiGPO-style): ``step_rows`` gives one row per turn, the context the generator saw as the prompt
  and that turn's response as the only masked span; advantages per turn come from ``rollhpc.algo.agentic``.

Budgets: before each turn the generator may produce ``turn_budget(row length, per-turn cap, max_model_len)``
tokens; a budget <= 0 means the row is full and the episode ends ``truncated``. Every row then fits in
``max_model_len`` (an observation that overflows the row is recorded on its turn but not put in any row).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Turn", "Trajectory", "TrajectoryRow", "FINISHES", "turn_budget", "trajectory_row", "step_rows",
           "pad_rows"]

# How an episode ended. Also "error: <what happened>" (the env raised or timed out; the run goes on).
FINISHES = ("terminated", "truncated", "abandoned")


@dataclass
class Turn:
    """One policy turn: the response it generated and what the environment made of it."""

    response: list[int]  # [R] generated ids, as the generator produced them (EOS included when it stopped)
    logprobs: list[float]  # [R] sampled-token log-probs from the generator
    version: int  # oldest policy version that produced any of its tokens (a resumed partial mixes versions)
    observation: list[int] = field(default_factory=list)  # [O] ids appended after the response (the formatted
    #   next observation); empty for the last turn, unless that observation overflowed the row
    reward: float = 0.0  # the env reward of this turn's action
    state_key: Hashable | None = None  # the state the policy acted from (the observation it answered); turns of
    #   one group with equal keys are GiGPO's anchor states. None: matches nothing
    finish_reason: str = ""  # the generator's: "stop" (EOS) or "length" (hit the turn budget)
    action: str = ""  # the text the environment was given (formatter.action of the decoded response)

    def __post_init__(self) -> None:
        if not self.response:
            raise ValueError("a turn needs at least one generated token (its reward sits on the last one)")
        if len(self.logprobs) != len(self.response):
            raise ValueError(f"a turn has {len(self.response)} response ids but {len(self.logprobs)} logprobs")


@dataclass
class Trajectory:
    """One finished episode of a text environment, turn by turn: the first prompt and the policy's turns.

    The per-turn view the rows and advantages are made from (``rollout.types.Episode`` is the environment
    side of a sample while it runs).
    """

    prompt: list[int]  # [P] ids of the formatted first prompt (instruction and first observation)
    turns: list[Turn] = field(default_factory=list)
    group: int = 0  # episodes of one group share the reset seed (the group baseline of GRPO and GiGPO)
    index: int = 0  # position in its group, 0 .. group_size-1
    seed: int = 0  # the environment's reset seed
    finish: str = ""  # FINISHES or "error: ..."; "" while the episode is running
    success: bool = False  # the env's info["success"] at the end
    metrics: dict[str, float] = field(default_factory=dict)  # the env's info["metrics"] for the episode

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("an episode needs a non-empty prompt (the first generated token is predicted from it)")
        if self.finish and self.finish not in FINISHES and not self.finish.startswith("error: "):
            raise ValueError(f"finish must be one of {', '.join(FINISHES)} or 'error: ...', got {self.finish!r}")

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
        """Tokens the generator's context holds now: prompt, responses and every appended observation."""
        return len(self.prompt) + sum(len(t.response) + len(t.observation) for t in self.turns)


@dataclass(frozen=True)
class TrajectoryRow:
    """One training row. Per-position arrays are over the T-1 predicted positions (i predicts tokens[i+1])."""

    tokens: np.ndarray  # [T] int64
    loss_mask: np.ndarray  # [T-1] float32, 1 where tokens[i+1] was generated by the policy
    logprobs: np.ndarray  # [T-1] float32, the generator's log-prob of tokens[i+1]; 0 where the mask is 0
    token_rewards: np.ndarray  # [T-1] float64, a turn's env reward on its last generated token, 0 elsewhere
    turn_ids: np.ndarray  # [T-1] int32, the turn that generated tokens[i+1]; -1 where the mask is 0


def turn_budget(row_len: int, per_turn_cap: int, max_model_len: int) -> int:
    """Tokens the next response may have: min(per-turn cap, room left in the model's context).

    ``row_len`` is the row as the generator will see it (``Trajectory.length``, observation included).
    A result <= 0 means the row is full: the episode ends ``truncated`` without another turn.
    """
    if per_turn_cap < 1:
        raise ValueError(f"per_turn_cap must be >= 1, got {per_turn_cap}")
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    return min(per_turn_cap, max_model_len - row_len)


def _row(prompt: Sequence[int], turns: Sequence[Turn], masked: Sequence[int]) -> TrajectoryRow:
    """``prompt || r_0 || o_0 || ... || r_last`` with the responses of turns ``masked`` (indices) masked in.

    The last turn's observation is left out: no generated token follows it, so it would be pure padding.
    """
    parts: list[list[int]] = [list(prompt)]
    starts: list[int] = []  # row index of each turn's first generated token
    pos = len(prompt)
    for k, turn in enumerate(turns):
        starts.append(pos)
        parts.append(turn.response)
        pos += len(turn.response)
        if k < len(turns) - 1:
            parts.append(turn.observation)
            pos += len(turn.observation)
    tokens = np.fromiter((t for p in parts for t in p), dtype=np.int64, count=pos)  # [T]
    loss_mask = np.zeros(pos - 1, dtype=np.float32)  # [T-1]
    logprobs = np.zeros(pos - 1, dtype=np.float32)  # [T-1]
    token_rewards = np.zeros(pos - 1, dtype=np.float64)  # [T-1]
    turn_ids = np.full(pos - 1, -1, dtype=np.int32)  # [T-1]
    for k in masked:
        span = slice(starts[k] - 1, starts[k] - 1 + len(turns[k].response))  # predicted positions of r_k
        loss_mask[span] = 1.0
        logprobs[span] = turns[k].logprobs
        turn_ids[span] = k
        token_rewards[span.stop - 1] = turns[k].reward
    return TrajectoryRow(tokens, loss_mask, logprobs, token_rewards, turn_ids)


def trajectory_row(traj: Trajectory) -> TrajectoryRow:
    """The trajectory-wise row of an episode: every turn's response masked in, one row for the whole episode."""
    if not traj.turns:
        raise ValueError(f"episode {traj.group}.{traj.index} has no turns: nothing to train on")
    return _row(traj.prompt, traj.turns, range(len(traj.turns)))


def step_rows(traj: Trajectory) -> list[TrajectoryRow]:
    """The step-wise rows of an episode: row k is the context turn k was generated from, then its response.

    The context is the whole row up to that turn, exactly as the generator saw it (no history window):
    the log-probs were sampled under that context, and training on a shorter one would be off-policy.
    Rows of one episode share prefixes; that costs compute, not correctness.
    """
    if not traj.turns:
        raise ValueError(f"episode {traj.group}.{traj.index} has no turns: nothing to train on")
    return [_row(traj.prompt, traj.turns[:k + 1], [k]) for k in range(len(traj.turns))]


def pad_rows(rows: Sequence[TrajectoryRow], pad_id: int) -> dict[str, np.ndarray]:
    """Stack rows into batch arrays, right-padded to the longest row (W = its length).

    Returns ``tokens [B, W]`` int64 (pad_id after the row), ``loss_mask [B, W-1]`` float32,
    ``old_logprob [B, W-1]`` float32 (the generator's log-probs, RLVR's key for them), ``token_rewards
    [B, W-1]`` float64 and ``turn_ids [B, W-1]`` int32 (-1 where no generated token is predicted).
    Padding is 0 (-1 for turn ids), so it is never an action.
    """
    if not rows:
        raise ValueError("pad_rows needs at least one row")
    width = max(len(r.tokens) for r in rows)
    n = len(rows)
    out = {"tokens": np.full((n, width), pad_id, dtype=np.int64),
           "loss_mask": np.zeros((n, width - 1), dtype=np.float32),
           "old_logprob": np.zeros((n, width - 1), dtype=np.float32),
           "token_rewards": np.zeros((n, width - 1), dtype=np.float64),
           "turn_ids": np.full((n, width - 1), -1, dtype=np.int32)}
    for i, r in enumerate(rows):
        t = len(r.tokens)
        out["tokens"][i, :t] = r.tokens
        out["loss_mask"][i, :t - 1] = r.loss_mask
        out["old_logprob"][i, :t - 1] = r.logprobs
        out["token_rewards"][i, :t - 1] = r.token_rewards
        out["turn_ids"][i, :t - 1] = r.turn_ids
    return out
