"""The plan-time side of the quickstart's roles (rollhpc.workers.toy_policy): their options and the remote
methods the controller calls. Light: no torch (rollhpc.protocol.spec)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollhpc.protocol.dispatch import Dispatch, register
from rollhpc.protocol.spec import WorkerSpec

if TYPE_CHECKING:
    import numpy as np
    import torch

    from rollhpc.batch import Batch

__all__ = ["PolicyOptions", "ToyGenerateWorkerSpec", "ToyTrainWorkerSpec"]


@dataclass(kw_only=True)
class PolicyOptions:
    modulus: int = 10
    hidden: int = 256


class ToyTrainWorkerSpec(WorkerSpec):
    """The tiny policy's trainer, data-parallel over MPI."""

    @dataclass(kw_only=True)
    class Options(PolicyOptions):
        lr: float = 0.005
        clip: float = 0.2

    @register(Dispatch.DP_SPLIT)
    def train_step(self, batch: Batch) -> list[dict[str, float]]:
        """Per DP rank its loss, entropy and row count after one clipped policy-gradient step."""
        raise NotImplementedError

    @register(Dispatch.RANK_ZERO)
    def weights(self) -> dict[str, torch.Tensor]:
        """Rank 0's state dict, detached copies."""
        raise NotImplementedError


class ToyGenerateWorkerSpec(WorkerSpec):
    """The tiny policy's sampler."""

    Options = PolicyOptions

    @register(Dispatch.ONE_TO_ALL)
    def set_weights(self, state: dict[str, torch.Tensor], version: int) -> int:
        """Each rank's weights version after loading ``state``."""
        raise NotImplementedError

    @register(Dispatch.DP_SPLIT)
    def generate(self, prompts: np.ndarray | list, samples_per_prompt: int) -> Batch:
        """Rows of prompt, sampled answer, its log-prob and the weights version."""
        raise NotImplementedError

    @register(Dispatch.DP_SPLIT)
    def greedy(self, prompts: list) -> list[int]:
        """The most likely answer to each prompt."""
        raise NotImplementedError
