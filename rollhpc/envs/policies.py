"""Policies that play a text environment outside training: random, expert, or a language model.

Why these three: random and expert bound what a trained policy should reach on an environment (a task
where random already succeeds, or the expert does not, measures nothing); a model directory shows what a
checkpoint does, turn by turn, before or after RL.

A policy sees an episode as the pipeline's policy does: ``begin`` with the instruction and first
observation, then ``act`` (the next action, or None when it cannot go on) and ``observe`` (the
environment's answer) in turn. A model policy also hands back the token ids it read and wrote, so the
episode's record (``rollhpc.rollout.episode``) holds its row as training would.

``ModelPolicy`` builds the episode's row exactly as rollout does (rollhpc.rollout.turns): the prompt's ids,
then each turn's generated ids as generated (EOS included, never decoded and re-encoded), then the ids of
the next observation's text. The row is capped at the model's ``max_position_embeddings``: when the next
observation does not fit, or no room is left to generate, ``act`` returns None and the episode ends as
truncated.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rollhpc.envs.base import TextEnv
from rollhpc.rollout.turns import PlainTextTurns, TurnFormatter
from rollhpc.tasks.arithmetic import randint

__all__ = ["Action", "Policy", "RandomPolicy", "ExpertPolicy", "ModelPolicy", "make_policy"]


@dataclass(frozen=True)
class Action:
    text: str  # what the environment is given
    # a model policy's generated ids, as generated (EOS included)
    ids: list[int] = field(default_factory=list)
    # a model policy's: "stop" (it ended its turn) or "length" (its budget ran out)
    finish_reason: str = ""


class Policy(Protocol):
    def begin(self, instruction: str, observation: str, seed: int) -> list[int]:
        """A new episode: its instruction (may be empty), first observation and seed. Returns the prompt ids
        the policy reads (empty for a policy that reads text)."""
        ...

    def act(self) -> Action | None:
        """The next action; None when the policy cannot go on (its context is full)."""
        ...

    def observe(self, observation: str) -> list[int]:
        """The environment's answer to the last action (not called after the episode ended). Returns the ids
        it added to the policy's row (empty for a policy that reads text, or when they no longer fit)."""
        ...


class RandomPolicy:
    """Uniform over the environment's example actions (its class attribute ``ACTIONS``), seeded per episode."""

    def __init__(self, actions: tuple[str, ...]) -> None:
        if not actions:
            raise ValueError(
                "a random policy needs the environment's example actions (an ACTIONS attribute)"
            )
        self.actions = tuple(actions)
        self._rng = random.Random(0)

    def begin(self, instruction: str, observation: str, seed: int) -> list[int]:
        self._rng = random.Random(seed)
        return []

    def act(self) -> Action | None:
        return Action(self.actions[randint(self._rng, 0, len(self.actions) - 1)])

    def observe(self, observation: str) -> list[int]:
        return []


class ExpertPolicy:
    """The environment's own ``expert_action()``."""

    def __init__(self, env: TextEnv) -> None:
        if not callable(getattr(env, "expert_action", None)):
            raise ValueError(f"{type(env).__name__} has no expert (no expert_action method)")
        self.env = env

    def begin(self, instruction: str, observation: str, seed: int) -> list[int]:
        return []

    def act(self) -> Action | None:
        return Action(self.env.expert_action())

    def observe(self, observation: str) -> list[int]:
        return []


class ModelPolicy:
    """Greedy generation with a Hugging Face causal LM and its tokenizer (e.g. a tiny rollhpc policy), CPU."""

    def __init__(
        self, model_dir: str | Path, max_new_tokens: int = 32, turns: TurnFormatter | None = None
    ) -> None:
        # torch and transformers imported here: the agentic warm start's spec imports this module
        # when a config loads (rollhpc.pipelines.agentic_spec), where no heavy library may load
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.max_len = int(self.model.config.max_position_embeddings)
        self.max_new_tokens = max_new_tokens
        self.turns = turns or PlainTextTurns()
        self.eos = self.tokenizer.eos_token_id
        self.pad = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos
        )
        self.row: list[int] = []
        self.full = False

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def begin(self, instruction: str, observation: str, seed: int) -> list[int]:
        self.row, self.full = [], False
        return self._append(self._encode(self.turns.first(instruction, observation)))

    def act(self) -> Action | None:
        import torch

        room = self.max_len - len(self.row)
        if self.full or room < 1:
            return None
        with torch.no_grad():
            out = self.model.generate(
                input_ids=torch.tensor([self.row]),
                attention_mask=torch.ones(1, len(self.row), dtype=torch.long),
                max_new_tokens=min(self.max_new_tokens, room),
                do_sample=False,
                eos_token_id=self.eos,
                pad_token_id=self.pad,
            )
        generated = out[0, len(self.row) :].tolist()
        self.row += generated
        return Action(
            self.turns.action(self.tokenizer.decode(generated, skip_special_tokens=True)),
            generated,
            "stop" if generated[-1:] == [self.eos] else "length",
        )

    def observe(self, observation: str) -> list[int]:
        return self._append(self._encode(self.turns.next(observation)))

    def _append(self, ids: list[int]) -> list[int]:
        """Ids that do not fit in the context end the episode (the row is never cut mid-turn); returns the ids
        appended (none when they did not fit)."""
        if len(self.row) + len(ids) > self.max_len:
            self.full = True
            return []
        self.row += ids
        return list(ids)


def make_policy(spec: str, env: TextEnv, max_new_tokens: int = 32) -> Policy:
    """``random``, ``expert`` or a model directory (with config.json) for ``env``; anything else raises."""
    if spec == "random":
        return RandomPolicy(tuple(getattr(env, "ACTIONS", ())))
    if spec == "expert":
        return ExpertPolicy(env)
    if (Path(spec) / "config.json").is_file():
        return ModelPolicy(spec, max_new_tokens)
    raise ValueError(
        f"policy {spec!r} is neither random, expert nor a model directory (no {spec}/config.json)"
    )
