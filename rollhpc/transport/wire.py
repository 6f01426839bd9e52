"""Payload encoding for MPI messages: small structure pickled, large buffers sent raw.

Why: pickling a 64 MiB tensor copies it twice and holds the GIL for the whole copy. Here every
numpy array and torch CPU tensor in a payload is replaced by a placeholder naming its dtype and
shape, and its memory travels as a separate raw MPI message straight from (and into) the array.
Everything else is pickled as usual, so any picklable Python value is still a valid payload.
"""

from __future__ import annotations

import io
import pickle
import sys
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

# Arrays smaller than this are cheaper to pickle inline than to send as a separate message.
INLINE_LIMIT_BYTES = 8 * 1024


@dataclass(frozen=True)
class _ArrayRef:
    index: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _TensorRef:
    index: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]


def _torch():
    # torch is imported by whoever puts tensors in a payload; the transport never imports it itself,
    # so diagnostic workers and the controller of a numpy-only job stay light.
    return sys.modules.get("torch")


_PLAIN = frozenset({int, float, str, bytes, bool, list, tuple, dict, set, type(None)})


class _Pickler(pickle.Pickler):
    def __init__(self, file: BinaryIO, buffers: list[memoryview]):
        super().__init__(file, protocol=5)
        self._buffers = buffers

    def persistent_id(self, obj: object) -> _ArrayRef | _TensorRef | None:
        # called for every object in the payload (each int of a token list): the plain types leave at once (a
        # rollout request's pickling was half this method's own time at scale: bench/scale_routing.py)
        if type(obj) in _PLAIN:
            return None
        if isinstance(obj, np.ndarray) and obj.dtype != object and obj.nbytes >= INLINE_LIMIT_BYTES:
            arr = np.ascontiguousarray(obj)
            self._buffers.append(memoryview(arr.reshape(-1).view(np.uint8)))
            return _ArrayRef(len(self._buffers) - 1, arr.dtype.str, tuple(arr.shape))
        torch = _torch()
        if torch is not None and isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu":
                raise TypeError(
                    f"only CPU tensors can be sent to another rank, got one on {obj.device}"
                )
            nbytes = obj.numel() * obj.element_size()
            if nbytes >= INLINE_LIMIT_BYTES:
                t = obj.detach().contiguous()
                raw = t.reshape(-1).view(torch.uint8).numpy()
                self._buffers.append(memoryview(raw))
                return _TensorRef(
                    len(self._buffers) - 1, str(t.dtype).removeprefix("torch."), tuple(t.shape)
                )
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, buffers: list[np.ndarray]):
        super().__init__(file)
        self._buffers = buffers

    def persistent_load(self, pid: object) -> object:
        if isinstance(pid, _ArrayRef):
            return self._buffers[pid.index].view(np.dtype(pid.dtype)).reshape(pid.shape)
        if isinstance(pid, _TensorRef):
            # only a rank that was sent a tensor imports torch (the controller of a numpy-only job never does)
            import torch

            raw = torch.from_numpy(self._buffers[pid.index])
            return raw.view(getattr(torch, pid.dtype)).reshape(pid.shape)
        raise pickle.UnpicklingError(f"unknown buffer reference {pid!r}")


def layout(sizes: list[int], align: int) -> tuple[list[int], int]:
    """Offsets of buffers of ``sizes`` laid back to back, each starting at a multiple of ``align`` (so the arrays
    viewing them are aligned), and the total length."""
    offsets, pos = [], 0
    for n in sizes:
        pos += -pos % align
        offsets.append(pos)
        pos += n
    return offsets, pos


def encode(obj: object) -> tuple[bytes, list[memoryview]]:
    """Return (header, buffers): the header is a pickle that refers to the buffers by index."""
    buffers: list[memoryview] = []
    f = io.BytesIO()
    _Pickler(f, buffers).dump(obj)
    return f.getvalue(), buffers


def decode(header: bytes, buffers: list[np.ndarray]) -> object:
    """Inverse of encode; buffers are uint8 arrays received in the same order, used without copying."""
    # no buffer was taken out, so the header refers to none: the plain unpickler, 3x quicker
    if not buffers:
        return pickle.loads(header)
    return _Unpickler(io.BytesIO(header), buffers).load()
