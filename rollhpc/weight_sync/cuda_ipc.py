"""GPU slots for the streamed weight sync (``weight_sync.slots``) between processes on the same GPU: CUDA IPC.

When the trainer and a vLLM engine are colocated (the same GPU, two processes), broadcasting the weights over
NCCL or MPI would copy every byte out of the GPU and back in, and NCCL refuses two ranks of one GPU anyway.
Instead the trainer packs its weights, bucket by bucket, into ``IN_FLIGHT_BUCKETS`` (2) reused slots on its
GPU and hands out each slot's IPC handle (torch's own ``reduce_tensor``: a picklable description of the CUDA
allocation); a receiver maps the slot, copies the bucket out of it device to device into memory of its own,
lets go of the mapping and acknowledges it, after which the trainer refills that slot. The trainer's extra
memory is two slots of ``bucket_mb`` (a larger one for a tensor larger than that), not the whole model: a 30B
MoE packed whole would be ~57 GiB more on the trainer's GPU at the first sync. The protocol itself (headers,
acknowledgements, errors) is ``weight_sync.slots``'; this module is only where the slots live.

The handles name the sender's device by its index as the sender sees it; a receiver that sees the same GPU
under another index (its own CUDA_VISIBLE_DEVICES) passes it as ``receiver_device`` to ``CudaSlots``.
"""

from __future__ import annotations

import itertools

import torch
from torch.multiprocessing.reductions import reduce_tensor

from rollhpc.weight_sync.slot_memory import SlotHandle

__all__ = ["CudaSlots"]

_ids = itertools.count()


class CudaSlots:
    """Slots in GPU memory (sender), and the receiver's mapping of them. ``device``: the receiver's index of the
    sender's GPU when it differs from the sender's."""

    kind = "cuda_ipc"
    # A receiver maps a slot for one bucket and lets go before acknowledging it. Torch keeps a shared allocation
    # that the sender drops (a slot resized for a tensor larger than ``bucket_mb``) allocated while a receiver
    # still maps it (its IPC "limbo"): a mapping kept per slot would hold the old slot beside the two live ones.
    keep_mapped = False

    def __init__(self, device: torch.device | None = None, receiver_device: int | None = None):
        self.device = (
            device if device is not None else torch.device("cuda", torch.cuda.current_device())
        )
        self.receiver_device = receiver_device

    # -- sender
    def allocate(self, nbytes: int) -> tuple[torch.Tensor, str, SlotHandle]:
        """A new slot: the buffer, its id, and the IPC handle a receiver maps it by."""
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf, f"cuda-{next(_ids)}", reduce_tensor(buf)

    def ready(self) -> None:
        """The slot's copies (queued on this stream) are done before its header leaves."""
        torch.cuda.current_stream(self.device).synchronize()

    def mapped_by_all(self, handle: SlotHandle) -> None:  # noqa: ARG002 - the shared-memory slots' hook
        """Nothing to do: torch's IPC reference counting keeps a mapped allocation alive on its own."""

    def close(self) -> None:
        """The slots (dropped by the caller) go back to the caching allocator; torch frees what no receiver maps."""
        torch.cuda.ipc_collect()

    # -- receiver
    def open(self, handle: SlotHandle) -> torch.Tensor:
        """The sender's slot mapped into this process (no copy)."""
        rebuild, args = handle
        if self.receiver_device is not None:  # the same GPU under this process's index for it
            args = list(args)
            # torch's rebuild_cuda_tensor: (cls, size, stride, offset, storage_cls, dtype, device, ...)
            args[6] = self.receiver_device
            args = tuple(args)
        return rebuild(*args)

    def copy_out(self, view: torch.Tensor) -> torch.Tensor:
        """A device-to-device copy of a bucket, finished before the caller acknowledges it."""
        data = view.clone()
        torch.cuda.current_stream(data.device).synchronize()
        return data
