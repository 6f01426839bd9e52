"""The names inside a trainer role's share of a run checkpoint (``checkpoint.trainer_state`` writes them),
for the readers that need no torch: ``rollhpc export`` and ``rollhpc ckpt inspect``."""

from __future__ import annotations

from pathlib import Path

MODEL_DIR = "model"  # the GPT model: a megatron dist checkpoint (checkpoint.mcore)
OPTIMIZER_DIR = "optimizer"  # megatron's optimizer checkpoint; absent before the first step
RANKS_DIR = "ranks"  # one file per rank: its RNG states and the optimizer step count


def rank_file(role_dir: Path, rank: int) -> Path:
    return role_dir / RANKS_DIR / f"rank_{rank:05d}.pt"
