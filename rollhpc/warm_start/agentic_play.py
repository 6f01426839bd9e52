"""A model playing episodes of a text environment, batched, with rows built as rollout builds them
(``rollhpc.warm_start.agentic_episodes``): the agentic warm start's early stop and its report's
evaluation.

Heavy (torch): imported by ``rollhpc.warm_start.agentic_build`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache

from rollhpc.envs import make_env
from rollhpc.envs.base import TextEnv
from rollhpc.rollout.episode import Episode, Turn
from rollhpc.rollout.turns import PlainTextTurns
from rollhpc.warm_start.agentic_episodes import MAX_TURNS, prompt_ids, text_ids

__all__ = ["play_episodes"]


def play_episodes(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    env: str,
    env_options: dict[str, Any],
    seeds: Sequence[int],
    *,
    max_new_tokens: int = 8,
    max_turns: int = MAX_TURNS,
    batch_size: int = 64,
    formatter: PlainTextTurns | None = None,
    temperature: float = 0.0,
    sample_seed: int = 0,
    end_unstopped: bool = False,
) -> list[Episode]:
    """Episodes of ``model`` on ``env`` (one per seed), greedy by default, rows built as in rollout.

    Up to ``batch_size`` episodes are open at once and share each forward pass; a KV cache kept
    across turns means a turn costs its new tokens only (``_TurnDecoder``). A turn gets at most
    ``max_new_tokens`` tokens; an episode ends truncated after ``max_turns`` turns or when its row
    (next observation plus one generated token) no longer fits ``max_position_embeddings``.

    ``temperature`` > 0 samples instead (no top-k or top-p: what RL's rollouts draw), seeded by
    ``sample_seed`` without touching the caller's torch RNG (the same call gives the same episodes).
    ``end_unstopped`` ends an episode at its first turn without EOS (truncated): it can no longer be
    a clean success, and the early stop's checks of a still babbling model then cost one turn, not
    ``max_turns``.
    """
    formatter = formatter or PlainTextTurns()
    out: list[Episode] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(sample_seed)
        for lo in range(0, len(seeds), batch_size):
            envs = [make_env(env, env_options) for _ in seeds[lo : lo + batch_size]]
            try:
                out += _play_batch(
                    model,
                    tokenizer,
                    envs,
                    list(seeds[lo : lo + batch_size]),
                    max_new_tokens,
                    max_turns,
                    formatter,
                    temperature,
                    end_unstopped,
                )
            finally:
                for e in envs:
                    e.close()
    return out


def _play_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    envs: list[TextEnv],
    seeds: list[int],
    max_new_tokens: int,
    max_turns: int,
    formatter: PlainTextTurns,
    temperature: float,
    end_unstopped: bool,
) -> list[Episode]:
    max_len = int(model.config.max_position_embeddings)
    episodes = []
    rows = []
    for e, seed in zip(envs, seeds):
        observation, info = e.reset(seed)
        instruction = str(info.get("instruction", ""))
        rows.append(prompt_ids(tokenizer, formatter.first(instruction, observation)))
        episodes.append(
            Episode(
                prompt=list(rows[-1]), seed=seed, instruction=instruction, observation=observation
            )
        )
    open_ids = [i for i in range(len(envs)) if len(rows[i]) < max_len]
    for i in set(range(len(envs))) - set(open_ids):
        episodes[i].finish = "truncated"
    decoder = _TurnDecoder(model, tokenizer.pad_token_id)
    while open_ids:
        budget = min(max_new_tokens, *(max_len - len(rows[i]) for i in open_ids))
        generated = decoder.turn(open_ids, rows, budget, tokenizer.eos_token_id, temperature)
        still = []
        for i, ids in zip(open_ids, generated):
            ep = episodes[i]
            rows[i] += ids
            stopped = ids[-1:] == [tokenizer.eos_token_id]
            turn = Turn(response=list(ids), finish_reason="stop" if stopped else "length")
            ep.turns.append(turn)
            if end_unstopped and not stopped:
                ep.finish = "truncated"
                continue
            turn.action = formatter.action(tokenizer.decode(ids, skip_special_tokens=True))
            observation, reward, terminated, truncated, info = envs[i].step(turn.action)
            turn.reward, turn.observation_text = float(reward), observation
            for k, v in (info.get("metrics") or {}).items():
                ep.metrics[k] = ep.metrics.get(k, 0.0) + float(v)
            if terminated or truncated:
                ep.success, ep.finish = (
                    bool(info.get("success", False)),
                    "truncated" if truncated else "terminated",
                )
                continue
            next_ids = text_ids(tokenizer, formatter.next(observation))
            if len(ep.turns) >= max_turns or len(rows[i]) + len(next_ids) + 1 > max_len:
                ep.finish = "truncated"
                continue
            rows[i] += next_ids
            turn.observation = next_ids
            still.append(i)
        open_ids = still
    return episodes


class _TurnDecoder:
    """Batched decoding over the growing rows of open episodes, with one KV cache kept across turns.

    Why not ``generate`` per turn: that re-reads every row from its first token at each turn, and a
    Sokoban episode that fails runs 20 turns over rows of 300 tokens, so the early stop's checks
    cost more than the training. Here each forward pass feeds only what the cache lacks (a turn's
    observation, then one generated token at a time). Rows grow by different amounts, so each chunk
    is left-padded and the padding stays in the cache as holes the attention mask hides; positions
    count real tokens only, so a row reads exactly as if it had been fed alone. Rows of finished
    episodes linger as holes until half the batch is finished; then the batch is rebuilt from the
    open rows (one prefill).
    """

    def __init__(self, model: PreTrainedModel, pad: int) -> None:
        self.model, self.pad = model, pad
        self.slots: list[int] = []  # the episode index of each batch row
        self.fed: list[int] = []  # per batch row: tokens of its row in the cache
        self.cache: Cache | None = None
        self.mask: torch.Tensor | None = None  # [B, cached positions]: 1 where a real token sits

    def turn(
        self, open_ids: list[int], rows: list[list[int]], budget: int, eos: int, temperature: float
    ) -> list[list[int]]:
        """Each open episode's continuation of its row: up to and including EOS, at most ``budget``
        tokens."""
        if (
            self.cache is None
            or 2 * len(open_ids) <= len(self.slots)
            or not set(open_ids) <= set(self.slots)
        ):
            self.slots, self.fed, self.cache, self.mask = (
                list(open_ids),
                [0] * len(open_ids),
                None,
                None,
            )
        wanted = set(open_ids)
        logits = self._feed(
            [rows[i][n:] if i in wanted else [] for i, n in zip(self.slots, self.fed)]
        )
        out: dict[int, list[int]] = {i: [] for i in open_ids}
        active = [i in wanted for i in self.slots]
        for step in range(budget):
            if temperature > 0:
                picked = torch.multinomial(torch.softmax(logits.float() / temperature, dim=-1), 1)[
                    :, 0
                ].tolist()
            else:
                picked = logits.argmax(dim=-1).tolist()
            for b, i in enumerate(self.slots):
                if active[b]:
                    out[i].append(picked[b])
                    active[b] = picked[b] != eos
            if not any(active) or step + 1 == budget:
                break
            logits = self._feed([[picked[b]] if active[b] else [] for b in range(len(self.slots))])
        return [out[i] for i in open_ids]

    def _feed(self, chunks: list[list[int]]) -> torch.Tensor:
        """Append each batch row's ``chunk`` to the cache; returns the logits after each row's last
        token [B, V]."""
        width = max(map(len, chunks))
        ids = torch.tensor([[self.pad] * (width - len(c)) + c for c in chunks])
        new_mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunks])
        positions = torch.tensor(
            [
                [n + max(k - (width - len(c)), 0) for k in range(width)]
                for c, n in zip(chunks, self.fed)
            ]
        )
        mask = new_mask if self.mask is None else torch.cat([self.mask, new_mask], dim=1)
        with torch.no_grad():
            result = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=self.cache,
                use_cache=True,
            )
        self.cache, self.mask = result.past_key_values, mask
        self.fed = [n + len(c) for n, c in zip(self.fed, chunks)]
        return result.logits[:, -1]
