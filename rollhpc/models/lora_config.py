"""The LoRA settings of a train or critic role (``roles.train.options.lora``): apart from ``rollhpc.models.lora``
so that loading a config does not import torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["TARGETS", "LoraConfig"]

# short name -> (submodule of the transformer layer, linear in it, parallel mode of that linear)
TARGETS: dict[str, tuple[str, str, Literal["column", "row"]]] = {
    "qkv": ("self_attention", "linear_qkv", "column"),
    "proj": ("self_attention", "linear_proj", "row"),
    "fc1": ("mlp", "linear_fc1", "column"),
    "fc2": ("mlp", "linear_fc2", "row"),
}


@dataclass(kw_only=True)
class LoraConfig:
    rank: int = 16  # r: the adapters' inner dimension
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input, in training only
    target: list[str] = field(default_factory=lambda: ["qkv", "proj", "fc1", "fc2"])  # of TARGETS
    seed: int = 0  # of A's initial draw (B starts at zero)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora.rank must be >= 1, got {self.rank}")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ValueError(f"lora.alpha must be a positive number, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        unknown = [t for t in self.target if t not in TARGETS]
        if unknown or not self.target or len(set(self.target)) != len(self.target):
            raise ValueError(
                f"lora.target must name distinct layers of {sorted(TARGETS)}, got {self.target}"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def adapter_parameter_count(
    config: LoraConfig, hidden: int, ffn: int, q_out: int, kv_out: int, layers: int, tp: int = 1
) -> int:
    """Elements of ``layers`` dense layers' adapters on one TP rank (A: r x in, B: out x r per target; the
    sharded one of the two split over tp, rollhpc.models.lora): the memory plan's count. ``q_out``: heads x head
    dim; ``kv_out``: KV heads x head dim; ``ffn``: the MLP's intermediate size."""
    shapes = {
        "qkv": (hidden, q_out + 2 * kv_out),
        "proj": (q_out, hidden),
        "fc1": (hidden, 2 * ffn),
        "fc2": (ffn, hidden),
    }
    total = 0
    for t in config.target:
        i, o = shapes[t]
        total += (
            config.rank * (i + o // tp)
            if TARGETS[t][2] == "column"
            else config.rank * (i // tp + o)
        )
    return layers * total
