"""What the streamed weight sync's slots (``weight_sync.slots``) live in: the interface both kinds of slot memory
serve, GPU memory shared by CUDA IPC (``weight_sync.cuda_ipc``) and host files in /dev/shm
(``weight_sync.shared_memory``), and the handle a receiver maps a slot by."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

__all__ = ["SlotHandle", "SlotMemory"]

# How a receiver maps a slot: torch's CUDA IPC rebuild function and its arguments, or a file's path and size
SlotHandle = tuple[Callable[..., torch.Tensor], tuple[object, ...]] | tuple[str, int]


class SlotMemory(Protocol):
    """Slots on the sender (``allocate`` .. ``close``) and a receiver's mapping of them (``open``, ``copy_out``)."""

    kind: str  # "cuda_ipc" or "shared_memory": the header says it, a receiver maps the slots accordingly
    device: torch.device
    keep_mapped: (
        bool  # a receiver keeps a slot mapped across the buckets it holds (else maps it per bucket)
    )

    def allocate(self, nbytes: int) -> tuple[torch.Tensor, str, SlotHandle]:
        """A new slot: the buffer, its id, and the handle a receiver maps it by."""
        ...

    def ready(self) -> None:
        """The slot's writes are done before its header leaves."""
        ...

    def mapped_by_all(self, handle: SlotHandle) -> None:
        """Every receiver has mapped the slot."""
        ...

    def close(self) -> None:
        """The sync is over: what is left of the slots goes."""
        ...

    def open(self, handle: SlotHandle) -> torch.Tensor:
        """The sender's slot mapped into this process (no copy)."""
        ...

    def copy_out(self, view: torch.Tensor) -> torch.Tensor:
        """A bucket in this process's own memory, copied before the caller acknowledges it."""
        ...
