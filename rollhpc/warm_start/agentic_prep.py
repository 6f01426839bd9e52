"""The agentic pipeline's starting policy: a tiny Qwen2 model fine-tuned on an environment's expert episodes.

Why a warm start: a random tiny model never writes a valid move, let alone reaches a goal, so RL on
episode returns would have nothing to compare. ``prepare_agentic_policy`` plays expert episodes
(``expert_action``: BFS / optimal play) on training seeds, trains a tokenizer on their text, creates a
tiny model (``rollhpc.warm_start.tiny``) and fine-tunes it on every turn of every episode, stopping as soon
as the model, playing episodes, succeeds on a small share of them (``SftConfig.target_accuracy`` read as
an episode success rate). RL then starts from a policy that sometimes succeeds and has room to improve.

Why the early stop plays SAMPLED episodes by default (``stop_on="sampled"``, temperature 1, what RL's
rollouts draw) rather than greedy ones: greedy success says what the policy prefers, not how sure it is.
Measured on 4x4 FrozenLake (p=0.8): greedy success reached 0.16 after 25 steps (lr 3e-4) at a completion
loss of 3.8 nats, the argmax happening to spell a blind down/right walk (which alone solves ~0.4 of those
maps), while sampling from the same model ended 12% of its turns with EOS and solved none: RL would have
started from noise. Sampled success only rises once the policy answers with confidence, and more smoothly
(an expectation, not an argmax flipping). ``stop_on="greedy"`` stops on greedy play.
In both, an episode counts only when each of its turns stopped with EOS: lenient action parsing lets a
babbling model ("down down down ..." up to the token budget) reach a goal now and then.

Rows are built exactly as rollout builds them (``rollhpc.rollout.turns.PlainTextTurns`` and the env
role, ``rollhpc.workers.env``), by concatenating token ids, never by re-encoding text across a turn:

    row  = encode(first(instruction, observation), add_special_tokens=True)      # the env role's prompt
    turn = encode(ACTION_PREFIX + action) + [EOS]                                # what the policy generates
    row += turn; row += encode(next(observation))  (after every turn but the last)

``ACTION_PREFIX`` is one space: the policy writes " right" after the ``>`` marker and stops with EOS; the
formatter strips the space before the environment parses the action. Each turn is one SFT example:
prompt = the row up to the turn, completion = the turn's ids (EOS included), so the model learns to act
from the whole multi-turn context it will see in RL.

The directory is an ordinary Hugging Face model with ``sft_report.json`` (held-out greedy success rate on
seeds ``HELDOUT_SEED_BASE + i``, the seeds the agentic pipeline evaluates greedily on, so RL's first
evaluation is comparable; the sampled success rate on the same seeds, what RL's first rollouts see; the
expert's success on them; train success; mean turns; settings and their hash),
written atomically and cached like ``rollhpc.warm_start.policy_prep.prepare_policy``: the same settings reuse
it, other settings are refused (FileExistsError), never overwritten.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rollhpc.envs import make_env
from rollhpc.envs.base import HELDOUT_SEED_BASE
from rollhpc.envs.episodes import run_episode
from rollhpc.envs.policies import ExpertPolicy
from rollhpc.rollout.episode import Episode, Turn
from rollhpc.rollout.turns import PlainTextTurns
from rollhpc.warm_start.policy_prep import build_once, torch_threads
from rollhpc.warm_start.sft import SftConfig, train_sft_ids
from rollhpc.warm_start.tiny import TinyModelConfig, build_tokenizer, create_tiny_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "expert_episode",
    "episode_texts",
    "clean_success",
    "episode_examples",
    "play_episodes",
    "agentic_settings",
    "prepare_agentic_policy",
    "ACTION_PREFIX",
    "MONITOR_EPISODES",
    "MAX_TURNS",
]

log = logging.getLogger("rollhpc.sft")
FORMAT_VERSION = (
    1  # bump when a code change alters what the same settings produce (invalidates caches)
)
ACTION_PREFIX = " "  # the policy answers "> right<EOS>": a space after the marker, then the action
MONITOR_EPISODES = (
    64  # training seeds the early stop plays every check_every steps (at most eval_examples)
)
MAX_TURNS = 64  # a guard for environments without a turn limit of their own (theirs applies first)


def expert_episode(env: Any, seed: int, max_turns: int = MAX_TURNS) -> Episode:
    """One episode of ``env`` from ``reset(seed)`` played by its ``expert_action`` (a record in text: the
    expert has no tokens). ``episode.observations`` has one entry more than ``episode.actions`` (the first
    one, then the answer to each action; the last answer ends the episode and never enters a row)."""
    if not callable(getattr(env, "expert_action", None)):
        raise ValueError(
            f"{type(env).__name__} has no expert (no expert_action method): an agentic warm start "
            "learns from expert episodes"
        )
    return run_episode(env, ExpertPolicy(env), seed, max_turns=max_turns)


def episode_texts(episode: Episode, formatter: PlainTextTurns) -> list[str]:
    """The pieces an expert episode's row is encoded from, in order (the tokenizer's training corpus)."""
    pieces = [formatter.first(episode.instruction, episode.observation)]
    for k, turn in enumerate(episode.turns):
        pieces.append(ACTION_PREFIX + turn.action)
        if k + 1 < len(episode.turns):
            pieces.append(formatter.next(turn.observation_text))
    return pieces


def clean_success(episode: Episode) -> bool:
    """Solved with every turn a well-formed answer (stopped by EOS): what the early stop counts."""
    return episode.success and episode.turns_cut == 0


def _first_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The prompt's ids as the env role encodes them (plain turns: with the tokenizer's special tokens)."""
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def _text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def episode_examples(
    episode: Episode, tokenizer: PreTrainedTokenizerBase, formatter: PlainTextTurns | None = None
) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    """(the episode's whole row, one (prompt ids, completion ids) example per turn).

    The row is concatenated from pieces encoded one by one (module docstring); an example's prompt is the
    row before its turn and its completion the turn's ids, EOS included.
    """
    formatter = formatter or PlainTextTurns()
    row = _first_ids(tokenizer, formatter.first(episode.instruction, episode.observation))
    examples = []
    for k, turn in enumerate(episode.turns):
        completion = _text_ids(tokenizer, ACTION_PREFIX + turn.action) + [tokenizer.eos_token_id]
        examples.append((list(row), completion))
        row += completion
        if k + 1 < len(episode.turns):
            row += _text_ids(tokenizer, formatter.next(turn.observation_text))
    return row, examples


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

    Up to ``batch_size`` episodes are open at once and share each forward pass; a KV cache kept across
    turns means a turn costs its new tokens only (``_TurnDecoder``). A turn gets at
    most ``max_new_tokens`` tokens; an episode ends truncated after ``max_turns`` turns or when its row
    (next observation plus one generated token) no longer fits ``max_position_embeddings``.

    ``temperature`` > 0 samples instead (no top-k or top-p: what RL's rollouts draw), seeded by
    ``sample_seed`` without touching the caller's torch RNG (the same call gives the same episodes).
    ``end_unstopped`` ends an episode at its first turn without EOS (truncated): it can no longer be a
    clean success, and the early stop's checks of a still babbling model then cost one turn, not ``max_turns``.
    """
    import torch

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
    envs: list[Any],
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
        rows.append(_first_ids(tokenizer, formatter.first(instruction, observation)))
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
            next_ids = _text_ids(tokenizer, formatter.next(observation))
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
    Sokoban episode that fails runs 20 turns over rows of 300 tokens, so the early stop's checks cost more
    than the training. Here each forward pass feeds only what the cache lacks (a turn's observation, then
    one generated token at a time). Rows grow by different amounts, so each chunk is left-padded and the
    padding stays in the cache as holes the attention mask hides; positions count real tokens only, so a
    row reads exactly as if it had been fed alone. Rows of finished episodes linger as holes until half
    the batch is finished; then the batch is rebuilt from the open rows (one prefill).
    """

    def __init__(self, model: PreTrainedModel, pad: int) -> None:
        self.model, self.pad = model, pad
        self.slots: list[int] = []  # the episode index of each batch row
        self.fed: list[int] = []  # per batch row: tokens of its row in the cache
        self.cache: Any = None
        self.mask: Any = None  # [B, cached positions]: 1 where a real token sits

    def turn(
        self, open_ids: list[int], rows: list[list[int]], budget: int, eos: int, temperature: float
    ) -> list[list[int]]:
        """Each open episode's continuation of its row: up to and including EOS, at most ``budget`` tokens."""
        import torch

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

    def _feed(self, chunks: list[list[int]]) -> Any:
        """Append each batch row's ``chunk`` to the cache; returns the logits after each row's last token [B, V]."""
        import torch

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


def _success_rate(episodes: Sequence[Episode]) -> float:
    return sum(e.success for e in episodes) / max(len(episodes), 1)


def _clean_success_rate(episodes: Sequence[Episode]) -> float:
    return sum(clean_success(e) for e in episodes) / max(len(episodes), 1)


def _stopped_rate(episodes: Sequence[Episode]) -> float:
    """The fraction of turns that ended with EOS."""
    return 1.0 - sum(e.turns_cut for e in episodes) / max(sum(len(e.turns) for e in episodes), 1)


def _mean_turns(episodes: Sequence[Episode]) -> float:
    return sum(len(e.turns) for e in episodes) / max(len(episodes), 1)


def agentic_settings(
    env: str,
    env_options: dict[str, Any],
    spec: TinyModelConfig,
    sft: SftConfig,
    seed: int,
    vocab_size: int,
    episodes: int,
    train_seeds: int,
    stop_on: Literal["sampled", "greedy"] = "sampled",
    unmerged: str = "",
) -> dict[str, Any]:
    """Everything that determines the prepared weights and report; its hash is the cache key."""
    if stop_on not in ("sampled", "greedy"):
        raise ValueError(f"stop_on must be 'sampled' or 'greedy', got {stop_on!r}")
    # absent when empty: earlier policies keep their key
    extra = {"unmerged": unmerged} if unmerged else {}
    return {
        **extra,
        "format_version": FORMAT_VERSION,
        "kind": "agentic",
        "env": env,
        "stop_on": stop_on,
        "env_options": json.loads(json.dumps(env_options, sort_keys=True)),
        "turns": "plain",
        "seed": seed,
        "vocab_size": vocab_size,
        "episodes": episodes,
        "train_seeds": train_seeds,
        "monitor_episodes": min(MONITOR_EPISODES, sft.eval_examples, episodes),
        "max_turns": MAX_TURNS,
        "spec": asdict(spec),
        "sft": asdict(sft),
    }


def prepare_agentic_policy(
    out_dir: str | Path,
    *,
    env: str,
    env_options: dict[str, Any],
    spec: TinyModelConfig,
    sft: SftConfig,
    seed: int,
    vocab_size: int,
    episodes: int,
    train_seeds: int,
    stop_on: Literal["sampled", "greedy"] = "sampled",
    progress: bool = True,
    unmerged: str = "",
) -> Path:
    """Build, fine-tune on expert episodes and write the agentic starting policy to ``out_dir``; returns it.

    ``episodes`` expert episodes are played on distinct seeds drawn (seeded by ``seed``) from
    ``[0, train_seeds)``; every turn is an SFT example. How ``sft`` reads here:
    - ``target_accuracy``: an episode SUCCESS RATE. Every ``check_every`` steps the model plays episodes
      (sampled at temperature 1, or greedy with ``stop_on="greedy"``: module docstring) on
      ``MONITOR_EPISODES`` of the training seeds (at most ``eval_examples``; training seeds, so the held-out
      rate is not selected on) and training stops once its success rate, counting only episodes whose
      every turn stopped with EOS, reaches it (None trains all ``steps``);
    - ``eval_examples``: held-out episodes in the report (seeds ``HELDOUT_SEED_BASE + i``), and as many
      training seeds for the report's train success rate;
    - ``max_new_tokens``: tokens per turn in played episodes;
    - ``max_len`` and ``train_examples`` are not used: the rows must fit ``spec.max_position_embeddings``
      (checked, the context RL will use) and the examples are the expert's turns.

    Reuses ``out_dir`` when it holds a policy prepared with the same settings; raises FileExistsError when
    it holds anything else. Seeded like ``prepare_policy`` (same settings, same torch build and thread
    count: same weights); the caller's torch RNG is left alone.
    """
    if not isinstance(episodes, int) or episodes < 1:
        raise ValueError(f"episodes must be a positive int, got {episodes!r}")
    if not 0 < train_seeds <= HELDOUT_SEED_BASE:
        raise ValueError(
            f"train_seeds must be in (0, {HELDOUT_SEED_BASE}] (held-out seeds start there), "
            f"got {train_seeds}"
        )
    if episodes > train_seeds:
        raise ValueError(
            f"{episodes} expert episodes need as many distinct training seeds, but train_seeds is "
            f"{train_seeds}"
        )
    out_dir = Path(out_dir)
    env_options = dict(env_options or {})
    make_env(
        env, env_options
    ).close()  # a bad name or option fails here, before anything is hashed or built
    settings = agentic_settings(
        env, env_options, spec, sft, seed, vocab_size, episodes, train_seeds, stop_on, unmerged
    )
    report = build_once(
        out_dir, settings, lambda work: _fine_tune(work, settings, spec, sft, progress)
    )
    if report is None:
        return out_dir
    log.info(
        "sft: wrote %s in %.0f s (%d steps): held-out greedy success %.3f (expert %.3f, train %.3f)",
        out_dir,
        report["wall_s"],
        report["steps"],
        report["heldout_success_rate"],
        report["expert_success_rate"],
        report["train_success_rate"],
    )
    return out_dir


def _fine_tune(
    work_dir: Path, settings: dict[str, Any], spec: TinyModelConfig, sft: SftConfig, progress: bool
) -> tuple[Path, dict[str, Any]]:
    """Expert episodes, tokenizer, initial model, SFT and evaluation inside ``work_dir``; (model dir, report)."""
    from transformers import AutoModelForCausalLM

    env_name, env_options, seed = settings["env"], settings["env_options"], settings["seed"]
    formatter = PlainTextTurns()
    expert_start = time.perf_counter()
    train_seeds = random.Random(seed).sample(range(settings["train_seeds"]), settings["episodes"])
    heldout_seeds = [HELDOUT_SEED_BASE + i for i in range(sft.eval_examples)]
    env = make_env(env_name, env_options)
    try:
        expert = [expert_episode(env, s) for s in train_seeds]
        expert_heldout = [expert_episode(env, s) for s in heldout_seeds]
    finally:
        env.close()
    expert_s = time.perf_counter() - expert_start
    tokenizer = build_tokenizer(
        (text for ep in expert for text in episode_texts(ep, formatter)),
        settings["vocab_size"],
        settings.get("unmerged", ""),
    )
    rows, examples = [], []
    for ep in expert:
        row, turns = episode_examples(ep, tokenizer, formatter)
        rows.append(row)
        examples += turns
    longest = max(range(len(rows)), key=lambda i: len(rows[i]))
    if len(rows[longest]) > spec.max_position_embeddings:
        raise ValueError(
            f"the longest expert episode (seed {expert[longest].seed}, {len(expert[longest].turns)} "
            f"turns) is a row of {len(rows[longest])} tokens but spec.max_position_embeddings is "
            f"{spec.max_position_embeddings}: raise it or shorten the episodes (the environment's "
            "max_turns or size)"
        )
    model = AutoModelForCausalLM.from_pretrained(
        create_tiny_model(work_dir / "init", spec, tokenizer, seed)
    )
    monitor_seeds = train_seeds[: settings["monitor_episodes"]]
    log.info(
        "sft: %s %s, %d expert episodes (success %.3f, %.1f turns) -> %d turn examples, longest row %d tokens; "
        "%d parameters, at most %d steps",
        env_name,
        env_options,
        len(expert),
        _success_rate(expert),
        _mean_turns(expert),
        len(examples),
        len(rows[longest]),
        model.num_parameters(),
        sft.steps,
    )

    def play(
        m: PreTrainedModel,
        seeds: Sequence[int],
        temperature: float = 0.0,
        end_unstopped: bool = False,
    ) -> list[Episode]:
        return play_episodes(
            m,
            tokenizer,
            env_name,
            env_options,
            seeds,
            max_new_tokens=sft.max_new_tokens,
            formatter=formatter,
            temperature=temperature,
            sample_seed=seed,
            end_unstopped=end_unstopped,
        )

    stop_temperature = 1.0 if settings["stop_on"] == "sampled" else 0.0
    result = train_sft_ids(
        model,
        examples,
        sft,
        pad_id=tokenizer.pad_token_id,
        seed=seed,
        monitor=lambda m: _clean_success_rate(play(m, monitor_seeds, stop_temperature, True)),
        metric=f"{settings['stop_on']} success rate",
        progress=progress,
    )
    if sft.target_accuracy is not None and not result.reached_target:
        log.warning(
            "sft: the target success rate %.3f was not reached in %d steps",
            sft.target_accuracy,
            sft.steps,
        )
    eval_start = time.perf_counter()
    model.eval()
    heldout = play(model, heldout_seeds)
    sampled = play(model, heldout_seeds, temperature=1.0)
    train = play(model, train_seeds[: sft.eval_examples])
    report = {
        "parameters": model.num_parameters(),
        "vocab": len(tokenizer),
        "steps": result.steps,
        "reached_target": result.reached_target,
        "heldout_success_rate": _success_rate(heldout),
        "heldout_clean_success_rate": _clean_success_rate(heldout),
        "heldout_stopped_turns": _stopped_rate(heldout),
        "heldout_turns_mean": _mean_turns(heldout),
        "heldout_sampled_success_rate": _success_rate(sampled),
        "heldout_sampled_stopped_turns": _stopped_rate(sampled),
        "heldout_return_mean": sum(e.episode_return for e in heldout) / len(heldout),
        "heldout_seeds": {"first": HELDOUT_SEED_BASE, "count": len(heldout_seeds)},
        "train_success_rate": _success_rate(train),
        "expert_success_rate": _success_rate(expert_heldout),
        "expert_turns_mean": _mean_turns(expert_heldout),
        "expert_train_success_rate": _success_rate(expert),
        "turn_examples": len(examples),
        "row_tokens_max": len(rows[longest]),
        "row_tokens_mean": round(sum(map(len, rows)) / len(rows), 2),
        "loss_first": result.loss_first,
        "loss_final": result.loss_final,
        "loss_curve": result.loss_curve,
        "success_curve": result.accuracy_curve,
        "expert_s": round(expert_s, 2),
        "train_s": round(result.wall_s, 2),
        "eval_s": round(time.perf_counter() - eval_start, 2),
        "torch_threads": torch_threads(),
    }
    model.save_pretrained(work_dir / "policy")
    tokenizer.save_pretrained(work_dir / "policy")
    return work_dir / "policy", report
