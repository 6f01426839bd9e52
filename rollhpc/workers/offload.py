"""Stage-wise offload of a model role's state to host memory and back (ROLL's time-division multiplexing).

Colocated roles share GPUs: while vLLM generates, the trainer's parameters, gradients and optimizer states
need not sit on the GPU, and while the trainer trains, vLLM's weights and KV cache need not either. A
``StateOffloader`` moves the chosen parts of a role (``parameters``, ``gradients``, ``optimizer``) to
pinned host buffers, allocated once and reused by every later offload, and back to the device, keeping
every tensor object (``param.data`` and the optimizer's state tensors are swapped in place, so modules,
the optimizer and hooks keep their references). On a CPU role the device is the host: the same code runs
and every move is the tensor itself, so CPU runs exercise the orchestration and GPU runs free memory.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

PARTS = ("parameters", "gradients", "optimizer")


def gpu_memory() -> dict[str, float]:
    """This process's GPU memory in bytes (allocated, reserved by torch's cache, free on the device);
    zeros on a machine without CUDA, so metrics keep one shape."""
    import torch

    if not torch.cuda.is_available():
        return {"allocated": 0.0, "reserved": 0.0, "free": 0.0}
    free, _ = torch.cuda.mem_get_info()
    return {
        "allocated": float(torch.cuda.memory_allocated()),
        "reserved": float(torch.cuda.memory_reserved()),
        "free": float(free),
    }


def release_gpu_memory() -> None:
    """Hand what the process no longer holds back to the device, for a colocated role to take: the caching
    allocator's free blocks, and cuBLAS's workspaces (allocator memory counted as allocated, one per handle and
    stream, made again at the next matrix product)."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


class _Offloader:
    """What both offloaders share: ``offload`` / ``reload`` of named parts, checked and put in PARTS order
    (parameters before their gradients, both ways); ``_move`` does the moving."""

    def offload(self, parts: Iterable[str] = PARTS) -> dict[str, float]:
        return self._move(self._parts(parts), to_host=True)

    def reload(self, parts: Iterable[str] = PARTS) -> dict[str, float]:
        return self._move(self._parts(parts), to_host=False)

    @staticmethod
    def _parts(parts: Iterable[str]) -> list[str]:
        parts = list(parts)
        unknown = set(parts) - set(PARTS)
        if unknown:
            raise ValueError(f"unknown parts {sorted(unknown)}; parts: {', '.join(PARTS)}")
        return [p for p in PARTS if p in parts]

    def _move(self, parts: list[str], to_host: bool) -> dict[str, float]:
        raise NotImplementedError


class StateOffloader(_Offloader):
    """Moves the state of ``modules`` (and ``optimizer``'s) between ``device`` and pinned host memory."""

    def __init__(self, modules: Iterable[Any], optimizer: Any | None, device: Any):
        import torch

        self.params = [p for m in modules for p in m.parameters()]
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.offloaded: set[str] = set()
        self._host: dict[
            tuple[int, str], Any
        ] = {}  # (id of the tensor's owner, slot) -> pinned host buffer

    def _tensors(self, part: str) -> list[tuple[tuple[int, str], Any, str]]:
        """(key, owner, attribute or state key) of every tensor of ``part``: owner.attr or owner[key]."""
        import torch

        if part == "parameters":
            return [((id(p), "data"), p, "data") for p in self.params]
        if part == "gradients":
            return [((id(p), "grad"), p, "grad") for p in self.params if p.grad is not None]
        if part == "optimizer":
            if self.optimizer is None:
                return []
            return [
                ((id(state), k), state, k)
                for state in self.optimizer.state.values()
                for k, v in state.items()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            ]
        raise ValueError(f"unknown part {part!r}; parts: {', '.join(PARTS)}")

    def _move(self, parts: list[str], to_host: bool) -> dict[str, float]:
        import torch

        start = time.perf_counter()
        moved = 0
        on_gpu = self.device.type == "cuda"
        for part in parts:
            if (part in self.offloaded) == to_host:
                continue  # already where it should be
            for key, owner, slot in self._tensors(part):
                t = owner[slot] if isinstance(owner, dict) else getattr(owner, slot)
                moved += t.numel() * t.element_size()
                if not on_gpu:
                    continue  # a CPU role: its device is the host, the tensor stays where it is
                if to_host:
                    host = self._host.get(key)
                    if host is None or host.shape != t.shape or host.dtype != t.dtype:
                        host = self._host[key] = torch.empty(
                            t.shape, dtype=t.dtype, device="cpu", pin_memory=True
                        )
                    new = host.copy_(t, non_blocking=True)
                else:
                    new = t.to(self.device, non_blocking=True)
                if isinstance(owner, dict):
                    owner[slot] = new
                # the parameter's own data (``p.data`` is a new alias each time: swapping an
                elif slot == "data":
                    owner.data = new  # alias's data would leave the parameter where it was)
                else:  # swap the storage under the same grad tensor (a grad assigned across devices is refused)
                    t.data = new
            if to_host:
                self.offloaded.add(part)
            else:
                self.offloaded.discard(part)
        if on_gpu:
            torch.cuda.synchronize(self.device)
            if to_host:
                release_gpu_memory()  # the freed blocks back to the device, so the colocated role can take them
        return {"bytes": float(moved), "seconds": time.perf_counter() - start}


class MegatronStateOffloader(_Offloader):
    """The same three parts for a trainer role (megatron-core's DDP and optimizer), moved by megatron's
    own RL offload: DDP's buffers (``offload_to_cpu`` / ``reload_from_cpu``: the parameters, which the distributed
    optimizer keeps in the buffers, copied to pinned host memory; the fp32 gradient buffers freed and zeroed on
    return) and the optimizer's (``offload_to_cpu`` / ``restore_from_cpu``: fp32 main parameters and Adam moments).
    Parameters move with the buffers only under the distributed optimizer (without it they are not in a buffer:
    refused on a GPU). On a CPU role nothing moves and the bytes are counted, as ``StateOffloader`` does."""

    def __init__(self, ddp_chunks: Iterable[Any], optimizer: Any, device: Any):
        import torch

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
        import torch

        if part == "parameters":
            return sum(
                p.numel() * p.element_size() for c in self.chunks for p in c.module.parameters()
            )
        if part == "gradients":
            return sum(b.grad_data.numel() * b.grad_data.element_size() for b in self.buffers)
        if part == "optimizer":
            from rollhpc.checkpoint.trainer_state import inner_optimizers

            return sum(
                v.numel() * v.element_size()
                for inner in inner_optimizers(self.optimizer)
                for s in inner.state.values()
                for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0
            )
        raise ValueError(f"unknown part {part!r}; parts: {', '.join(PARTS)}")

    def _move(self, parts: list[str], to_host: bool) -> dict[str, float]:
        import torch

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
