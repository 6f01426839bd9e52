"""Expert episodes of a text environment and the SFT examples an agentic warm start makes of them.

Rows are built exactly as rollout builds them (``rollhpc.rollout.turns.PlainTextTurns`` and the env
role, ``rollhpc.workers.env``), by concatenating token ids, never by re-encoding text across a turn:

    row  = encode(first(instruction, observation), add_special_tokens=True)      # the env role's prompt
    turn = encode(ACTION_PREFIX + action) + [EOS]                                # what the policy generates
    row += turn; row += encode(next(observation))  (after every turn but the last)

``ACTION_PREFIX`` is one space: the policy writes " right" after the ``>`` marker and stops with
EOS; the formatter strips the space before the environment parses the action. Each turn is one SFT
example: prompt = the row up to the turn, completion = the turn's ids (EOS included), so the model
learns to act from the whole multi-turn context it will see in RL.

Light (the tokenizer is passed in): the warm start's settings (``rollhpc.warm_start.agentic_prep``)
read its constants when a config loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollhpc.envs.base import TextEnv
from rollhpc.envs.episodes import run_episode
from rollhpc.envs.policies import ExpertPolicy
from rollhpc.rollout.episode import Episode
from rollhpc.rollout.turns import PlainTextTurns

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "ACTION_PREFIX",
    "MAX_TURNS",
    "clean_success",
    "episode_examples",
    "episode_texts",
    "expert_episode",
    "prompt_ids",
    "text_ids",
]

ACTION_PREFIX = " "  # the policy answers "> right<EOS>": a space after the marker, then the action
MAX_TURNS = 64  # a guard for environments without a turn limit of their own (theirs applies first)


def expert_episode(env: TextEnv, seed: int, max_turns: int = MAX_TURNS) -> Episode:
    """One episode of ``env`` from ``reset(seed)`` played by its ``expert_action`` (a record in
    text: the expert has no tokens). ``episode.observations`` has one entry more than
    ``episode.actions`` (the first one, then the answer to each action; the last answer ends the
    episode and never enters a row)."""
    if not callable(getattr(env, "expert_action", None)):
        raise ValueError(
            f"{type(env).__name__} has no expert (no expert_action method): an agentic warm start "
            "learns from expert episodes"
        )
    return run_episode(env, ExpertPolicy(env), seed, max_turns=max_turns)


def episode_texts(episode: Episode, formatter: PlainTextTurns) -> list[str]:
    """The pieces an expert episode's row is encoded from, in order (the tokenizer's training
    corpus)."""
    pieces = [formatter.first(episode.instruction, episode.observation)]
    for k, turn in enumerate(episode.turns):
        pieces.append(ACTION_PREFIX + turn.action)
        if k + 1 < len(episode.turns):
            pieces.append(formatter.next(turn.observation_text))
    return pieces


def clean_success(episode: Episode) -> bool:
    """Solved with every turn a well-formed answer (stopped by EOS): what the early stop counts."""
    return episode.success and episode.turns_cut == 0


def prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The prompt's ids as the env role encodes them (plain turns: with the tokenizer's special
    tokens)."""
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """A piece's ids inside a row (an action or a later observation): no special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def episode_examples(
    episode: Episode, tokenizer: PreTrainedTokenizerBase, formatter: PlainTextTurns | None = None
) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    """(the episode's whole row, one (prompt ids, completion ids) example per turn).

    The row is concatenated from pieces encoded one by one (module docstring); an example's prompt
    is the row before its turn and its completion the turn's ids, EOS included.
    """
    formatter = formatter or PlainTextTurns()
    row = prompt_ids(tokenizer, formatter.first(episode.instruction, episode.observation))
    examples = []
    for k, turn in enumerate(episode.turns):
        completion = text_ids(tokenizer, ACTION_PREFIX + turn.action) + [tokenizer.eos_token_id]
        examples.append((list(row), completion))
        row += completion
        if k + 1 < len(episode.turns):
            row += text_ids(tokenizer, formatter.next(turn.observation_text))
    return row, examples
