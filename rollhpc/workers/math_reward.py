"""Reward role for verifiable tasks: decode the response, score it with the task's exact verifier.

Rule-based rather than a model: the answer of an arithmetic or countdown problem is checked exactly
(``rollhpc.tasks``), so the reward cannot be gamed by style and costs microseconds. The tokenizer is
the checkpoint's own (decoding must match what the policy wrote).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollhpc.protocol.worker import Dispatch, Worker, WorkerContext, register
from rollhpc.tasks import task_module


class MathRewardWorker(Worker):
    @dataclass(kw_only=True)
    class Options:
        model_dir: str  # where the tokenizer is (the policy checkpoint)
        task: str = "arithmetic"

        def __post_init__(self) -> None:
            task_module(self.task)

    def __init__(self, ctx: WorkerContext, options: Options):
        super().__init__(ctx, options)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(options.model_dir)
        self.task = task_module(options.task)

    @register(Dispatch.DP_SPLIT)
    def score(self, items: list[tuple[Any, list[int]]]) -> list[float]:
        """``(example, response token ids)`` -> reward in [0, 1] per item."""
        texts = self.tokenizer.batch_decode([ids for _, ids in items], skip_special_tokens=True)
        return [float(self.task.score(example, text)) for (example, _), text in zip(items, texts)]
