"""The trainer's learning rate at each optimizer step: linear warm-up, then constant, linear or cosine decay to a
floor, as megatron's ``OptimizerParamScheduler`` shapes it.

A pure function of the optimizer step count, which the run checkpoint saves: a resumed run continues the schedule
exactly, without a scheduler state of its own.
"""

from __future__ import annotations

import math
from typing import Literal

Schedule = Literal["constant", "linear", "cosine"]


def learning_rate(
    step: int,
    *,
    lr: float,
    warmup_steps: int = 0,
    schedule: Schedule = "constant",
    decay_steps: int = 0,
    min_lr: float = 0.0,
) -> float:
    """The rate of optimizer step ``step`` (0 for the first): ``lr * (step + 1) / warmup_steps`` during the warm-up,
    then ``lr`` (constant) or a decay from ``lr`` to ``min_lr`` over the ``decay_steps`` steps after the warm-up,
    ``min_lr`` after them."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    done = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    if schedule == "linear":
        return min_lr + (lr - min_lr) * (1.0 - done)
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * done))
    raise ValueError(f"unknown learning-rate schedule {schedule!r}: constant, linear or cosine")
