"""Weight sync between processes on the same GPU through CUDA IPC: no copy through the host.

When the trainer and a vLLM engine are colocated (the same GPU, two processes), broadcasting the weights
over NCCL or MPI would copy every byte out of the GPU and back in. Instead the trainer packs its weights
into buckets on the GPU (``weight_sync.buckets``) and hands out an IPC handle per bucket (torch's own
``reduce_tensor``: a picklable description of the CUDA allocation); the receiver maps each bucket into its
address space and copies the tensors it needs device to device. The sender keeps the buckets alive until
every receiver has said it is done (``SharedWeights.release``), since the receivers read its memory.

The handles name the sender's device by its index as the sender sees it; a receiver that sees the same GPU
under another index (its own CUDA_VISIBLE_DEVICES) passes ``device`` to ``open_buckets``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

from rollhpc.weight_sync.buckets import Bucket, pack_buckets, stamp, verified

__all__ = ["SharedBucket", "SharedWeights", "share_weights", "open_buckets"]


@dataclass
class SharedBucket:
    """One bucket as a receiver gets it: the IPC handle of its storage and the tensors' places in it."""

    handle: tuple[Any, tuple[Any, ...]]  # (rebuild function, its arguments), as torch's reduce_tensor gives it
    names: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    nbytes: int = 0
    checksums: list[int] | None = None  # per tensor, on a verified sync (``buckets.stamp``)


@dataclass
class SharedWeights:
    """What ``share_weights`` made: the handles to send, and the buckets they point into."""

    buckets: list[SharedBucket]
    _storage: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def release(self) -> None:
        """Every receiver is done: the buckets' memory goes back to the trainer's allocator."""
        self._storage.clear()


def share_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 512 << 20,
                  verify: bool = False) -> SharedWeights:
    """Pack CUDA tensors into buckets on their GPU and describe each by an IPC handle (``verify``: with a
    checksum per tensor, which the receiver checks on what it maps)."""
    from torch.multiprocessing.reductions import reduce_tensor

    buckets, storage = [], []
    for b in pack_buckets(named_tensors, bucket_bytes):
        if b.data.device.type != "cuda":
            raise ValueError(f"CUDA IPC shares GPU memory, got a bucket on {b.data.device}: use the broadcast sync")
        if verify:
            stamp(b)
        storage.append(b.data)
        buckets.append(SharedBucket(reduce_tensor(b.data), b.names, b.shapes, b.offsets, b.nbytes, b.checksums))
    torch.cuda.current_stream().synchronize()  # the buckets are written before any receiver reads them
    return SharedWeights(buckets, storage)


def open_buckets(shared: Iterable[SharedBucket], device: int | None = None,
                 sync: int | str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into the sender's buckets, mapped into this process (no copy): copy them
    into your own tensors before telling the sender you are done. A stamped bucket is checked first."""
    for sb in shared:
        rebuild, args = sb.handle
        if device is not None:  # the same GPU under this process's index for it
            args = list(args)
            args[6] = device  # torch's rebuild_cuda_tensor: (cls, size, stride, offset, storage_cls, dtype, device, ...)
            args = tuple(args)
        data = rebuild(*args)
        yield from verified(Bucket(data, sb.names, sb.shapes, sb.offsets, sb.checksums), sync)
