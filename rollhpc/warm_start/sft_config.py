"""What an SFT warm start trains with (``SftConfig``): light, so a config that names its fields
loads without torch (the trainer is ``rollhpc.warm_start.sft``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SftConfig"]


@dataclass(kw_only=True)
class SftConfig:
    """Everything that changes the trained weights (and so the cache key of a prepared policy)."""

    steps: int = 3000  # at most; the target accuracy usually stops training far sooner
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 30  # linear warmup steps (at most steps), then cosine decay to min_lr_ratio * lr
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # prompt + completion + EOS tokens; longer examples are an error, not truncated
    max_len: int = 64
    train_examples: int = 4000
    # held-out examples for the report's accuracy (and as many monitored train examples)
    eval_examples: int = 400
    max_new_tokens: int = 32  # generation budget of the greedy evaluation
    # Stop once the greedy accuracy on monitored training examples reaches this: the RL start should
    # sometimes succeed, not master the task. None trains all ``steps``.
    target_accuracy: float | None = 0.2
    # steps between accuracy checks (one forward pass over the monitored examples)
    check_every: int = 5

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "batch_size",
            "max_len",
            "train_examples",
            "eval_examples",
            "max_new_tokens",
            "check_every",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SftConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"SftConfig.warmup must be an int >= 0, got {self.warmup!r}")
        if (
            self.lr <= 0
            or not 0 <= self.min_lr_ratio <= 1
            or self.weight_decay < 0
            or self.grad_clip <= 0
        ):
            raise ValueError(
                f"need lr > 0, 0 <= min_lr_ratio <= 1, weight_decay >= 0, grad_clip > 0; got lr={self.lr},"
                f" min_lr_ratio={self.min_lr_ratio}, weight_decay={self.weight_decay}, "
                f"grad_clip={self.grad_clip}"
            )
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ValueError(
                f"SftConfig.target_accuracy must be in (0, 1] or None, got {self.target_accuracy}"
            )
