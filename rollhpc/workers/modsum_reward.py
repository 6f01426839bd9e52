"""The toy demo's reward role: whether each answer is (a + b) mod ``modulus``. Rule-based and light (numpy
only), so its rank does not load torch beside the toy policy's."""

from __future__ import annotations

from dataclasses import dataclass

from rollhpc.batch import Batch
from rollhpc.protocol.dispatch import Dispatch, register
from rollhpc.protocol.worker import Worker
from rollhpc.tasks.modsum import reward


class ModSumRewardWorker(Worker):
    """The rule-based reward of configs/toy_grpo.yaml."""

    @dataclass(kw_only=True)
    class Options:
        modulus: int = 10

    @register(Dispatch.DP_SPLIT)
    def score(self, batch: Batch) -> Batch:
        """The batch with its ``reward`` column."""
        return Batch(
            {
                **batch.data,
                "reward": reward(batch["prompt"], batch["answer"], self.options.modulus),
            },
            batch.meta,
        )
