"""What builds the agentic starting policy inside its staging directory (``fine_tune_on_experts``):
expert episodes on training seeds, a tokenizer trained on their text, the tiny model fine-tuned on
every turn until its played episodes succeed often enough (``rollhpc.warm_start.agentic_prep`` says
why sampled play by default), then the report's held-out play.

Heavy (torch, transformers): ``rollhpc.warm_start.agentic_prep`` decides what to build and caches
it, and imports this module only when a directory is built.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rollhpc.envs import make_env
from rollhpc.envs.base import HELDOUT_SEED_BASE
from rollhpc.rollout.episode import Episode
from rollhpc.rollout.turns import PlainTextTurns
from rollhpc.warm_start.agentic_episodes import (
    clean_success,
    episode_examples,
    episode_texts,
    expert_episode,
)
from rollhpc.warm_start.agentic_play import play_episodes
from rollhpc.warm_start.policy_build import (
    new_tiny_model,
    no_transformers_bars,
    save_policy,
    torch_threads,
    warn_if_target_missed,
)
from rollhpc.warm_start.sft import SftResult, train_sft_ids
from rollhpc.warm_start.sft_config import SftConfig
from rollhpc.warm_start.tiny import build_tokenizer
from rollhpc.warm_start.tiny_config import TinyModelConfig

log = logging.getLogger("rollhpc.sft")


@dataclass
class _Experts:
    """The expert's episodes on the training seeds (what SFT learns from) and the held-out seeds."""

    train_seeds: list[int]
    heldout_seeds: list[int]
    train: list[Episode]
    heldout: list[Episode]
    wall_s: float


@dataclass
class _Examples:
    """Each expert episode's whole row, and one (prompt ids, completion ids) example per turn."""

    rows: list[list[int]]
    turns: list[tuple[list[int], list[int]]]
    longest: int  # the index of the longest row


def fine_tune_on_experts(
    work_dir: Path,
    settings: dict[str, Any],
    spec: TinyModelConfig,
    sft: SftConfig,
    progress: bool,
) -> tuple[Path, dict[str, Any]]:
    """Expert episodes, tokenizer, initial model, SFT and evaluation inside ``work_dir``; (model
    dir, report)."""
    with no_transformers_bars():
        formatter = PlainTextTurns()
        experts = _play_experts(settings, sft)
        tokenizer = build_tokenizer(
            (text for ep in experts.train for text in episode_texts(ep, formatter)),
            settings["vocab_size"],
            settings.get("unmerged", ""),
        )
        examples = _turn_examples(experts.train, tokenizer, formatter, spec)
        model = new_tiny_model(work_dir, spec, tokenizer, settings["seed"])
        _log_start(settings, sft, experts, examples, model)
        play = _Player(tokenizer, settings, sft, formatter)
        stop_temperature = 1.0 if settings["stop_on"] == "sampled" else 0.0
        monitor_seeds = experts.train_seeds[: settings["monitor_episodes"]]
        result = train_sft_ids(
            model,
            examples.turns,
            sft,
            pad_id=tokenizer.pad_token_id,
            seed=settings["seed"],
            monitor=lambda m: _clean_success_rate(play(m, monitor_seeds, stop_temperature, True)),
            metric=f"{settings['stop_on']} success rate",
            progress=progress,
        )
        warn_if_target_missed(result, sft, "success rate")
        report = _report(model, tokenizer, play, experts, examples, sft, result)
        return save_policy(work_dir, model, tokenizer), report


def _play_experts(settings: dict[str, Any], sft: SftConfig) -> _Experts:
    """The expert's episodes on ``settings["episodes"]`` distinct training seeds drawn (seeded)
    below ``settings["train_seeds"]``, and on the first ``sft.eval_examples`` held-out seeds."""
    start = time.perf_counter()
    train_seeds = random.Random(settings["seed"]).sample(
        range(settings["train_seeds"]), settings["episodes"]
    )
    heldout_seeds = [HELDOUT_SEED_BASE + i for i in range(sft.eval_examples)]
    env = make_env(settings["env"], settings["env_options"])
    try:
        train = [expert_episode(env, s) for s in train_seeds]
        heldout = [expert_episode(env, s) for s in heldout_seeds]
    finally:
        env.close()
    return _Experts(train_seeds, heldout_seeds, train, heldout, time.perf_counter() - start)


def _turn_examples(
    expert: list[Episode],
    tokenizer: PreTrainedTokenizerBase,
    formatter: PlainTextTurns,
    spec: TinyModelConfig,
) -> _Examples:
    """Every turn of every expert episode as an SFT example; ValueError when a row would not fit the
    model."""
    rows, turns = [], []
    for ep in expert:
        row, examples = episode_examples(ep, tokenizer, formatter)
        rows.append(row)
        turns += examples
    longest = max(range(len(rows)), key=lambda i: len(rows[i]))
    if len(rows[longest]) > spec.max_position_embeddings:
        raise ValueError(
            f"the longest expert episode (seed {expert[longest].seed}, {len(expert[longest].turns)} "
            f"turns) is a row of {len(rows[longest])} tokens but spec.max_position_embeddings is "
            f"{spec.max_position_embeddings}: raise it or shorten the episodes (the environment's "
            "max_turns or size)"
        )
    return _Examples(rows, turns, longest)


def _log_start(
    settings: dict[str, Any],
    sft: SftConfig,
    experts: _Experts,
    examples: _Examples,
    model: PreTrainedModel,
) -> None:
    log.info(
        "sft: %s %s, %d expert episodes (success %.3f, %.1f turns) -> %d turn examples, longest row %d "
        "tokens; %d parameters, at most %d steps",
        settings["env"],
        settings["env_options"],
        len(experts.train),
        _success_rate(experts.train),
        _mean_turns(experts.train),
        len(examples.turns),
        len(examples.rows[examples.longest]),
        model.num_parameters(),
        sft.steps,
    )


class _Player:
    """The model's episodes on given seeds, played as the report and the early stop play them."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        settings: dict[str, Any],
        sft: SftConfig,
        formatter: PlainTextTurns,
    ) -> None:
        self.tokenizer, self.settings, self.sft, self.formatter = (
            tokenizer,
            settings,
            sft,
            formatter,
        )

    def __call__(
        self,
        model: PreTrainedModel,
        seeds: Sequence[int],
        temperature: float = 0.0,
        end_unstopped: bool = False,
    ) -> list[Episode]:
        return play_episodes(
            model,
            self.tokenizer,
            self.settings["env"],
            self.settings["env_options"],
            seeds,
            max_new_tokens=self.sft.max_new_tokens,
            formatter=self.formatter,
            temperature=temperature,
            sample_seed=self.settings["seed"],
            end_unstopped=end_unstopped,
        )


def _report(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    play: _Player,
    experts: _Experts,
    examples: _Examples,
    sft: SftConfig,
    result: SftResult,
) -> dict[str, Any]:
    """The report: the SFT run, the model's greedy and sampled play on held-out seeds (and greedy on
    training seeds), the expert's on the same seeds, and the examples' sizes."""
    eval_start = time.perf_counter()
    model.eval()
    heldout = play(model, experts.heldout_seeds)
    sampled = play(model, experts.heldout_seeds, temperature=1.0)
    train = play(model, experts.train_seeds[: sft.eval_examples])
    rows = examples.rows
    return {
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
        "heldout_seeds": {"first": HELDOUT_SEED_BASE, "count": len(experts.heldout_seeds)},
        "train_success_rate": _success_rate(train),
        "expert_success_rate": _success_rate(experts.heldout),
        "expert_turns_mean": _mean_turns(experts.heldout),
        "expert_train_success_rate": _success_rate(experts.train),
        "turn_examples": len(examples.turns),
        "row_tokens_max": len(rows[examples.longest]),
        "row_tokens_mean": round(sum(map(len, rows)) / len(rows), 2),
        "loss_first": result.loss_first,
        "loss_final": result.loss_final,
        "loss_curve": result.loss_curve,
        "success_curve": result.accuracy_curve,
        "expert_s": round(experts.wall_s, 2),
        "train_s": round(result.wall_s, 2),
        "eval_s": round(time.perf_counter() - eval_start, 2),
        "torch_threads": torch_threads(),
    }


def _success_rate(episodes: Sequence[Episode]) -> float:
    return sum(e.success for e in episodes) / max(len(episodes), 1)


def _clean_success_rate(episodes: Sequence[Episode]) -> float:
    return sum(clean_success(e) for e in episodes) / max(len(episodes), 1)


def _stopped_rate(episodes: Sequence[Episode]) -> float:
    """The fraction of turns that ended with EOS."""
    return 1.0 - sum(e.turns_cut for e in episodes) / max(sum(len(e.turns) for e in episodes), 1)


def _mean_turns(episodes: Sequence[Episode]) -> float:
    return sum(len(e.turns) for e in episodes) / max(len(episodes), 1)
