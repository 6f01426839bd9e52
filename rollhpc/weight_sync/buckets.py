"""Pack named tensors into a few flat buckets and back.

Why buckets: a model is hundreds of tensors; sending each one as its own message costs a round of
latency per tensor, while one message for the whole model needs the whole model in memory twice.
Buckets of ``bucket_bytes`` bound both: few messages, and at most one bucket being packed while the
previous one travels. A bucket holds one dtype (tensors are viewed, never cast), so the receiver gets
bit-identical weights. Pure torch: used on both ends of any transport (MPI relay today; a NCCL
broadcast of ``Bucket.data`` on GPU is the same layout).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

__all__ = ["Bucket", "pack_buckets", "unpack_bucket"]


@dataclass
class Bucket:
    data: torch.Tensor  # 1-D, one dtype: the tensors' elements back to back
    names: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # element offset of each tensor in ``data``

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def pack_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 64 << 20) -> Iterator[Bucket]:
    """Group tensors (in order) into buckets of at most ``bucket_bytes`` per dtype; a tensor larger
    than ``bucket_bytes`` gets a bucket of its own. Lazy: consumes ``named_tensors`` one at a time."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    open_parts: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    open_bytes: dict[torch.dtype, int] = {}
    for name, tensor in named_tensors:
        t = tensor.detach()
        size = t.numel() * t.element_size()
        if open_parts.get(t.dtype) and open_bytes[t.dtype] + size > bucket_bytes:
            yield _flatten(open_parts.pop(t.dtype))
            open_bytes[t.dtype] = 0
        open_parts.setdefault(t.dtype, []).append((name, t))
        open_bytes[t.dtype] = open_bytes.get(t.dtype, 0) + size
    for parts in open_parts.values():
        if parts:
            yield _flatten(parts)


def _flatten(parts: list[tuple[str, torch.Tensor]]) -> Bucket:
    bucket = Bucket(torch.cat([t.reshape(-1) for _, t in parts]))  # on the tensors' device (GPU for NCCL)
    offset = 0
    for name, t in parts:
        bucket.names.append(name)
        bucket.shapes.append(tuple(t.shape))
        bucket.offsets.append(offset)
        offset += t.numel()
    return bucket


def unpack_bucket(bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into ``bucket.data`` (no copy)."""
    for name, shape, offset in zip(bucket.names, bucket.shapes, bucket.offsets):
        n = 1
        for d in shape:
            n *= d
        yield name, bucket.data[offset:offset + n].view(shape)
