"""Offload of a trainer on megatron-core's DDP and optimizer: its parameters, gradients and optimizer state
moved to host memory and back by megatron's own RL offload (the other roles': ``workers.offload``)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from rollhpc.checkpoint.trainer_state import inner_optimizers
from rollhpc.workers.offload import PARTS, Offloader, release_gpu_memory

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer

__all__ = ["MegatronStateOffloader"]


class MegatronStateOffloader(Offloader):
    """The same three parts for a trainer role (megatron-core's DDP and optimizer), moved by megatron's
    own RL offload: DDP's buffers (``offload_to_cpu`` / ``reload_from_cpu``: the parameters, which the distributed
    optimizer keeps in the buffers, copied to pinned host memory; the fp32 gradient buffers freed and zeroed on
    return) and the optimizer's (``offload_to_cpu`` / ``restore_from_cpu``: fp32 main parameters and Adam moments).
    Parameters move with the buffers only under the distributed optimizer (without it they are not in a buffer:
    refused on a GPU). On a CPU role nothing moves and the bytes are counted, as ``StateOffloader`` does."""

    def __init__(
        self,
        ddp_chunks: Iterable[DistributedDataParallel],
        optimizer: MegatronOptimizer,
        device: torch.device | str,
    ):
        self.chunks = list(ddp_chunks)
        self.buffers = [b for c in self.chunks for b in c.buffers + c.expert_parallel_buffers]
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.offloaded: set[str] = set()
        if self.device.type == "cuda" and any(b.param_data is None for b in self.buffers):
            raise ValueError(
                "offload on the megatron stack moves the parameters inside DDP's buffers, where only the "
                "distributed optimizer keeps them: set distributed_optimizer: true"
            )
        if self.device.type == "cuda" and any(b.param_dtype == torch.float32 for b in self.buffers):
            # fp32 parameters are their own main parameters (the optimizer steps views of DDP's buffer), and
            # megatron's optimizer offload replaces those views with copies: the steps would no longer reach the model
            raise ValueError(
                "offload on the megatron stack needs 16-bit parameters (dtype: bfloat16): with float32 "
                "ones megatron's optimizer offload would cut its main parameters off from the model's"
            )

    def _bytes(self, part: str) -> int:
        if part == "parameters":
            return sum(
                p.numel() * p.element_size() for c in self.chunks for p in c.module.parameters()
            )
        if part == "gradients":
            return sum(b.grad_data.numel() * b.grad_data.element_size() for b in self.buffers)
        if part == "optimizer":
            return sum(
                v.numel() * v.element_size()
                for inner in inner_optimizers(self.optimizer)
                for s in inner.state.values()
                for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0
            )
        raise ValueError(f"unknown part {part!r}; parts: {', '.join(PARTS)}")

    def _move(self, parts: list[str], to_host: bool) -> dict[str, float]:
        start = time.perf_counter()
        todo = [p for p in parts if (p in self.offloaded) != to_host]
        # counted before the buffers give their storage back
        moved = sum(self._bytes(p) for p in todo)
        if self.device.type == "cuda" and todo:
            params, grads = "parameters" in todo, "gradients" in todo
            for buffer in self.buffers:
                if to_host:
                    buffer.offload_to_cpu(move_params=params, move_grads=grads)
                else:
                    buffer.reload_from_cpu(move_params=params, move_grads=grads)
            if "optimizer" in todo:
                self.optimizer.offload_to_cpu() if to_host else self.optimizer.restore_from_cpu()
            torch.cuda.synchronize(self.device)
            if to_host:
                release_gpu_memory()
        for p in todo:
            (self.offloaded.add if to_host else self.offloaded.discard)(p)
        return {"bytes": float(moved), "seconds": time.perf_counter() - start}
