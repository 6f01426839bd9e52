"""What builds a prepared starting policy inside its staging directory: the tiny model fine-tuned on
a task's train split, evaluated greedily on its held-out split, and saved (``fine_tune_on_task``);
and the steps every warm start shares (``new_tiny_model``, ``save_policy``,
``warn_if_target_missed``).

Heavy (torch, transformers): ``rollhpc.warm_start.policy_prep`` decides what to build and caches it,
and imports this module only when a directory is built.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from rollhpc.tasks import task_module
from rollhpc.warm_start.sft import SftResult, greedy_responses, train_sft
from rollhpc.warm_start.sft_config import SftConfig
from rollhpc.warm_start.tiny import build_tokenizer, create_tiny_model
from rollhpc.warm_start.tiny_config import TinyModelConfig

log = logging.getLogger("rollhpc.sft")


def fine_tune_on_task(
    work_dir: Path,
    task: ModuleType,
    splits: tuple[list, list],
    spec: TinyModelConfig,
    sft: SftConfig,
    *,
    seed: int,
    vocab_size: int,
    progress: bool,
    label: str,
) -> tuple[Path, dict[str, Any]]:
    """Tokenizer, initial model, SFT and evaluation inside ``work_dir``; returns (model dir,
    report).

    ``splits``: the task's (train, held-out) examples; ``label`` names the task in the log."""
    train, heldout = splits
    with no_transformers_bars():
        tokenizer = build_tokenizer(task.corpus(train), vocab_size)
        model = new_tiny_model(work_dir, spec, tokenizer, seed)
        log.info(
            "sft: %s, %d train examples, %d parameters, at most %d steps",
            label,
            len(train),
            model.num_parameters(),
            sft.steps,
        )
        pairs = [(task.format_prompt(e), task.completion(e)) for e in train]
        # Early stopping watches training examples, so the held-out accuracy is not selected on.
        result = train_sft(
            model,
            tokenizer,
            pairs,
            sft,
            seed=seed,
            progress=progress,
            monitor_pairs=pairs[: sft.eval_examples],
        )
        warn_if_target_missed(result, sft, "accuracy")
        report = _task_report(model, tokenizer, task, splits, sft, result)
        return save_policy(work_dir, model, tokenizer), report


def _task_report(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: ModuleType,
    splits: tuple[list, list],
    sft: SftConfig,
    result: SftResult,
) -> dict[str, Any]:
    """The report of a task warm start: the SFT run and the greedy accuracy on held-out and train
    examples."""
    train, heldout = splits
    eval_start = time.perf_counter()

    def evaluate(examples: list) -> float:
        return evaluate_greedy(
            model, examples, task, tokenizer=tokenizer, max_new_tokens=sft.max_new_tokens
        )

    return {
        "parameters": model.num_parameters(),
        "steps": result.steps,
        "reached_target": result.reached_target,
        "heldout_accuracy": evaluate(heldout),
        "train_accuracy": evaluate(train[: sft.eval_examples]),
        "loss_first": result.loss_first,
        "loss_final": result.loss_final,
        "loss_curve": result.loss_curve,
        "accuracy_curve": result.accuracy_curve,
        "train_s": round(result.wall_s, 2),
        "eval_s": round(time.perf_counter() - eval_start, 2),
        "torch_threads": torch_threads(),
    }


def evaluate_greedy(
    model: PreTrainedModel | str | Path,
    examples: Sequence[object],
    task: ModuleType | str,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_new_tokens: int = 24,
    batch_size: int = 64,
) -> float:
    """Fraction of ``examples`` whose greedy response the task's verifier scores 1.

    ``model`` is a model directory (its tokenizer is loaded from it) or a loaded model with
    ``tokenizer``; ``task`` is a task module (``format_prompt``, ``score``) or its name.
    """
    if isinstance(task, str):
        task = task_module(task)
    if isinstance(model, (str, Path)):
        tokenizer = AutoTokenizer.from_pretrained(model)
        model = AutoModelForCausalLM.from_pretrained(model)
    elif tokenizer is None:
        raise ValueError("pass the tokenizer along with a loaded model (or pass a model directory)")
    if not examples:
        raise ValueError("no examples to evaluate")
    was_training = model.training
    model.eval()
    responses = greedy_responses(
        model,
        tokenizer,
        [task.format_prompt(e) for e in examples],
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
    )
    model.train(was_training)
    return sum(task.score(e, r) for e, r in zip(examples, responses)) / len(examples)


def new_tiny_model(
    work_dir: Path, spec: TinyModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> PreTrainedModel:
    """A randomly initialised tiny model for ``tokenizer`` (seeded), written to ``work_dir/init``
    and loaded."""
    return AutoModelForCausalLM.from_pretrained(
        create_tiny_model(work_dir / "init", spec, tokenizer, seed)
    )


def warn_if_target_missed(result: SftResult, sft: SftConfig, metric: str) -> None:
    """Log a warning when SFT ran all its steps without reaching ``sft.target_accuracy`` (the
    ``metric``)."""
    if sft.target_accuracy is not None and not result.reached_target:
        log.warning(
            "sft: the target %s %.3f was not reached in %d steps",
            metric,
            sft.target_accuracy,
            sft.steps,
        )


def save_policy(work_dir: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Path:
    """Write the trained model and its tokenizer to ``work_dir/policy``; returns that directory."""
    model.save_pretrained(work_dir / "policy")
    tokenizer.save_pretrained(work_dir / "policy")
    return work_dir / "policy"


@contextmanager
def no_transformers_bars() -> Iterator[None]:
    """Hide transformers' "Loading weights" / "Writing model shards" bars (noise for 2 MB models)."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def torch_threads() -> int:
    return torch.get_num_threads()
