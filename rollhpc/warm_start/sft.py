"""Supervised fine-tuning of a causal LM on (prompt, completion) pairs, and greedy decoding.

The warm start of the RL pipelines: the tiny policy learns the task's answer format and part of the
skill from reference completions, so that RL starts from a model that sometimes succeeds. Prompt and
completion are tokenized separately and concatenated, exactly as the generator sees them (a prompt's
ids, then sampled ids), and the loss covers the completion and its EOS only. ``train_sft`` takes
text pairs and stops on greedy exact match (RLVR); ``train_sft_ids`` takes pairs already encoded
(multi-turn rows, built by concatenating ids) and stops on whatever a caller's monitor measures
(episode success for agentic warm starts, ``rollhpc.warm_start.agentic_build``). What training runs
with is ``SftConfig`` (``rollhpc.warm_start.sft_config``, light: configs name it). Left out:
packing, gradient accumulation, mixed precision and multi-process data parallelism (the tiny model
trains in minutes on one CPU process).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from rollhpc.warm_start.sft_config import SftConfig

try:  # optional: a progress bar (else train_sft_ids logs every log_every steps)
    from tqdm.auto import tqdm
except ImportError:
    tqdm = None

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger("rollhpc.sft")
IGNORE_INDEX = -100  # label of prompt and padding positions: no loss there


@dataclass
class SftResult:
    steps: int  # steps taken (fewer than options.steps when the target accuracy stopped training)
    reached_target: bool
    loss_first: float  # mean completion-token loss of the first step
    loss_final: float  # mean over the last 10 steps (less noisy than the last one)
    # (step, loss) every log_every steps
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    # (step, monitored accuracy)
    accuracy_curve: list[tuple[int, float]] = field(default_factory=list)
    wall_s: float = 0.0


def encode_pairs(
    tokenizer: PreTrainedTokenizerBase, pairs: Sequence[tuple[str, str]], max_len: int
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids + EOS) per (prompt, completion) text pair."""
    encoded = []
    for prompt, completion in pairs:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(p) + len(c) > max_len:
            raise ValueError(
                f"example of {len(p) + len(c)} tokens exceeds max_len={max_len}: {prompt + completion!r}"
            )
        encoded.append((p, c))
    return encoded


def collate(encoded: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and labels [B, T]; labels are IGNORE_INDEX outside completions."""
    width = max(len(p) + len(c) for p, c in encoded)
    ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    labels = torch.full((len(encoded), width), IGNORE_INDEX, dtype=torch.long)
    for row, (p, c) in enumerate(encoded):
        n = len(p) + len(c)
        ids[row, :n] = torch.tensor(p + c)
        mask[row, :n] = 1
        labels[row, len(p) : n] = torch.tensor(c)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def lr_factor(step: int, options: SftConfig) -> float:
    """Multiplier of ``options.lr`` at 0-based ``step``: linear warmup (at most ``steps`` long), then
    cosine to ``min_lr_ratio`` at the last step."""
    warmup = min(options.warmup, options.steps)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, options.steps - warmup - 1)
    return options.min_lr_ratio + (1 - options.min_lr_ratio) * 0.5 * (
        1 + math.cos(math.pi * min(progress, 1.0))
    )


def completion_loss(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over the completion tokens of the batch."""
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).logits  # [B, T, V]
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(),
        batch["labels"][:, 1:].flatten(),
        ignore_index=IGNORE_INDEX,
    )


def exact_match(
    model: PreTrainedModel,
    encoded: Sequence[tuple[list[int], list[int]]],
    pad_id: int,
    batch_size: int = 256,
) -> float:
    """Fraction of examples whose every completion token (EOS included) is the argmax given the
    reference prefix: exactly the examples that greedy decoding reproduces, at the cost of one
    forward pass instead of a generation loop."""
    was_training, hits = model.training, 0
    model.eval()
    with torch.no_grad():
        for lo in range(0, len(encoded), batch_size):
            batch = collate(encoded[lo : lo + batch_size], pad_id)
            logits = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
            labels = batch["labels"][:, 1:]
            wrong = (logits[:, :-1].argmax(-1) != labels) & (labels != IGNORE_INDEX)  # [B, T-1]
            hits += int((~wrong.any(dim=1)).sum())
    model.train(was_training)
    return hits / len(encoded)


def train_sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    pairs: Sequence[tuple[str, str]],
    options: SftConfig,
    *,
    seed: int = 0,
    monitor_pairs: Sequence[tuple[str, str]] = (),
    progress: bool = True,
    log_every: int = 50,
) -> SftResult:
    """Fine-tune ``model`` in place on (prompt, completion) text ``pairs`` for up to ``options.steps`` AdamW steps.

    Every ``options.check_every`` steps the greedy exact-match accuracy on ``monitor_pairs`` is recorded;
    training stops once it reaches ``options.target_accuracy``. The texts are encoded by ``encode_pairs``
    (each example at most ``options.max_len`` tokens); the training itself is ``train_sft_ids``.
    """
    encoded = encode_pairs(tokenizer, pairs, options.max_len)
    monitored = encode_pairs(tokenizer, monitor_pairs, options.max_len)
    _check_inputs(
        len(encoded), options, bool(monitored), "monitor_pairs to measure the accuracy on"
    )
    pad_id = tokenizer.pad_token_id

    def monitor(m: PreTrainedModel) -> float:
        return exact_match(m, monitored, pad_id)

    return train_sft_ids(
        model,
        encoded,
        options,
        pad_id=pad_id,
        seed=seed,
        monitor=monitor if monitored else None,
        progress=progress,
        log_every=log_every,
    )


def train_sft_ids(
    model: PreTrainedModel,
    encoded: Sequence[tuple[list[int], list[int]]],
    options: SftConfig,
    *,
    pad_id: int,
    seed: int = 0,
    monitor: Callable[[PreTrainedModel], float] | None = None,
    metric: str = "accuracy",
    progress: bool = True,
    log_every: int = 50,
) -> SftResult:
    """Fine-tune ``model`` in place on pre-encoded (prompt ids, completion ids) examples.

    Why ids and not text: a multi-turn episode's prompt is a row built by concatenating token ids turn by
    turn (``rollhpc.rollout.turns``); re-encoding its text could merge tokens across a turn boundary and
    teach the model rows it never reads in RL. The completion ids must already end with EOS (the loss
    covers every completion id and nothing else); ``options.max_len`` is not applied here (the caller knows
    what its examples must fit).

    Batches are drawn without replacement from a seeded permutation (a new one each epoch), so the run is
    deterministic for a seed. Every ``options.check_every`` steps ``monitor(model)`` (called in eval mode,
    without gradients) gives the value recorded in ``accuracy_curve``; training stops once it reaches
    ``options.target_accuracy``. ``metric`` names that value in the log (e.g. "success rate").
    """
    _check_inputs(
        len(encoded), options, monitor is not None, f"a monitor to measure the {metric} with"
    )
    generator = torch.Generator().manual_seed(seed)
    optimizer, scheduler = _optimizer(model, options)
    report = _Report(options, metric, progress, log_every)
    recent: list[float] = []
    order: list[int] = []
    model.train()
    start = time.perf_counter()
    for step in range(1, options.steps + 1):
        if len(order) < options.batch_size:
            order = torch.randperm(len(encoded), generator=generator).tolist()
        batch_idx, order = order[: options.batch_size], order[options.batch_size :]
        batch = collate([encoded[i] for i in batch_idx], pad_id)
        value = _step(model, optimizer, scheduler, batch, options.grad_clip)
        recent = [*recent[-9:], value]
        if monitor is not None and step % options.check_every == 0:
            report.checked(step, _measure(model, monitor))
        report.stepped(step, value, scheduler.get_last_lr()[0])
        if report.result.reached_target:
            break
    report.close()
    model.eval()
    report.result.loss_final = sum(recent) / len(recent)
    report.result.wall_s = time.perf_counter() - start
    return report.result


def _check_inputs(examples: int, options: SftConfig, monitored: bool, monitor: str) -> None:
    """ValueError for fewer examples than a batch, or a target accuracy with nothing to measure."""
    if examples < options.batch_size:
        raise ValueError(
            f"{examples} training examples are fewer than batch_size={options.batch_size}"
        )
    if options.target_accuracy is not None and not monitored:
        raise ValueError(f"SftConfig.target_accuracy needs {monitor}")


def _optimizer(
    model: PreTrainedModel, options: SftConfig
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (no weight decay on norms and biases) and its warmup-cosine schedule, ``lr_factor``."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # norms: no weight decay
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": options.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=options.lr,
        betas=(0.9, 0.95),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, options))
    return optimizer, scheduler


def _step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: dict[str, torch.Tensor],
    grad_clip: float,
) -> float:
    """One optimizer step on ``batch``; returns its loss."""
    loss = completion_loss(model, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    scheduler.step()
    return loss.item()


def _measure(model: PreTrainedModel, monitor: Callable[[PreTrainedModel], float]) -> float:
    """``monitor(model)`` in eval mode without gradients; the model is back in train mode after."""
    model.eval()
    with torch.no_grad():
        value = float(monitor(model))
    model.train()
    return value


class _Report:
    """What a run records as it goes (the ``SftResult``'s curves and early stop) and shows (a
    progress bar, else a log line every ``log_every`` steps)."""

    def __init__(self, options: SftConfig, metric: str, progress: bool, log_every: int) -> None:
        self.options, self.metric = options, metric
        self.progress, self.log_every = progress, log_every
        self.bar = _progress_bar(options.steps) if progress else None
        self.result = SftResult(
            steps=0, reached_target=False, loss_first=float("nan"), loss_final=float("nan")
        )
        self.accuracy = float("nan")

    def checked(self, step: int, accuracy: float) -> None:
        """The monitor's value at ``step``; reaching the target stops training."""
        target = self.options.target_accuracy
        self.accuracy = accuracy
        self.result.accuracy_curve.append((step, accuracy))
        self.result.reached_target = target is not None and accuracy >= target

    def stepped(self, step: int, loss: float, lr: float) -> None:
        result, options = self.result, self.options
        result.steps = step
        if step == 1:
            result.loss_first = loss
        if step % self.log_every == 0 or step == options.steps or result.reached_target:
            result.loss_curve.append((step, round(loss, 5)))
            if self.bar is None and self.progress:
                log.info(
                    "sft step %d/%d: loss %.4f, monitored %s %.3f, lr %.2e",
                    step,
                    options.steps,
                    loss,
                    self.metric,
                    self.accuracy,
                    lr,
                )
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", acc=f"{self.accuracy:.3f}", refresh=False)
        if result.reached_target:
            log.info(
                "sft: monitored %s %.3f reached the target %.3f at step %d",
                self.metric,
                self.accuracy,
                options.target_accuracy,
                step,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _progress_bar(total: int) -> tqdm | None:
    """A tqdm bar when tqdm is installed, else None (train_sft then logs every log_every steps)."""
    if tqdm is None:
        return None
    return tqdm(total=total, desc="sft", unit="step", dynamic_ncols=True)


def greedy_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 24,
    batch_size: int = 64,
) -> list[str]:
    """Greedy continuations of ``prompts`` (special tokens removed), batched with left padding."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    out: list[str] = []
    with torch.no_grad():
        for lo in range(0, len(prompts), batch_size):
            ids = [
                tokenizer(p, add_special_tokens=False)["input_ids"]
                for p in prompts[lo : lo + batch_size]
            ]
            width = max(map(len, ids))
            input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
            generated = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=pad,
            )
            out += tokenizer.batch_decode(generated[:, width:], skip_special_tokens=True)
    return out
