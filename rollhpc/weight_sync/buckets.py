"""Pack named tensors into a few flat buckets and back.

Why buckets: a model is hundreds of tensors; sending each one as its own message costs a round of
latency per tensor, while one message for the whole model needs the whole model in memory twice.
Buckets of ``bucket_bytes`` bound both: few messages, and at most one bucket being packed while the
previous one travels. A bucket holds one dtype (tensors are viewed, never cast), so the receiver gets
bit-identical weights. Pure torch: the relay path (through the controller) sends these buckets; the
broadcast and IPC paths stream through reused slots instead (``weight_sync.slots``, mixed dtypes per bucket),
with the checksums (``tensor_checksum``, ``check_tensor``) defined here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from rollhpc.weight_sync.routing import IN_FLIGHT_BUCKETS

__all__ = [
    "IN_FLIGHT_BUCKETS",
    "Bucket",
    "WeightSyncMismatch",
    "check_tensor",
    "pack_buckets",
    "stamp",
    "tensor_checksum",
    "unpack_bucket",
    "verified",
]


@dataclass
class Bucket:
    data: torch.Tensor  # 1-D, one dtype: the tensors' elements back to back
    names: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # element offset of each tensor in ``data``
    checksums: list[int] | None = None  # per tensor (``stamp``), when this sync is verified

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def pack_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 64 << 20
) -> Iterator[Bucket]:
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
    # on the tensors' device (GPU for NCCL)
    bucket = Bucket(torch.cat([t.reshape(-1) for _, t in parts]))
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
        yield name, bucket.data[offset : offset + n].view(shape)


# -- verify after sync ----------------------------------------------------------------------------------------
# Peers' weight-sync bugs were silent: a generator held other weights than the trainer's (a bucket read before
# the sender's stream had written it, a tensor loaded under another name) and the run learned nothing. The
# sender stamps each tensor with a checksum of its bytes; the receiver recomputes it on what arrived, before the
# engine loads anything, and a difference stops the run with the parameter's name.


class WeightSyncMismatch(RuntimeError):
    """A tensor arrived with other bytes than the trainer sent: the run stops instead of training against
    weights the generator does not hold."""


_ROW = 1024  # words per row of the checksum's matrix view
_CHUNK_ROWS = 256  # rows reduced at once: an int64 copy of at most 2 MiB beside a sync's slots


def tensor_checksum(t: torch.Tensor) -> int:
    """An exact, order-sensitive fingerprint of a tensor's bytes, computed where it lives (no host copy of the
    data). Its 32-bit words (16- or 8-bit when the size asks) seen as rows of 1024: the total, the sum of each
    row's sum times its row number and of each column's sum times its column number (a swap of two words moves
    one of them), in integer arithmetic modulo 2**64, which is associative, so any device and reduction order
    gives the same value. The rows are reduced ``_CHUNK_ROWS`` at a time: torch's ``sum(dtype=int64)`` makes an
    int64 copy of what it reduces, which over a whole tensor was four times its size (a 6 MiB tensor cost the
    sender 28 MiB at its peak); a chunk's copy is at most 2 MiB, and the sums of chunks are the same sums."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    n = raw.numel()
    words = raw.view(torch.int32 if n % 4 == 0 else torch.int16 if n % 2 == 0 else torch.uint8)
    rows_n = words.numel() // _ROW
    main, tail = words[: rows_n * _ROW].view(rows_n, _ROW), words[rows_n * _ROW :]
    i64 = dict(dtype=torch.int64, device=words.device)
    tail_pos = torch.arange(rows_n * _ROW, words.numel(), **i64) + 1
    total, by_row = tail.sum(dtype=torch.int64), (tail.to(torch.int64) * tail_pos).sum()
    cols = torch.zeros(_ROW, **i64)
    for r0 in range(0, rows_n, _CHUNK_ROWS):
        chunk = main[r0 : r0 + _CHUNK_ROWS]
        rows = chunk.sum(1, dtype=torch.int64)
        total = total + rows.sum()
        by_row = by_row + (rows * (torch.arange(r0, r0 + chunk.shape[0], **i64) + 1)).sum()
        cols += chunk.sum(0, dtype=torch.int64)
    parts = (total, by_row, (cols * (torch.arange(_ROW, **i64) + 1)).sum())
    plain, by_row, by_col = (int(p) & 0xFFFFFFFFFFFFFFFF for p in parts)
    return plain ^ (by_row * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF) ^ (by_col << 1) ^ n


def stamp(bucket: Bucket) -> Bucket:
    """Give ``bucket`` the checksum of each of its tensors (before it leaves the sender)."""
    bucket.checksums = [tensor_checksum(t) for _, t in unpack_bucket(bucket)]
    return bucket


def verified(bucket: Bucket, sync: int | str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``unpack_bucket``, checking each tensor against the sender's checksum when the bucket carries them."""
    if bucket.checksums is None:
        yield from unpack_bucket(bucket)
        return
    tensors = list(unpack_bucket(bucket))
    for (name, t), want in zip(tensors, bucket.checksums):
        check_tensor(name, t, want, sync)
    yield from tensors


def check_tensor(name: str, t: torch.Tensor, want: int, sync: int | str = "") -> None:
    """Raise ``WeightSyncMismatch`` naming the parameter when ``t``'s bytes are not the ones the sender stamped."""
    if (got := tensor_checksum(t)) != want:
        raise WeightSyncMismatch(
            f"weight sync {sync}: parameter {name} {tuple(t.shape)} {t.dtype} arrived with other bytes than the "
            f"trainer sent (checksum {got:#x}, sent {want:#x}); the run stops rather than "
            f"generate with weights the trainer does not hold"
        )
