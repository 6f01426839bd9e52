"""Stage-wise offload of a model role's state to host memory and back (ROLL's time-division multiplexing).

Colocated roles share GPUs: while vLLM generates, the trainer's parameters, gradients and optimizer states
need not sit on the GPU, and while the trainer trains, vLLM's weights and KV cache need not either. A
``StateOffloader`` moves the chosen parts of a role (``parameters``, ``gradients``, ``optimizer``) to
pinned host buffers, allocated once and reused by every later offload, and back to the device, keeping
every tensor object (``param.data`` and the optimizer's state tensors are swapped in place, so modules,
the optimizer and hooks keep their references). On a CPU role the device is the host: the same code runs
and every move is the tensor itself, so CPU runs exercise the orchestration and GPU runs free memory.
The trainer on megatron-core's DDP and optimizer moves through megatron's own offload instead
(``workers.megatron_offload``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

PARTS = ("parameters", "gradients", "optimizer")


def gpu_memory() -> dict[str, float]:
    """This process's GPU memory in bytes (allocated, reserved by torch's cache, free on the device);
    zeros on a machine without CUDA, so metrics keep one shape."""
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
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


class Offloader:
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


class StateOffloader(Offloader):
    """Moves the state of ``modules`` (and ``optimizer``'s) between ``device`` and pinned host memory."""

    def __init__(
        self,
        modules: Iterable[torch.nn.Module],
        optimizer: torch.optim.Optimizer | None,
        device: torch.device | str,
    ):
        self.params = [p for m in modules for p in m.parameters()]
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.offloaded: set[str] = set()
        # (id of the tensor's owner, slot) -> pinned host buffer
        self._host: dict[tuple[int, str], torch.Tensor] = {}

    def _tensors(self, part: str) -> list[tuple[tuple[int, str], object, str]]:
        """(key, owner, attribute or state key) of every tensor of ``part``: owner.attr or owner[key]."""
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
